"""The FP8 quantizers as rewritten for speed (block maxima on the input's bits, L2-sized conversion
steps, and the compiled kernels of ``paramstore.kernels``) against the implementation they
replaced, kept here verbatim in substance: the same bytes for every input, stripe size, block shape
and thread count, and the same refusals. Every test runs twice: through the compiled kernels
(skipped where none can be built) and through torch's path.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from paramstore import kernels, recipes
from paramstore.errors import InvalidTensorError
from paramstore.recipes import AMAX_FLOOR, FP8_MAX

FP8 = torch.float8_e4m3fn
PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def previous_block(x, block=(128, 128), stripe_bytes=8 << 20):
    """``quantize_block`` before the rewrite (commit d5aff02): float32 stripes of whole block rows,
    maxima as max(amax, -amin) of the float32 values."""
    bn, bk = block
    n, k = x.shape
    gn, gk = -(-n // bn), -(-k // bk)
    q = torch.empty((n, k), dtype=FP8)
    scale = torch.empty((gn, gk), dtype=torch.float32)
    step = bn * max(1, stripe_bytes // max(1, bn * gk * bk * 4))
    buf = torch.zeros((min(step, gn * bn), gk * bk), dtype=torch.float32)
    for r0 in range(0, n, step):
        rows = min(step, n - r0)
        brows = -(-rows // bn)
        chunk = buf[:brows * bn]
        chunk[:rows, :k].copy_(x[r0:r0 + rows])
        if rows < brows * bn:
            chunk[rows:].zero_()
        blocks = chunk.view(brows, bn, gk, bk)
        amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg_())
        s = amax.clamp_(min=AMAX_FLOOR).div_(FP8_MAX)
        scale[r0 // bn:r0 // bn + brows] = s
        blocks.div_(s[:, None, :, None])
        q[r0:r0 + rows].copy_(chunk[:rows, :k])
    return q, scale


def previous_tensor(x):
    """``quantize_tensor`` before the rewrite (commit d5aff02), in one stripe."""
    flat = x.reshape(x.shape[0], -1) if x.ndim >= 2 else x.reshape(1, -1)
    low, high = torch.aminmax(flat)
    s = torch.maximum(high, low.neg()).float().clamp(min=AMAX_FLOOR).div_(FP8_MAX)
    return flat.to(torch.float32, copy=True).div_(s).to(FP8).view(x.shape), s


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module", params=["kernel", "torch"], autouse=True)
def conversion(request):
    """Which path converts: the compiled kernels, or torch's (``kernels.fp8`` made to say none)."""
    if request.param == "kernel" and kernels.fp8() is None:
        pytest.skip("no compiled FP8 kernel here (no C compiler?)")
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "torch":
            mp.setattr(kernels, "fp8", lambda: None)
        yield request.param


@contextlib.contextmanager
def stripes(stripe_bytes):
    saved, recipes.STRIPE_BYTES = recipes.STRIPE_BYTES, stripe_bytes
    try:
        yield
    finally:
        recipes.STRIPE_BYTES = saved


