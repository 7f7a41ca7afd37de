"""Derivation recipes: a committed version turned into what an engine loads (issue 29, items 1 and 3).

A :class:`Recipe` is a small registered object: a ``name`` and a ``version`` (bumped whenever its
output bytes change for the same input), an ``eligible`` predicate choosing the tensors it converts,
a ``convert`` function mapping one eligible ``(name, tensor)`` to the tensors that replace it, and
the ``quantization_config`` an engine reads from ``config.json``. :func:`derive` applies a recipe to
a whole state dict: eligible tensors are replaced, every other one passes through unchanged (the
same object). :func:`register` adds a recipe, :func:`get` finds one by name; the two built in:

``"fp8-block128"`` -- block FP8, the layout of DeepSeek-V3's checkpoints and vLLM's block-FP8 loader
    Each eligible 2-D weight ``W`` of shape ``(N, K)`` is stored as ``name`` = ``W`` in
    ``float8_e4m3fn``, same shape (the weight itself is never padded), and
    ``name[:-len("weight")] + "weight_scale_inv"`` (``...down_proj.weight_scale_inv``): float32 of
    shape ``(ceil(N/128), ceil(K/128))``, one scale per 128x128 block, the blocks at the bottom and
    right edges covering what is left (partial blocks). The loader dequantizes
    ``W[i, j] ~= float(q[i, j]) * scale_inv[i // 128, j // 128]``: despite its name the scale is the
    *multiplier* (DeepSeek's name, kept by vLLM: ``# The weight_scale_inv name is intentional for
    deepseekv3``). Sources: vLLM ``Fp8LinearMethod.create_weights`` (``BlockQuantScaleParameter`` of
    ``((out + block_n - 1) // block_n, (in + block_k - 1) // block_k)``, float32, registered as
    ``weight_scale_inv``), ``Fp8Config.from_config`` (keys ``quant_method``, ``activation_scheme``,
    ``weight_block_size``, ``ignored_layers``; block quantization requires ``"dynamic"``
    activations), and the quantizer of DeepGEMM's and vLLM's tests, ``per_block_cast_to_fp8``
    (``amax = |block|.max().clamp(1e-4)``, ``q = x * (448 / amax)``, ``scale = amax / 448``, edges
    zero-padded for the amax only).

``"fp8-tensor"`` -- per-tensor FP8, the layout of vLLM's ``fp8`` checkpoints without ``weight_block_size``
    Each eligible weight becomes ``name`` in ``float8_e4m3fn`` and ``name[:-len("weight")] +
    "weight_scale"``: a float32 scalar (shape ``()``), the multiplier again
    (``W ~= float(q) * weight_scale``). Source: vLLM ``Fp8LinearMethod.create_weights`` registers a
    ``PerTensorScaleParameter`` named ``weight_scale``, float32, one per fused shard, whose loader
    takes a scalar (``()`` or ``(1,)``) from the checkpoint; ``ops.scaled_fp8_quant`` computes the
    same ``amax / 448`` scale when vLLM quantizes a bf16 checkpoint itself. **vLLM's layout only:**
    transformers (5.19) reads an ``fp8`` config without ``weight_block_size`` as 128x128 blocks
    with ``weight_scale_inv``, drops ``weight_scale`` as unexpected and loads the raw FP8 values,
    silently (``tests/integrations/test_vllm_fp8.py`` holds that as a strict xfail); use
    ``"fp8-block128"`` for a checkpoint both read.

**The quantizer** (both recipes; the block's amax is the tensor's for ``"fp8-tensor"``)::

    s = max(amax(|x| over the block), 1e-4) / 448        # float32, stored as the scale
    q = float8_e4m3fn(float32(x) / s)                    # round to nearest even

448 is the largest finite ``float8_e4m3fn``. ``|x / s| <= 448 * (1 + 2**-23)``, which rounds to
448, never past it. The floor ``1e-4`` (:data:`AMAX_FLOOR`, DeepGEMM's) is what makes zero and tiny
blocks safe: an all-zero block gets ``s = 1e-4 / 448`` (finite, positive) and ``q = 0``, and no
scale is ever so small that a kernel multiplying it by an activation scale underflows. A weight
with an infinite or NaN element has no finite scale: :func:`derive` refuses it
(:class:`~paramstore.errors.InvalidTensorError`).

**The error bound.** For every element ``x`` of a block with stored scale ``s``, the value the
loader computes, ``d = float(q) * s``, satisfies::

    |d - x| <= max(2**-4 * |x|, 2**-10 * s) * (1 + 2**-20)

``float8_e4m3fn`` has 3 mantissa bits: between its smallest normal ``2**-6`` and 448, rounding
``y = x / s`` to nearest errs by at most half a spacing, ``2**-4 * |y|``; below ``2**-6`` the spacing
is that of the subnormals, ``2**-9``, so the error is at most ``2**-10``. Multiplying by ``s`` gives
the two terms; ``(1 + 2**-20)`` covers float32's rounding of ``x / s`` (and of the product, in a
loader that forms it in float32). So a block whose amax is above the floor keeps every element
within 6.25 % of itself down to ``amax / 2**14.8`` (``2**-6 * s``), and below that within
``2**-10 * s`` absolutely; a block under the floor is within ``2**-10 * 1e-4 / 448 ~= 2.2e-10``.

**The same bytes everywhere.** Every step is elementwise or a max (exact, in any order), so the
output does not depend on the thread count or the host. There is no Python loop over blocks, and
deriving never holds a float32 copy of a whole weight: the block maxima are taken on the input's own
bits with the sign cleared, compared as integers (the order of the magnitudes, infinity above every
finite value and NaN above infinity: the amax is exact, and a non-finite element still leaves a
non-finite scale). On CPU, for bfloat16 and float32 input, the whole quantizer runs in the compiled
loops of :mod:`paramstore.kernels` (block rows split between ``torch.get_num_threads()`` threads);
elsewhere (float16, another device, no C compiler) it is torch operations over stripes of whole
block rows, the division and the rounding (torch's cast to ``float8_e4m3fn``) on float32 copies of
at most :data:`STRIPE_BYTES`. The two paths give the same bytes.

Which tensors (:func:`default_eligible`, each recipe's default): 2-D bfloat16, float16 or float32
tensors, not empty, named ``*.weight``, except embeddings (``embed`` in the name), norms (``norm``),
``lm_head`` and routers (a module named ``gate`` or ``*_gate``, as ``mlp.gate`` and
``shared_expert_gate``: vLLM builds those unquantized whatever the checkpoint). Make a recipe with
another predicate with :func:`fp8_block_recipe` or :func:`fp8_tensor_recipe` and register it under
its own name.

Example:
    >>> from paramstore import recipes
    >>> w = torch.linspace(-1, 1, 129 * 200).reshape(129, 200).to(torch.bfloat16)
    >>> out = recipes.derive("fp8-block128", {"mlp.up_proj.weight": w, "norm.weight": torch.ones(200)})
    >>> {name: (tuple(t.shape), t.dtype) for name, t in out.items()}  # doctest: +NORMALIZE_WHITESPACE
    {'mlp.up_proj.weight': ((129, 200), torch.float8_e4m3fn),
     'mlp.up_proj.weight_scale_inv': ((2, 2), torch.float32),
     'norm.weight': ((200,), torch.float32)}
    >>> back = recipes.dequantize_block(out["mlp.up_proj.weight"], out["mlp.up_proj.weight_scale_inv"])
    >>> bool(((back - w.float()).abs() <= w.float().abs() / 16 + 1e-5).all())
    True
    >>> recipes.get("fp8-block128").quantization_config["weight_block_size"]
    (128, 128)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from . import kernels
from .errors import InvalidArgumentError, InvalidTensorError
from .patch import run_all

__all__ = [
    "Recipe", "register", "get", "names", "derive", "default_eligible", "fp8_block_recipe", "fp8_tensor_recipe",
    "quantize_block", "quantize_tensor", "dequantize_block", "scale_name", "FP8_MAX", "AMAX_FLOOR", "STRIPE_BYTES",
    "ERROR_BOUND",
]

#: The largest finite ``float8_e4m3fn``: a block's amax is scaled onto it.
FP8_MAX = 448.0
#: The smallest amax a scale is computed from (DeepGEMM's ``clamp(1e-4)``): zero and tiny blocks get
#: the finite, positive scale ``AMAX_FLOOR / FP8_MAX``.
AMAX_FLOOR = 1e-4
#: The most bytes of float32 one conversion step holds (at least one row); the block maxima are taken
#: over stripes of whole block rows of about as many elements (at least one block row).
STRIPE_BYTES = 8 << 20
#: The documented bound as ``(relative, absolute in units of the scale, slack)``:
#: ``|dequantized - x| <= max(relative * |x|, absolute * scale) * (1 + slack)``.
ERROR_BOUND = (2.0 ** -4, 2.0 ** -10, 2.0 ** -20)

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
#: Each input dtype's integer view and the mask clearing its sign bit.
_MAGNITUDE_BITS = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
                   torch.float32: (torch.int32, 0x7FFFFFFF)}
#: The input dtypes the compiled kernels take (:mod:`paramstore.kernels`); float16 takes torch's path.
_KERNEL_KINDS = {torch.bfloat16: "bf16", torch.float32: "f32"}
#: Fewer elements than this are converted on the calling thread alone.
_PARALLEL_ELEMENTS = 1 << 18
_NAME = re.compile(r"[a-z0-9][a-z0-9._+-]*\Z")


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@dataclass(frozen=True, eq=False)
class Recipe:
    """How to derive one kind of version: see the module's documentation.

    ``convert(name, tensor)`` is called for each tensor ``eligible(name, tensor)`` accepts and returns
    the tensors that replace it, by name (usually ``name`` itself and a scale). ``version`` counts
    changes of the output bytes: a derived object made by another version of the recipe is another
    object. ``quantization_config`` (JSON data, kept read-only: :meth:`config` gives a plain copy) is
    what the engine reads from ``config.json``'s ``quantization_config``.

    ``shapes`` (optional) says what ``convert`` makes of a tensor without converting it: its
    outputs' ``(dtype, shape)`` by name. A recipe that has it must also take ``convert(name, tensor,
    out=...)``: ``out`` the outputs, by name, allocated by the caller (contiguous, of those dtypes and
    shapes), filled in place and returned, and not kept once ``convert`` returns (the memory is the
    store's: the object's slab, unmapped later). A store then converts into memory it reuses and
    writes the object from there, instead of allocating every output anew (the built-in recipes do).

    Example:
        >>> from paramstore.recipes import Recipe, derive
        >>> halve = Recipe("half", 1, lambda n, t: t.dtype == torch.float32,
        ...                lambda n, t: {n: t.to(torch.float16)}, {"quant_method": "none"})
        >>> derive(halve, {"w": torch.ones(2)})["w"].dtype
        torch.float16
    """

    name: str
    version: int
    eligible: Callable[[str, torch.Tensor], bool]
    convert: Callable[[str, torch.Tensor], Mapping[str, torch.Tensor]]
    quantization_config: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""
    shapes: Callable[[str, torch.Tensor], Mapping[str, tuple[torch.dtype, tuple[int, ...]]]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise InvalidArgumentError(f"recipe name {self.name!r}: lowercase letters, digits and . _ + - only, "
                                       "starting with a letter or digit")
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise InvalidArgumentError(f"recipe {self.name!r}: version must be an int >= 1, not {self.version!r}")
        if not callable(self.eligible) or not callable(self.convert) or not (self.shapes is None or callable(self.shapes)):
            raise InvalidArgumentError(f"recipe {self.name!r}: eligible, convert and shapes must be callables")
        try:
            json.dumps(self.quantization_config)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"recipe {self.name!r}: quantization_config is not JSON data: {e}") from None
        object.__setattr__(self, "quantization_config", _freeze(self.quantization_config))

    def config(self) -> dict[str, Any]:
        """A plain, mutable copy of :attr:`quantization_config` (lists, dicts), for ``json.dump``.

        Example:
            >>> from paramstore.recipes import get
            >>> get("fp8-block128").config()
            {'quant_method': 'fp8', 'activation_scheme': 'dynamic', 'fmt': 'e4m3', 'weight_block_size': [128, 128]}
        """
        return _thaw(self.quantization_config)

    def __repr__(self) -> str:
        return f"Recipe({self.name!r}, version={self.version})"


_REGISTRY: dict[str, Recipe] = {}


def register(recipe: Recipe, *, replace: bool = False) -> Recipe:
    """Make ``recipe`` known by its name, and return it. A name already taken by another recipe is an
    :class:`~paramstore.errors.InvalidArgumentError` unless ``replace`` (registering the same object
    again is a no-op).

    Example:
        >>> from paramstore.recipes import register, get, fp8_block_recipe
        >>> mine = register(fp8_block_recipe("fp8-block128-all", eligible=lambda n, t: t.ndim == 2))
        >>> get("fp8-block128-all") is mine
        True
    """
    if not isinstance(recipe, Recipe):
        raise InvalidArgumentError(f"register takes a Recipe, not {type(recipe).__name__}")
    known = _REGISTRY.get(recipe.name)
    if known is not None and known is not recipe and not replace:
        raise InvalidArgumentError(f"a recipe named {recipe.name!r} is already registered ({known!r}): "
                                   "choose another name, or pass replace=True")
    _REGISTRY[recipe.name] = recipe
    return recipe


def names() -> list[str]:
    """The registered recipes' names, sorted.

    Example:
        >>> from paramstore.recipes import names
        >>> [n for n in names() if n in ("fp8-block128", "fp8-tensor")]
        ['fp8-block128', 'fp8-tensor']
    """
    return sorted(_REGISTRY)


def get(recipe: str | Recipe) -> Recipe:
    """The recipe registered as ``recipe`` (a :class:`Recipe` is returned as it is).

    Example:
        >>> from paramstore.recipes import get
        >>> get("fp8-tensor")
        Recipe('fp8-tensor', version=1)
        >>> get("int4")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        paramstore.errors.InvalidArgumentError: unknown recipe 'int4': the known recipes are ...'fp8-block128', ...
    """
    if isinstance(recipe, Recipe):
        return recipe
    found = _REGISTRY.get(recipe) if isinstance(recipe, str) else None
    if found is None:
        raise InvalidArgumentError(f"unknown recipe {recipe!r}: the known recipes are "
                                   f"{', '.join(repr(n) for n in names()) or '(none)'}")
    return found


def derive(recipe: str | Recipe, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` as ``recipe`` derives it: each tensor the recipe's predicate accepts replaced by
    what its ``convert`` returns (in its place, in order), every other value passed through as the
    same object. An output name that another tensor already has is an
    :class:`~paramstore.errors.InvalidArgumentError` (a state dict quantized already, say).

    Example:
        >>> from paramstore.recipes import derive
        >>> out = derive("fp8-tensor", {"lm_head.weight": torch.ones(2, 2), "o_proj.weight": torch.ones(2, 2)})
        >>> [(n, t.dtype, tuple(t.shape)) for n, t in out.items()]  # doctest: +NORMALIZE_WHITESPACE
        [('lm_head.weight', torch.float32, (2, 2)), ('o_proj.weight', torch.float8_e4m3fn, (2, 2)),
         ('o_proj.weight_scale', torch.float32, ())]
    """
    recipe = get(recipe)
    if not isinstance(state_dict, Mapping):
        raise InvalidArgumentError(f"derive takes a mapping of names to tensors, not {type(state_dict).__name__}")
    out: dict[str, Any] = {}
    source: dict[str, str] = {}  # output name -> the input name it came from
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor) and recipe.eligible(name, value):
            produced = recipe.convert(name, value)
        else:
            produced = {name: value}
        for new, tensor in produced.items():
            claim_output(recipe, source, name, new, new in state_dict, "the state dict")
            out[new] = tensor
    return out


