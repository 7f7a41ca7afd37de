"""The object format: safetensors shards, their layout and their digests. Pure data, no I/O, no torch.

An *object* is a valid safetensors file holding a shard of tensors::

    [8-byte little-endian header length N][N bytes of JSON header, space padded][data]

paramstore pads the header so the data starts on a 64-byte boundary and orders the tensors of a
shard by item size (largest first), so every tensor starts at an offset that is a multiple of its
item size: any tensor can be viewed in place with its own dtype, with no copy. Tensors are dense and
contiguous, as safetensors requires.

Digests (blake3, hex):

* tensor digest: for a tensor of at most ``P`` bytes, ``blake3(tensor bytes)``; for a larger one,
  the root over its *pieces* (consecutive ``P``-byte ranges, the last one shorter): ``blake3(PIECES_DOMAIN || u64le(length) || piece_digest_1 || ... || piece_digest_k)``
  with ``piece_digest_i = blake3(bytes[(i-1)*P : i*P])`` (raw 32-byte digests). Dtype and shape are
  not part of it, so equal bytes are stored once whatever they are viewed as. Each piece can be
  hashed on its own thread, and verified alone (against the piece digests a manifest lists: see
  :mod:`paramstore.manifest`) as soon as its bytes are there;
* object digest = ``blake3(OBJECT_DOMAIN || header bytes || tensor digest_1 || ... || digest_n)``
  with the tensor digests in file order. Because the tensors tile the data section exactly, this
  is a digest of every byte of the file computed as a two-level tree: commit hashes each byte
  once (per tensor) and gets the object name for the price of hashing a few kilobytes.

The piece size ``P`` is :data:`PIECE_SIZE` (2 MiB) for the objects this paramstore writes; objects
written before it use 8 MiB pieces and stay readable (:data:`PIECE_SIZES`). Which rule an object's
tensor digests follow is in its own header, so every check of an object's bytes (``verify``,
scrub, pulls, peers, patches) needs nothing but the bytes: an object holding a tensor larger than
its piece size says ``{"paramstore_pieces": "<P>"}`` in its ``__metadata__`` (covered by the
object digest like every header byte). An object without it was written before pieces existed
(format v1: every tensor ``blake3(bytes)``, however large) or holds only tensors of one piece, for
which both rules agree; an object naming a piece size not in :data:`PIECE_SIZES` was written by a
newer paramstore and is refused (:func:`piece_size_of`). A manifest's piece digests say their
piece size by their number (:func:`piece_size_for`).

An object may also list its own piece digests in its header (:data:`DIGESTS_KEY`: patch objects,
which no manifest lists): checked against its name (:func:`listed_digests`), that list lets a
receiver verify each piece alone as it arrives, as a manifest's piece digests do.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import blake3

from .validate import is_digest

__all__ = [
    "rehash",
    "tensor_spans",
    "header_layout",
    "cores",
    "ObjectHasher",
    "ITEMSIZE",
    "DATA_ALIGN",
    "TensorSpec",
    "Placement",
    "ShardPlan",
    "plan_shards",
    "build_header",
    "parse_header",
    "read_header",
    "loads",
    "tensor_digest",
    "object_digest",
    "OBJECT_SUFFIX",
    "PIECE_SIZE",
    "PIECE_SIZES",
    "PIECES_KEY",
    "pieces",
    "piece_digest",
    "piece_hasher",
    "pieces_root",
    "tensor_pieces",
    "bad_pieces",
    "piece_size_of",
    "piece_size_for",
    "DIGESTS_KEY",
    "listed_digests",
]

#: Bytes per element of every safetensors dtype paramstore stores.
ITEMSIZE: dict[str, int] = {
    "F64": 8, "I64": 8, "U64": 8, "C64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
    "I8": 1, "U8": 1, "BOOL": 1,
}

#: The data section of every object starts on this boundary.
DATA_ALIGN = 64
OBJECT_SUFFIX = ".safetensors"
OBJECT_DOMAIN = b"paramstore/object/v1\0"
_HASH_THREADS_MIN_BYTES = 1 << 22  # below this, blake3's thread pool costs more than it saves
#: Bytes per piece of the objects this paramstore writes (see the module docstring). A piece is
#: the unit a receiver verifies alone, hence the unit a host relays on (:mod:`paramstore.relay`):
#: each hop of a relay holds a piece back until it verified it, so a chain of n hosts fills in
#: about n pieces' time. 2 MiB: a piece's time is 17 ms at 1 Gbit/s, 0.17 s at 100 Mbit/s (1
#: trainer + 8 hosts at 100 Mbit/s, measured: ~0.24 s a hop and 1.13x the link's ideal, against
#: ~0.78 s and 1.30x with 8 MiB pieces; docs/benchmarks.md); a thread hashes a piece in ~0.3 ms
#: (measured, one thread, this 2-core host), far above the cost of handing it over (the commit
#: hands over four at a time: hashing.UNIT_BYTES); a piece digest costs ~67 bytes of manifest JSON
#: per 2 MiB of weights (~33 KiB per GiB).
PIECE_SIZE = 2 << 20
#: Piece sizes this paramstore reads: :data:`PIECE_SIZE`, and 8 MiB (objects and manifests written
#: before pieces were 2 MiB). Powers of two, so that a manifest's number of piece digests tells
#: which one they use (:func:`piece_size_for`).
PIECE_SIZES = (PIECE_SIZE, 8 << 20)
PIECES_DOMAIN = b"paramstore/pieces/v1\0"
#: The ``__metadata__`` key of an object header naming the piece size of its tensor digests.
PIECES_KEY = "paramstore_pieces"
#: The ``__metadata__`` key of an object header that lists the object's own piece digests (patch
#: objects, which no manifest lists): a JSON array with, per tensor in file order, the array of its
#: piece digests (hex; one, its digest, for a tensor of one piece). See :func:`listed_digests`.
DIGESTS_KEY = "paramstore_digests"


@dataclass(frozen=True)
class TensorSpec:
    """What the layout needs to know of a tensor: its name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Placement:
    """Where a tensor lies in an object file: absolute byte offset and length."""

    spec: TensorSpec
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ShardPlan:
    """One object's layout: its header bytes and where each tensor goes."""

    header: bytes
    placements: tuple[Placement, ...]

    @property
    def size(self) -> int:
        """Total file size in bytes."""
        return len(self.header) + sum(p.nbytes for p in self.placements)


