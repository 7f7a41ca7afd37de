"""Sparse patches (paramstore.patch): bit-exact round trips on any dtype, compact when little
changed, refused when damaged or applied to the wrong base."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paramstore.errors import CorruptObjectError, InvalidArgumentError
from paramstore.patch import apply_patch, make_patch, patch_info
from paramstore.tensors import TORCH_TO_ST

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.int64, torch.uint8, torch.bool, torch.complex64]


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def random_bits(dtype: torch.dtype, n: int, rng: np.random.Generator) -> torch.Tensor:
    """Any bit patterns of ``dtype`` (NaN payloads, infinities, -0.0 included)."""
    size = torch.empty(0, dtype=dtype).element_size()
    data = rng.integers(0, 2 if dtype == torch.bool else 256, size=n * size, dtype=np.uint8)
    t = torch.from_numpy(data).view(dtype) if n else torch.empty(0, dtype=dtype)
    return t


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 3000), fraction=st.sampled_from([0.0, 0.001, 0.01, 0.2, 1.0]),
       seed=st.integers(0, 2**32 - 1))
def test_a_patch_round_trips_bit_for_bit(dtype, n, fraction, seed):
    rng = np.random.default_rng(seed)
    base = random_bits(dtype, n, rng)
    target = base.clone()
    k = int(n * fraction)
    if k:
        where = torch.from_numpy(rng.choice(n, size=k, replace=False))
        target[where] = random_bits(dtype, k, rng)
    st_dtype = TORCH_TO_ST[dtype]
    patch = make_patch(raw(base), raw(target), st_dtype, max_ratio=1e9)  # keep every patch, to test it
    if n == 0:
        assert patch is None  # nothing to patch: an empty tensor moves as it is (0 bytes)
        return
    assert patch is not None
    assert apply_patch(raw(base), patch) == raw(target)
    info = patch_info(patch)
    assert info["dtype"] == st_dtype and info["nbytes"] == len(raw(target))
    assert info["changed"] <= k  # a replacement may equal the old bits


def test_special_floats_are_compared_as_bits():
    base = torch.tensor([0.0, float("nan"), 1.0, float("inf")], dtype=torch.float32)
    target = base.clone()
    target[0] = -0.0  # equal as numbers, not as bits
    bits = target.view(torch.int32)
    bits[1] = bits[1] | 1  # another NaN payload
    patch = make_patch(raw(base), raw(target), "F32", max_ratio=100)
    assert patch_info(patch)["changed"] == 2
    assert apply_patch(raw(base), patch) == raw(target)


def test_one_percent_of_a_bf16_tensor_gives_a_small_patch():
    rng = np.random.default_rng(0)
    master = torch.from_numpy(rng.standard_normal(1 << 20).astype(np.float32)) * 0.02
    base = master.to(torch.bfloat16)
    target = (master + torch.from_numpy(rng.choice([-2e-7, 2e-7], size=1 << 20).astype(np.float32))).to(torch.bfloat16)
    changed = int((base.view(torch.int16) != target.view(torch.int16)).sum())
    patch = make_patch(raw(base), raw(target), "BF16")
    assert patch is not None and 0 < changed < 0.05 * base.numel()
    # positions (4 bytes) + values (2 bytes) per changed element, compressed: well under the tensor
    assert len(patch) <= 6 * changed + 512 and len(patch) < 0.1 * len(raw(target))
    assert apply_patch(raw(base), patch) == raw(target)


def test_a_patch_larger_than_the_margin_is_not_made():
    rng = np.random.default_rng(1)
    base, target = random_bits(torch.float32, 4096, rng), random_bits(torch.float32, 4096, rng)
    assert make_patch(raw(base), raw(target), "F32") is None  # everything changed: move the tensor whole
    assert make_patch(raw(base), raw(base), "F32") is not None  # nothing changed: a tiny patch


def test_a_damaged_patch_or_the_wrong_base_is_refused():
    base = torch.zeros(1000, dtype=torch.float32)
    target = base.clone()
    target[[1, 10, 100]] = 3.0
    patch = bytearray(make_patch(raw(base), raw(target), "F32"))
    with pytest.raises(CorruptObjectError, match="hashes to|wrong base"):
        apply_patch(raw(torch.ones(1000)), bytes(patch))  # another base
    with pytest.raises(CorruptObjectError, match="not .* base|patch is for base"):
        apply_patch(raw(base), bytes(patch), base_digest="0" * 64)
    damaged = bytes(patch[:-3]) + bytes([patch[-3] ^ 0xFF]) + bytes(patch[-2:])
    with pytest.raises(CorruptObjectError):
        apply_patch(raw(base), damaged)  # corrupt data: does not decompress, or the digest disagrees
    for junk in (b"", b"\x10" + b"\0" * 7 + b"{}", bytes(patch[:20])):
        with pytest.raises(CorruptObjectError, match="malformed patch"):
            apply_patch(raw(base), junk)
    with pytest.raises(CorruptObjectError, match="bytes, the base has"):
        apply_patch(raw(torch.zeros(10)), bytes(patch))


def test_bad_arguments_are_refused():
    with pytest.raises(InvalidArgumentError, match="one length"):
        make_patch(b"\0" * 8, b"\0" * 12, "F32")
    with pytest.raises(InvalidArgumentError, match="whole number"):
        make_patch(b"\0" * 6, b"\0" * 6, "F32")
    with pytest.raises(InvalidArgumentError, match="dtype"):
        make_patch(b"", b"", "Q7")
