"""Sparse patches (paramstore.patch): bit-exact round trips on any dtype, compact when little
changed, refused when damaged or applied to the wrong base."""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor

import blake3
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import paramstore.patch as patch_module
from paramstore.errors import CorruptObjectError, InvalidArgumentError
from paramstore.patch import Encoded, apply_patch, decode_into, encode, make_patch, patch_info
from paramstore.format import ITEMSIZE
from paramstore.tensors import TORCH_TO_ST

PINNED_CONTENT = "60a7a79b7fee7d05"
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


def sparse_pair(n: int, fraction: float, seed: int = 0, dtype=torch.bfloat16) -> tuple[bytes, bytes]:
    rng = np.random.default_rng(seed)
    base = random_bits(dtype, n, rng)
    target = base.clone()
    k = int(n * fraction)
    if k:
        target[torch.from_numpy(rng.choice(n, size=k, replace=False))] = random_bits(dtype, k, rng)
    return raw(base), raw(target)


def test_encode_and_decode_into_a_bytearray_or_an_mmap():
    base, target = sparse_pair(100_003, 0.02)
    enc = encode(base, target, "BF16")
    assert isinstance(enc, Encoded) and enc.gap_width == 4
    assert enc.changed == int((np.frombuffer(base, np.uint16) != np.frombuffer(target, np.uint16)).sum())
    assert encode(np.frombuffer(base, np.uint8), memoryview(target), "BF16") == enc  # any buffer, same frame
    out = bytearray(len(base))
    decode_into(out, base, enc.frame, "BF16", enc.changed, enc.gap_width)
    assert out == target
    with mmap.mmap(-1, len(base) + 4096) as m:  # a view into a mapping, base read-only from another one
        with mmap.mmap(-1, len(base)) as src:
            src[:] = base
            view = memoryview(m)[4096:]
            decode_into(view, memoryview(src).toreadonly(), memoryview(enc.frame), "BF16", enc.changed, enc.gap_width)
            assert m[4096:] == target and m[:4096] == bytes(4096)  # nothing written outside out
            view.release()


def test_a_frame_decodes_chunk_by_chunk_in_place_as_decode_into_does():
    """open_frame + Frame.decode_chunk (what a rebuild uses, a chunk read from the base then patched
    in place) give decode_into's bytes, for every chunk alone; a chunk's changes do not fit another
    chunk's buffer; the count is checked once every chunk is done."""
    from paramstore.patch import open_frame

    base, target = sparse_pair(3_000_001, 0.015, seed=4)  # 3 chunks, the last partial
    enc = encode(base, target, "BF16")
    frame = open_frame(enc.frame, len(base), "BF16", enc.changed, enc.gap_width)
    assert frame.chunks()[-1][1] == len(base) and len(frame.chunks()) == 3
    count = 0
    for i, (lo, hi) in reversed(list(enumerate(frame.chunks()))):  # any order
        block = bytearray(base[lo:hi])
        count += frame.decode_chunk(i, block)
        assert block == target[lo:hi]
    frame.check(count)
    with pytest.raises(CorruptObjectError, match="expected"):
        frame.check(count - 1)
    with pytest.raises(InvalidArgumentError, match="chunk 2 is"):
        frame.decode_chunk(2, bytearray(frame.chunk_bytes))
    with pytest.raises(CorruptObjectError, match="its chunks say"):
        open_frame(enc.frame[:-1], len(base), "BF16", enc.changed, enc.gap_width)


def test_run_all_returns_or_raises_only_once_no_job_runs():
    """A job's error is raised only after the jobs already running have finished (a rebuild's
    threads must not write into a file or buffer its caller is about to delete)."""
    import threading
    import time

    done = threading.Event()

    def job(k: int) -> int:
        if k == 0:
            raise CorruptObjectError("bad chunk")
        time.sleep(0.2)
        done.set()
        return k

    with pytest.raises(CorruptObjectError, match="bad chunk"):
        patch_module.run_all(job, [(0,), (1,)])
    assert done.is_set() or patch_module.cores() == 1  # (one core: job 1 was cancelled, never started)
    assert patch_module.run_all(job, [(3,), (2,)]) == [3, 2]


