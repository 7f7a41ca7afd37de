"""Transports: how object bytes move between processes and hosts.

:class:`Transport` is the contract (register memory, read a peer's registered memory);
:class:`MooncakeTransport` implements it with the Mooncake transfer engine (``paramstore[mooncake]``,
imported only when a transport is created).
"""

from .base import Buffer, Read, Transport
from .mooncake import MooncakeTransport

__all__ = ["Transport", "Buffer", "Read", "MooncakeTransport"]