def claim_output(recipe: Recipe, made_by: dict[str, str], name: str, new: str, present: bool, where: str) -> None:
    """Record that input ``name`` gives output ``new`` (``made_by``: output -> input), refusing
    (InvalidArgumentError) an output another input gives too, or one already ``present`` in the
    input (``where`` names it) that ``name`` does not simply keep."""
    clash = made_by.get(new)
    if clash is None and new != name and present:
        clash = new
    if clash is not None:
        said = f"is in {where} already" if clash == new else f"{clash!r} gives too"
        raise InvalidArgumentError(f"recipe {recipe.name!r}: {name!r} gives {new!r}, which {said}: "
                                   "is it derived already?")
    made_by[new] = name


def default_eligible(name: str, tensor: torch.Tensor) -> bool:
    """Whether a tensor is one vLLM's FP8 loaders expect quantized: a non-empty 2-D bfloat16, float16
    or float32 ``*.weight``, not of an embedding, a norm, ``lm_head`` or a router (``gate``,
    ``*_gate``; ``gate_proj`` and ``gate_up_proj`` are quantized).

    Example:
        >>> from paramstore.recipes import default_eligible
        >>> w = torch.zeros(4, 4)
        >>> [n for n in ("model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.gate.weight",
        ...              "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight",
        ...              "model.layers.0.self_attn.o_proj.bias") if default_eligible(n, w)]
        ['model.layers.0.mlp.gate_up_proj.weight']
    """
    if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2 or tensor.dtype not in _FLOATS or tensor.numel() == 0:
        return False
    if not name.endswith(".weight"):
        return False
    module = name[:-len(".weight")]
    last = module.rsplit(".", 1)[-1]
    lowered = module.lower()
    if "embed" in lowered or "norm" in lowered or "lm_head" in lowered:
        return False
    return not (last == "gate" or last.endswith("_gate"))


