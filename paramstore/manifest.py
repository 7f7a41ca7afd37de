"""Versions and manifests: pure data with a canonical JSON form. No I/O, no torch.

A *manifest* says where every tensor of a version lies: for each name its dtype, shape, tensor
digest, and the object (by digest) and byte range holding it. Names that were tied to another
tensor at commit time (one storage, several names) are recorded as aliases of that name.

A *version* is the small record listed by ``ls``: step, creation time, tags, metrics, metadata,
logical size, tensor count and the version digest. The version digest covers names, dtypes, shapes,
tensor digests and aliases, not where the bytes happen to be stored, so the same weights committed
twice (or to two stores) have the same digest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import blake3

from .errors import CorruptObjectError, ParamStoreError
from .format import ITEMSIZE
from .validate import check_name

from paramstore.backends.tiers.base import check_digest

__all__ = ["TensorEntry", "Manifest", "Version", "MANIFEST_FORMAT", "check_manifest"]

MANIFEST_FORMAT = 1
_VERSION_DOMAIN = b"paramstore/version/v1\0"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a manifest: what it is and where its bytes lie."""

    dtype: str
    shape: tuple[int, ...]
    digest: str
    object: str
    offset: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "digest": self.digest,
            "object": self.object,
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TensorEntry":
        """Parse and check an entry's fields: a dtype string, a shape of ints >= 0, both digests 64
        lowercase hex digits (so ``object`` can never name a path), an offset and a length >= 0.
        Raises CorruptObjectError. (Whether the length fits the dtype and shape, and the entry its
        object: :func:`check_manifest`.)"""
        _expect_keys("tensor entry", d, {"dtype", "shape", "digest", "object", "offset", "nbytes"})
        dtype, shape = d["dtype"], d["shape"]
        if not isinstance(dtype, str) or not dtype:
            raise CorruptObjectError(f"tensor entry has a bad dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_count(n) for n in shape):
            raise CorruptObjectError(f"tensor entry has a bad shape {shape!r}: expected a list of ints >= 0")
        try:
            check_digest(d["digest"])
            check_digest(d["object"])
        except ParamStoreError as e:
            raise CorruptObjectError(f"tensor entry: {e}") from None
        if not _count(d["offset"]) or not _count(d["nbytes"]):
            raise CorruptObjectError(f"tensor entry has a bad offset {d['offset']!r} or length {d['nbytes']!r}")
        return cls(dtype, tuple(shape), d["digest"], d["object"], d["offset"], d["nbytes"])


@dataclass(frozen=True)
class Manifest:
    """Every tensor of a version, and the names that alias another one."""

    tensors: Mapping[str, TensorEntry]
    aliases: Mapping[str, str] = field(default_factory=dict)

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
        return {e.object for e in self.tensors.values()}

    def digest(self) -> str:
        """Content digest of the version: independent of tensor order and of object placement."""
        canon = {
            "tensors": {n: [e.dtype, list(e.shape), e.digest] for n, e in self.tensors.items()},
            "aliases": dict(self.aliases),
        }
        body = json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()
        return blake3.blake3(_VERSION_DOMAIN + body).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "tensors": {n: e.to_json() for n, e in sorted(self.tensors.items())},
            "aliases": dict(sorted(self.aliases.items())),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Manifest":
        """Parse and check a manifest (see :meth:`TensorEntry.from_json`; names are valid, each alias
        names a stored tensor and is not one). Raises CorruptObjectError, or ParamStoreError for a
        format this paramstore does not read."""
        _expect_keys("manifest", d, {"format", "tensors", "aliases"})
        if d["format"] != MANIFEST_FORMAT:
            raise ParamStoreError(
                f"manifest format {d['format']} is not supported by this paramstore "
                f"(expects {MANIFEST_FORMAT}); upgrade paramstore"
            )
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
        return cls(tensors, dict(d["aliases"]))


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
    for name, e in manifest.tensors.items():
        want = ITEMSIZE.get(e.dtype, 0)
        for n in e.shape:
            want *= n
        if e.dtype not in ITEMSIZE or e.nbytes != want:
            raise CorruptObjectError(f"version {version.step}{at}: tensor {name!r} of dtype {e.dtype!r} and shape "
                                     f"{list(e.shape)} says {e.nbytes} bytes (an unknown dtype, or not {want})")
        if e.offset < 8 or e.offset + e.nbytes > sizes[e.object] or e.offset % ITEMSIZE[e.dtype]:
            raise CorruptObjectError(f"version {version.step}{at}: tensor {name!r} at [{e.offset}, "
                                     f"{e.offset + e.nbytes}) does not lie in object {e.object[:16]}… of "
                                     f"{sizes[e.object]} bytes (aligned for {e.dtype})")


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
    if not isinstance(d, Mapping):
        raise CorruptObjectError(f"{what} record is not a JSON object: {type(d).__name__}")
    have = set(d)
    if have != keys:
        missing, unknown = sorted(keys - have), sorted(have - keys)
        raise ParamStoreError(
            f"{what} record has missing fields {missing} / unknown fields {unknown}; "
            "written by another paramstore format?"
        )
