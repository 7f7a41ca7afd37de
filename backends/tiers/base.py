"""The tier contract: where object bytes live.

A tier stores immutable objects named by digest. The contract is small on purpose; the store
builds everything else on it. The local (shared-memory) tier adds slabs, buffers that a commit
writes into and then publishes without a second copy.
"""

from __future__ import annotations

import abc
import mmap
from typing import Iterator

__all__ = ["Tier"]


class Tier(abc.ABC):
    """Immutable objects named by digest."""

    @abc.abstractmethod
    def exists(self, digest: str) -> bool:
        """Whether object ``digest`` is fully present."""

    @abc.abstractmethod
    def size(self, digest: str) -> int:
        """Size in bytes of object ``digest``. Raises FileNotFoundError."""

    @abc.abstractmethod
    def list(self) -> Iterator[str]:
        """Digests of every object present."""

    @abc.abstractmethod
    def map(self, digest: str, *, private: bool = True) -> mmap.mmap:
        """Map object ``digest`` into memory (copy-on-write when ``private``, else read-only)."""

    @abc.abstractmethod
    def delete(self, digest: str) -> None:
        """Remove object ``digest`` (no error if absent). Only GC calls this."""

    @abc.abstractmethod
    def leftovers(self) -> list[str]:
        """Temporary files not (yet) published: in flight, or left by a crash."""
