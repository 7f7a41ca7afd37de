"""Sparse patches between two versions of a tensor: only the elements that changed, bit-exact.

In RL post-training most bf16 weights are bit-identical from one step to the next (updates below
bf16 resolution), so a tensor that "changed" usually changed in a few percent of its elements. A
*patch* records those elements: their positions (delta-coded: the gaps between them, which are
small) and how their bit patterns changed (the difference target − base of the bit patterns as
unsigned integers, wrapping, zigzag-coded: a weight that moved by a unit or two in the last place
costs a small number), compressed with zstd. Elements are compared as bit patterns of their item
size, never as numbers, so NaN payloads, -0.0 against +0.0 and float8 encodings round trip exactly.

:func:`encode` makes the compressed *frame* of those changes and :func:`decode_into` applies one
into a caller's buffer (an mmap view, say); both work in fixed chunks of 2 MiB, on a pool of
threads for large tensors, and the frame does not depend on the number of threads. The frame is an
8-byte head (``b"psp\\x02"``, log2 of the elements per chunk, the gap width, 0), a ``<u4`` table of
each chunk's segment length (0: nothing changed there), then the segments: per chunk a zstd frame
of its byte-shuffled gaps (``<u4``; the first counted from the chunk's start) then its
byte-shuffled zigzag differences.

A patch is a safetensors file (no pickle anywhere): one ``U8`` tensor ``"data"`` holding the frame,
and ``__metadata__`` saying what it patches (the format, the dtype, the tensor's byte length, how
many elements changed, the gap width, the base and target tensor digests, and ``piece_size``: the
piece size those digests use, :mod:`paramstore.format`; absent in patches made before pieces, whose
digests are blake3 of all the bytes). :func:`apply_patch`
rebuilds the target into a new buffer and checks its blake3 digest against the target's: a wrong
patch (or a wrong base) is an error, never wrong weights.

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

import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, NamedTuple, TypeVar

import numpy as np

from .errors import CorruptObjectError, InvalidArgumentError
from .format import ITEMSIZE, PIECE_SIZE, PIECE_SIZES, TensorSpec, build_header, cores, read_header, tensor_digest

__all__ = ["make_patch", "apply_patch", "patch_info", "encode", "decode_into", "open_frame", "Frame", "run_all",
           "Encoded", "PATCH_FORMAT", "DEFAULT_MAX_RATIO"]

#: The patch format this paramstore writes and reads.
PATCH_FORMAT = "2"
#: A patch is kept only when it is at most this fraction of the tensor's bytes.
DEFAULT_MAX_RATIO = 0.5
# Bit patterns as little-endian unsigned ints (safetensors' byte order): frames are the same on any machine.
_BITS = {n: np.dtype(f"<u{n}") for n in (1, 2, 4, 8)}
_SIGNED = {n: np.dtype(f"<i{n}") for n in (1, 2, 4, 8)}
_WORD = _BITS[8]
_GAP_WIDTH = 4
#: zstd level 1: on byte-shuffled gaps and differences about as small as level 3, and several times faster.
_ZSTD_LEVEL = 1
#: Tensors are coded in chunks of 2**this bytes, each on its own (in parallel; positions restart at
#: each chunk). A frame records its chunk length, so this may change without a new format.
_CHUNK_LOG2_BYTES = 21
#: The smallest chunk a frame may declare (2**this bytes of elements). A frame's head chooses its
#: chunk length: bounded on both sides, what a hostile frame makes the reader allocate stays within
#: a small multiple of the tensor (few chunks' bookkeeping; one chunk's changes at a time per thread).
_MIN_CHUNK_LOG2_BYTES = 12
_MAGIC = b"psp\x02"
_HEAD = struct.Struct("<4sBBH")  # magic, log2 of the elements per chunk, gap width, 0
_T = TypeVar("_T")


class Encoded(NamedTuple):
    """The changes between two versions of a tensor, as :func:`encode` makes them."""

    frame: bytes
    """The compressed payload (what a patch carries)."""
    changed: int
    """The number of elements that differ."""
    gap_width: int
    """4 or 8: the bytes per delta-coded position (this version writes 4, as positions are coded
    within chunks of fewer than 2**32 elements; it reads both)."""


def encode(base: Any, target: Any, dtype: str, *, max_bytes: int | None = None) -> Encoded | None:
    """The changes turning ``base`` into ``target`` (bytes-like, the same length, elements of
    safetensors dtype ``dtype`` such as ``"BF16"``), or None when the frame would be larger than
    ``max_bytes`` (None: no limit).

    Deterministic: the same inputs give the same frame bytes on any machine, whatever its number of
    cores (the chunks are fixed, and joined in order). A tensor of several chunks is encoded on a
    pool of threads, one per core this process may run on. Raises InvalidArgumentError for an
    unknown dtype or buffers of other lengths or not a whole number of elements.

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
    log2 = _CHUNK_LOG2_BYTES - (a.itemsize.bit_length() - 1)
    bounds = _chunks(a.size, log2)
    head = _HEAD.pack(_MAGIC, log2, _GAP_WIDTH, 0)
    size = len(head) + 4 * len(bounds)
    if max_bytes is not None and size > max_bytes:
        return None
    segments: list[bytes] = []
    changed = 0
    for seg, count in run_all(_encode_chunk, [(a, b, lo, hi) for lo, hi in bounds]):
        size += len(seg)
        if max_bytes is not None and size > max_bytes:
            return None  # (chunks already started finish on the pool, unused)
        segments.append(seg)
        changed += count
    table = np.array([len(seg) for seg in segments], dtype="<u4").tobytes()
    return Encoded(b"".join([head, table, *segments]), changed, _GAP_WIDTH)


