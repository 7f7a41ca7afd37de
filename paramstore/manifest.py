"""Versions and manifests: pure data with a canonical JSON form. No I/O, no torch.

A *manifest* says where every tensor of a version lies: for each name its dtype, shape, tensor
digest, and the object (by digest) and byte range holding it. Names that were tied to another
tensor at commit time (one storage, several names) are recorded as aliases of that name.

A tensor committed sharded (a DTensor whose ranks each stored their own block) is *chunked*: its
entry has the global dtype and shape and a list of :class:`Chunk` s (each block's offsets and sizes
in the global tensor, its digest and where its bytes lie), which tile the tensor exactly. A tensor
stored whole keeps the plain form, so a manifest without chunked tensors is written in format 1,
as before chunks existed, and one with chunks in format 2 (which older readers refuse, naming the
format).

A version may also carry *assets*: small files that belong with the weights (a Hugging Face
model's ``config.json`` and ``generation_config.json``, tokenizer files), each stored as a 1-D
``U8`` entry in the same content-addressed objects as the tensors. So they are deduplicated, moved
between hosts, pushed, pulled, verified and kept from GC exactly like tensors; only the views of a
version's tensors (a snapshot's keys, ``load_into``, ``diff`` of tensors) leave them out. A
manifest with assets is written in format 3.

A tensor (or chunk, or asset) larger than a piece has a digest over its *pieces*
(:mod:`paramstore.format`), and its entry lists the piece digests (``"piece_digests"``: hex, in
order; 64 bytes of JSON per piece), so a receiver can check each piece alone as it arrives. Their
number says the piece size (:func:`~paramstore.format.piece_size_for`: 2 MiB, or 8 MiB for
objects written before). The entry's digest must be the root over them (checked on parse), so the
version digest, which covers the digests, covers the piece digests too. A manifest with piece
digests of 2 MiB pieces is written in format 5; one whose piece digests are all of 8 MiB pieces
in format 4; one without (every tensor of one piece, or written before pieces existed, when a
tensor's digest was ``blake3`` of all its bytes however large) in the lowest of 1-3 that holds it,
as before. Older readers refuse formats 4 and 5, naming them; this one refuses formats it does not
know, saying to upgrade.

A *version* is the small record listed by ``ls``: step, creation time, tags, metrics, metadata,
logical size, tensor count and the version digest. The version digest covers names, dtypes, shapes,
tensor digests and aliases, not where the bytes happen to be stored, so the same weights committed
twice (or to two stores) in the same layout have the same digest (a chunked tensor's digest covers
its chunk list: committed by another number of ranks, the same weights have another digest).
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import blake3

from .errors import CorruptObjectError, ParamStoreError
from .format import ITEMSIZE, PIECE_SIZES, loads, piece_size_for, pieces, pieces_root
from .validate import check_asset_name, check_digest, check_name


__all__ = ["Chunk", "TensorEntry", "Manifest", "Version", "MANIFEST_FORMAT", "MAX_MANIFEST_BYTES", "ASSET_PREFIX", "check_manifest",
           "check_tiling", "object_spans", "object_piece_spans"]

#: A manifest's JSON from elsewhere (a remote, a Redis registry's compressed field) larger than this
#: is refused before it is parsed (CorruptObjectError). About 150 bytes per tensor, plus ~67 per
#: 2 MiB piece of a larger one: 256 MiB is ~1.7M tensors, or the piece digests of ~8 TB of weights.
MAX_MANIFEST_BYTES = 256 << 20

#: The newest manifest format this paramstore reads and writes: 1 (every tensor whole), 2 (some
#: tensors chunked), 3 (with assets) or 4 (with piece digests: tensors larger than a piece, whose
#: digests are over pieces). A manifest is written in the lowest format that can hold it.
MANIFEST_FORMAT = 5
_FORMATS = (1, 2, 3, 4, 5)
#: The piece size of the piece digests a manifest of format 4 lists (format 5: any of PIECE_SIZES).
_FORMAT4_PIECE_SIZE = 8 << 20
#: An asset's name where assets and tensors share one namespace (staging, the names inside objects,
#: a sharded commit's exchange): a tensor name has no NUL, so none can collide with it.
ASSET_PREFIX = "\0asset\0"
_VERSION_DOMAIN = b"paramstore/version/v1\0"
_CHUNKED_DOMAIN = b"paramstore/chunked/v1\0"
_CHUNK_KEYS = {"offsets", "sizes", "digest", "object", "offset", "nbytes"}


@dataclass(frozen=True)
class Chunk:
    """A block of a tensor and where its bytes lie.

    ``offsets`` and ``sizes`` place the block in the whole tensor (one int per dimension), as
    ``torch.distributed.checkpoint`` describes a shard; its bytes are a dense C-order tensor of shape
    ``sizes`` at ``[offset, offset + nbytes)`` of ``object``, with tensor digest ``digest``
    (:func:`paramstore.format.tensor_digest`) and, when larger than a piece, the digests of its
    pieces (``piece_digests``, in order: see :meth:`hash_pieces`). A tensor stored whole is one
    chunk at offsets 0 (see :meth:`TensorEntry.pieces`).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    digest: str
    object: str
    offset: int
    nbytes: int
    piece_digests: tuple[str, ...] = ()

    @property
    def piece_size(self) -> int:
        """The piece size of :attr:`piece_digests` (:func:`~paramstore.format.piece_size_for`); 0
        without them: the digest is ``blake3`` of all the bytes (:func:`~paramstore.format.tensor_digest`'s rule)."""
        return _piece_size(self.nbytes, self.piece_digests)

    def hash_pieces(self) -> list[tuple[int, int, str]]:
        """``(begin, end, digest)`` of each piece of these bytes in the object (absolute offsets):
        what a receiver checks a piece against (:meth:`paramstore.format.ObjectHasher.check_piece`).
        One piece with the tensor digest for bytes of at most one piece, and for bytes recorded
        without piece digests (a manifest written before pieces: the digest is of all the bytes)."""
        if not self.piece_digests:
            return [(self.offset, self.offset + self.nbytes, self.digest)]
        return [(self.offset + b, self.offset + e, d)
                for (b, e), d in zip(pieces(self.nbytes, self.piece_size), self.piece_digests)]

    def to_json(self) -> dict[str, Any]:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes), "digest": self.digest,
                "object": self.object, "offset": self.offset, "nbytes": self.nbytes} | _pieces_json(self.piece_digests)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Chunk":
        _expect_keys("chunk", d, _CHUNK_KEYS | ({"piece_digests"} & set(d) if isinstance(d, dict) else set()))
        offsets, sizes = d["offsets"], d["sizes"]
        for what, v in (("offsets", offsets), ("sizes", sizes)):
            if not isinstance(v, list) or not all(_count(n) for n in v):
                raise CorruptObjectError(f"chunk has bad {what} {v!r}: expected a list of ints >= 0")
        _check_location("chunk", d)
        return cls(tuple(offsets), tuple(sizes), d["digest"], d["object"], d["offset"], d["nbytes"],
                   _parse_pieces("chunk", d))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a manifest: what it is and where its bytes lie.

    A tensor stored whole has its digest, object, offset and length here and no ``chunks``. A
    chunked tensor (see :meth:`chunked`) has ``chunks``; its ``digest`` is then the digest of its
    chunk list (offsets, sizes and chunk digests: the same weights in the same layout give the same
    digest), ``object`` is empty and ``nbytes`` is the whole tensor's. Code that reads bytes should
    go through :meth:`pieces`, which covers both forms.
    """

    dtype: str
    shape: tuple[int, ...]
    digest: str
    object: str
    offset: int
    nbytes: int
    chunks: tuple[Chunk, ...] = ()
    piece_digests: tuple[str, ...] = ()  # of a tensor stored whole, larger than a piece (see Chunk)

    @property
    def piece_size(self) -> int:
        """The piece size of :attr:`piece_digests` (see :attr:`Chunk.piece_size`)."""
        return _piece_size(self.nbytes, self.piece_digests)

    @classmethod
    def chunked(cls, dtype: str, shape: tuple[int, ...], chunks: list[Chunk]) -> "TensorEntry":
        """The entry of a tensor stored as ``chunks`` (sorted here by offsets; they must tile it:
        :func:`check_tiling`). One chunk covering the whole tensor gives the plain form."""
        ordered = tuple(sorted(chunks, key=lambda c: c.offsets))
        if len(ordered) == 1 and ordered[0].offsets == (0,) * len(shape) and ordered[0].sizes == tuple(shape):
            c = ordered[0]
            return cls(dtype, tuple(shape), c.digest, c.object, c.offset, c.nbytes, (), c.piece_digests)
        canon = json.dumps([[list(c.offsets), list(c.sizes), c.digest] for c in ordered], separators=(",", ":"))
        digest = blake3.blake3(_CHUNKED_DOMAIN + canon.encode()).hexdigest()
        return cls(dtype, tuple(shape), digest, "", 0, sum(c.nbytes for c in ordered), ordered)

    def pieces(self) -> tuple[Chunk, ...]:
        """Where the bytes lie: the chunks, or one chunk for a tensor stored whole."""
        if self.chunks:
            return self.chunks
        return (Chunk((0,) * len(self.shape), self.shape, self.digest, self.object, self.offset, self.nbytes,
                      self.piece_digests),)

    def ranges(self) -> tuple[tuple[str, int, int, str], ...]:
        """``(object, offset, nbytes, digest)`` of each piece (see :meth:`pieces`), without making a
        :class:`Chunk` for a tensor stored whole (what per-checkout code over 10,000s of tensors reads)."""
        if self.chunks:
            return tuple((c.object, c.offset, c.nbytes, c.digest) for c in self.chunks)
        return ((self.object, self.offset, self.nbytes, self.digest),)

    def to_json(self) -> dict[str, Any]:
        if self.chunks:
            return {"dtype": self.dtype, "shape": list(self.shape), "chunks": [c.to_json() for c in self.chunks]}
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "digest": self.digest,
            "object": self.object,
            "offset": self.offset,
            "nbytes": self.nbytes,
        } | _pieces_json(self.piece_digests)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TensorEntry":
        """Parse and check an entry's fields: a dtype string, a shape of ints >= 0, both digests 64
        lowercase hex digits (so ``object`` can never name a path), an offset and a length >= 0.
        Raises CorruptObjectError. (Whether the length fits the dtype and shape, and the entry its
        object: :func:`check_manifest`.) A chunked entry's chunks must tile its shape."""
        chunked = isinstance(d, dict) and "chunks" in d
        _expect_keys("tensor entry", d, {"dtype", "shape", "chunks"} if chunked
                     else {"dtype", "shape", "digest", "object", "offset", "nbytes"}
                     | ({"piece_digests"} & set(d) if isinstance(d, dict) else set()))
        dtype, shape = d["dtype"], d["shape"]
        if not isinstance(dtype, str) or not dtype:
            raise CorruptObjectError(f"tensor entry has a bad dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_count(n) for n in shape):
            raise CorruptObjectError(f"tensor entry has a bad shape {shape!r}: expected a list of ints >= 0")
        if chunked:
            if not isinstance(d["chunks"], list) or len(d["chunks"]) < 2:
                raise CorruptObjectError("tensor entry: 'chunks' must be a list of at least two chunks")
            chunks = [Chunk.from_json(c) for c in d["chunks"]]
            check_tiling(tuple(shape), chunks)
            return cls.chunked(dtype, tuple(shape), chunks)
        _check_location("tensor entry", d)
        return cls(dtype, tuple(shape), d["digest"], d["object"], d["offset"], d["nbytes"], (),
                   _parse_pieces("tensor entry", d))


def object_spans(entries: Iterable[TensorEntry]) -> dict[str, dict[tuple[int, int], str]]:
    """Per object, the digest of each tensor (or chunk) the ``entries`` place in it, by absolute
    byte range ``(begin, end)``: :meth:`Manifest.spans` for any entries (a derived record's, say).

    Example:
        >>> e = TensorEntry("U8", (4,), "ab" * 32, "cd" * 32, 64, 4)
        >>> object_spans([e]) == {"cd" * 32: {(64, 68): "ab" * 32}}
        True
    """
    out: dict[str, dict[tuple[int, int], str]] = {}
    for e in entries:
        for obj, offset, nbytes, digest in e.ranges():
            out.setdefault(obj, {})[(offset, offset + nbytes)] = digest
    return out


def object_piece_spans(entries: Iterable[TensorEntry]) -> dict[str, dict[tuple[int, int], str]]:
    """Per object, the digest of each piece the ``entries`` place in it (:meth:`Chunk.hash_pieces`),
    by absolute byte range: :meth:`Manifest.piece_spans` for any entries; with
    :func:`object_spans`, what :func:`paramstore.peer.fetch` relays an object by.

    Example:
        >>> e = TensorEntry("U8", (4,), "ab" * 32, "cd" * 32, 64, 4)
        >>> object_piece_spans([e]) == {"cd" * 32: {(64, 68): "ab" * 32}}
        True
    """
    out: dict[str, dict[tuple[int, int], str]] = {}
    for e in entries:
        for c in e.pieces():
            out.setdefault(c.object, {}).update(((b, end), d) for b, end, d in c.hash_pieces())
    return out


@dataclass(frozen=True)
class Manifest:
    """Every tensor of a version, the names that alias another one, and the version's assets
    (file name -> a 1-D ``U8`` entry holding the file's bytes; see the module docstring)."""

    tensors: Mapping[str, TensorEntry]
    aliases: Mapping[str, str] = field(default_factory=dict)
    assets: Mapping[str, TensorEntry] = field(default_factory=dict)

    @classmethod
    def of(cls, entries: Mapping[str, TensorEntry], aliases: Mapping[str, str]) -> "Manifest":
        """The manifest of a commit's ``entries``, where assets are named ``ASSET_PREFIX + name``."""
        n = len(ASSET_PREFIX)
        return cls({k: e for k, e in entries.items() if not k.startswith(ASSET_PREFIX)}, dict(aliases),
                   {k[n:]: e for k, e in entries.items() if k.startswith(ASSET_PREFIX)})

    def stored(self) -> list[tuple[str, TensorEntry]]:
        """Every entry whose bytes an object holds: the tensors, then the assets (named
        ``"asset <name>"`` here, for messages). Byte-level code (verify, fetch, push and pull
        checks) goes through this; the views of tensors use :attr:`tensors`."""
        return [*self.tensors.items(), *((f"asset {n}", e) for n, e in self.assets.items())]

    def names(self) -> list[str]:
        """All names, tensors and aliases, sorted."""
        return sorted([*self.tensors, *self.aliases])

    def entry(self, name: str) -> TensorEntry:
        """The entry for ``name``, following an alias."""
        return self.tensors[self.aliases.get(name, name)]

    @property
    def nbytes(self) -> int:
        """Logical size: bytes of every stored tensor (an alias adds nothing)."""
        return sum(e.nbytes for e in self.tensors.values())

    def objects(self) -> set[str]:
        """Digests of the objects this manifest references."""
        return set(self.spans())

    def spans(self) -> Mapping[str, Mapping[tuple[int, int], str]]:
        """Per object, the digest of each tensor (or chunk) it holds, by byte range ``(begin, end)``:
        what a check of the object's bytes compares against. Computed once; do not modify."""
        return self.memo("spans", lambda: object_spans(e for _, e in self.stored()))

    def piece_spans(self) -> Mapping[str, Mapping[tuple[int, int], str]]:
        """Per object, the digest of each piece it holds (:meth:`Chunk.hash_pieces`), by byte range
        ``(begin, end)``: what a receiver checks each piece against as it arrives. Computed once."""
        return self.memo("piece_spans", lambda: object_piece_spans(e for _, e in self.stored()))

    @property
    def pieced(self) -> bool:
        """Whether some entry lists piece digests (a tensor larger than a piece: format 4 or 5)."""
        return any(c.piece_digests for _, e in self.stored() for c in e.chunks or (e,))

    def _pieces_format(self) -> int | None:
        """The format the entries' piece digests need: 5 where one lists digests of pieces other
        than 8 MiB, 4 where all are of 8 MiB pieces, None where none lists any."""
        sizes = {c.piece_size for _, e in self.stored() for c in e.chunks or (e,) if c.piece_digests}
        return None if not sizes else 4 if sizes == {_FORMAT4_PIECE_SIZE} else 5

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per manifest (a manifest never changes): for what readers
        derive from it at every checkout (its objects, the snapshot's byte ranges)."""
        memo = self.__dict__.setdefault("_memo", {})
        if key not in memo:
            memo[key] = make()
        return memo[key]

    @property
    def chunked(self) -> bool:
        """Whether some tensor is stored in chunks (a sharded commit)."""
        return any(e.chunks for e in self.tensors.values())

    def digest(self) -> str:
        """Content digest of the version: independent of tensor order and of object placement."""
        canon = {
            "tensors": {n: [e.dtype, list(e.shape), e.digest] for n, e in self.tensors.items()},
            "aliases": dict(self.aliases),
        }
        if self.assets:  # absent otherwise: digests of versions without assets are unchanged
            canon["assets"] = {n: e.digest for n, e in self.assets.items()}
        body = json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()
        return blake3.blake3(_VERSION_DOMAIN + body).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self._pieces_format() or (3 if self.assets else 2 if self.chunked else 1),
            "tensors": {n: e.to_json() for n, e in sorted(self.tensors.items())},
            "aliases": dict(sorted(self.aliases.items())),
        } | ({"assets": {n: e.to_json() for n, e in sorted(self.assets.items())}} if self.assets else {})

    @classmethod
    def parse(cls, raw: bytes | str) -> "Manifest":
        """:meth:`from_json` of the JSON text ``raw``, with the cyclic garbage collector paused: the
        tens of thousands of (acyclic) objects a large manifest makes would otherwise trigger full
        collections of the whole process (measured: a 10,000-tensor manifest parsed in 42 ms, or
        in 146 ms when a collection ran). Raises what ``json.loads`` and :meth:`from_json` raise."""
        with _gc_paused():
            return cls.from_json(loads(raw, object, "manifest JSON"))

    def __getstate__(self) -> dict[str, Any]:
        # what memo() derived is not part of the manifest: not pickled
        return {k: v for k, v in self.__dict__.items() if k != "_memo"}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Manifest":
        """Parse and check a manifest (see :meth:`TensorEntry.from_json`; names are valid, each alias
        names a stored tensor and is not one). Raises CorruptObjectError, or ParamStoreError for a
        format this paramstore does not read."""
        if not isinstance(d, Mapping) or not _count(d.get("format")):
            raise CorruptObjectError(f"manifest record is not a JSON object with an int format: {str(d)[:80]}")
        if d["format"] not in _FORMATS:
            raise ParamStoreError(
                f"manifest format {d['format']} is not supported by this paramstore "
                f"(reads {', '.join(map(str, _FORMATS))}); upgrade paramstore"
            )
        _expect_keys("manifest", d, {"format", "tensors", "aliases"}
                     | ({"assets"} if d["format"] == 3 or (d["format"] >= 4 and "assets" in d) else set()))
        if not isinstance(d["tensors"], dict) or not isinstance(d["aliases"], dict):
            raise CorruptObjectError("manifest: 'tensors' and 'aliases' must be JSON objects")
        tensors = {}
        for n, e in d["tensors"].items():
            _check_name(n)
            try:
                tensors[n] = TensorEntry.from_json(e)
            except CorruptObjectError as err:
                raise CorruptObjectError(f"manifest entry {n!r}: {err}") from None
        for a, n in d["aliases"].items():
            _check_name(a)
            if not isinstance(n, str) or n not in tensors or a in tensors:
                raise CorruptObjectError(f"manifest alias {a!r} -> {n!r} does not name a stored tensor")
        if not isinstance(d.get("assets", {}), dict):
            raise CorruptObjectError("manifest: 'assets' must be a JSON object")
        assets = {}
        for n, e in d.get("assets", {}).items():
            try:
                check_asset_name(n)
                assets[n] = TensorEntry.from_json(e)
            except ParamStoreError as err:
                raise CorruptObjectError(f"manifest asset {n!r}: {err}") from None
            if assets[n].dtype != "U8" or len(assets[n].shape) != 1 or assets[n].chunks:
                raise CorruptObjectError(f"manifest asset {n!r} is not a 1-D U8 entry")
        manifest = cls(tensors, dict(d["aliases"]), assets)
        if manifest.chunked and d["format"] < 2:
            raise CorruptObjectError("manifest of format 1 holds chunked tensors (format 2)")
        if d["format"] == 3 and not assets:
            raise CorruptObjectError("manifest of format 3 holds no assets")
        # Format 4: every entry larger than an 8 MiB piece lists the digests of its 8 MiB pieces
        # (its digest is over them); format 5 also those of 2 MiB pieces (an entry over 2 MiB
        # may list none: written before, its digest is over 8 MiB pieces or all of its bytes);
        # before, none does (its digest is blake3 of all its bytes).
        for name, e in manifest.stored():
            for c in e.chunks or (e,):
                if d["format"] >= 4 and c.nbytes > max(PIECE_SIZES) and not c.piece_digests:
                    raise CorruptObjectError(f"manifest of format {d['format']}: {name!r} of {c.nbytes} bytes lists "
                                             "no piece digests")
                if d["format"] < 4 and c.piece_digests:
                    raise CorruptObjectError(f"manifest of format {d['format']} lists piece digests for {name!r} "
                                             "(format 4)")
                if d["format"] == 4 and c.piece_digests and c.piece_size != _FORMAT4_PIECE_SIZE:
                    raise CorruptObjectError(f"manifest of format 4 lists digests of {c.piece_size}-byte pieces for "
                                             f"{name!r} (format 5)")
        need = manifest._pieces_format()
        if d["format"] >= 4 and need is None:
            raise CorruptObjectError(f"manifest of format {d['format']} lists no piece digests")
        if d["format"] == 5 and need == 4:
            raise CorruptObjectError("manifest of format 5 lists no digests of pieces under 8 MiB (format 4)")
        return manifest


@dataclass(frozen=True)
class Version:
    """An immutable committed version of the parameters.

    Attributes:
        step: the trainer step it was committed at (unique, strictly increasing).
        created_at: commit time, seconds since the epoch (UTC).
        tags: names pointing at this version.
        metrics: numbers recorded with the commit (loss, reward, ...).
        metadata: any JSON recorded with the commit.
        nbytes: logical size, bytes of every tensor (aliases not counted twice).
        digest: content digest of the whole version (names, dtypes, shapes, bytes).
        num_tensors: number of names, aliases included.
        writer: run id of the trainer that committed it ("" for versions written before 0.2).
    """

    step: int
    created_at: float
    nbytes: int
    digest: str
    num_tensors: int
    tags: tuple[str, ...] = ()
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    writer: str = ""

    def to_json(self) -> dict[str, Any]:
        """JSON form. Tags are not stored with the version (they move); they are joined on read."""
        return {
            "step": self.step,
            "created_at": self.created_at,
            "nbytes": self.nbytes,
            "digest": self.digest,
            "num_tensors": self.num_tensors,
            "metrics": dict(self.metrics),
            "metadata": dict(self.metadata),
        } | ({"writer": self.writer} if self.writer else {})

    def as_dict(self) -> dict[str, Any]:
        """JSON form with tags, as the CLI prints it."""
        return {**self.to_json(), "tags": list(self.tags)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], tags: tuple[str, ...] = ()) -> "Version":
        """Parse and check a version record (field types, a 64-hex digest). Raises CorruptObjectError."""
        if not isinstance(d, dict):  # (before set(d) below: a list of objects is not a record either)
            raise CorruptObjectError(f"version record is not a JSON object: {type(d).__name__}")
        _expect_keys(  # "writer" is optional: versions written before 0.2 have none
            "version", d, {"step", "created_at", "nbytes", "digest", "num_tensors", "metrics", "metadata"}
            | ({"writer"} & set(d))
        )
        if not isinstance(d.get("writer", ""), str) or len(d.get("writer", "")) > 128:
            raise CorruptObjectError(f"version record has a bad writer {d.get('writer')!r}")
        if not (_count(d["step"]) and _count(d["nbytes"]) and _count(d["num_tensors"])):
            raise CorruptObjectError(f"version record has a bad step, nbytes or num_tensors: {d['step']!r}, "
                                     f"{d['nbytes']!r}, {d['num_tensors']!r}")
        if isinstance(d["created_at"], bool) or not isinstance(d["created_at"], (int, float)):
            raise CorruptObjectError(f"version record has a bad created_at {d['created_at']!r}")
        if not isinstance(d["metrics"], dict) or not isinstance(d["metadata"], dict):
            raise CorruptObjectError("version record: metrics and metadata must be JSON objects")
        try:
            check_digest(d["digest"])
        except ParamStoreError as e:
            raise CorruptObjectError(f"version record: bad version digest: {e}") from None
        return cls(
            step=d["step"],
            created_at=d["created_at"],
            nbytes=d["nbytes"],
            digest=d["digest"],
            num_tensors=d["num_tensors"],
            tags=tags,
            metrics=d["metrics"],
            metadata=d["metadata"],
            writer=d.get("writer", ""),
        )


