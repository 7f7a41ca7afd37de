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

__all__ = ["Registry", "TensorLocation", "Watch"]


class TensorLocation(NamedTuple):
    """Where a tensor's bytes already lie: object digest, absolute offset, length."""

    object: str
    offset: int
    nbytes: int


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
    """Metadata of one store. One instance per process; never shared across ``fork``."""

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
        new_objects: dict[str, int],
        new_tensors: dict[str, TensorLocation],
    ) -> None:
        """Make ``version`` visible, atomically, with its manifest, tags and index entries.

        Called only after every object the manifest references is durable in the tier.
        Raises StepOrderError if ``version.step`` is not above the latest step.
        """

    @abc.abstractmethod
    def watch(self) -> "Watch":
        """Start watching for changes (a publish or a tag). Arm it *before* reading the state.

        Use as ``with registry.watch() as w: while ...: read state; w.wait(timeout)``: a change
        made after ``watch()`` returned always wakes ``wait``. Must not busy-spin.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the registry's resources."""