def decode_into(out: Any, base: Any, frame: Any, dtype: str, changed: int, gap_width: int) -> None:
    """Write ``base`` with the changes of ``frame`` (an :attr:`Encoded.frame`) applied into ``out``:
    a writable buffer of ``base``'s length (a ``bytearray``, a memoryview into an mmap, ...), never
    the same memory as ``base``, which is only read. A tensor of several chunks is decoded on a pool
    of threads.

    Raises CorruptObjectError for a frame that does not decode to ``changed`` positions and values
    of that ``gap_width``, or changes positions out of range (``out`` then holds no particular
    bytes); InvalidArgumentError for an unknown dtype or an ``out`` that is read-only or of another
    length. Checks no digest: callers check the result's.
    """
    a = _elements(base, dtype)
    o = _elements(out, dtype, writable=True)
    if o.shape != a.shape:
        raise InvalidArgumentError(f"out is {o.nbytes} bytes, the base {a.nbytes}")
    f = open_frame(frame, a.nbytes, dtype, changed, gap_width)
    ob, ab = o.view(np.uint8), a.view(np.uint8)
    f.check(sum(run_all(f.decode_chunk, [(i, ob[lo:hi], ab[lo:hi]) for i, (lo, hi) in enumerate(f.chunks())])))


def open_frame(frame: Any, nbytes: int, dtype: str, changed: int, gap_width: int) -> "Frame":
    """The frame ``frame`` of a tensor of ``nbytes`` bytes of ``dtype`` (with ``changed`` changes of
    gap width ``gap_width``, as the patch says), its head and chunk table checked: what decoding any
    of its chunks, on any thread, needs (:meth:`Frame.decode`; :func:`decode_into` decodes them all).

    Raises CorruptObjectError for a frame that is not one of this format, says other gap widths, or
    whose chunk table does not match its length or ``nbytes`` (checked before anything is built from
    it: a hostile frame cannot choose what its reader allocates); InvalidArgumentError for an unknown
    dtype or ``nbytes`` not a whole number of its elements.
    """
    if dtype not in ITEMSIZE or ITEMSIZE[dtype] not in _BITS:
        raise InvalidArgumentError(f"cannot patch tensors of dtype {dtype!r}")
    itemsize = ITEMSIZE[dtype]
    if nbytes < 0 or nbytes % itemsize:
        raise InvalidArgumentError(f"{nbytes} bytes is not a whole number of {dtype} elements")
    size = nbytes // itemsize
    mv = memoryview(frame).cast("B")
    if mv.nbytes < _HEAD.size:
        raise CorruptObjectError(f"patch data is {mv.nbytes} bytes: too short to be a frame")
    magic, log2, width, reserved = _HEAD.unpack_from(mv, 0)
    chunk_log2 = log2 + itemsize.bit_length() - 1  # bytes of elements per chunk
    if magic != _MAGIC or reserved or width not in (4, 8) \
            or not _MIN_CHUNK_LOG2_BYTES <= chunk_log2 <= _CHUNK_LOG2_BYTES:
        raise CorruptObjectError("patch data is not a frame of this patch format")
    if width != gap_width:
        raise CorruptObjectError(f"patch data has gaps of {width} bytes, not {gap_width}")
    if not 0 <= changed <= size:
        raise CorruptObjectError(f"patch data says {changed} of {size} elements changed")
    chunks = -(-size >> log2)  # counted before any list of them is made: the frame must hold their table
    start = _HEAD.size + 4 * chunks
    if start > mv.nbytes:
        raise CorruptObjectError(f"patch data is {mv.nbytes} bytes, too short for {chunks} chunks")
    ends = np.cumsum(np.frombuffer(mv, dtype="<u4", count=chunks, offset=_HEAD.size), dtype=np.int64) + start
    if (int(ends[-1]) if chunks else start) != mv.nbytes:
        raise CorruptObjectError(f"patch data is {mv.nbytes} bytes, its chunks say "
                                 f"{int(ends[-1]) if chunks else start}")
    return Frame(mv, dtype, size, log2, width, changed, [start, *ends.tolist()])