def check_manifest(manifest: Manifest, version: Version, sizes: Mapping[str, int] | None = None, *,
                   where: str = "") -> None:
    """Raise CorruptObjectError unless ``manifest`` is the one ``version`` names, and lies in ``sizes``.

    Checks the version digest (names, dtypes, shapes, tensor digests and aliases), the logical size
    and the tensor count. With ``sizes`` (object digest -> size, e.g. a remote record's), also the
    layout: the manifest references exactly those objects, every dtype is one paramstore stores,
    every length is the shape's element count times the item size, and every entry lies inside
    its object, past the 8-byte header length, at an offset aligned for its dtype. ``where`` (a
    URL, a key) is named in the message. For a manifest read from another host, bucket or
    registry, before use.
    """
    at = f" ({where})" if where else ""
    got = manifest.digest()
    if got != version.digest:
        raise CorruptObjectError(f"the manifest of version {version.step}{at} hashes to {got[:16]}…, but the "
                                 f"version's digest is {version.digest[:16]}…: tampered or mixed up")
    count = len(manifest.tensors) + len(manifest.aliases)
    if manifest.nbytes != version.nbytes or count != version.num_tensors:
        raise CorruptObjectError(f"the manifest of version {version.step}{at} holds {count} names and "
                                 f"{manifest.nbytes} bytes; the version says {version.num_tensors} and "
                                 f"{version.nbytes}")
    if sizes is None:
        return
    if set(sizes) != manifest.objects():
        raise CorruptObjectError(f"version {version.step}{at}: its record lists other objects than its manifest")
    for name, e in manifest.stored():
        for c in e.pieces():
            want = ITEMSIZE.get(e.dtype, 0)
            for n in c.sizes:
                want *= n
            if e.dtype not in ITEMSIZE or c.nbytes != want:
                raise CorruptObjectError(f"version {version.step}{at}: tensor {name!r} of dtype {e.dtype!r} and "
                                         f"shape {list(c.sizes)} says {c.nbytes} bytes (an unknown dtype, or not "
                                         f"{want})")
            if c.offset < 8 or c.offset + c.nbytes > sizes[c.object] or c.offset % ITEMSIZE[e.dtype]:
                raise CorruptObjectError(f"version {version.step}{at}: tensor {name!r} at [{c.offset}, "
                                         f"{c.offset + c.nbytes}) does not lie in object {c.object[:16]}… of "
                                         f"{sizes[c.object]} bytes (aligned for {e.dtype})")


