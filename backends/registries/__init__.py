"""Registries: where versions, manifests, tags and the tensor index live.

Every registry implements :class:`Registry`. :func:`open_registry` finds one by the scheme of its
URL among the entry points of the group ``paramstore.registries`` (see :mod:`paramstore.plugins`);
with no URL it opens ``lmdb``, the store root's own registry. paramstore declares its own in its
``pyproject.toml`` exactly as a third party would::

    [project.entry-points."paramstore.registries"]
    lmdb = "paramstore.backends.registries.lmdb:from_url"              # LmdbRegistry, one host
    redis = "paramstore.backends.registries.redis:from_url [redis]"    # RedisRegistry, shared
    rediss = "paramstore.backends.registries.redis:from_url [redis]"   # ... over TLS

An entry point names a **registry factory**, a callable (function or class) with this signature::

    def from_url(url: str | None, meta_dir: str, namespace: str, *, create: bool = True,
                 mode: int = 0o600) -> Registry: ...

* ``url``: the URL as the user gave it (its scheme is the entry point's name); None only for
  ``lmdb``, the registry used when no URL is given;
* ``meta_dir``: the store root's ``meta/`` directory, for a registry that keeps files on this host;
* ``namespace``: the store's name (``ParamStore(name=)``), which separates stores sharing a server;
* ``create``: make the registry's files if missing (false when a store is reopened);
* ``mode``: permission bits of the files it makes (``0o660`` for a group store).

A factory ignores the arguments it does not need, raises the package's errors (InvalidArgumentError
for a bad URL, RegistryError for a server it cannot reach) and returns a :class:`Registry` whose
``shared`` flag says whether several hosts share it. The ``[extra]`` after an entry point's value
names the extra that provides what its module imports: when that import fails, the message says
``pip install 'dist[extra]'``.

A third party's etcd registry, for instance, ships a package ``paramstore_etcd`` with a
``Registry`` subclass (``shared = True``; it passes the registry contract's tests) and a
``from_url(url, meta_dir, namespace, *, create=True, mode=0o600)`` that connects to ``url``, and
declares it in its own ``pyproject.toml``::

    [project.entry-points."paramstore.registries"]
    etcd = "paramstore_etcd:from_url"

Once it is installed, ``ParamStore(root, registry="etcd://10.0.0.5:2379", name="run-42")`` uses it;
nothing in paramstore changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from paramstore.errors import InvalidArgumentError
from paramstore.plugins import REGISTRIES, entry_points, load

from .base import Lease, ObjectInfo, Peer, Registry, TensorLocation, Watch

if TYPE_CHECKING:
    from .lmdb import LmdbRegistry
    from .redis import RedisRegistry

__all__ = ["Registry", "TensorLocation", "Watch", "Lease", "ObjectInfo", "Peer", "LmdbRegistry", "RedisRegistry",
           "open_registry", "find_registry", "DEFAULT_REGISTRY"]

#: The entry point used when a store is opened with no registry URL: the root's own LMDB registry.
DEFAULT_REGISTRY = "lmdb"


def open_registry(url: str | None, meta_dir: str, namespace: str, *, create: bool = True,
                  mode: int = 0o600) -> Registry:
    """The registry of a store: :data:`DEFAULT_REGISTRY` (LMDB in ``meta_dir``) when ``url`` is None,
    else the one the entry point named by the URL's scheme makes.

    Args:
        url: None, or a URL whose scheme names an installed registry: ``redis://[:password@]host:port/db``,
            ``rediss://...`` (TLS), or a third party's.
        meta_dir: the store's ``meta/`` directory (the LMDB environment, created if missing).
        namespace: separates stores that share one server: the store's ``name`` (``ParamStore(name=)``).
        create, mode: passed to the factory (see the module's doc).

    A ``redis://`` URL without a password draws a ParamStoreWarning: whoever reaches the server
    could rewrite the store's metadata.

    Raises:
        InvalidArgumentError: a URL scheme no installed registry declares (the message lists those
            that are), or one whose module cannot be imported (with the ``pip install`` that fixes it).
        RegistryError: the server cannot be reached.

    Example:
        >>> reg = open_registry(None, root + "/meta", "run-42")  # LMDB, created in root/meta
        >>> reg.latest_step() is None, list(reg.versions()), reg.shared
        (True, [], False)
        >>> reg.close()
        >>> open_registry("etcd://10.0.0.5:2379", root + "/meta", "run-42")
        Traceback (most recent call last):
        ...
        paramstore.errors.InvalidArgumentError: unknown registry URL scheme 'etcd': installed: lmdb, redis, rediss ...

        With a shared registry (needs a server; not run here)::

            reg = open_registry("redis://:secret@10.0.0.5:6379/0", root + "/meta", "run-42")
    """
    return find_registry(url)(url, meta_dir, namespace, create=create, mode=mode)


def find_registry(url: str | None) -> Callable[..., Registry]:
    """The registry factory for ``url`` (see the module's doc), imported; :func:`open_registry`
    calls it. Raises InvalidArgumentError as :func:`open_registry` does, before anything is opened."""
    if url is None:
        return load(REGISTRIES, DEFAULT_REGISTRY, "registry")
    scheme, sep, _ = url.partition("://") if isinstance(url, str) else ("", "", "")
    if not sep or not scheme:
        raise InvalidArgumentError(f"a registry URL is SCHEME://..., such as redis://host:port/db; got {url!r} "
                                   f"(installed schemes: {', '.join(sorted(entry_points(REGISTRIES)))})")
    return load(REGISTRIES, scheme, "registry URL scheme")


def __getattr__(name: str) -> Any:
    """The shipped registries, imported when named (redis-py is an extra; LMDB is imported only by
    whoever uses it)."""
    if name == "LmdbRegistry":
        from .lmdb import LmdbRegistry

        return LmdbRegistry
    if name == "RedisRegistry":
        try:
            from .redis import RedisRegistry
        except ImportError as e:  # redis-py is an extra
            raise InvalidArgumentError("a redis:// registry needs redis-py: pip install 'paramstore[redis]'") from e
        return RedisRegistry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