class Frame:
    """A frame whose head and chunk table were checked (:func:`open_frame`). Its chunks are
    independent: each is decoded alone (:meth:`decode_chunk`), on any thread, so a caller can decode
    a tensor a chunk at a time (a chunk is at most 2 MiB, a power of two that divides a piece) and
    use each chunk while it is still in cache; :meth:`check` then checks the changes counted."""

    def __init__(self, data: memoryview, dtype: str, size: int, log2: int, width: int, changed: int,
                 bounds: list[int]) -> None:
        self._data, self.dtype, self._log2, self._width, self.changed = data, dtype, log2, width, changed
        self._size, self._bounds = size, bounds
        #: Bytes of elements per chunk (the last chunk may be shorter).
        self.chunk_bytes = ITEMSIZE[dtype] << log2

    def chunks(self) -> list[tuple[int, int]]:
        """Every chunk's ``(begin, end)`` byte range in the tensor, in order."""
        n, step = self._size * ITEMSIZE[self.dtype], self.chunk_bytes
        return [(b, min(b + step, n)) for b in range(0, n, step)]

    def decode_chunk(self, i: int, out: Any, base: Any = None) -> int:
        """Write chunk ``i`` of the patched tensor into ``out`` (a writable buffer of that chunk's
        bytes, :meth:`chunks`): ``base`` (the base tensor's bytes of that chunk) with the chunk's
        changes applied; ``base`` None: ``out`` holds them already, and the changes are applied in
        place. Returns the number of changes; CorruptObjectError for a chunk that is not one
        (``out`` then holds no particular bytes); InvalidArgumentError for buffers of another length."""
        if not 0 <= i < len(self._bounds) - 1:
            raise InvalidArgumentError(f"the frame has no chunk {i}")
        o = _elements(out, self.dtype, writable=True)
        a = o if base is None else _elements(base, self.dtype)
        n = min((i + 1) << self._log2, self._size) - (i << self._log2)
        if o.size != n or a.size != n:
            raise InvalidArgumentError(f"chunk {i} is {n} elements, out {o.size} and the base {a.size}")
        if a is not o:
            np.copyto(o, a)
        return _decode_chunk(o, a, self._data[self._bounds[i] : self._bounds[i + 1]], self._width)

    def check(self, count: int) -> None:
        """CorruptObjectError unless ``count`` (the changes every chunk decoded) is what the patch says."""
        if count != self.changed:
            raise CorruptObjectError(f"patch data changes {count} elements, expected {self.changed}")


