"""Sparse patches between two versions of a tensor: only the elements that changed, bit-exact.

In RL post-training most bf16 weights are bit-identical from one step to the next (updates below
bf16 resolution), so a tensor that "changed" usually changed in a few percent of its elements. A
*patch* records those elements: their positions (delta-coded: the gaps between them, which are
small) and their new bit patterns, compressed with zstd. Elements are compared as bit patterns of
their item size, never as numbers, so NaN payloads, -0.0 against +0.0 and float8 encodings round
trip exactly.

A patch is a safetensors file (no pickle anywhere): one ``U8`` tensor ``"data"`` holding the zstd
frame of ``gaps ‖ values``, and ``__metadata__`` saying what it patches (the dtype, the tensor's
byte length, how many elements changed, the gap width, and the base and target tensor digests).
:func:`apply_patch` rebuilds the target into a new buffer and checks its blake3 digest against the
target's: a wrong patch (or a wrong base) is an error, never wrong weights.

Example:
    >>> import numpy as np
    >>> base = np.zeros(1000, dtype=np.float32)
    >>> target = base.copy(); target[[3, 500]] = [1.5, -0.0]
    >>> patch = make_patch(base.tobytes(), target.tobytes(), "F32")
    >>> len(patch) < target.nbytes // 10
    True
    >>> apply_patch(base.tobytes(), patch) == target.tobytes()
    True
    >>> patch_info(patch)["changed"]
    2
"""

from __future__ import annotations

import json
import struct
from typing import Any, NamedTuple

import numpy as np

from .errors import CorruptObjectError, InvalidArgumentError
from .format import ITEMSIZE, TensorSpec, build_header, tensor_digest

__all__ = ["make_patch", "apply_patch", "patch_info", "encode", "decode_into", "Encoded", "PATCH_FORMAT",
           "DEFAULT_MAX_RATIO"]

#: The patch format this paramstore writes and reads.
PATCH_FORMAT = "1"
#: A patch is kept only when it is at most this fraction of the tensor's bytes.
DEFAULT_MAX_RATIO = 0.5
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ZSTD_LEVEL = 3


class Encoded(NamedTuple):
    """The changes between two versions of a tensor, as :func:`encode` makes them."""

    frame: bytes
    """The compressed payload (what a patch carries)."""
    changed: int
    """The number of elements that differ."""
    gap_width: int
    """4 or 8: the bytes per delta-coded position."""


def encode(base: Any, target: Any, dtype: str, *, max_bytes: int | None = None) -> Encoded | None:
    """The changes turning ``base`` into ``target`` (bytes-like, the same length, elements of
    safetensors dtype ``dtype`` such as ``"BF16"``), or None when the frame would be larger than
    ``max_bytes`` (None: no limit).

    Deterministic: the same inputs give the same frame bytes on any machine, whatever its number of
    cores. Raises InvalidArgumentError for an unknown dtype or buffers of other lengths or not a
    whole number of elements.

    >>> e = encode(bytes(8), bytes([0, 0, 7, 0, 0, 0, 0, 0]), "BF16")
    >>> e.changed, e.gap_width
    (1, 4)
    >>> out = bytearray(8); decode_into(out, bytes(8), e.frame, "BF16", e.changed, e.gap_width)
    >>> bytes(out)
    b'\\x00\\x00\\x07\\x00\\x00\\x00\\x00\\x00'
    >>> encode(bytes(8), bytes([1] * 8), "BF16", max_bytes=4) is None
    True
    """
    a, b = _elements(base, dtype), _elements(target, dtype)
    if a.shape != b.shape:
        raise InvalidArgumentError(f"a patch needs buffers of one length: {a.nbytes} and {b.nbytes} bytes")
    changed = _changed(a, b)
    gaps = np.diff(changed, prepend=0)
    if gaps.size and int(gaps.max()) >= 1 << 32:
        width, gaps = 8, gaps.astype(np.uint64)
    else:
        width, gaps = 4, gaps.astype(np.uint32)
    if max_bytes is not None and changed.size * (width + b.itemsize) > 4 * max_bytes:
        return None  # hopeless even at 4:1 compression
    import zstandard

    frame = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(gaps.tobytes() + b[changed].tobytes())
    if max_bytes is not None and len(frame) > max_bytes:
        return None
    return Encoded(frame, int(changed.size), width)