def check_tiling(shape: tuple[int, ...], chunks: "list[Chunk] | tuple[Chunk, ...]", what: str = "") -> None:
    """Raise CorruptObjectError unless ``chunks`` tile ``shape`` exactly: every chunk non-empty and
    inside it, and together a grid (per dimension, the chunks' ranges partition it; every cell of
    that grid is exactly one chunk), so every element is in exactly one chunk. This is the layout
    every DTensor placement paramstore stores (``Shard`` on any dims, over any mesh) produces."""
    at = f" {what}" if what else ""
    cuts: list[set[tuple[int, int]]] = [set() for _ in shape]
    cells = set()
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
            raise CorruptObjectError(f"chunk{at} at {list(c.offsets)} has {len(c.offsets)} offsets and "
                                     f"{len(c.sizes)} sizes for a tensor of {len(shape)} dimensions")
        if any(n == 0 for n in c.sizes) or any(o + n > s for o, n, s in zip(c.offsets, c.sizes, shape)):
            raise CorruptObjectError(f"chunk{at} at {list(c.offsets)} of sizes {list(c.sizes)} is empty or "
                                     f"exceeds the shape {list(shape)}")
        for dim, (o, n) in enumerate(zip(c.offsets, c.sizes)):
            cuts[dim].add((o, o + n))
        cells.add(tuple(zip(c.offsets, c.sizes)))
    count = 1
    for dim, ranges in enumerate(cuts):
        pos = 0
        for lo, hi in sorted(ranges):
            if lo != pos:
                raise CorruptObjectError(f"chunks{at} do not tile dimension {dim} of {list(shape)}: "
                                         f"{'overlap' if lo < pos else 'gap'} at {min(lo, pos)}")
            pos = hi
        if pos != shape[dim]:
            raise CorruptObjectError(f"chunks{at} do not cover dimension {dim} of {list(shape)}")
        count *= len(ranges)
    if len(cells) != len(chunks) or count != len(chunks):
        raise CorruptObjectError(f"chunks{at} of a tensor of shape {list(shape)} do not form a grid "
                                 f"({len(chunks)} chunks, {count} cells)")