def make_patch(base: Any, target: Any, dtype: str, *, max_ratio: float = DEFAULT_MAX_RATIO,
               base_digest: str | None = None, target_digest: str | None = None,
               piece_size: int = PIECE_SIZE) -> bytes | None:
    """A patch turning ``base`` into ``target`` (bytes-like, the same length, elements of
    safetensors dtype ``dtype``), or None when it would be larger than ``max_ratio`` times the
    tensor (then move the tensor whole; an empty tensor never gets one).

    ``base_digest``, ``target_digest``: the tensors' digests when known (a manifest's), which
    saves hashing them here. ``piece_size``: the rule they follow (:func:`paramstore.format.tensor_digest`;
    0 for digests of a manifest written before pieces).

    Raises InvalidArgumentError for an unknown dtype or buffers of other lengths or not a whole
    number of elements.
    """
    if piece_size not in (0, *PIECE_SIZES):
        raise InvalidArgumentError(f"piece_size must be 0 or one of {PIECE_SIZES}, got {piece_size!r}")
    a, b = _elements(base, dtype), _elements(target, dtype)
    if a.shape != b.shape:
        raise InvalidArgumentError(f"a patch needs buffers of one length: {a.nbytes} and {b.nbytes} bytes")
    budget = max_ratio * b.nbytes
    enc = encode(a, b, dtype, max_bytes=int(budget))
    if enc is None:
        return None
    meta = {"paramstore_patch": PATCH_FORMAT, "dtype": dtype, "nbytes": str(b.nbytes), "changed": str(enc.changed),
            "gap_width": str(enc.gap_width), "base": base_digest or _digest(a, piece_size),
            "target": target_digest or _digest(b, piece_size)}
    if piece_size and b.nbytes > piece_size:  # (for one piece both rules agree: said only when it matters)
        meta["piece_size"] = str(piece_size)
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
    digest = tensor_digest(memoryview(out), piece_size=int(meta.get("piece_size", "0")))
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


def _chunks(n: int, log2: int) -> list[tuple[int, int]]:
    """The chunks ``[lo, hi)`` of ``n`` elements, ``2**log2`` elements each (the last one fewer)."""
    step = 1 << log2
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _encode_chunk(a: np.ndarray, b: np.ndarray, lo: int, hi: int) -> tuple[bytes, int]:
    """One chunk's segment (b"" when nothing in it changed) and its number of changes.

    Compared 8 bytes at a time first, then element by element inside the words that differ (few,
    when little changed). Byte-shuffled (all first bytes, then all second bytes...), gaps and
    differences compress far better and faster than as whole integers."""
    ca, cb = a[lo:hi], b[lo:hi]
    size = ca.itemsize
    per = 8 // size
    whole = (hi - lo) // per * per
    wa, wb = ca[:whole].view(_WORD), cb[:whole].view(_WORD)
    words = np.flatnonzero(wa != wb)
    if per == 1:
        pos, d = words, wb[words] - wa[words]
    else:  # the elements of the words that differ: their differences, 0 where equal
        dw = wb[words].view(cb.dtype) - wa[words].view(ca.dtype)  # wraps: bit patterns, not numbers
        idx = np.flatnonzero(dw != 0)  # (faster than on the integers)
        pos = words[idx >> (per.bit_length() - 1)] * per + (idx & (per - 1))
        d = dw[idx]
    if whole < hi - lo:  # the tensor's last elements, fewer than a word's worth
        dt = cb[whole:] - ca[whole:]
        tail = np.flatnonzero(dt)
        if tail.size:
            pos, d = np.concatenate([pos, tail + whole]), np.concatenate([d, dt[tail]])
    n = pos.size
    if not n:
        return b"", 0
    buf = np.empty(n * (_GAP_WIDTH + size), dtype=np.uint8)
    gaps = np.empty(n, dtype=_BITS[_GAP_WIDTH])
    gaps[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:], casting="unsafe")
    _shuffle(gaps, buf[: n * _GAP_WIDTH])
    d = d.view(_SIGNED[size])
    zz = (d << 1) ^ (d >> (8 * size - 1))  # zigzag: 0, -1, 1, -2, ... as 0, 1, 2, 3, ...
    _shuffle(zz.view(_BITS[size]), buf[n * _GAP_WIDTH :])
    return _compressor().compress(buf), n


