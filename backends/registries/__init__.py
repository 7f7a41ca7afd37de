"""Registries: where versions, manifests, tags and the tensor index live.

``LmdbRegistry`` is the single-host default. Every registry implements :class:`Registry`.
"""

from .base import Lease, ObjectInfo, Registry, TensorLocation, Watch
from .lmdb import LmdbRegistry

__all__ = ["Registry", "TensorLocation", "Watch", "Lease", "ObjectInfo", "LmdbRegistry"]