def decode_into(out: Any, base: Any, frame: Any, dtype: str, changed: int, gap_width: int) -> None:
    """Write ``base`` with the changes of ``frame`` (an :attr:`Encoded.frame`) applied into ``out``:
    a writable buffer of ``base``'s length (a ``bytearray``, a memoryview into an mmap, ...), never
    the same memory as ``base``, which is only read.

    Raises CorruptObjectError for a frame that does not decode to ``changed`` positions and values
    of that ``gap_width``, or changes positions out of range; InvalidArgumentError for an unknown
    dtype or an ``out`` of another length. Checks no digest: callers check the result's.
    """
    a = _elements(base, dtype)
    o = _elements(out, dtype, writable=True)
    if o.shape != a.shape:
        raise InvalidArgumentError(f"out is {o.nbytes} bytes, the base {a.nbytes}")
    if gap_width not in (4, 8) or changed < 0:
        raise CorruptObjectError(f"bad patch sizes: {changed} changes of gap width {gap_width}")
    if changed > a.size:
        raise CorruptObjectError(f"patch changes {changed} elements of a tensor of {a.size}")
    import zstandard

    expect = changed * (gap_width + a.itemsize)
    try:
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=expect)
    except zstandard.ZstdError as e:
        raise CorruptObjectError(f"patch data does not decompress: {e}") from None
    if len(raw) != expect:
        raise CorruptObjectError(f"patch data is {len(raw)} bytes, expected {expect}")
    gaps = np.frombuffer(raw, dtype=np.uint32 if gap_width == 4 else np.uint64, count=changed)
    values = np.frombuffer(raw, dtype=a.dtype, offset=changed * gap_width)
    positions = _positions(gaps, a.size)
    np.copyto(o, a)
    o[positions] = values


def make_patch(base: Any, target: Any, dtype: str, *, max_ratio: float = DEFAULT_MAX_RATIO,
               base_digest: str | None = None, target_digest: str | None = None) -> bytes | None:
    """A patch turning ``base`` into ``target`` (bytes-like, the same length, elements of
    safetensors dtype ``dtype``), or None when it would be larger than ``max_ratio`` times the
    tensor (then move the tensor whole; an empty tensor never gets one).

    ``base_digest``, ``target_digest``: the tensors' digests when known (a manifest's), which
    saves hashing them here.

    Raises InvalidArgumentError for an unknown dtype or buffers of other lengths or not a whole
    number of elements.
    """
    a, b = _elements(base, dtype), _elements(target, dtype)
    if a.shape != b.shape:
        raise InvalidArgumentError(f"a patch needs buffers of one length: {a.nbytes} and {b.nbytes} bytes")
    budget = max_ratio * b.nbytes
    enc = encode(a, b, dtype, max_bytes=int(budget))
    if enc is None:
        return None
    meta = {"paramstore_patch": PATCH_FORMAT, "dtype": dtype, "nbytes": str(b.nbytes), "changed": str(enc.changed),
            "gap_width": str(enc.gap_width), "base": base_digest or _digest(a), "target": target_digest or _digest(b)}
    header, _ = build_header([TensorSpec("data", "U8", (len(enc.frame),))], meta)
    patch = header + enc.frame
    return patch if len(patch) <= budget else None


def apply_patch(base: Any, patch: bytes, *, base_digest: str | None = None) -> bytes:
    """The target tensor's bytes, rebuilt from ``base`` and ``patch`` and checked against the
    target digest the patch names. ``base_digest``: when the caller knows it (a manifest entry),
    the patch must be for that base.

    Raises CorruptObjectError: a malformed patch, a patch for another base, or a result whose
    digest is not the target's (nothing wrong is ever returned).
    """
    meta, frame = _parse(patch)
    dtype, nbytes, count, width = meta["dtype"], int(meta["nbytes"]), int(meta["changed"]), int(meta["gap_width"])
    if base_digest is not None and base_digest != meta["base"]:
        raise CorruptObjectError(f"patch is for base {meta['base'][:16]}…, not {base_digest[:16]}…")
    a = _elements(base, dtype)
    if a.nbytes != nbytes:
        raise CorruptObjectError(f"patch is for a tensor of {nbytes} bytes, the base has {a.nbytes}")
    out = bytearray(a.nbytes)
    decode_into(out, a, frame, dtype, count, width)
    digest = tensor_digest(memoryview(out))
    if digest != meta["target"]:
        raise CorruptObjectError(f"patched tensor hashes to {digest[:16]}…, the patch's target is "
                                 f"{meta['target'][:16]}…: a damaged patch or the wrong base")
    return bytes(out)


