"""The registry contract: the metadata side of a store.

A registry keeps versions, manifests, tags and the tensor index (tensor digest -> where its bytes
already lie) and tells waiting processes that something changed. Object bytes never pass through
it. Implementations must make :meth:`Registry.publish` atomic: a version, its manifest, its tags
and its index entries appear together or not at all.
"""

from __future__ import annotations

import abc
from typing import Iterator, NamedTuple

from paramstore.manifest import Manifest, Version

__all__ = ["Registry", "TensorLocation", "Watch", "Lease", "ObjectInfo"]


class Lease(NamedTuple):
    """A reader's hold on a version: while it is live, the version is not pruned."""

    id: str
    step: int
    holder: str
    pid: int
    host: str
    acquired_at: float


class TensorLocation(NamedTuple):
    """Where a tensor's bytes already lie: object digest, absolute offset, length."""

    object: str
    offset: int
    nbytes: int


class ObjectInfo(NamedTuple):
    """A stored object: its size and the digests of the tensors it holds (in file order)."""

    size: int
    tensors: tuple[str, ...]


class Watch(abc.ABC):
    """A handle that wakes up when the registry may have changed."""

    @abc.abstractmethod
    def wait(self, timeout: float | None) -> bool:
        """Block until a change since the last wait (or since arming), or ``timeout`` seconds.

        Returns False on timeout. Spurious wake-ups are allowed; callers re-read the state.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop watching."""

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Registry(abc.ABC):
    """Metadata of one store, opened per process (an implementation reopens itself after ``fork``)."""

    @abc.abstractmethod
    def latest_step(self) -> int | None:
        """The newest committed step, or None for an empty store."""

    @abc.abstractmethod
    def get_version(self, step: int) -> Version:
        """The version at ``step`` (tags joined). Raises VersionNotFoundError."""

    @abc.abstractmethod
    def get_manifest(self, step: int) -> Manifest:
        """The manifest of ``step``. Raises VersionNotFoundError."""

    @abc.abstractmethod
    def versions(self, after: int | None = None) -> Iterator[Version]:
        """Versions in increasing step order, only those with step > ``after`` when given."""

    @abc.abstractmethod
    def tags(self) -> dict[str, int]:
        """Every tag and the step it points at."""

    @abc.abstractmethod
    def set_tag(self, name: str, step: int) -> None:
        """Point ``name`` at ``step`` (moving it if it exists). Raises VersionNotFoundError."""

    @abc.abstractmethod
    def delete_tag(self, name: str) -> int:
        """Remove ``name``; returns the step it pointed at. Raises TagNotFoundError."""

    @abc.abstractmethod
    def locate_tensors(self, digests: list[str]) -> dict[str, TensorLocation]:
        """For the digests already stored, where their bytes lie."""

    @abc.abstractmethod
    def objects(self) -> dict[str, int]:
        """Every registered object digest and its size in bytes."""

    @abc.abstractmethod
    def publish(
        self,
        version: Version,
        manifest: Manifest,
        new_objects: dict[str, ObjectInfo],
        new_tensors: dict[str, TensorLocation],
        *,
        require_newest: bool = True,
    ) -> None:
        """Make ``version`` visible, atomically, with its manifest, tags and index entries.

        Called only after every object the manifest references is durable in the tier.
        Raises StepOrderError if ``version.step`` is not above the latest step (with
        ``require_newest``, as for a commit) or, without it, if the step already exists (a
        version restored from a remote may be older than the latest).
        """

    @abc.abstractmethod
    def set_persisted(self, step: int, remote: str) -> None:
        """Record that version ``step`` is durable in the remote at URL ``remote``.

        Raises VersionNotFoundError. The mark goes when the version is removed.
        """

    @abc.abstractmethod
    def persisted(self) -> dict[int, str]:
        """Every version known to be durable in a remote: step -> remote URL."""

    @abc.abstractmethod
    def acquire_lease(self, step: int, holder: str) -> Lease:
        """Hold version ``step`` for the calling process. Raises VersionNotFoundError if it is gone.

        The check and the lease are one transaction, so a concurrent prune either sees the lease
        or makes this call fail.
        """

    @abc.abstractmethod
    def release_lease(self, lease_id: str) -> None:
        """Release a lease (no error if it is already gone) and wake watchers."""

    @abc.abstractmethod
    def leases(self) -> list[Lease]:
        """Every live lease. Leases of dead processes are released here, with nobody's help."""

    @abc.abstractmethod
    def remove_versions(self, steps: list[int]) -> list[int]:
        """Delete these versions (with their tags) in one transaction; returns those removed.

        Never removes the latest version or a version with a live lease (checked inside the
        transaction). Objects are not touched: see :meth:`referenced_objects` and GC.
        """

    @abc.abstractmethod
    def referenced_objects(self) -> set[str]:
        """Digests of the objects any version references (the mark phase of GC)."""

    @abc.abstractmethod
    def forget_objects(self, digests: set[str]) -> None:
        """Drop object records and the tensor-index entries that point into them, atomically."""

    @abc.abstractmethod
    def watch(self, what: str = "versions") -> "Watch":
        """Start watching for changes. Arm it *before* reading the state.

        ``what``: ``"versions"`` (publish, prune, tags) or ``"leases"`` (a lease released or
        found dead; acquiring a lease wakes nobody).

        Use as ``with registry.watch() as w: while ...: read state; w.wait(timeout)``: a change
        made after ``watch()`` returned always wakes ``wait``. Must not busy-spin.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the registry's resources."""