def _check_location(what: str, d: Mapping[str, Any]) -> None:
    """Where bytes lie (a tensor entry's or a chunk's): both digests 64 lowercase hex digits (so
    ``object`` can never name a path), offset and length ints >= 0. Raises CorruptObjectError."""
    try:
        check_digest(d["digest"])
        check_digest(d["object"])
    except ParamStoreError as e:
        raise CorruptObjectError(f"{what}: {e}") from None
    if not _count(d["offset"]) or not _count(d["nbytes"]):
        raise CorruptObjectError(f"{what} has a bad offset {d['offset']!r} or length {d['nbytes']!r}")


def _piece_size(nbytes: int, piece_digests: tuple[str, ...]) -> int:
    return piece_size_for(nbytes, len(piece_digests)) if piece_digests else 0


def _pieces_json(piece_digests: tuple[str, ...]) -> dict[str, Any]:
    return {"piece_digests": list(piece_digests)} if piece_digests else {}


def _parse_pieces(what: str, d: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``piece_digests`` of an entry or chunk (absent: ``()``): 64-hex digests, as many as its
    length makes pieces of a size paramstore knows (more than one:
    :func:`~paramstore.format.piece_size_for`), whose root is its digest. Raises CorruptObjectError."""
    if "piece_digests" not in d:
        return ()
    ds = d["piece_digests"]
    if not isinstance(ds, list):
        raise CorruptObjectError(f"{what} of {d['nbytes']} bytes: its piece digests are not a list")
    try:
        piece_size_for(d["nbytes"], len(ds))
    except ValueError as e:
        raise CorruptObjectError(f"{what}: {e}") from None
    try:
        for x in ds:
            check_digest(x)
    except ParamStoreError as e:
        raise CorruptObjectError(f"{what}: bad piece digest: {e}") from None
    if pieces_root(ds, d["nbytes"]) != d["digest"]:
        raise CorruptObjectError(f"{what}: its piece digests do not hash to its digest {d['digest'][:16]}…")
    return tuple(ds)


def _count(n: Any) -> bool:
    """Whether ``n`` is an int >= 0 (a bool is not)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _check_name(name: Any) -> None:
    try:
        check_name(name)
    except ParamStoreError as e:
        raise CorruptObjectError(f"manifest: {e}") from None


def _expect_keys(what: str, d: Mapping[str, Any], keys: set[str]) -> None:
    # Never silently skip an unknown field: a newer writer may have meant something by it.
    if not isinstance(d, dict):  # what json.loads makes of an object (typing's Mapping check is slow)
        raise CorruptObjectError(f"{what} record is not a JSON object: {type(d).__name__}")
    have = set(d)
    if have != keys:
        missing, unknown = sorted(keys - have), sorted(have - keys)
        raise ParamStoreError(
            f"{what} record has missing fields {missing} / unknown fields {unknown}; "
            "written by another paramstore format?"
        )


_gc_lock = threading.Lock()
_gc_pauses = 0  # parses running with the collector paused
_gc_was_enabled = False


@contextlib.contextmanager
def _gc_paused() -> Any:
    """Pause the cyclic collector for the block; nested and concurrent blocks (parses on several
    threads) restore it once, when the last one ends, to what it was when the first began. (A
    caller that disables the collector itself while a parse runs finds it enabled again after.)"""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()