def patch_info(patch: bytes) -> dict[str, Any]:
    """What a patch says about itself: dtype, nbytes, changed (element count), base, target,
    and its own size. Raises CorruptObjectError for a malformed patch."""
    meta, _ = _parse(patch)
    return {"dtype": meta["dtype"], "nbytes": int(meta["nbytes"]), "changed": int(meta["changed"]),
            "base": meta["base"], "target": meta["target"], "size": len(patch)}


def _changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Positions where ``a`` and ``b`` differ, ascending. Compared 8 bytes at a time first, then
    element by element inside the words that differ (few, when little changed)."""
    per = 8 // a.itemsize
    if per == 1 or a.nbytes % 8:
        return np.flatnonzero(a != b)
    words = np.flatnonzero(a.view(np.uint64) != b.view(np.uint64))
    if not words.size:
        return words
    cand = (words[:, None] * per + np.arange(per)).ravel()
    return cand[a[cand] != b[cand]]


def _positions(gaps: np.ndarray, size: int) -> np.ndarray:
    """The positions that delta-coded ``gaps`` name; CorruptObjectError if one is outside
    ``range(size)`` (a sum that would wrap around 2**64 included)."""
    if not gaps.size:
        return gaps.astype(np.intp)
    if gaps.dtype == np.uint64 and int(gaps.max()) >= size:
        raise CorruptObjectError(f"patch skips {int(gaps.max())} elements of a tensor of {size}")
    positions = np.cumsum(gaps, dtype=np.uint64)  # gaps < size <= 2**63 each: no wrap below 2**64 * ...
    last = int(positions[-1])
    if last >= size:
        raise CorruptObjectError(f"patch changes element {last} of a tensor of {size}")
    return positions.view(np.int64)


def _elements(buf: Any, dtype: str, *, writable: bool = False) -> np.ndarray:
    """``buf`` as an array of unsigned ints of ``dtype``'s item size (bit patterns, not numbers)."""
    if dtype not in ITEMSIZE or ITEMSIZE[dtype] not in _BITS:
        raise InvalidArgumentError(f"cannot patch tensors of dtype {dtype!r}")
    if isinstance(buf, np.ndarray):
        buf = buf.reshape(-1).view(np.uint8)
    mv = memoryview(buf).cast("B")
    if writable and mv.readonly:
        raise InvalidArgumentError("out must be a writable buffer")
    if mv.nbytes % ITEMSIZE[dtype]:
        raise InvalidArgumentError(f"{mv.nbytes} bytes is not a whole number of {dtype} elements")
    return np.frombuffer(mv, dtype=_BITS[ITEMSIZE[dtype]])


def _digest(a: np.ndarray) -> str:
    """The tensor digest of an array's bytes."""
    return tensor_digest(memoryview(np.ascontiguousarray(a)).cast("B"))


def _parse(patch: bytes) -> tuple[dict[str, str], memoryview]:
    """The metadata and zstd frame of a patch; CorruptObjectError if it is not one."""
    mv = memoryview(patch)
    try:
        (n,) = struct.unpack_from("<Q", mv, 0)
        header = json.loads(bytes(mv[8 : 8 + n]))
        meta, entry = header["__metadata__"], header["data"]
        begin, end = entry["data_offsets"]
        if meta.get("paramstore_patch") != PATCH_FORMAT or entry["dtype"] != "U8" or 8 + n + end != len(mv) \
                or begin != 0:
            raise ValueError("not a paramstore patch of format " + PATCH_FORMAT)
        for key in ("dtype", "nbytes", "changed", "gap_width", "base", "target"):
            if not isinstance(meta.get(key), str):
                raise ValueError(f"no {key!r}")
        if meta["gap_width"] not in ("4", "8") or not meta["nbytes"].isdigit() or not meta["changed"].isdigit():
            raise ValueError("bad sizes")
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CorruptObjectError(f"malformed patch: {e}") from None
    return meta, mv[8 + n :]