def scale_name(name: str, suffix: str) -> str:
    """The name of a weight's scale: ``weight`` at the end of ``name`` replaced by ``suffix``.

    Example:
        >>> from paramstore.recipes import scale_name
        >>> scale_name("model.layers.0.mlp.down_proj.weight", "weight_scale_inv")
        'model.layers.0.mlp.down_proj.weight_scale_inv'
    """
    if not name.endswith("weight"):
        raise InvalidArgumentError(f"{name!r}: a quantized tensor's name ends in 'weight'")
    return name[:-len("weight")] + suffix


def _check_input(x: torch.Tensor, ndim: int | None) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise InvalidTensorError(f"FP8 quantization takes a bfloat16, float16 or float32 tensor, not "
                                 f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise InvalidTensorError(f"block FP8 quantization takes a 2-D tensor, not shape {tuple(x.shape)}")


def _check_scales(scale: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(scale).all()):
        raise InvalidTensorError(f"{what}: an infinite or NaN element leaves no finite FP8 scale")


def quantize_block(x: torch.Tensor, block: tuple[int, int] = (128, 128), amax_floor: float = AMAX_FLOOR, *,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)``: 2-D ``x`` in ``float8_e4m3fn`` (same shape) and its float32 block scales of
    shape ``(ceil(N / block[0]), ceil(K / block[1]))``, on ``x``'s device (``out``: into these two,
    contiguous, made by the caller). See the module's documentation for the quantizer and its
    error bound.

    Example:
        >>> from paramstore.recipes import quantize_block
        >>> q, s = quantize_block(torch.tensor([[0.0, 448.0], [-1.0, 3.0]]), block=(1, 2))
        >>> q.float().tolist(), s.tolist()
        ([[0.0, 448.0], [-144.0, 448.0]], [[1.0], [0.0066964286...]])
    """
    _check_input(x, 2)
    bn, bk = (int(b) for b in block)
    if bn < 1 or bk < 1:
        raise InvalidArgumentError(f"block sizes must be positive, not {block}")
    n, k = x.shape
    gn, gk = -(-n // bn), -(-k // bk)
    q, scale = _outputs(x, out, ((n, k), (gn, gk)))
    if n == 0 or k == 0:
        return q, scale
    kernel, kind = _kernel_for(x)
    if kernel is not None and (x.stride(1) == 1 or k == 1):
        _block_kernel(kernel.block[kind], x, (bn, bk), amax_floor, q, scale)
    else:
        _block_torch(x, (bn, bk), amax_floor, q, scale)
    _check_scales(scale, "block FP8")
    return q, scale


def _outputs(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None,
             shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` checked (contiguous, on ``x``'s device, ``float8_e4m3fn`` and float32 of ``shapes``),
    or the two made now."""
    if out is None:
        return (torch.empty(shapes[0], dtype=torch.float8_e4m3fn, device=x.device),
                torch.empty(shapes[1], dtype=torch.float32, device=x.device))
    for t, dtype, shape in zip(out, (torch.float8_e4m3fn, torch.float32), shapes):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape) \
                or not t.is_contiguous() or t.device != x.device:
            raise InvalidArgumentError(f"out: expected contiguous {dtype} tensors of shapes {shapes} on {x.device}, "
                                       f"not {[(getattr(o, 'dtype', None), tuple(getattr(o, 'shape', ()))) for o in out]}")
    return out[0], out[1]


