"""The object format: safetensors shards, their layout and their digests. Pure data, no I/O, no torch.

An *object* is a valid safetensors file holding a shard of tensors::

    [8-byte little-endian header length N][N bytes of JSON header, space padded][data]

paramstore pads the header so the data starts on a 64-byte boundary and orders the tensors of a
shard by item size (largest first), so every tensor starts at an offset that is a multiple of its
item size: any tensor can be viewed in place with its own dtype, with no copy. Tensors are dense and
contiguous, as safetensors requires.

Digests (blake3, hex):

* tensor digest = ``blake3(tensor bytes)``: dtype and shape are not part of it, so equal bytes
  are stored once whatever they are viewed as;
* object digest = ``blake3(OBJECT_DOMAIN || header bytes || tensor digest_1 || ... || digest_n)``
  with the tensor digests in file order. Because the tensors tile the data section exactly, this
  is a digest of every byte of the file computed as a two-level tree: commit hashes each byte
  once (per tensor) and gets the object name for the price of hashing a few kilobytes.
"""

from __future__ import annotations

import bisect
import json
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import blake3

__all__ = [
    "rehash",
    "tensor_spans",
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
    header's ``__metadata__`` (the store's objects have none; exports say ``{"format": "pt"}``).
    """
    entries: dict[str, dict] = {"__metadata__": dict(metadata)} if metadata else {}
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


def tensor_digest(data: bytes | memoryview, *, parallel: bool | None = None) -> str:
    """blake3 of a tensor's bytes, hex.

    ``parallel``: hash on several threads (default: for inputs of 4 MiB and more). The commit path
    passes False for tensors it already hashes side by side on its own threads.
    """
    if parallel is None:
        parallel = len(data) >= _HASH_THREADS_MIN_BYTES
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO if parallel else 1).hexdigest()


def object_digest(header: bytes | memoryview, tensor_digests: Iterable[str]) -> str:
    """Digest of an object from its header bytes and its tensors' digests in file order."""
    h = blake3.blake3(OBJECT_DOMAIN)
    h.update(header)
    for d in tensor_digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def rehash(buf: memoryview) -> tuple[str, dict[tuple[int, int], str]]:
    """Recompute an object's digest from all of its bytes (what ``verify`` and a pull check).

    Returns the object digest and each tensor's digest keyed by its absolute ``(begin, end)``
    (an empty tensor starts where the next one does). Raises
    ``ValueError`` if ``buf`` is not a well-formed paramstore object (a malformed header, or
    tensors that do not tile the data section exactly).
    """
    start, spans = tensor_spans(buf)
    digests = {(b, e): tensor_digest(buf[b:e]) for b, e in spans}
    return object_digest(buf[:start], [digests[s] for s in spans]), digests


def tensor_spans(buf: memoryview, size: int | None = None) -> tuple[int, list[tuple[int, int]]]:
    """``(data_start, [(begin, end), ...])``: the tensors' byte ranges of an object, in file order.

    Reads only the header from ``buf``; ``size`` is the object's size (default ``len(buf)``).
    Raises ``ValueError`` unless the tensors tile the data section exactly.
    """
    size = len(buf) if size is None else size
    start, entries = parse_header(buf)
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
    return start, spans


class ObjectHasher:
    """An object's digest, computed while its bytes arrive in any order; each byte hashed once.

    The receiver calls :meth:`arrived` for each range of ``buf`` that holds its final bytes. Each
    tensor is hashed from its start as far as the bytes are there, so when bytes come roughly in
    order, hashing overlaps the transfer and little is left when the last byte lands. Thread-safe;
    the hashing runs in the thread calling :meth:`arrived` (blake3 releases the GIL).
    """

    def __init__(self, buf: memoryview) -> None:
        self._buf = buf
        self._have: list[list[int]] = []  # merged [begin, end) ranges that arrived, sorted
        self._lock = threading.Lock()
        self._start = -1  # data start, once the header arrived
        self._spans: list[tuple[int, int]] = []
        self._pos: list[int] = []  # per tensor: hashed up to here
        self._hashers: list[blake3.blake3] = []
        self._error = ""

    def arrived(self, begin: int, end: int) -> None:
        """``buf[begin:end]`` is final: hash whatever it makes ready."""
        with self._lock:
            self._add(begin, end)
            if self._start < 0 and not self._error:
                self._parse()
            for i, (_, e) in enumerate(self._spans):
                pos = self._pos[i]
                reach = min(e, self._reach(pos))
                if reach > pos:
                    self._hashers[i].update(self._buf[pos:reach])
                    self._pos[i] = reach

    def digest(self) -> str:
        """The object digest; ``ValueError`` if the bytes are not a well-formed object or some
        have not arrived."""
        with self._lock:
            if self._error:
                raise ValueError(self._error)
            if self._start < 0 or any(p < e for p, (_, e) in zip(self._pos, self._spans)):
                raise ValueError("not every byte has arrived")
            return object_digest(self._buf[: self._start], [h.hexdigest() for h in self._hashers])

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
            self._start, self._spans = tensor_spans(self._buf)
        except ValueError as e:
            self._error = f"malformed ({e})"
            return
        self._pos = [b for b, _ in self._spans]
        self._hashers = [blake3.blake3(max_threads=1) for _ in self._spans]
