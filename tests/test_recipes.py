"""Derivation recipes (issue 29, items 1 and 3): the FP8 recipes against a plain reference quantizer.

The reference (:func:`reference_block`) quantizes one block at a time with a Python loop, the
obvious way; the recipes are vectorized and striped. Both must give the same bytes, and those bytes
must dequantize within the bound :mod:`paramstore.recipes` documents, computed here in float64.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from paramstore import recipes
from paramstore.errors import InvalidArgumentError, InvalidTensorError
from paramstore.recipes import AMAX_FLOOR, ERROR_BOUND, FP8_MAX

FP8 = torch.float8_e4m3fn
FLOOR_SCALE = torch.tensor(AMAX_FLOOR, dtype=torch.float32) / FP8_MAX  # the scale of a zero or tiny block
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference_block(x: torch.Tensor, bn: int = 128, bk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 the plain way: per block, s = max(amax, 1e-4) / 448 in float32, q = fp8(x / s)."""
    n, k = x.shape
    q = torch.empty((n, k), dtype=FP8)
    s = torch.empty((math.ceil(n / bn), math.ceil(k / bk)), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = x[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            scale = block.abs().max().clamp(min=AMAX_FLOOR) / FP8_MAX
            s[i, j] = scale
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (block / scale).to(FP8)
    return q, s


def expand(s: torch.Tensor, shape: tuple[int, int], bn: int = 128, bk: int = 128) -> torch.Tensor:
    """The per-element float64 scale of a block grid, written without repeat_interleave (unlike the module)."""
    n, k = shape
    rows = torch.arange(n) // bn
    cols = torch.arange(k) // bk
    return s.double()[rows[:, None], cols[None, :]]


def assert_within_bound(x: torch.Tensor, q: torch.Tensor, per_element_scale: torch.Tensor) -> None:
    relative, absolute, slack = ERROR_BOUND
    exact = x.double()
    deq = q.double() * per_element_scale  # exact in float64: 4 significant bits times 24
    err = (deq - exact).abs()
    bound = torch.maximum(relative * exact.abs(), absolute * per_element_scale) * (1 + slack)
    worst = (err - bound).max()
    assert bool((err <= bound).all()), f"dequantized values off by more than the bound (worst excess {worst.item()})"


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))