@st.composite
def weights(draw, max_side=300):
    """A 2-D weight with magnitudes over many decades, exact zeros and signed zeros, subnormals,
    duplicated maxima of both signs, and whole blocks zeroed or made tiny."""
    n, k = draw(st.integers(1, max_side)), draw(st.integers(1, max_side))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    top = {torch.float16: 3, torch.bfloat16: 30, torch.float32: 30}[dtype]
    x = torch.randn((n, k), generator=g, dtype=torch.float64) * 10.0 ** draw(st.integers(-12, top))
    if draw(st.booleans()):
        x[torch.rand((n, k), generator=g) < 0.2] = 0.0
        x[torch.rand((n, k), generator=g) < 0.1] = -0.0
    if draw(st.booleans()):  # the largest magnitude twice, once negative
        m = x.abs().max()
        x[0, 0], x[-1, -1] = -m, m
    for _ in range(draw(st.integers(0, 3))):
        i, j = draw(st.integers(0, (n - 1) // 128)), draw(st.integers(0, (k - 1) // 128))
        x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= draw(st.sampled_from([0.0, -0.0, 1e-30, 1e-42]))
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    return x.to(dtype)


@PROPERTY
@given(weights(), st.sampled_from([1, 4096, 3 * 128 * 256 * 4, 8 << 20]),
       st.sampled_from([(128, 128), (1, 1), (3, 5), (64, 128), (128, 32)]))
@example(torch.zeros((1, 1), dtype=torch.bfloat16), 8 << 20, (128, 128))
@example(torch.full((129, 257), -0.0), 1, (128, 128))
@example(torch.full((300, 300), 1e-42), 4096, (128, 128))
def test_block_bytes_as_before(x, stripe_bytes, block):
    with stripes(stripe_bytes):
        q, s = recipes.quantize_block(x, block)
    ref_q, ref_s = previous_block(x, block)
    assert same_bytes(s, ref_s) and same_bytes(q, ref_q)


@PROPERTY
@given(weights(max_side=200), st.sampled_from([1, 4096, 8 << 20]))
@example(torch.zeros((3, 3)), 1)
def test_tensor_bytes_as_before(x, stripe_bytes):
    with stripes(stripe_bytes):
        q, s = recipes.quantize_tensor(x)
    ref_q, ref_s = previous_tensor(x)
    assert same_bytes(s, ref_s) and same_bytes(q, ref_q)


@pytest.mark.parametrize("stripe_bytes", [
    4 * 128 * 256 * 2,  # two block rows per stripe: several stripes, the last one partial
    4 * 256 * 50,  # 50 rows per conversion step: each block row in three equal parts (43, 43, 42)
    8 << 20,
])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_stripe_layout_and_thread_count(stripe_bytes, threads):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn((700, 256), generator=g) * torch.logspace(-8, 8, 700)[:, None]).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with stripes(stripe_bytes):
            q, s = recipes.quantize_block(x)
            qt, st_ = recipes.quantize_tensor(x)
    finally:
        torch.set_num_threads(before)
    ref_q, ref_s = previous_block(x)
    assert same_bytes(q, ref_q) and same_bytes(s, ref_s)
    ref_qt, ref_st = previous_tensor(x)
    assert same_bytes(qt, ref_qt) and same_bytes(st_, ref_st)


def test_a_large_weight_in_many_stripes():
    # Llama's MLP width: a block row (128 x 11008 float32, 5.5 MiB) is one conversion step
    g = torch.Generator().manual_seed(8)
    x = (torch.randn((300, 11008), generator=g) * 0.02).to(torch.bfloat16)
    for got, ref in ((recipes.quantize_block(x), previous_block(x)), (recipes.quantize_tensor(x), previous_tensor(x))):
        assert same_bytes(got[0], ref[0]) and same_bytes(got[1], ref[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), -float("nan")])
@pytest.mark.parametrize("where", [(0, 0), (129, 200), (255, 255)])  # a full block, the edge blocks
def test_non_finite_anywhere_is_refused(dtype, bad, where):
    x = torch.ones((256, 256), dtype=dtype)[:250, :201].clone()
    i, j = min(where[0], 249), min(where[1], 200)
    x[i, j] = bad
    with pytest.raises(InvalidTensorError, match="infinite or NaN"):
        recipes.quantize_block(x)
    with pytest.raises(InvalidTensorError, match="infinite or NaN"):
        recipes.quantize_tensor(x)


def test_the_bit_order_is_the_order_of_magnitudes():
    # the maxima compare sign-cleared bit patterns as integers: for each dtype, every pattern's
    # order is its magnitude's, with infinity above every finite value and NaN above infinity
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float16, torch.int16)):
        patterns = torch.arange(0, 0x8000, dtype=torch.int32).to(bits)
        values = patterns.view(dtype).float()
        finite = torch.isfinite(values)
        assert bool((values[finite][1:] > values[finite][:-1]).all())
        first_nan = int(torch.isnan(values).nonzero()[0])
        assert bool(torch.isinf(values[first_nan - 1])) and bool(torch.isnan(values[first_nan:]).all())
    sample = torch.cat([torch.arange(0, 0x7F800001, 0x7F800000 // 100003, dtype=torch.int64),
                        torch.tensor([0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FFFFFFF])]).to(torch.int32)
    values = sample.view(torch.float32)
    assert bool((values[:-3][1:] > values[:-3][:-1]).all())
    assert torch.isinf(values[-3]) and bool(torch.isnan(values[-2:]).all())
