"""From what a trainer passes to ``commit`` to a checked list of tensors: the torch side of the format.

Validation happens here, on the caller's thread and before any byte is written, so bad input
raises at ``commit`` with nothing written.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from .errors import InvalidArgumentError, InvalidNameError, InvalidTensorError
from .format import TensorSpec
from .manifest import ASSET_PREFIX
from .sharded import chunk_name, group_ranks, is_dtensor, local_block
from .validate import check_name

__all__ = ["TORCH_TO_ST", "ST_TO_TORCH", "Collected", "collect", "Taker", "check_cast", "is_stream", "commit_ranks",
           "model_items", "in_place_version"]

#: torch dtype -> safetensors dtype name, for every dtype both support.
TORCH_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
ST_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in TORCH_TO_ST.items()}

_RESERVED = {"__metadata__"}


@dataclass(frozen=True)
class Collected:
    """A validated state dict, as this rank stores it: specs and source tensors in order, plus
    tied names.

    For a commit by several ranks (``ranks``: their global ranks, first the lead), ``names`` lists
    every tensor of the version with its stored dtype and global shape (also those another rank
    stores), and ``blocks`` maps each spec that is a block of a larger tensor to that tensor's name
    and the block's offsets (see :mod:`paramstore.sharded`). Both are empty for one process.
    """

    specs: list[TensorSpec]
    sources: list[torch.Tensor]
    aliases: dict[str, str]  # tied name -> the name stored
    names: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    blocks: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()

    def without_sources(self) -> "Collected":
        """The same commit with the references to the caller's tensors dropped (once copied)."""
        return replace(self, sources=[])

    def part(self, entries: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's contribution to a commit by several ranks (see
        :func:`paramstore.sharded.merge_parts`), from the manifest entries of its specs."""
        blocks: dict[str, list[dict]] = {}
        for spec in self.specs:
            e = entries[spec.name]
            name, offsets = self.blocks.get(spec.name, (spec.name, (0,) * len(spec.shape)))
            blocks.setdefault(name, []).append({"offsets": list(offsets), "sizes": list(spec.shape),
                                                "digest": e.digest, "object": e.object, "offset": e.offset,
                                                "nbytes": e.nbytes}
                                               | ({"piece_digests": list(e.piece_digests)} if e.piece_digests else {}))
        return {"names": {n: [d, list(s)] for n, (d, s) in self.names.items()}, "blocks": blocks}


def _as_plain_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidTensorError(f"{name!r} is a {type(value).__name__}, not a torch.Tensor")
    if value.is_meta:
        raise InvalidTensorError(f"{name!r} is a meta tensor: it has no data to store")
    if value.layout != torch.strided:
        raise InvalidTensorError(f"{name!r} has layout {value.layout}; only dense tensors can be stored (use .to_dense())")
    if value.is_quantized:
        raise InvalidTensorError(f"{name!r} is a quantized tensor; store its int_repr() and scales instead")
    if value.dtype not in TORCH_TO_ST:
        raise InvalidTensorError(
            f"{name!r} has dtype {value.dtype}, which safetensors cannot store; "
            f"supported: {', '.join(str(d) for d in TORCH_TO_ST)}"
        )
    return value.detach()


def in_place_version(t: torch.Tensor) -> int | None:
    """torch's in-place version counter of ``t`` (shared by its views and ``detach()``; bumped by
    every in-place op, ``optimizer.step()`` included), or None for an inference-mode tensor, which
    has none. Changes made through ``t.data`` do not move it.

    Example:
        >>> t = torch.zeros(2)
        >>> before = in_place_version(t)
        >>> _ = t.detach().add_(1)
        >>> in_place_version(t) - before
        1
    """
    try:
        return t._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def check_cast(dtype: Any) -> torch.dtype | None:
    """``dtype`` for ``commit(dtype=)``: None or a floating-point torch dtype safetensors stores."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype not in TORCH_TO_ST:
        raise InvalidArgumentError(f"dtype must be a floating-point torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    return dtype


def is_stream(model: Any) -> bool:
    """Whether ``model`` is an iterable of ``(name, tensor)`` (a streaming commit) rather than a
    module or a mapping."""
    return not isinstance(model, (torch.nn.Module, Mapping, str, bytes, torch.Tensor)) and hasattr(model, "__iter__")


def model_items(model: Any) -> list[tuple[Any, Any]]:
    """The ``(name, value)`` pairs of a module's state dict or a mapping."""
    if isinstance(model, torch.nn.Module):
        return list(model.state_dict(keep_vars=False).items())
    if isinstance(model, Mapping):
        return list(model.items())
    raise InvalidArgumentError(
        f"model must be a torch.nn.Module, a mapping of names to tensors or an iterable of (name, tensor), "
        f"got {type(model).__name__}"
    )


def check_pair(item: Any) -> tuple[Any, Any]:
    """One item of a streaming commit: a ``(name, tensor)`` pair."""
    if not isinstance(item, tuple) or len(item) != 2:
        raise InvalidArgumentError(f"a streaming commit yields (name, tensor) pairs, got {type(item).__name__}")
    return item


@dataclass
class Taker:
    """Turns ``(name, value)`` pairs into what this rank stores, one at a time (a streaming commit
    calls :meth:`take` as each tensor arrives; :func:`collect` for a whole state dict).

    ``writes_plain``: this rank stores plain tensors (one process, or the lead of several ranks);
    ``sharded``: a commit by several ranks (names and blocks are recorded); ``assets``: files kept
    with the version (name -> bytes; :meth:`take_assets`, after the tensors).
    """

    cast: torch.dtype | None = None
    writes_plain: bool = True
    sharded: bool = False
    ranks: tuple[int, ...] = ()  # the ranks committing (a streaming commit checks each DTensor's mesh)
    names: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    blocks: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    assets: Mapping[str, bytes] = field(default_factory=dict)

    def take_assets(self) -> list[tuple[TensorSpec, torch.Tensor]]:
        """The assets this rank stores (the lead's job, like plain tensors), each a 1-D ``U8``
        tensor named ``ASSET_PREFIX + name`` (see :mod:`paramstore.manifest`)."""
        out = []
        for name, data in sorted(self.assets.items()):
            key = ASSET_PREFIX + name
            self.names[key] = ("U8", (len(data),))
            if self.writes_plain:
                t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
                out.append((TensorSpec(key, "U8", (len(data),)), t))
        return out

    def take(self, name: Any, value: Any) -> tuple[TensorSpec, torch.Tensor] | None:
        """Validate one tensor; returns the spec and data this rank stores, or None (another rank
        stores it). Raises InvalidNameError, InvalidTensorError."""
        check_name(name)
        if name in _RESERVED:
            raise InvalidNameError(f"{name!r} is reserved by the safetensors format")
        if name in self.names:
            raise InvalidNameError(f"{name!r} is committed twice")
        offsets = None
        if is_dtensor(value):
            if value.numel() == 0:  # nothing to split: stored whole, once, like a plain tensor
                value = torch.empty(tuple(value.shape), dtype=value.dtype)
                writes = self.writes_plain
            else:
                if self.ranks or not self.sharded:
                    mesh_ranks = group_ranks([value.device_mesh])
                    if len(mesh_ranks) > 1 and not set(mesh_ranks) <= set(self.ranks):
                        raise InvalidArgumentError(
                            f"{name!r} is sharded over ranks {list(mesh_ranks)}, outside the ranks committing "
                            f"{list(self.ranks) or 'alone'}: pass group= (or yield a DTensor of that mesh first)")
                block = local_block(name, value)
                if block is None:
                    raise InvalidTensorError(f"{name!r}: this rank is not in the DTensor's mesh")
                value, writes = block.local, block.writes
                shape = block.shape
                offsets = None if block.whole else block.offsets
        else:
            writes = self.writes_plain
        t = _as_plain_tensor(name, value)
        if offsets is None:
            shape = tuple(t.shape)
        dtype = self.cast if self.cast is not None and t.dtype.is_floating_point else t.dtype
        st = TORCH_TO_ST[dtype]
        self.names[name] = (st, shape)
        if not writes:
            return None
        if offsets is None:
            return TensorSpec(name, st, tuple(t.shape)), t
        key = chunk_name(name, offsets)
        self.blocks[key] = (name, offsets)
        return TensorSpec(key, st, tuple(t.shape)), t


def collect(model: Any, *, dtype: torch.dtype | None = None, ranks: tuple[int, ...] | None = None,
            assets: Mapping[str, bytes] | None = None) -> Collected:
    """Validate ``model`` and list what this rank stores; tensors sharing one storage become aliases.

    Of a group of tied names, the smallest name is stored and the others alias it, so the version
    digest does not depend on the order of the state dict. ``dtype``: cast floating-point tensors
    to it. ``ranks``: the global ranks committing it together (default: those of its DTensors'
    meshes, :func:`commit_ranks`); with several, each rank keeps only the blocks it stores, and
    the first (the lead) the plain tensors (see :mod:`paramstore.sharded`). ``assets``: files kept
    with the version (checked names -> bytes), stored after the tensors.

    Raises InvalidArgumentError, InvalidNameError or InvalidTensorError.
    """
    items = model if isinstance(model, list) else model_items(model)  # a list: model_items() already taken
    if ranks is None:
        ranks = commit_ranks([v for _, v in items])
    taker = Taker(cast=dtype, sharded=len(ranks) > 1, writes_plain=len(ranks) <= 1 or _rank() == ranks[0],
                  assets=assets or {})
    aliases = _ties(items)
    specs: list[TensorSpec] = []
    sources: list[torch.Tensor] = []
    for name, value in items:
        if name in aliases:
            _as_plain_tensor(name, value)  # still validated
            continue
        got = taker.take(name, value)
        if got is not None:
            specs.append(got[0])
            sources.append(got[1])
    if not taker.names:
        raise InvalidArgumentError("model has no tensors to commit")
    for spec, t in taker.take_assets():
        specs.append(spec)
        sources.append(t)
    return Collected(specs, sources, aliases, taker.names if taker.sharded else {},
                     taker.blocks, ranks if len(ranks) > 1 else ())


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _ties(items: list[tuple[Any, Any]]) -> dict[str, str]:
    """Tied names (the very same view of the very same storage) -> the smallest of them, which is
    stored. DTensors are not tied this way (their blocks are deduplicated by digest instead)."""
    groups: dict[tuple, list[str]] = {}
    for name, t in items:
        if isinstance(t, torch.Tensor) and not is_dtensor(t) and not t.is_meta and t.layout == torch.strided \
                and t.numel() > 0 and isinstance(name, str):
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
                   t.dtype, t.is_conj(), t.is_neg())
            groups.setdefault(key, []).append(name)
    return {n: min(names) for names in groups.values() if len(names) > 1 for n in names if n != min(names)}


def commit_ranks(values: list[Any], group: Any = None) -> tuple[int, ...]:
    """The global ranks committing together: those of ``group`` and of every DTensor's mesh
    (sorted; empty when neither). Raises InvalidArgumentError when a mesh reaches outside ``group``."""
    meshes = {id(v.device_mesh): v.device_mesh for v in values if is_dtensor(v)}
    ranks = group_ranks(meshes.values())
    if group is None:
        return ranks
    import torch.distributed as dist

    mine = tuple(sorted(dist.get_process_group_ranks(group)))
    if not set(ranks) <= set(mine):
        raise InvalidArgumentError(f"the DTensors' meshes hold ranks {list(ranks)}, outside group= ranks {list(mine)}")
    return mine
