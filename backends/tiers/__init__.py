"""Storage tiers: where object bytes live.

Every tier implements :class:`Tier` (``base.py``): ``LocalTier`` is the shared-memory default,
``RemoteTier`` (``paramstore[s3]``) any fsspec URL. ``testing.TierTests`` is the conformance suite a
tier's tests subclass.
"""

from typing import TYPE_CHECKING, Any

from .base import Tier, object_key
from .local import LocalTier

if TYPE_CHECKING:
    from .remote import RemoteTier

__all__ = ["Tier", "LocalTier", "RemoteTier", "object_key"]


def __getattr__(name: str) -> Any:
    if name == "RemoteTier":  # imported on use: it pulls in fsspec
        from .remote import RemoteTier

        return RemoteTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