@st.composite
def weights(draw, max_side: int = 300):
    """A 2-D weight: random shape and dtype, magnitudes over many decades, and some blocks zeroed,
    made tiny or made huge."""
    n = draw(st.integers(1, max_side))
    k = draw(st.integers(1, max_side))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    seed = draw(st.integers(0, 2**31 - 1))
    top = {torch.float16: 3, torch.bfloat16: 30, torch.float32: 30}[dtype]
    magnitude = 10.0 ** draw(st.integers(-12, top))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, k), generator=g, dtype=torch.float64) * magnitude
    for _ in range(draw(st.integers(0, 3))):  # a few blocks (of 128, the recipe's) rescaled
        i, j = draw(st.integers(0, (n - 1) // 128)), draw(st.integers(0, (k - 1) // 128))
        factor = draw(st.sampled_from([0.0, 1e-9, 1e-30, 1e3]))
        x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= factor
    if draw(st.booleans()):  # exact zeros and a lone outlier
        x[0, :] = 0.0
        x[-1, -1] = magnitude * 100
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)  # finite in float16
    return x.to(dtype)


def fixed(shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


# -- block FP8 ------------------------------------------------------------------------------------------


@PROPERTY
@given(weights())
@example(fixed((129, 200)))
@example(fixed((1, 1)))
@example(fixed((127, 129), torch.float16))
@example(fixed((256, 384), torch.float32))
@example(torch.zeros((130, 130), dtype=torch.bfloat16))
def test_block_matches_the_reference_and_the_bound(x):
    before = x.clone()
    q, s = recipes.quantize_block(x)
    assert same_bytes(x, before)  # the input is left alone
    n, k = x.shape
    # the loader's layout: the weight unpadded, one float32 scale per (partial) 128x128 block
    assert q.dtype == FP8 and tuple(q.shape) == (n, k)
    assert s.dtype == torch.float32 and tuple(s.shape) == (math.ceil(n / 128), math.ceil(k / 128))
    # scales finite and positive, never below the floor's
    assert bool(torch.isfinite(s).all()) and bool((s >= FLOOR_SCALE).all())
    # byte for byte what the per-block loop gives
    ref_q, ref_s = reference_block(x)
    assert same_bytes(s, ref_s)
    assert same_bytes(q, ref_q)
    # within the documented bound, in float64
    assert_within_bound(x, q, expand(s, (n, k)))
    # each block's largest element lands on +-448 unless the block is under the floor
    qmax = torch.zeros_like(s)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            qmax[i, j] = q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float().abs().max()
    above = s > FLOOR_SCALE
    assert bool((qmax[above] == FP8_MAX).all())
    assert bool((qmax <= FP8_MAX).all())
    # the module's own dequantizer (what the docs show) agrees with the float64 one
    assert torch.equal(recipes.dequantize_block(q, s).double(), (q.double() * expand(s, (n, k))).float().double())


@PROPERTY
@given(weights(max_side=200), st.sampled_from([(1, 1), (3, 5), (64, 64), (128, 32)]))
def test_other_block_shapes_match_the_reference(x, block):
    q, s = recipes.quantize_block(x, block)
    ref_q, ref_s = reference_block(x, *block)
    assert same_bytes(q, ref_q) and same_bytes(s, ref_s)
    assert_within_bound(x, q, expand(s, tuple(x.shape), *block))


def test_partial_edge_blocks_get_their_own_scale():
    # 129 x 200: the last row and the last 72 columns are partial blocks; a large value in the
    # bottom-right corner must scale only that block, and the weight itself is not padded
    x = torch.full((129, 200), 0.5)
    x[128, 199] = 448.0
    q, s = recipes.quantize_block(x)
    assert tuple(q.shape) == (129, 200)
    assert torch.equal(s, torch.tensor([[0.5, 0.5], [0.5, 448.0]]) / FP8_MAX)
    assert q[128, 199].float().item() == 448.0 and q[128, 0].float().item() == 448.0
    assert q[128, 198].float().item() == 0.5  # in the big block: 0.5 / 1.0, exact in e4m3
    assert q[0, 0].float().item() == 448.0


def test_zero_and_tiny_blocks():
    x = torch.zeros((256, 256))
    x[128:, :128] = 1e-30  # tiny: under the floor, so quantized to zero within the absolute bound
    x[:128, 128:] = 3e-5  # small but above subnormal resolution of the floor's scale
    x[128:, 128:] = torch.linspace(-2, 2, 128 * 128).reshape(128, 128)
    q, s = recipes.quantize_block(x)
    assert same_bytes(s[0, 0], FLOOR_SCALE) and same_bytes(s[1, 0], FLOOR_SCALE) and same_bytes(s[0, 1], FLOOR_SCALE)
    assert s[1, 1].item() == pytest.approx(2 / 448, rel=1e-7)
    assert bool((q[:128, :128].view(torch.uint8) == 0).all())  # +0.0, not NaN, not -0.0
    assert bool((q[128:, :128].view(torch.uint8) == 0).all())
    assert q[0, 128].float().item() == pytest.approx(3e-5 / FLOOR_SCALE.item(), rel=2**-4)
    assert_within_bound(x, q, expand(s, (256, 256)))


def test_extreme_magnitudes():
    for dtype, big in ((torch.float32, 3e38), (torch.float16, 65504.0), (torch.bfloat16, 3e38)):
        x = torch.tensor([[big, -big / 3], [1.0, -0.0]], dtype=dtype)
        q, s = recipes.quantize_block(x)
        assert bool(torch.isfinite(s).all()) and q[0, 0].float().item() == 448.0
        assert_within_bound(x, q, expand(s, (2, 2)))
    x = torch.full((4, 4), torch.finfo(torch.float32).tiny / 8)  # float32 subnormals
    q, s = recipes.quantize_block(x)
    assert same_bytes(s[0, 0], FLOOR_SCALE) and bool((q.view(torch.uint8) == 0).all())


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_weights_are_refused(bad):
    x = torch.ones((130, 3))
    x[129, 1] = bad
    with pytest.raises(InvalidTensorError, match="infinite or NaN"):
        recipes.quantize_block(x)
    with pytest.raises(InvalidTensorError, match="infinite or NaN"):
        recipes.quantize_tensor(x)
    with pytest.raises(InvalidTensorError):
        recipes.derive("fp8-block128", {"mlp.up_proj.weight": x})


def test_stripes_do_not_change_the_bytes(monkeypatch):
    # one stripe per 128-row block row (the smallest), against the default (all in one stripe here)
    x = fixed((700, 300), torch.bfloat16, seed=3)
    whole = recipes.quantize_block(x)
    whole_t = recipes.quantize_tensor(x)
    monkeypatch.setattr(recipes, "STRIPE_BYTES", 1)
    striped = recipes.quantize_block(x)
    striped_t = recipes.quantize_tensor(x)
    assert all(same_bytes(a, b) for a, b in zip(whole, striped))
    assert all(same_bytes(a, b) for a, b in zip(whole_t, striped_t))
    ref_q, ref_s = reference_block(x)
    assert same_bytes(striped[0], ref_q) and same_bytes(striped[1], ref_s)


def test_non_contiguous_input():
    x = fixed((300, 260), torch.float32, seed=4)
    t = x.t()
    q, s = recipes.quantize_block(t)
    ref_q, ref_s = reference_block(t.contiguous())
    assert same_bytes(q, ref_q) and same_bytes(s, ref_s)


def test_empty_and_wrong_inputs():
    q, s = recipes.quantize_block(torch.zeros((0, 5)))
    assert tuple(q.shape) == (0, 5) and tuple(s.shape) == (0, 1)
    with pytest.raises(InvalidTensorError, match="2-D"):
        recipes.quantize_block(torch.zeros(5))
    with pytest.raises(InvalidTensorError, match="bfloat16, float16 or float32"):
        recipes.quantize_block(torch.zeros((2, 2), dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="expected"):
        recipes.dequantize_block(torch.zeros((130, 4), dtype=FP8), torch.ones((1, 1)))


# -- per-tensor FP8 -------------------------------------------------------------------------------------


@PROPERTY
@given(weights(max_side=200))
@example(torch.zeros((3, 3)))
def test_tensor_matches_the_reference_and_the_bound(x):
    before = x.clone()
    q, s = recipes.quantize_tensor(x)
    assert same_bytes(x, before)  # the input is left alone (a float32 one was once divided in place)
    assert q.dtype == FP8 and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == () and math.isfinite(s.item()) and s.item() > 0
    ref_q, ref_s = reference_block(x, *x.shape)  # one block: the whole tensor
    assert same_bytes(s, ref_s.reshape(())) and same_bytes(q, ref_q)
    assert_within_bound(x, q, s.double().expand(x.shape))


# -- recipes, the registry, derive --------------------------------------------------------------------------


LLAMA = {
    "model.embed_tokens.weight": (64, 32),
    "model.layers.0.input_layernorm.weight": (32,),
    "model.layers.0.self_attn.q_proj.weight": (32, 32),
    "model.layers.0.self_attn.q_proj.bias": (32,),
    "model.layers.0.self_attn.kv_a_layernorm.weight": (16,),
    "model.layers.0.mlp.gate.weight": (8, 32),
    "model.layers.0.mlp.shared_expert_gate.weight": (1, 32),
    "model.layers.0.mlp.gate_up_proj.weight": (130, 32),
    "model.layers.0.mlp.experts.0.down_proj.weight": (32, 129),
    "model.layers.0.mlp.experts.w13": (2, 8, 32),  # fused 3-D experts: not 2-D, passed through
    "model.norm.weight": (32,),
    "lm_head.weight": (64, 32),
}
QUANTIZED = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
             "model.layers.0.mlp.experts.0.down_proj.weight"]


def llama(dtype=torch.bfloat16):
    return {name: fixed(shape, dtype, seed=i) for i, (name, shape) in enumerate(LLAMA.items())}


def test_block_recipe_on_a_state_dict():
    sd = llama()
    sd["model.layers.0.rotary.inv_freq"] = torch.ones(4)
    sd["step"] = torch.tensor(7)
    copies = {n: t.clone() for n, t in sd.items()}
    out = recipes.derive("fp8-block128", sd)
    assert all(same_bytes(sd[n], copies[n]) for n in sd)
    expected = []
    for name in sd:
        expected.append(name)
        if name in QUANTIZED:
            expected.append(name[:-len("weight")] + "weight_scale_inv")
    assert list(out) == expected  # scales right after their weight, the order otherwise kept
    for name, value in sd.items():
        if name in QUANTIZED:
            q, s = out[name], out[name + "_scale_inv"]
            ref_q, ref_s = reference_block(value)
            assert same_bytes(q, ref_q) and same_bytes(s, ref_s)
        else:
            assert out[name] is value  # passed through, not copied
    assert tuple(out["model.layers.0.mlp.gate_up_proj.weight_scale_inv"].shape) == (2, 1)
    assert tuple(out["model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"].shape) == (1, 2)
    # through safetensors, as an export would write it: F8_E4M3 and F32, bytes intact
    back = load(save(out))
    assert all(same_bytes(back[n], out[n]) for n in out)


def test_tensor_recipe_on_a_state_dict():
    sd = llama(torch.float32)
    copies = {n: t.clone() for n, t in sd.items()}
    out = recipes.derive("fp8-tensor", sd)
    assert all(same_bytes(sd[n], copies[n]) for n in sd)
    for name in QUANTIZED:
        scale = out[name[:-len("weight")] + "weight_scale"]
        assert out[name].dtype == FP8 and scale.shape == () and scale.dtype == torch.float32
        assert_within_bound(sd[name], out[name], scale.double().expand(sd[name].shape))
    assert not any(n.endswith("_scale_inv") for n in out)
    assert len(out) == len(sd) + len(QUANTIZED)
    back = load(save(out))
    assert all(same_bytes(back[n], out[n]) for n in out)


def test_the_default_selection():
    w = torch.zeros(4, 4)
    picked = [n for n in LLAMA if recipes.default_eligible(n, fixed(LLAMA[n]))]
    assert picked == QUANTIZED
    assert not recipes.default_eligible("x.weight", torch.zeros((4, 4), dtype=FP8))  # quantized already
    assert not recipes.default_eligible("x.weight", torch.zeros((4, 4), dtype=torch.int8))
    assert not recipes.default_eligible("x.weight", torch.zeros((0, 4)))
    assert recipes.default_eligible("x.weight", w.double()) is False
    assert recipes.default_eligible("model.layers.0.self_attn.kv_b_proj.weight", w)
    assert not recipes.default_eligible("model.layers.0.self_attn.kv_b_proj.weight_scale_inv", w)


def test_a_recipe_with_another_selection_and_block():
    only_lm_head = recipes.fp8_block_recipe("test-lm-head-64", block=64, eligible=lambda n, t: n == "lm_head.weight")
    sd = llama()
    out = recipes.derive(only_lm_head, sd)
    assert [n for n in out if out[n] is not sd.get(n)] == ["lm_head.weight", "lm_head.weight_scale_inv"]
    ref_q, ref_s = reference_block(sd["lm_head.weight"], 64, 64)
    assert same_bytes(out["lm_head.weight"], ref_q) and same_bytes(out["lm_head.weight_scale_inv"], ref_s)
    assert only_lm_head.config()["weight_block_size"] == [64, 64]


def test_a_state_dict_derived_already_is_refused():
    out = recipes.derive("fp8-block128", llama())
    # its scales are there: quantizing the bf16 weights of a half-derived dict would overwrite them
    half = dict(llama())
    half["model.layers.0.self_attn.q_proj.weight_scale_inv"] = out["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    with pytest.raises(InvalidArgumentError, match="weight_scale_inv"):
        recipes.derive("fp8-block128", half)
    # the fully derived dict has nothing eligible left: it passes through unchanged
    again = recipes.derive("fp8-block128", out)
    assert list(again) == list(out) and all(again[n] is out[n] for n in out)
    # two tensors a recipe maps to the same name
    clash = recipes.Recipe("test-clash", 1, lambda n, t: True, lambda n, t: {"same": t})
    with pytest.raises(InvalidArgumentError, match="gives too"):
        recipes.derive(clash, {"a": torch.ones(1), "b": torch.ones(1)})


def test_unknown_recipe():
    with pytest.raises(InvalidArgumentError) as info:
        recipes.get("fp8-block256")
    assert isinstance(info.value, ValueError)
    assert "unknown recipe 'fp8-block256'" in str(info.value)
    assert "'fp8-block128'" in str(info.value) and "'fp8-tensor'" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="unknown recipe"):
        recipes.derive("nope", {})
    with pytest.raises(InvalidArgumentError, match="unknown recipe"):
        recipes.get(None)


def test_register():
    mine = recipes.fp8_tensor_recipe("test-register", version=3)
    try:
        assert recipes.register(mine) is mine and recipes.get("test-register") is mine
        assert "test-register" in recipes.names()
        assert recipes.register(mine) is mine  # the same object again: fine
        other = recipes.fp8_tensor_recipe("test-register", version=4)
        with pytest.raises(InvalidArgumentError, match="already registered"):
            recipes.register(other)
        assert recipes.get("test-register") is mine
        assert recipes.register(other, replace=True) is other and recipes.get("test-register").version == 4
        with pytest.raises(InvalidArgumentError, match="already registered"):
            recipes.register(recipes.fp8_block_recipe())  # the built-in's name
    finally:
        recipes._REGISTRY.pop("test-register", None)
    assert recipes.get("fp8-block128").version == 1


def test_recipe_fields_are_checked_and_frozen():
    for bad in ("", "FP8", "a b", "-x", 3):
        with pytest.raises(InvalidArgumentError, match="recipe name"):
            recipes.Recipe(bad, 1, lambda n, t: False, lambda n, t: {})
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(InvalidArgumentError, match="version"):
            recipes.Recipe("ok", bad, lambda n, t: False, lambda n, t: {})
    with pytest.raises(InvalidArgumentError, match="callables"):
        recipes.Recipe("ok", 1, None, lambda n, t: {})
    with pytest.raises(InvalidArgumentError, match="JSON"):
        recipes.Recipe("ok", 1, lambda n, t: False, lambda n, t: {}, {"x": object()})
    block = recipes.get("fp8-block128")
    with pytest.raises(TypeError):
        block.quantization_config["quant_method"] = "int8"
    with pytest.raises(AttributeError):
        block.version = 2
    config = block.config()
    config["weight_block_size"].append(1)  # a copy: the recipe's own is untouched
    assert block.config() == {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                              "weight_block_size": [128, 128]}
    assert recipes.get("fp8-tensor").config() == {"quant_method": "fp8", "activation_scheme": "dynamic"}


# -- the same bytes everywhere ------------------------------------------------------------------------------


def digest(out: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in out.items():
        h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_same_bytes_for_any_thread_count():
    sd = {"a.weight": fixed((1024, 1536), torch.bfloat16, seed=5), "b.weight": fixed((777, 1000), torch.float32, seed=6)}
    threads = torch.get_num_threads()
    try:
        got = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            got[n] = {r: digest(recipes.derive(r, sd)) for r in ("fp8-block128", "fp8-tensor")}
    finally:
        torch.set_num_threads(threads)
    assert got[1] == got[2]


def integer_weight(shape, dtype):
    """A weight from integer arithmetic only (no RNG, no libm): the same values on any host."""
    n = math.prod(shape)
    i = torch.arange(n, dtype=torch.int64)
    v = torch.ldexp(((i * 7919 + 13) % 20011 - 10005).double() / 10005, (i * 31) % 17 - 8)  # exact: a power of 2
    return v.reshape(shape).to(dtype)


# A change of either digest changes what engines load: bump the recipe's version with it.
GOLDEN = {
    "fp8-block128": "502d0691815b61ec92b33fa37c66b327ea78efd302a283941c7a48b9c392f1c1",
    "fp8-tensor": "7504e50221088af152c21d56f1256ced25e907ddb5612cf07b70570a2d9bf9b7",
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name):
    sd = {"x.weight": integer_weight((300, 257), torch.bfloat16), "y.weight": integer_weight((129, 130), torch.float32),
          "z.weight": integer_weight((40, 60), torch.float16)}
    assert digest(recipes.derive(name, sd)) == GOLDEN[name]
