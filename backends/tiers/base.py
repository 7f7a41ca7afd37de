"""The tier contract: where object bytes live.

A tier stores immutable *objects* named by their digest (64 lowercase hex digits: see
:mod:`paramstore.format`). The contract is a handful of primitives; the store builds everything
else on them (commit, checkout, push, pull, GC). Two tiers ship: :class:`~.local.LocalTier`
(files on a tmpfs: shared memory) and :class:`~.remote.RemoteTier` (any fsspec URL: S3, a shared
filesystem).

Rules every implementation keeps (the conformance suite, :mod:`paramstore.backends.tiers.testing`,
checks each one):

* **Objects are immutable and appear whole.** :meth:`Tier.put` publishes an object at once or not
  at all; a reader never sees part of one. Putting a digest that exists is a no-op (the bytes are
  the same by construction) and returns False.
* **Names are validated.** Every method that takes a digest refuses anything but 64 lowercase hex
  digits with :class:`~paramstore.errors.InvalidArgumentError`, before it touches a path or a key:
  a digest read from another host, a registry or a bucket can never name a file outside the tier.
* **Missing objects raise FileNotFoundError** (``size``, ``get``, ``get_file``, ``map``);
  ``delete`` of a missing object is a no-op.
* **A tier moves bytes; it does not check them.** Callers verify what they read (the digests in
  the manifest) before they trust it.

Capability flags (class attributes) tell the store what a tier can do beyond the primitives:
``mappable`` (:meth:`Tier.map` gives zero-copy views: the shared-memory tier), ``ranged_reads``
(:meth:`Tier.get` with a range reads only that range), ``atomic_put`` (concurrent writers of one
digest cannot tear it; false only for filesystems without an atomic rename).

The object key layout (``objects/<d[:2]>/<digest>.safetensors``) is defined once, here
(:func:`object_key`), and used by every tier, so a local root and a bucket hold the same tree.
"""

from __future__ import annotations

import abc
import mmap
import os
from typing import ClassVar, Iterable, Iterator

from paramstore.errors import InvalidArgumentError
from paramstore.format import OBJECT_SUFFIX
from paramstore.validate import check_digest, is_digest

__all__ = ["Tier", "object_key", "digest_of_key", "check_range", "OBJECT_SUFFIX", "OBJECTS_DIR"]

#: The folder (key prefix) under a tier's root that holds objects.
OBJECTS_DIR = "objects"


def object_key(digest: str) -> str:
    """The key of object ``digest`` relative to a tier's root, the same in every tier.

    Example:
        >>> object_key("ab" + "0" * 62)
        'objects/ab/ab00000000000000000000000000000000000000000000000000000000000000.safetensors'
    """
    check_digest(digest)
    return f"{OBJECTS_DIR}/{digest[:2]}/{digest}{OBJECT_SUFFIX}"


def digest_of_key(name: str) -> str | None:
    """The digest an object file or key is named after (its last path component), or None."""
    base = name.rsplit("/", 1)[-1]
    if not base.endswith(OBJECT_SUFFIX):
        return None
    d = base[: -len(OBJECT_SUFFIX)]
    return d if is_digest(d) else None


class Tier(abc.ABC):
    """Immutable objects named by digest: the contract every storage tier implements.

    Subclasses implement the six abstract primitives; the rest has defaults built on them (marked
    *note for implementers* where an override is worth it). Register a new tier's tests by
    subclassing :class:`paramstore.backends.tiers.testing.TierTests`.
    """

    #: :meth:`map` returns zero-copy views of an object (a local, memory-backed tier).
    mappable: ClassVar[bool] = False
    #: :meth:`get` with a range reads only that range.
    ranged_reads: ClassVar[bool] = True
    #: :meth:`put` is atomic even with concurrent writers of the same digest.
    atomic_put: ClassVar[bool] = True

    #: Where the tier lives (a path or URL), for messages.
    url: str = ""

    # -- the primitives ------------------------------------------------------------------------
    @abc.abstractmethod
    def exists(self, digest: str) -> bool:
        """Whether object ``digest`` is present (whole: a partial object is never visible)."""

    @abc.abstractmethod
    def size(self, digest: str) -> int:
        """Size in bytes of object ``digest``. Raises FileNotFoundError."""

    @abc.abstractmethod
    def list(self) -> Iterator[str]:
        """Digests of every object present (in no particular order)."""

    @abc.abstractmethod
    def get(self, digest: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of object ``digest`` (``end=None``: to the end; clipped to the size).

        Raises FileNotFoundError; InvalidArgumentError for a negative ``start`` or ``end < start``.
        """

    @abc.abstractmethod
    def put(self, digest: str, path: str, *, move: bool = False) -> bool:
        """Publish the local file ``path`` as object ``digest``, whole and at once.

        Returns True if the object is new, False if it was already present (then nothing is
        written). With ``move``, the tier may take the file over (rename it into place) and the
        caller must not use ``path`` afterwards; without it ``path`` is left as it was.
        The tier does not hash the bytes: the caller has checked them. Raises FileNotFoundError if
        ``path`` does not exist (and the object does not either).
        """

    @abc.abstractmethod
    def delete(self, digest: str) -> None:
        """Remove object ``digest`` (no error if absent). Only GC calls this."""

    # -- defaults built on the primitives ------------------------------------------------------
    def get_file(self, digest: str, path: str) -> None:
        """Write object ``digest`` into the new local file ``path``.

        Raises FileNotFoundError (no such object) or FileExistsError (``path`` exists).

        Note for implementers: the default reads the whole object into memory; a tier with
        streamed or parallel downloads should override it.
        """
        if os.path.lexists(path):
            raise FileExistsError(path)
        data = self.get(digest)
        with open(path, "xb") as f:
            f.write(data)

    def sizes(self, digests: Iterable[str]) -> dict[str, int]:
        """Sizes of the objects present among ``digests`` (absent ones are left out).

        Note for implementers: the default calls :meth:`size` once per digest.
        """
        out = {}
        for d in [check_digest(d) for d in digests]:
            try:
                out[d] = self.size(d)
            except FileNotFoundError:
                pass
        return out

    def map(self, digest: str, *, private: bool = False) -> mmap.mmap:
        """A zero-copy map of object ``digest`` (only when ``mappable``).

        ``private=False``: read-only. ``private=True``: copy-on-write: the map is writable and
        writes stay in this process, never reaching the object.
        Raises FileNotFoundError, or NotImplementedError on a tier that is not mappable.
        """
        raise NotImplementedError(f"{type(self).__name__} objects cannot be mapped (mappable is False)")

    def close(self) -> None:
        """Release connections and handles (idempotent). The default has nothing to release."""

    def __enter__(self) -> "Tier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_range(start: int, end: int | None) -> None:
    """InvalidArgumentError unless ``0 <= start`` and (``end`` is None or ``start <= end``)."""
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise InvalidArgumentError(f"start must be a non-negative int, got {start!r}")
    if end is not None and (isinstance(end, bool) or not isinstance(end, int) or end < start):
        raise InvalidArgumentError(f"end must be None or an int >= start ({start}), got {end!r}")
