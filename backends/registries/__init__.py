"""Registries: where versions, manifests, tags and the tensor index live.

``LmdbRegistry`` is the single-host default; ``RedisRegistry`` (``paramstore[redis]``) is shared by
several hosts. Every registry implements :class:`Registry`; :func:`open_registry` picks one by URL.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from paramstore.errors import InvalidArgumentError, ParamStoreWarning

from .base import Lease, ObjectInfo, Peer, Registry, TensorLocation, Watch
from .lmdb import LmdbRegistry

if TYPE_CHECKING:
    from .redis import RedisRegistry

__all__ = ["Registry", "TensorLocation", "Watch", "Lease", "ObjectInfo", "Peer", "LmdbRegistry", "RedisRegistry",
           "open_registry"]


def open_registry(url: str | None, meta_dir: str, namespace: str) -> Registry:
    """The registry of a store: LMDB in ``meta_dir`` when ``url`` is None, else the server at ``url``.

    Args:
        url: None, or ``redis://[:password@]host:port/db`` / ``rediss://...`` (TLS).
        meta_dir: the store's ``meta/`` directory (the LMDB environment, created if missing).
        namespace: separates stores that share one server: the store's ``name`` (``ParamStore(name=)``).

    A ``redis://`` URL without a password draws a ParamStoreWarning: whoever reaches the server
    could rewrite the store's metadata.

    Raises:
        InvalidArgumentError: an unsupported URL scheme.
        RegistryError: the server cannot be reached.

    Example:
        >>> reg = open_registry(None, root + "/meta", "run-42")  # LMDB, created in root/meta
        >>> reg.latest_step() is None, list(reg.versions())
        (True, [])
        >>> reg.close()

        With a shared registry (needs a server; not run here)::

            reg = open_registry("redis://:secret@10.0.0.5:6379/0", root + "/meta", "run-42")
    """
    if url is None:
        return LmdbRegistry(meta_dir, create=True)
    if url.startswith(("redis://", "rediss://")):
        parts = urlsplit(url)
        if not parts.password and not parse_qs(parts.query).get("password"):
            warnings.warn(f"the registry URL {url} has no password: anyone who reaches the server can rewrite this "
                          "store's metadata (use redis://:PASSWORD@host:port/db and requirepass)",
                          ParamStoreWarning, stacklevel=3)
        return _redis_registry()(url, namespace)
    scheme = url.partition("://")[0] if "://" in url else "(none)"
    raise InvalidArgumentError(f"unsupported registry URL scheme {scheme!r}: use redis://host:port/db, "
                               "rediss://... or no URL (LMDB in the store root)")


def _redis_registry() -> type[RedisRegistry]:
    try:
        from .redis import RedisRegistry
    except ImportError as e:  # redis-py is an extra
        raise InvalidArgumentError("a redis:// registry needs redis-py: pip install 'paramstore[redis]'") from e
    return RedisRegistry


def __getattr__(name: str) -> Any:
    if name == "RedisRegistry":
        return _redis_registry()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
