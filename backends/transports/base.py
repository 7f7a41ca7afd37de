"""The transport contract: one-sided reads of a peer's registered memory.

A process *registers* buffers (shared-memory objects it serves, or destinations it reads into) and
publishes its :attr:`Transport.session`; a peer then reads byte ranges of those buffers straight
into its own registered memory. Addresses are plain integers in each process's address space: the
reader learns the remote ones from the peer (an announcement in the registry), never computes them.
"""

from __future__ import annotations

import abc
import mmap
from typing import Sequence

__all__ = ["Transport", "Buffer", "Read"]

#: Memory a transport can register: a mapping or any C-contiguous buffer (writable to read into).
Buffer = mmap.mmap | memoryview

#: One read: ``(local_addr, remote_addr, nbytes)``.
Read = tuple[int, int, int]


class Transport(abc.ABC):
    """Moves bytes between processes' registered memory. One per process: not usable after fork."""

    #: How peers reach this process, e.g. ``"127.0.0.1:15012"``.
    session: str

    @abc.abstractmethod
    def register(self, buf: Buffer) -> int:
        """Register ``buf`` for transfers and return its address; idempotent per buffer.

        The transport keeps ``buf`` alive (and its mapping open) until :meth:`unregister`.
        Raises InvalidArgumentError for an empty buffer or one overlapping another registration,
        StoreClosedError once closed or after fork.
        """

    @abc.abstractmethod
    def unregister(self, addr: int) -> None:
        """Stop serving and reading into the buffer registered at ``addr`` (InvalidArgumentError
        if none is registered there)."""

    @abc.abstractmethod
    def read(self, peer: str, reads: Sequence[Read], *, timeout: float | None = None) -> None:
        """Copy each ``(local_addr, remote_addr, nbytes)`` range from ``peer`` into local memory.

        Each local range must lie in one writable registered buffer, each remote range in one
        buffer the peer registered. Returns when every byte has arrived.

        Raises:
            InvalidArgumentError: a malformed read, or a local range that is not inside one
                writable buffer registered here (checked before any byte moves).
            TransferError: anything about the peer: nobody at ``peer``, a remote range it has
                not registered, the peer dead or silent past ``timeout``. The destination ranges
                then hold garbage and must not be trusted; the transport stays usable.
            StoreClosedError: the transport is closed, or this is a forked child of its process.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine and every registration (idempotent)."""

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
