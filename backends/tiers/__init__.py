"""Storage tiers: where object bytes live. ``LocalTier`` is the shared-memory default."""

from .base import Tier
from .local import LocalTier, Slab, SlabPool

__all__ = ["Tier", "LocalTier", "Slab", "SlabPool"]