def _shuffle(x: np.ndarray, out: np.ndarray) -> None:
    """Write the unsigned ints ``x`` into ``out`` (``x.nbytes`` bytes) byte-shuffled, little-endian:
    all their first bytes, then all their second bytes, ... (what :func:`_unshuffle` reads back)."""
    rows = out.reshape(x.itemsize, x.size)
    for j in range(x.itemsize):
        rows[j] = x >> (8 * j) if j else x  # (the assignment keeps the low byte)


def _decode_chunk(co: np.ndarray, ca: np.ndarray, seg: memoryview, width: int) -> int:
    """Apply the changes of segment ``seg`` to one chunk: ``co`` (its elements, holding the base's
    already) gets ``ca``'s (the base's; may be ``co`` itself) with the changes added. Returns the
    number of changes; CorruptObjectError for a segment that is not one."""
    if not seg.nbytes:
        return 0
    import zstandard

    size, limit = ca.itemsize, ca.size * (width + ca.itemsize)
    try:
        expect = zstandard.frame_content_size(seg)
        if not 0 < expect <= limit or expect % (width + size):
            raise CorruptObjectError(f"patch data has a chunk of {expect} bytes, not whole changes within "
                                     f"{ca.size} elements")
        raw = _decompressor().decompress(seg)
    except zstandard.ZstdError as e:
        raise CorruptObjectError(f"patch data does not decompress: {e}") from None
    if len(raw) != expect:
        raise CorruptObjectError(f"patch data has a chunk of {len(raw)} bytes, its frame says {expect}")
    n = expect // (width + size)
    arr = np.frombuffer(raw, dtype=np.uint8)
    gaps = _unshuffle(arr[: n * width], n, width)
    if width == 8 and int(gaps.max()) >= ca.size:
        raise CorruptObjectError(f"patch data skips {int(gaps.max())} elements of a chunk of {ca.size}")
    pos = np.cumsum(gaps, dtype=np.int64)  # no overflow: under 2**30 gaps, each under 2**32
    if int(pos[-1]) >= ca.size:
        raise CorruptObjectError(f"patch changes element {int(pos[-1])} of a chunk of {ca.size}")
    zz = _unshuffle(arr[n * width :], n, size)
    co[pos] = ca[pos] + ((zz >> 1) ^ (0 - (zz & 1)).astype(ca.dtype))  # un-zigzag, add (wrapping)
    return n


def _unshuffle(planes: np.ndarray, n: int, width: int) -> np.ndarray:
    """The ``n`` little-endian unsigned ints of ``width`` bytes that ``planes`` holds byte-shuffled
    (all their first bytes, then all their second bytes, ...). Assembled plane by plane with shifts
    (a strided byte copy, ``out.view(u1).reshape(n, width)[...] = planes.reshape(width, n).T``, is
    3-8x slower)."""
    rows = planes.reshape(width, n)
    out = rows[0].astype(_BITS[width])
    for j in range(1, width):
        out |= rows[j].astype(_BITS[width]) << (8 * j)
    return out


