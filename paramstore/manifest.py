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

from .errors import ParamStoreError

__all__ = ["TensorEntry", "Manifest", "Version", "MANIFEST_FORMAT"]

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
        _expect_keys("tensor entry", d, {"dtype", "shape", "digest", "object", "offset", "nbytes"})
        return cls(d["dtype"], tuple(d["shape"]), d["digest"], d["object"], d["offset"], d["nbytes"])


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
        _expect_keys("manifest", d, {"format", "tensors", "aliases"})
        if d["format"] != MANIFEST_FORMAT:
            raise ParamStoreError(
                f"manifest format {d['format']} is not supported by this paramstore "
                f"(expects {MANIFEST_FORMAT}); upgrade paramstore"
            )
        tensors = {n: TensorEntry.from_json(e) for n, e in d["tensors"].items()}
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
    """

    step: int
    created_at: float
    nbytes: int
    digest: str
    num_tensors: int
    tags: tuple[str, ...] = ()
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)

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
        }

    def as_dict(self) -> dict[str, Any]:
        """JSON form with tags, as the CLI prints it."""
        return {**self.to_json(), "tags": list(self.tags)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], tags: tuple[str, ...] = ()) -> "Version":
        _expect_keys(
            "version", d, {"step", "created_at", "nbytes", "digest", "num_tensors", "metrics", "metadata"}
        )
        return cls(
            step=d["step"],
            created_at=d["created_at"],
            nbytes=d["nbytes"],
            digest=d["digest"],
            num_tensors=d["num_tensors"],
            tags=tags,
            metrics=d["metrics"],
            metadata=d["metadata"],
        )


def _expect_keys(what: str, d: Mapping[str, Any], keys: set[str]) -> None:
    # Never silently skip an unknown field: a newer writer may have meant something by it.
    have = set(d)
    if have != keys:
        missing, unknown = sorted(keys - have), sorted(have - keys)
        raise ParamStoreError(
            f"{what} record has missing fields {missing} / unknown fields {unknown}; "
            "written by another paramstore format?"
        )
