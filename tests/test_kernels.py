"""The compiled FP8 kernels (``paramstore.kernels``): their rounding is torch's on every float32 a
recipe can produce, non-contiguous rows and thread splits change nothing, and where no kernel can
be built the recipes still work (torch's path, the same bytes: ``tests/test_recipes_stripes.py``
runs each of its tests through both)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from paramstore import kernels, recipes

KERNEL = kernels.fp8()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no compiled FP8 kernel here (no C compiler?)")


def e4m3_by_kernel(y: torch.Tensor) -> torch.Tensor:
    """``y`` (float32, contiguous, 1-D) converted by the kernel with a scale of 1."""
    q = torch.empty(y.shape, dtype=torch.float8_e4m3fn)
    one = torch.ones(1)
    KERNEL.scaled["f32"](y.data_ptr(), 1, y.numel(), y.numel(), y.numel(), one.data_ptr(), q.data_ptr(), y.numel())
    return q


def every_rounding_case() -> torch.Tensor:
    """float32 values up to 448, both signs: every exponent (subnormal float32 included) with every
    3-bit leading mantissa and the low mantissa bits around the rounding point (just below, at and
    above the tie, odd and even), plus a million random bit patterns in range."""
    exps = torch.arange(0, 136, dtype=torch.int64)
    tops = torch.arange(8, dtype=torch.int64)
    lows = torch.tensor([0, 1, 0x3FFFF, 0x7FFFF, 0x80000, 0x80001, 0xBFFFF, 0xFFFFF], dtype=torch.int64)
    bits = ((exps[:, None, None] << 23) | (tops[None, :, None] << 20) | lows[None, None, :]).reshape(-1)
    g = torch.Generator().manual_seed(3)
    rand = torch.randint(0, 0x43E00001, (1 << 20,), generator=g, dtype=torch.int64)
    bits = torch.cat([bits, rand])
    bits = bits[bits <= 0x43E00000]  # 448
    bits = torch.cat([bits, bits - (1 << 32)])  # the sign bit set, as int32 bits
    return bits.to(torch.int32).view(torch.float32)


@needs_kernel
def test_the_kernels_rounding_is_torchs_on_every_case():
    y = every_rounding_case()
    got = e4m3_by_kernel(y).view(torch.uint8)
    want = y.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, [(float(y[i]), int(got[i]), int(want[i])) for i in bad[:5, 0]]


@needs_kernel
def test_just_above_448_still_rounds_to_448():
    """The largest quotient a scale allows, 448 * (1 + 2**-23), is 448 in FP8, never NaN."""
    y = torch.tensor([448.0, 448.0 * (1 + 2 ** -23), -448.0 * (1 + 2 ** -23)], dtype=torch.float32)
    assert e4m3_by_kernel(y).float().tolist() == [448.0, 448.0, -448.0]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_of_a_wider_matrix_and_any_thread_split(dtype, threads, monkeypatch):
    """A weight that is a column slice of a wider one (row stride > width) converts as its copy does,
    whatever the threads, and the kernel path is the torch path's bytes."""
    monkeypatch.setattr(recipes, "_PARALLEL_ELEMENTS", 1)  # split even this small weight
    g = torch.Generator().manual_seed(11)
    wide = (torch.randn((700, 900), generator=g) * torch.logspace(-9, 9, 900)).to(dtype)
    x = wide[:, 100:853]
    assert x.stride(0) == 900 and not x.is_contiguous()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, s = recipes.quantize_block(x)
        qt, st = recipes.quantize_tensor(x)
        with monkeypatch.context() as m:
            m.setattr(kernels, "fp8", lambda: None)
            ref_q, ref_s = recipes.quantize_block(x.contiguous())
            ref_qt, ref_st = recipes.quantize_tensor(x.contiguous())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    assert torch.equal(qt.view(torch.uint8), ref_qt.view(torch.uint8)) and torch.equal(st, ref_st)


def test_switched_off_or_without_a_compiler_the_recipes_take_torchs_path(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("PARAMSTORE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("PARAMSTORE_KERNELS", "off")
    assert kernels._load() is None
    monkeypatch.delenv("PARAMSTORE_KERNELS")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert kernels._load() is None
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'cc: out of luck' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    with caplog.at_level(logging.WARNING, logger="paramstore.kernels"):
        assert kernels._load() is None
    assert "could not be built" in caplog.text and "out of luck" in caplog.text
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".so")] == []  # nothing half-built kept
    monkeypatch.setattr(kernels, "fp8", lambda: None)
    x = torch.linspace(-3, 3, 300 * 260).reshape(300, 260)
    q, s = recipes.quantize_block(x)
    back = recipes.dequantize_block(q, s)
    assert bool(((back - x).abs() <= x.abs() / 16 + 1e-5).all())


@needs_kernel
def test_built_once_into_the_cache_directory_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("PARAMSTORE_KERNEL_DIR", str(tmp_path / "cache"))
    first = kernels._load()
    assert first is not None and os.path.dirname(first.path) == str(tmp_path / "cache")
    made = os.stat(first.path).st_mtime_ns

    def no_compiler(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(kernels.subprocess, "run", no_compiler)
    second = kernels._load()
    assert second is not None and second.path == first.path and os.stat(first.path).st_mtime_ns == made
    assert not [p for p in os.listdir(tmp_path / "cache") if p.startswith(".build-")]


@needs_kernel
def test_a_cache_others_may_write_is_not_loaded_from(monkeypatch, tmp_path):
    """A kernel someone else could have planted (a group- or world-writable cache) is never
    loaded: it is built again in a private directory."""
    cache = tmp_path / "shared"
    monkeypatch.setenv("PARAMSTORE_KERNEL_DIR", str(cache))
    first = kernels._load()
    assert first is not None and os.path.dirname(first.path) == str(cache)
    os.chmod(cache, 0o777)
    again = kernels._load()
    assert again is not None and os.path.dirname(again.path) != str(cache)
    os.chmod(cache, 0o700)
    os.chmod(first.path, 0o666)
    third = kernels._load()
    assert third is not None and third.path != first.path