def _ordered(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    # Largest item size first: every offset then stays a multiple of the next tensor's item size.
    indexed = list(enumerate(specs))
    indexed.sort(key=lambda it: (-ITEMSIZE[it[1].dtype], it[0]))
    return [s for _, s in indexed]


def build_header(specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """Build the safetensors header for ``specs`` laid out in the given order.

    Returns the header bytes (length prefix included, padded so data starts at ``DATA_ALIGN``)
    and each tensor's absolute offset in the file. ``metadata`` (string to string) becomes the
    header's ``__metadata__`` (the store's objects have none; exports say ``{"format": "pt"}``),
    with :data:`PIECES_KEY` added when a tensor is larger than :data:`PIECE_SIZE`.
    """
    meta = dict(metadata or {})
    if any(s.nbytes > PIECE_SIZE for s in specs):  # its tensor digests are over pieces: say so
        meta[PIECES_KEY] = str(PIECE_SIZE)
    entries: dict[str, dict] = {"__metadata__": meta} if meta else {}
    begin = 0
    rel = []
    for s in specs:
        end = begin + s.nbytes
        entries[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [begin, end]}
        rel.append(begin)
        begin = end
    body = json.dumps(entries, separators=(",", ":")).encode()
    pad = (-(8 + len(body))) % DATA_ALIGN
    body += b" " * pad
    header = struct.pack("<Q", len(body)) + body
    return header, [len(header) + r for r in rel]


def plan_shards(specs: Sequence[TensorSpec], shard_size_bytes: int) -> list[ShardPlan]:
    """Group ``specs`` (in order) into shards of about ``shard_size_bytes`` and lay each one out.

    A tensor larger than the shard size gets an object of its own. The plan depends only on the
    names, dtypes and shapes, so an unchanged model gets the same plan on every commit (which is
    what lets the shared-memory tier prepare the next commit's buffers in advance).
    """
    if shard_size_bytes <= 0:
        raise ValueError(f"shard_size_bytes must be positive, got {shard_size_bytes}")
    groups: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    filled = 0
    for s in specs:
        n = s.nbytes
        if current and filled + n > shard_size_bytes:
            groups.append(current)
            current, filled = [], 0
        current.append(s)
        filled += n
    if current:
        groups.append(current)
    return [layout(g) for g in groups]


def layout(specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> ShardPlan:
    """Lay ``specs`` out as one object (ordered by item size, header padded; ``metadata``: see
    :func:`build_header`)."""
    ordered = _ordered(specs)
    header, offsets = build_header(ordered, metadata)
    return ShardPlan(header, tuple(Placement(s, o, s.nbytes) for s, o in zip(ordered, offsets)))


def parse_header(buf: bytes | memoryview) -> tuple[int, dict[str, dict]]:
    """Parse a safetensors header from the start of ``buf``.

    Returns ``(data_start, entries)`` where ``entries`` maps tensor names to their header dicts
    (``__metadata__`` removed). Raises ``ValueError`` on a malformed header.
    """
    start, entries, _ = read_header(buf)
    return start, entries


def read_header(buf: bytes | memoryview) -> tuple[int, dict[str, dict], dict[str, Any]]:
    """Like :func:`parse_header`, also returning the ``__metadata__`` dict (empty when absent).

    Example:
        >>> header, _ = build_header([TensorSpec("x", "U8", (2,))], {"k": "v"})
        >>> read_header(header)[1:]
        ({'x': {'dtype': 'U8', 'shape': [2], 'data_offsets': [0, 2]}}, {'k': 'v'})
    """
    if len(buf) < 8:
        raise ValueError(f"file too short for a safetensors header ({len(buf)} bytes): truncated")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > len(buf) - 8 or n > 100_000_000:
        raise ValueError(f"safetensors header length {n} exceeds the file ({len(buf)} bytes): truncated, or not "
                         "a safetensors file")
    entries = loads(bytes(buf[8 : 8 + n]), dict, "safetensors header")
    meta = entries.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise ValueError("safetensors __metadata__ is not a JSON object")
    return 8 + n, entries, meta


def loads(data: str | bytes, kind: type, what: str = "JSON") -> Any:
    """``json.loads(data)``, which must be a ``kind`` (dict, list, or ``object``: any value); the one
    JSON reader for bytes from outside the process. ValueError for anything else: bad JSON, bad
    UTF-8, or nesting too deep for the parser (a hostile input's RecursionError).

    Example:
        >>> loads("[[1]]", list)
        [[1]]
        >>> loads("[" * 100_000, list)
        Traceback (most recent call last):
        ...
        ValueError: JSON is nested too deeply
    """
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} is not JSON: {e}") from e
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply") from None
    if not isinstance(value, kind):
        raise ValueError(f"{what} is not a JSON {'object' if kind is dict else 'array'}")
    return value


def pieces(nbytes: int, piece_size: int = PIECE_SIZE) -> list[tuple[int, int]]:
    """The pieces of a tensor of ``nbytes`` bytes: ``[(begin, end), ...]`` relative to its start.
    One piece for a tensor of at most ``piece_size`` bytes (or ``piece_size`` 0: the whole-tensor
    rule of objects written before pieces), an empty one included.

    Example:
        >>> pieces(10, 4), pieces(4, 4), pieces(0, 4), pieces(10, 0)
        ([(0, 4), (4, 8), (8, 10)], [(0, 4)], [(0, 0)], [(0, 10)])
    """
    if not piece_size or nbytes <= piece_size:
        return [(0, nbytes)]
    return [(b, min(b + piece_size, nbytes)) for b in range(0, nbytes, piece_size)]


def piece_digest(data: bytes | memoryview) -> str:
    """The digest of one piece's bytes (blake3, hex, on the calling thread): what a receiver
    compares with the piece digest a manifest lists (or, for a tensor of one piece, its digest)."""
    return blake3.blake3(data, max_threads=1).hexdigest()


def piece_hasher() -> Any:
    """An incremental :func:`piece_digest` on the calling thread: ``update()`` it with a piece's
    bytes in order (a block at a time, say, each while it is in cache), then ``hexdigest()``."""
    return blake3.blake3(max_threads=1)


def pieces_root(piece_digests: Sequence[str], nbytes: int) -> str:
    """The digest of a tensor of ``nbytes`` bytes (more than a piece) from its piece digests (hex,
    in order)."""
    h = blake3.blake3(PIECES_DOMAIN)
    h.update(struct.pack("<Q", nbytes))
    h.update(b"".join(bytes.fromhex(d) for d in piece_digests))
    return h.hexdigest()


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def cores() -> int:
    """The cores this process may run on (``taskset`` and cgroup CPU sets count; at least 1): how many
    threads hash or decode side by side."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _hash_pool() -> ThreadPoolExecutor:
    """Threads to hash pieces side by side on (one per core this process may run on), made once."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(cores(), thread_name_prefix="paramstore-pieces")
        return _pool


def _map(fn: Any, items: Sequence[Any], parallel: bool) -> list[Any]:
    if parallel and len(items) > 1:
        return list(_hash_pool().map(fn, items))
    return [fn(x) for x in items]


def tensor_pieces(data: bytes | memoryview, *, piece_size: int = PIECE_SIZE,
                  parallel: bool | None = None) -> tuple[str, tuple[str, ...]]:
    """``(tensor digest, piece digests)`` of a tensor's bytes; no piece digests (``()``) for a
    tensor of one piece, whose piece digest is its digest. ``piece_size`` 0: the whole-tensor rule
    of objects written before pieces (format v1). ``parallel``: pieces side by side on a thread
    per core (default: for inputs of 4 MiB and more; a v1 tensor on blake3's own threads)."""
    mv = data if isinstance(data, memoryview) else memoryview(data)
    n = mv.nbytes
    if parallel is None:
        parallel = n >= _HASH_THREADS_MIN_BYTES
    if not piece_size or n <= piece_size:
        auto = parallel and n >= _HASH_THREADS_MIN_BYTES
        return blake3.blake3(mv, max_threads=blake3.blake3.AUTO if auto else 1).hexdigest(), ()
    flat = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    digests = tuple(_map(lambda r: piece_digest(flat[r[0] : r[1]]), pieces(n, piece_size), parallel))
    return pieces_root(digests, n), digests


def tensor_digest(data: bytes | memoryview, *, parallel: bool | None = None, piece_size: int = PIECE_SIZE) -> str:
    """The digest of a tensor's bytes (see the module docstring): ``blake3(bytes)`` up to
    ``piece_size`` bytes, the root over its pieces above. ``piece_size`` 0: ``blake3(bytes)``
    whatever the size (objects written before pieces).

    ``parallel``: hash on several threads (default: for inputs of 4 MiB and more). The commit path
    hashes pieces on its own threads and passes False.
    """
    return tensor_pieces(data, piece_size=piece_size, parallel=parallel)[0]


def bad_pieces(data: bytes | memoryview, piece_digests: Sequence[str], digest: str = "") -> list[int]:
    """The indexes of the pieces of a tensor's bytes ``data`` that do not hash to the digests a
    manifest lists for it (``piece_digests``; for a tensor of one piece, ``()`` and its
    ``digest``). A length that does not make that many pieces: every index.

    Example:
        >>> good = bytes(PIECE_SIZE + 5)
        >>> _, ds = tensor_pieces(good)
        >>> bad_pieces(good[:-1] + b"x", ds)
        [1]
    """
    mv = data if isinstance(data, memoryview) else memoryview(data)
    want = list(piece_digests) if piece_digests else [digest]
    try:
        ranges = pieces(mv.nbytes, piece_size_for(mv.nbytes, len(want)) if piece_digests else 0)
    except ValueError:
        return list(range(len(want)))
    flat = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    return [i for i, (b, e) in enumerate(ranges) if piece_digest(flat[b:e]) != want[i]]


def piece_size_of(meta: dict[str, Any]) -> int:
    """The piece size an object's header (its ``__metadata__``) says its tensor digests use: 0 (no
    :data:`PIECES_KEY`: whole tensors, format v1) or one of :data:`PIECE_SIZES`. ValueError for
    another value: an object written by a newer paramstore (upgrade it) or a damaged header.

    Example:
        >>> piece_size_of({}), piece_size_of({PIECES_KEY: str(8 << 20)}) >> 20
        (0, 8)
    """
    value = meta.get(PIECES_KEY)
    if value is None:
        return 0
    for size in PIECE_SIZES:
        if value == str(size):
            return size
    raise ValueError(f"object header says its tensor digests use pieces of {str(value)[:40]!r} bytes; this "
                     f"paramstore knows pieces of {' or '.join(map(str, PIECE_SIZES))} bytes: written by a newer "
                     "paramstore (upgrade paramstore) or damaged")


def piece_size_for(nbytes: int, count: int) -> int:
    """The piece size (of :data:`PIECE_SIZES`) that cuts ``nbytes`` bytes into ``count`` pieces,
    more than one: how many piece digests a manifest lists for a tensor says which size they use
    (for sizes that are powers of two, at most one does). ValueError when none does.

    Example:
        >>> [piece_size_for(20 << 20, n) >> 20 for n in (10, 3)]
        [2, 8]
    """
    for size in PIECE_SIZES:
        if count > 1 and nbytes > size and -(-nbytes // size) == count:
            return size
    raise ValueError(f"{count} pieces of {nbytes} bytes: expected " + " or ".join(
        f"{-(-nbytes // p)} (pieces of {p >> 20} MiB)" for p in PIECE_SIZES if nbytes > p) if nbytes > PIECE_SIZE
        else f"{count} pieces of {nbytes} bytes: bytes of one piece list no piece digests")


def listed_digests(header: bytes | memoryview, size: int, digest: str
                   ) -> tuple[dict[tuple[int, int], str], dict[tuple[int, int], str]] | None:
    """What the header of object ``digest`` (``size`` bytes) says of its bytes when it lists its own
    piece digests (:data:`DIGESTS_KEY`), checked against the object's name: ``(tensor digests,
    piece digests)``, each keyed by absolute ``(begin, end)`` (as :meth:`paramstore.manifest.Manifest.spans`
    and :meth:`~paramstore.manifest.Manifest.piece_spans` give them for one object), so that each
    piece can be verified alone as it arrives though no manifest lists it. ``header``: the
    object's first bytes, its whole header at least. None when the header lists no digests.

    The object digest covers the header, the list in it and the tensor digests the list makes, so
    a list that makes ``digest`` is the object's own: ValueError for a malformed header or list,
    or one that does not make ``digest`` (a damaged or hostile copy).

    Example:
        >>> blobs = [b"ab", bytes(PIECE_SIZE + 1)]
        >>> listed = [[tensor_digest(blobs[0])], list(tensor_pieces(blobs[1])[1])]
        >>> head, _ = build_header([TensorSpec("a", "U8", (2,)), TensorSpec("b", "U8", (PIECE_SIZE + 1,))],
        ...                        {DIGESTS_KEY: json.dumps(listed)})
        >>> name = object_digest(head, [tensor_digest(b) for b in blobs])
        >>> tensors, piece_digests = listed_digests(head, len(head) + 3 + PIECE_SIZE, name)
        >>> len(tensors), len(piece_digests)
        (2, 3)
        >>> listed_digests(head, len(head) + 3 + PIECE_SIZE, "0" * 64)
        Traceback (most recent call last):
        ...
        ValueError: the piece digests its header lists do not make the object's name 000000000000…
    """
    start, spans, meta = _spans(memoryview(header), size)
    raw = meta.get(DIGESTS_KEY)
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise ValueError("the header's piece digests are malformed (not a JSON string)")
    listed = loads(raw, list, "the header's piece digests")
    if len(listed) != len(spans):
        raise ValueError(f"the header's piece digests are malformed ({len(listed)} lists for {len(spans)} tensors)")
    piece_size = piece_size_of(meta)
    tensors: dict[tuple[int, int], str] = {}
    by_piece: dict[tuple[int, int], str] = {}
    for (b, e), ds in zip(spans, listed):
        ranges = pieces(e - b, piece_size)
        if not isinstance(ds, list) or len(ds) != len(ranges) or not all(is_digest(d) for d in ds):
            raise ValueError(f"the header's piece digests of the tensor at byte {b} are malformed")
        tensors[(b, e)] = ds[0] if len(ranges) == 1 else pieces_root(ds, e - b)
        by_piece.update({(b + pb, b + pe): d for (pb, pe), d in zip(ranges, ds)})
    if object_digest(memoryview(header)[:start], [tensors[s] for s in spans]) != digest:
        raise ValueError(f"the piece digests its header lists do not make the object's name {digest[:12]}…")
    return tensors, by_piece


def object_digest(header: bytes | memoryview, tensor_digests: Iterable[str]) -> str:
    """Digest of an object from its header bytes and its tensors' digests in file order."""
    h = blake3.blake3(OBJECT_DOMAIN)
    h.update(header)
    for d in tensor_digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def rehash(buf: memoryview) -> tuple[str, dict[tuple[int, int], str]]:
    """Recompute an object's digest from all of its bytes (what ``verify`` and a pull check), with
    the rule its header names (:func:`piece_size_of`: pieces, or whole tensors for objects written
    before pieces); pieces of large tensors are hashed side by side, a thread per core.

    Returns the object digest and each tensor's digest keyed by its absolute ``(begin, end)``
    (an empty tensor starts where the next one does). Raises
    ``ValueError`` if ``buf`` is not a well-formed paramstore object (a malformed header, or
    tensors that do not tile the data section exactly).
    """
    start, spans, piece_size = header_layout(buf)
    digests = {(b, e): tensor_digest(buf[b:e], piece_size=piece_size) for b, e in spans}
    return object_digest(buf[:start], [digests[s] for s in spans]), digests


def tensor_spans(buf: memoryview, size: int | None = None) -> tuple[int, list[tuple[int, int]]]:
    """``(data_start, [(begin, end), ...])``: the tensors' byte ranges of an object, in file order.

    Reads only the header from ``buf``; ``size`` is the object's size (default ``len(buf)``).
    Raises ``ValueError`` unless the tensors tile the data section exactly.
    """
    start, spans, _ = _spans(buf, size)
    return start, spans


def header_layout(buf: memoryview, size: int | None = None) -> tuple[int, list[tuple[int, int]], int]:
    """``(data_start, [(begin, end), ...], piece_size)``: what an object's header says of its bytes
    (:func:`tensor_spans`, and the rule of its tensor digests, :func:`piece_size_of`), from one parse.
    Raises ``ValueError`` as they do."""
    start, spans, meta = _spans(buf, size)
    return start, spans, piece_size_of(meta)


def _spans(buf: memoryview, size: int | None = None) -> tuple[int, list[tuple[int, int]], dict[str, Any]]:
    """:func:`tensor_spans`, and the header's ``__metadata__``."""
    size = len(buf) if size is None else size
    start, entries, meta = read_header(buf)
    try:
        spans = sorted((start + int(e["data_offsets"][0]), start + int(e["data_offsets"][1]))
                       for e in entries.values())
    except (KeyError, TypeError, IndexError, ValueError, OverflowError) as e:  # (int() of Infinity: OverflowError)
        raise ValueError(f"malformed header entry: {e!r}") from e
    pos = start
    for b, e in spans:
        if b != pos or e < b:
            raise ValueError("data offsets do not tile the file")
        pos = e
    if pos > size:
        raise ValueError(f"truncated: its tensors end at byte {pos}, the file at byte {size}")
    if pos != size:
        raise ValueError(f"{size - pos} bytes past the last tensor")
    return start, spans, meta


class _Unit:
    """One piece of an object as :class:`ObjectHasher` hashes it: absolute ``[begin, end)``, hashed
    up to ``pos``, and whether a thread is hashing it now."""

    __slots__ = ("begin", "end", "pos", "hasher", "busy")

    def __init__(self, begin: int, end: int, threads: int) -> None:
        self.begin, self.end, self.pos, self.busy = begin, end, begin, False
        self.hasher = blake3.blake3(max_threads=threads)


class ObjectHasher:
    """An object's digest, computed while its bytes arrive in any order; each byte hashed once.

    The receiver calls :meth:`arrived` for each range of ``buf`` that holds its final bytes. Each
    piece (:func:`pieces`: a tensor of one piece, or a piece of a larger one, with the rule the
    object's header names) is hashed from its start as far as the bytes are there, so when bytes
    come roughly in order, hashing overlaps the transfer and little is left when the last byte
    lands; pieces are independent, so threads calling :meth:`arrived` at once hash different pieces
    side by side. Once a piece is all there its digest is known (:meth:`piece_digest`,
    :meth:`check_piece`): it can be checked alone, before the rest of the object arrives.

    ``parallel``: the pieces one call makes ready are hashed side by side on a thread per core
    (what a receiver of large buckets wants); otherwise on the calling thread. Thread-safe
    (blake3 releases the GIL).
    """

    def __init__(self, buf: memoryview, *, parallel: bool = False) -> None:
        self._buf = buf
        self._parallel = parallel
        self._have: list[list[int]] = []  # merged [begin, end) ranges that arrived, sorted
        self._lock = threading.Lock()
        self._start = -1  # data start, once the header arrived
        self._spans: list[tuple[int, int]] = []
        self._units: list[_Unit] = []  # every piece, in file order
        self._first: list[int] = []  # per tensor: the index of its first unit (and a last entry: len(units))
        self._piece_size = 0
        self._error = ""

    def arrived(self, begin: int, end: int) -> None:
        """``buf[begin:end]`` is final: hash whatever it makes ready."""
        with self._lock:
            self._add(begin, end)
            if self._start < 0 and not self._error:
                self._parse()
            work = self._claim()
        while work:
            try:
                _map(lambda w: w[0].hasher.update(self._buf[w[1] : w[2]]), work, self._parallel)
            finally:
                with self._lock:
                    for u, _, reach in work:
                        u.pos, u.busy = reach, False
                    work = self._claim()  # what arrived for these pieces meanwhile (others skipped them)

    def _claim(self) -> list[tuple[_Unit, int, int]]:
        work = []
        for u in self._units:
            if u.busy or u.pos >= u.end:
                continue
            reach = min(u.end, self._reach(u.pos))
            if reach > u.pos:
                u.busy = True
                work.append((u, u.pos, reach))
        return work

    def digest(self) -> str:
        """The object digest; ``ValueError`` if the bytes are not a well-formed object or some
        have not arrived."""
        with self._lock:
            return object_digest(self._buf[: self._start], [d for _, d in self._tensor_digests()])

    def tensor_digests(self) -> dict[tuple[int, int], str]:
        """Each tensor's digest by its absolute ``(begin, end)``, in file order (as :func:`rehash`
        gives them); ``ValueError`` as :meth:`digest`."""
        with self._lock:
            return dict(self._tensor_digests())

    def _tensor_digests(self) -> list[tuple[tuple[int, int], str]]:
        if self._error:
            raise ValueError(self._error)
        if self._start < 0 or any(u.pos < u.end or u.busy for u in self._units):
            raise ValueError("not every byte has arrived")
        out = []
        for t, (b, e) in enumerate(self._spans):
            units = self._units[self._first[t] : self._first[t + 1]]
            ds = [u.hasher.hexdigest() for u in units]
            out.append(((b, e), ds[0] if len(ds) == 1 else pieces_root(ds, e - b)))
        return out

    def pieces(self) -> list[tuple[int, int]]:
        """Every piece of the object as absolute ``(begin, end)``, in file order; empty until the
        header has arrived (or if it is malformed)."""
        with self._lock:
            return [(u.begin, u.end) for u in self._units]

    def piece_digest(self, begin: int) -> str | None:
        """The digest of the piece starting at byte ``begin`` once all of its bytes arrived and were
        hashed; None before (or if no piece starts there)."""
        with self._lock:
            i = bisect.bisect_left(self._units, begin, key=lambda u: u.begin)
            # (empty tensors make empty pieces starting where the next one does: the non-empty one)
            while i < len(self._units) and self._units[i].begin == begin and self._units[i].end == begin \
                    and i + 1 < len(self._units) and self._units[i + 1].begin == begin:
                i += 1
            if i == len(self._units) or self._units[i].begin != begin:
                return None
            u = self._units[i]
            return u.hasher.hexdigest() if u.pos >= u.end and not u.busy else None

    def check_piece(self, begin: int, expected: str) -> bool:
        """Whether the piece starting at ``begin`` is all here and hashes to ``expected`` (the piece
        digest a manifest lists; for a tensor of one piece, its tensor digest)."""
        return self.piece_digest(begin) == expected

    def _add(self, begin: int, end: int) -> None:
        have = self._have
        i = bisect.bisect_left(have, [begin, -1])
        if i and have[i - 1][1] >= begin:
            i -= 1
        j = i
        while j < len(have) and have[j][0] <= end:
            begin, end = min(begin, have[j][0]), max(end, have[j][1])
            j += 1
        have[i:j] = [[begin, end]]

    def _reach(self, pos: int) -> int:
        """End of the arrived run holding ``pos`` (``pos`` itself if it has not arrived)."""
        i = bisect.bisect_right(self._have, [pos, float("inf")]) - 1
        return self._have[i][1] if i >= 0 and self._have[i][1] > pos else pos

    def _parse(self) -> None:
        if self._reach(0) < 8:
            return
        (n,) = struct.unpack_from("<Q", self._buf, 0)
        if self._reach(0) < min(8 + n, len(self._buf)):
            return
        try:
            start, self._spans, self._piece_size = header_layout(self._buf)
        except ValueError as e:
            self._error = f"malformed ({e})"
            return
        for b, e in self._spans:
            self._first.append(len(self._units))
            # a tensor hashed whole though large (an object written before pieces): blake3's own
            # threads when this hasher is to hash side by side (never for pieces, which the pool's
            # threads hash side by side already: blake3's would be nested, spinning, in them)
            whole = not self._piece_size and e - b > PIECE_SIZE
            threads = blake3.blake3.AUTO if self._parallel and whole else 1
            self._units += [_Unit(b + pb, b + pe, threads) for pb, pe in pieces(e - b, self._piece_size)]
        self._first.append(len(self._units))
        self._start = start