def test_encode_is_deterministic_and_independent_of_threads(monkeypatch):
    base, target = sparse_pair(3_000_001, 0.015, seed=3)  # 3 chunks, the last partial, an odd tail
    first = encode(base, target, "BF16")
    out = bytearray(len(base))
    decode_into(out, base, first.frame, "BF16", first.changed, first.gap_width)
    assert out == target
    for threads in (1, 3, 8):
        monkeypatch.setattr(patch_module, "_POOL", ThreadPoolExecutor(threads))
        assert encode(base, target, "BF16") == first
        out = bytearray(len(base))
        decode_into(out, base, first.frame, "BF16", first.changed, first.gap_width)
        assert out == target
    monkeypatch.setattr(patch_module, "run_all", lambda fn, jobs: [fn(*job) for job in jobs])  # no pool at all
    assert encode(base, target, "BF16") == first
    # the same bytes on any machine: what a frame of fixed inputs holds is pinned (a change here is a format
    # change); its zstd bytes are left out, as another libzstd may compress the same content otherwise
    assert content_digest(first.frame, len(base) // 2) == PINNED_CONTENT and first.changed == 45_000


def content_digest(frame: bytes, n: int) -> str:
    """blake3 of a frame's head and table and its chunks decompressed."""
    import zstandard

    log2 = frame[4]
    chunks = -(-n // (1 << log2))
    table = np.frombuffer(frame, "<u4", count=chunks, offset=8).tolist()
    h, at = blake3.blake3(frame[: 8 + 4 * chunks]), 8 + 4 * chunks
    for length in table:
        if length:
            h.update(zstandard.ZstdDecompressor().decompress(frame[at : at + length]))
        at += length
    return h.hexdigest()[:16]


@settings(max_examples=100, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 700), fraction=st.sampled_from([0.0, 0.01, 0.2, 1.0]),
       seed=st.integers(0, 2**32 - 1))
def test_many_small_chunks_round_trip(dtype, n, fraction, seed):
    """Chunks of 64 bytes (a frame says its chunk length): chunk edges, empty chunks, partial tails."""
    old = patch_module._CHUNK_LOG2_BYTES, patch_module._MIN_CHUNK_LOG2_BYTES
    patch_module._CHUNK_LOG2_BYTES = patch_module._MIN_CHUNK_LOG2_BYTES = 6
    try:
        base, target = sparse_pair(n, fraction, seed=seed, dtype=dtype)
        st_dtype = TORCH_TO_ST[dtype]
        enc = encode(base, target, st_dtype)
        bits = f"<u{ITEMSIZE[st_dtype]}"
        assert enc.changed == int((np.frombuffer(base, bits) != np.frombuffer(target, bits)).sum())
        out = bytearray(len(base))
        decode_into(out, base, enc.frame, st_dtype, enc.changed, enc.gap_width)
        assert out == target
    finally:
        patch_module._CHUNK_LOG2_BYTES, patch_module._MIN_CHUNK_LOG2_BYTES = old


def frame_of(chunks: list[bytes], log2: int, width: int) -> bytes:
    """A frame built by hand from its chunks' payloads (byte-shuffled already; b"": nothing changed)."""
    import zstandard

    segs = [zstandard.ZstdCompressor().compress(c) if c else b"" for c in chunks]
    return (b"psp\x02" + bytes([log2, width, 0, 0]) + np.array([len(x) for x in segs], "<u4").tobytes()
            + b"".join(segs))


def shuffled(gaps: np.ndarray, deltas: np.ndarray) -> bytes:
    return (np.ascontiguousarray(gaps.view(np.uint8).reshape(len(gaps), -1).T).tobytes()
            + np.ascontiguousarray(deltas.view(np.uint8).reshape(len(deltas), -1).T).tobytes())


def test_8_byte_gaps_are_read_and_checked(monkeypatch):
    monkeypatch.setattr(patch_module, "_MIN_CHUNK_LOG2_BYTES", 6)  # frames of 64-byte chunks
    base = bytes(64)  # 32 BF16 elements, one chunk of 2**5
    ok = frame_of([shuffled(np.array([3, 5], "<u8"), np.array([2, 1], "<u2"))], 5, 8)  # +1 at 3, -1 at 8
    out = bytearray(64)
    decode_into(out, base, ok, "BF16", 2, 8)
    assert np.frombuffer(out, "<u2")[[3, 8]].tolist() == [1, 0xFFFF] and np.frombuffer(out, "<u2").sum() == 0x10000
    with pytest.raises(CorruptObjectError, match="gaps of 8 bytes"):
        decode_into(out, base, ok, "BF16", 2, 4)
    for gaps in ([3, 2**64 - 1], [40], [31, 1]):  # wraps around 2**64; past the chunk
        bad = frame_of([shuffled(np.array(gaps, "<u8"), np.zeros(len(gaps), "<u2"))], 5, 8)
        with pytest.raises(CorruptObjectError, match="skips|element"):
            decode_into(out, base, bad, "BF16", len(gaps), 8)
    with pytest.raises(CorruptObjectError, match="whole changes"):  # a segment of 1.5 changes
        decode_into(out, base, frame_of([bytes(15)], 5, 8), "BF16", 1, 8)
    with pytest.raises(CorruptObjectError, match="not a frame"):
        decode_into(out, base, b"psp\x01" + ok[4:], "BF16", 2, 8)
    with pytest.raises(CorruptObjectError, match="its chunks say"):
        decode_into(out, base, ok + b"\0", "BF16", 2, 8)


def test_max_bytes_refuses_a_large_frame():
    base, target = sparse_pair(50_000, 0.3, seed=1)
    enc = encode(base, target, "BF16")
    assert encode(base, target, "BF16", max_bytes=len(enc.frame)) == enc
    assert encode(base, target, "BF16", max_bytes=len(enc.frame) - 1) is None
    assert encode(base, target, "BF16", max_bytes=10) is None
    same = encode(base, base, "BF16", max_bytes=100)
    assert same is not None and same.changed == 0


def test_empty_tensors_encode_to_no_changes():
    enc = encode(b"", b"", "F32")
    assert enc.changed == 0
    out = bytearray()
    decode_into(out, b"", enc.frame, "F32", 0, enc.gap_width)
    assert out == b""


@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_round_trips_every_dtype(dtype):
    base, target = sparse_pair(10_007, 0.05, seed=7, dtype=dtype)
    st_dtype = TORCH_TO_ST[dtype]
    enc = encode(base, target, st_dtype)
    out = bytearray(len(base))
    decode_into(out, base, enc.frame, st_dtype, enc.changed, enc.gap_width)
    assert out == target


def test_a_corrupt_frame_is_refused():
    base, target = sparse_pair(20_000, 0.02, seed=2)
    enc = encode(base, target, "BF16")
    out = bytearray(len(base))
    with pytest.raises(CorruptObjectError):
        decode_into(out, base, enc.frame[:-5], "BF16", enc.changed, enc.gap_width)  # truncated
    with pytest.raises(CorruptObjectError):
        decode_into(out, base, b"not a frame at all", "BF16", enc.changed, enc.gap_width)
    with pytest.raises(CorruptObjectError):
        decode_into(out, base, enc.frame, "BF16", enc.changed + 1, enc.gap_width)  # count disagrees
    with pytest.raises(CorruptObjectError):
        decode_into(out, base, enc.frame, "BF16", enc.changed - 1, enc.gap_width)
    with pytest.raises(CorruptObjectError):
        decode_into(out, base, enc.frame, "BF16", enc.changed, 8)  # width disagrees
    with pytest.raises(CorruptObjectError):
        decode_into(out, base, enc.frame, "BF16", enc.changed, 3)
    # a frame whose positions run past the end of a (smaller) tensor
    small = base[: len(base) // 2]
    with pytest.raises(CorruptObjectError, match="element|beyond|range"):
        decode_into(bytearray(len(small)), small, enc.frame, "BF16", enc.changed, enc.gap_width)
    with pytest.raises(InvalidArgumentError):
        decode_into(bytearray(len(base) - 2), base, enc.frame, "BF16", enc.changed, enc.gap_width)
    with pytest.raises(InvalidArgumentError):
        decode_into(bytes(len(base)), base, enc.frame, "BF16", enc.changed, enc.gap_width)  # read-only out