def _kernel_for(x: torch.Tensor) -> tuple[Any, str]:
    """The compiled FP8 kernels and ``x``'s kind for them, or ``(None, "")`` (torch's path)."""
    kind = _KERNEL_KINDS.get(x.dtype, "")
    if not kind or x.device.type != "cpu":
        return None, ""
    return kernels.fp8(), kind


def _chunks(count: int, elements: int) -> list[tuple[int, int]]:
    """``range(count)`` in as many equal parts as torch has threads (one for fewer than
    :data:`_PARALLEL_ELEMENTS` elements in all)."""
    parts = max(1, min(count, torch.get_num_threads() if elements >= _PARALLEL_ELEMENTS else 1))
    return [(count * i // parts, count * (i + 1) // parts) for i in range(parts)]


def _block_kernel(fn: Callable[..., int], x: torch.Tensor, block: tuple[int, int], amax_floor: float,
                  q: torch.Tensor, scale: torch.Tensor) -> None:
    """:func:`quantize_block` by the compiled kernel: block rows split between threads
    (:func:`paramstore.patch.run_all`; the kernel releases the GIL)."""
    (n, k), (bn, bk) = x.shape, block
    ld = x.stride(0) if n > 1 else k
    args = (x.data_ptr(), n, k, ld, bn, bk, amax_floor)
    done = run_all(lambda b0, b1: fn(*args, b0, b1, q.data_ptr(), k, scale.data_ptr()), _chunks(scale.shape[0], n * k))
    if any(done):
        raise MemoryError("block FP8: the kernel could not allocate its block maxima")


def _block_torch(x: torch.Tensor, block: tuple[int, int], amax_floor: float,
                 q: torch.Tensor, scale: torch.Tensor) -> None:
    """:func:`quantize_block` by torch operations (no compiler; another device): the same bytes."""
    (n, k), (bn, bk), (gn, gk) = x.shape, block, scale.shape
    width = gk * bk  # a row padded to whole blocks; the padding stays zero (the right edge's, for the maxima)
    group = max(1, STRIPE_BYTES // (4 * bn * width))  # block rows per stripe of maxima
    fit = max(1, STRIPE_BYTES // (4 * width))  # rows per conversion step
    step = group * bn if group > 1 else -(-bn // -(-bn // fit))  # a stripe, or a block row in equal parts
    bits, mask = _MAGNITUDE_BITS[x.dtype]
    xbits = x.view(bits)
    mags = torch.zeros((min(group, gn) * bn, width), dtype=bits, device=x.device)
    buf = torch.zeros((min(step, mags.shape[0]), width), dtype=torch.float32, device=x.device)
    for b0 in range(0, gn, group):
        r0 = b0 * bn
        rows = min(group * bn, n - r0)
        gb = -(-rows // bn)
        m = mags[:gb * bn]
        torch.bitwise_and(xbits[r0:r0 + rows], mask, out=m[:rows, :k])  # |x|, as bits
        if rows < gb * bn:
            m[rows:].zero_()  # the bottom edge: padding for the maxima only
        amax = m.view(gb, bn, gk, bk).amax(dim=3).amax(dim=1).view(x.dtype).float()
        s = amax.clamp_(min=amax_floor).div_(FP8_MAX)
        scale[b0:b0 + gb] = s
        for i in range(0, rows, step):
            r = min(step, rows - i)
            f = buf[:r if gb == 1 else gb * bn]
            f[:r, :k].copy_(x[r0 + i:r0 + i + r])  # the conversion to float32
            f.view(gb, -1, gk, bk).div_(s[:, None, :, None])
            q[r0 + i:r0 + i + r].copy_(f[:r, :k])  # round to nearest even


def quantize_tensor(x: torch.Tensor, amax_floor: float = AMAX_FLOOR, *,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` in ``float8_e4m3fn`` and its one float32 scale (shape ``()``), on ``x``'s
    device (``out``: into these two, made by the caller). The same quantizer as
    :func:`quantize_block`, one block the whole tensor.

    Example:
        >>> from paramstore.recipes import quantize_tensor
        >>> q, s = quantize_tensor(torch.tensor([0.25, -2.0, 3.5]))
        >>> q.float().tolist(), s.item()
        ([32.0, -256.0, 448.0], 0.0078125)
    """
    _check_input(x, None)
    q, scale = _outputs(x, out, (tuple(x.shape), ()))
    q, s = _quantize_tensor(x, amax_floor, q)
    return q, scale.copy_(s)


def _quantize_tensor(x: torch.Tensor, amax_floor: float, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.numel() == 0:
        return q, torch.tensor(amax_floor / FP8_MAX, dtype=torch.float32, device=x.device)
    kernel, kind = _kernel_for(x)
    if kernel is not None:
        return _tensor_kernel(kernel, kind, x.contiguous().view(-1), amax_floor, q)
    flat = x.reshape(x.shape[0], -1) if x.ndim >= 2 else x.reshape(1, -1)
    low, high = torch.aminmax(flat)  # one pass
    amax = torch.maximum(high, low.neg()).float()
    s = amax.clamp(min=amax_floor).div_(FP8_MAX)
    _check_scales(s, "per-tensor FP8")
    out = q.view(flat.shape)
    step = max(1, STRIPE_BYTES // (4 * flat.shape[1]))
    buf = torch.empty((min(step, flat.shape[0]), flat.shape[1]), dtype=torch.float32, device=x.device)
    for r0 in range(0, flat.shape[0], step):
        f = buf[:min(step, flat.shape[0] - r0)]
        out[r0:r0 + step].copy_(f.copy_(flat[r0:r0 + step]).div_(s))  # a copy: never divide the input
    return q, s


def _tensor_kernel(kernel: Any, kind: str, flat: torch.Tensor, amax_floor: float,
                   q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_tensor` by the compiled kernels, on contiguous ``flat``: the maxima, then the
    conversion, each over ranges of elements split between threads (no torch operation between
    them: its idle OpenMP workers would spin on the cores the kernels' threads need)."""
    size, width, x, out = flat.numel(), flat.element_size(), flat.data_ptr(), q.view(-1).data_ptr()
    spans = _chunks(size, size)
    maxima = run_all(lambda a, b: kernel.absmax[kind](x + a * width, b - a), spans)
    bits, _ = _MAGNITUDE_BITS[flat.dtype]
    top = torch.tensor([max(maxima)], dtype=torch.int32).to(bits).view(flat.dtype).float()[0]
    s = top.clamp(min=amax_floor).div_(FP8_MAX)
    _check_scales(s, "per-tensor FP8")
    run_all(lambda a, b: kernel.scaled[kind](x + a * width, 1, b - a, b - a, b - a, s.data_ptr(), out + a, b - a), spans)
    return q, s


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The float32 weight a block-FP8 loader computes: ``q[i, j] * scale_inv[i // bn, j // bk]``.

    Example:
        >>> from paramstore.recipes import quantize_block, dequantize_block
        >>> w = torch.tensor([[1.0, -2.0], [0.0, 0.25]])
        >>> dequantize_block(*quantize_block(w)).tolist()
        [[1.0, -2.0], [0.0, 0.25]]
    """
    bn, bk = block
    n, k = q.shape
    if scale_inv.shape != (-(-n // bn), -(-k // bk)):
        raise InvalidArgumentError(f"scale_inv of shape {tuple(scale_inv.shape)} for a weight of {(n, k)} in "
                                   f"{bn}x{bk} blocks: expected {(-(-n // bn), -(-k // bk))}")
    full = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * full


def fp8_block_recipe(name: str = "fp8-block128", *, block: int = 128,
                     eligible: Callable[[str, torch.Tensor], bool] = default_eligible,
                     amax_floor: float = AMAX_FLOOR, version: int = 1) -> Recipe:
    """A block-FP8 recipe (``block`` x ``block`` scales named ``*weight_scale_inv``); the defaults make
    ``"fp8-block128"``. Another predicate or block size is another recipe: give it another name.

    Example:
        >>> from paramstore.recipes import fp8_block_recipe, derive
        >>> r = fp8_block_recipe("fp8-block64-lm", block=64, eligible=lambda n, t: n == "lm_head.weight")
        >>> tuple(derive(r, {"lm_head.weight": torch.ones(130, 64)})["lm_head.weight_scale_inv"].shape)
        (3, 1)
    """
    def shapes(tensor_name: str, tensor: torch.Tensor) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        n, k = tensor.shape
        return {tensor_name: (torch.float8_e4m3fn, (n, k)),
                scale_name(tensor_name, "weight_scale_inv"): (torch.float32, (-(-n // block), -(-k // block)))}

    def convert(tensor_name: str, tensor: torch.Tensor, out: Mapping[str, torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor]:
        sname = scale_name(tensor_name, "weight_scale_inv")
        q, s = quantize_block(tensor, (block, block), amax_floor,
                              out=None if out is None else (out[tensor_name], out[sname]))
        return {tensor_name: q, sname: s}

    return Recipe(name, version, eligible, convert,
                  {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [block, block]},
                  f"float8_e4m3fn weights with float32 {block}x{block} block scales (*weight_scale_inv)", shapes)


def fp8_tensor_recipe(name: str = "fp8-tensor", *, eligible: Callable[[str, torch.Tensor], bool] = default_eligible,
                      amax_floor: float = AMAX_FLOOR, version: int = 1) -> Recipe:
    """A per-tensor FP8 recipe (one float32 scalar ``*weight_scale`` per weight); the defaults make
    ``"fp8-tensor"``.

    Example:
        >>> from paramstore.recipes import fp8_tensor_recipe
        >>> fp8_tensor_recipe("fp8-tensor-v2", version=2)
        Recipe('fp8-tensor-v2', version=2)
    """
    def shapes(tensor_name: str, tensor: torch.Tensor) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {tensor_name: (torch.float8_e4m3fn, tuple(tensor.shape)),
                scale_name(tensor_name, "weight_scale"): (torch.float32, ())}

    def convert(tensor_name: str, tensor: torch.Tensor, out: Mapping[str, torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor]:
        sname = scale_name(tensor_name, "weight_scale")
        q, s = quantize_tensor(tensor, amax_floor, out=None if out is None else (out[tensor_name], out[sname]))
        return {tensor_name: q, sname: s}

    return Recipe(name, version, eligible, convert,
                  {"quant_method": "fp8", "activation_scheme": "dynamic"},
                  "float8_e4m3fn weights with one float32 scale per tensor (*weight_scale)", shapes)


register(fp8_block_recipe())
register(fp8_tensor_recipe())