def run_all(fn: Callable[..., _T], jobs: list[tuple]) -> list[_T]:
    """``[fn(*job) for job in jobs]``, the jobs side by side on the threads that encode and decode chunks (one
    per core this process may run on: :func:`paramstore.format.cores`). Returns or raises (the first
    job's error, in order) only once no job runs any more: jobs not started when one failed are
    cancelled, started ones finish, so nothing still writes into a caller's buffer afterwards.
    ``fn`` must not itself wait for jobs of this pool."""
    if len(jobs) < 2:
        return [fn(*job) for job in jobs]
    pool = _pool()
    futs = [pool.submit(fn, *job) for job in jobs]
    try:
        return [f.result() for f in futs]
    finally:
        for f in futs:
            f.cancel()
        wait(futs)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()


def _pool() -> ThreadPoolExecutor:
    """The threads that encode and decode chunks (one per core this process may run on), started on
    first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(cores(), thread_name_prefix="paramstore-patch")
        return _POOL


def _compressor() -> Any:
    """This thread's zstd compressor (a context is not safe to share between threads)."""
    c = getattr(_LOCAL, "cctx", None)
    if c is None:
        import zstandard

        c = _LOCAL.cctx = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    return c


def _decompressor() -> Any:
    """This thread's zstd decompressor."""
    d = getattr(_LOCAL, "dctx", None)
    if d is None:
        import zstandard

        d = _LOCAL.dctx = zstandard.ZstdDecompressor()
    return d


def _elements(buf: Any, dtype: str, *, writable: bool = False) -> np.ndarray:
    """``buf`` as an array of unsigned ints of ``dtype``'s item size (bit patterns, not numbers)."""
    if dtype not in ITEMSIZE or ITEMSIZE[dtype] not in _BITS:
        raise InvalidArgumentError(f"cannot patch tensors of dtype {dtype!r}")
    if isinstance(buf, np.ndarray):
        if writable and not buf.flags.c_contiguous:
            raise InvalidArgumentError("out must be a contiguous buffer")
        buf = buf.reshape(-1).view(np.uint8)
    mv = memoryview(buf).cast("B")
    if writable and mv.readonly:
        raise InvalidArgumentError("out must be a writable buffer")
    if mv.nbytes % ITEMSIZE[dtype]:
        raise InvalidArgumentError(f"{mv.nbytes} bytes is not a whole number of {dtype} elements")
    return np.frombuffer(mv, dtype=_BITS[ITEMSIZE[dtype]])


def _digest(a: np.ndarray, piece_size: int) -> str:
    """The tensor digest of an array's bytes."""
    return tensor_digest(memoryview(np.ascontiguousarray(a)).cast("B"), piece_size=piece_size)


def _parse(patch: bytes) -> tuple[dict[str, str], memoryview]:
    """The metadata and zstd frame of a patch; CorruptObjectError if it is not one."""
    mv = memoryview(patch)
    try:
        start, entries, meta = read_header(mv)
        entry = entries["data"]
        begin, end = entry["data_offsets"]
        if meta.get("paramstore_patch") != PATCH_FORMAT or entry["dtype"] != "U8" or start + end != len(mv) \
                or begin != 0:
            raise ValueError("not a paramstore patch of format " + PATCH_FORMAT)
        for key in ("dtype", "nbytes", "changed", "gap_width", "base", "target"):
            if not isinstance(meta.get(key), str):
                raise ValueError(f"no {key!r}")
        if meta["gap_width"] not in ("4", "8") or not meta["nbytes"].isdigit() or not meta["changed"].isdigit():
            raise ValueError("bad sizes")
        if meta.get("piece_size", "0") not in ("0", *map(str, PIECE_SIZES)):
            raise ValueError(f"its digests use pieces of {str(meta['piece_size'])[:40]!r} bytes, which this "
                             "paramstore does not know (made by a newer paramstore: upgrade paramstore)")
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CorruptObjectError(f"malformed patch: {e}") from None
    return meta, mv[start:]
