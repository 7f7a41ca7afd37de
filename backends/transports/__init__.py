"""Transports: how object bytes move between processes and hosts.

:class:`Transport` is the contract (register memory, read a peer's registered memory);
:class:`MooncakeTransport` implements it with the Mooncake transfer engine (``paramstore[mooncake]``,
imported only when a transport is created). :class:`Collective` is the contract of a process
group's transfers (broadcast, all-gather of short messages); :class:`TorchCollective` implements it
over ``torch.distributed`` (gloo, NCCL, HCCL; torch imported only when one is created).
"""

from .base import Buffer, Read, Transport
from .collective import Collective, Pending, TorchCollective
from .mooncake import MooncakeTransport

__all__ = ["Transport", "Buffer", "Read", "MooncakeTransport", "Collective", "Pending", "TorchCollective"]
