"""One store per process per ``(root, registry, name)``, shared by the integrations' engines, and
what an inference engine lets a weight-update request open.

Opening a :class:`paramstore.ParamStore` per sync would throw away its prepared staging buffers and
registry handle; every engine of a process (a trainer and a rollout colocated, engines built over
time, SGLang's loader called at every update) uses the one this module keeps.

**Requests choose nothing the engine did not allow.** vLLM's ``init_info`` and an SGLang loader
request arrive through the engine's HTTP routes, from whoever can reach them. So the store they
name is checked against the engine's own environment (:func:`request_store`):

- ``PARAMSTORE_ENGINE_ROOTS``: directories (``os.pathsep``-separated) under which a request's root
  may lie; a root there may be created as the host's cache of a shared-registry store. Unset: any
  root, read as a reader reads (waiting for a store to appear, never creating one; the cache root
  of a shared registry must exist already).
- ``PARAMSTORE_ENGINE_REGISTRIES``: the registry URLs (comma-separated) a request may name. Unset:
  none, so a request can never make the engine connect anywhere.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

from paramstore.errors import InvalidArgumentError
from paramstore.store import ParamStore

__all__ = ["open_store", "close_stores", "request_store", "ROOTS_ENV", "REGISTRIES_ENV"]

#: See the module docstring.
ROOTS_ENV = "PARAMSTORE_ENGINE_ROOTS"
REGISTRIES_ENV = "PARAMSTORE_ENGINE_REGISTRIES"

_stores: dict[tuple[Any, ...], tuple[Any, dict[str, Any]]] = {}
_stores_lock = threading.Lock()


def open_store(root: str, registry: str | None = None, name: str | None = None, **options: Any) -> Any:
    """The process's :class:`paramstore.ParamStore` for ``(root, registry, name)``, opened on first use.

    Every engine of a process (a trainer and a rollout colocated in one process, or several engines
    built over time) shares one store object, so its staging buffers and registry handle are made
    once. ``options`` are ``ParamStore`` keyword arguments; a second caller must pass the same ones.
    The store is closed at exit, or by :func:`close_stores`.

    Raises:
        InvalidArgumentError: the store is already open in this process with other options.
    """
    key = (os.getpid(), os.path.abspath(os.fspath(root)), registry, name or None)
    with _stores_lock:
        found = _stores.get(key)
        if found is not None:
            store, had = found
            if had != options:
                raise InvalidArgumentError(
                    f"paramstore store {root} is already open in this process with options {had!r}; "
                    f"another engine asked for {options!r}: give every engine of the store the same engine_kwargs")
            return store
        store = ParamStore(root, registry=registry, name=name, **options)
        _stores[key] = (store, dict(options))
        return store


def request_store(root: Any, registry: Any = None, name: Any = None, *, shared: bool = True) -> Any:
    """The store a weight-update request names, once the engine's environment allows it (see the
    module docstring); ``shared``: the process's one store (:func:`open_store`), else a new one the
    caller closes.

    Raises:
        InvalidArgumentError: a root or registry the engine does not allow (the message names the
            variable to set), or values of the wrong types.
        NotAStoreError: a shared registry's cache root that is missing outside the listed directories.
    """
    if not isinstance(root, str) or not root or "\0" in root \
            or not all(v is None or isinstance(v, str) for v in (registry, name)):
        raise InvalidArgumentError(f"a paramstore request names its store by root (a path) and optionally registry "
                                   f"and name (strings), got root={root!r}, registry={registry!r}, name={name!r}")
    real = os.path.realpath(root)
    allowed = [os.path.realpath(d) for d in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if d]
    listed = any(real == d or real.startswith(d.rstrip(os.sep) + os.sep) for d in allowed)
    if allowed and not listed:
        raise InvalidArgumentError(f"paramstore: this engine opens stores only under {ROOTS_ENV}="
                                   f"{os.pathsep.join(allowed)}, not {root}")
    if registry is not None and registry not in [r.strip() for r in os.environ.get(REGISTRIES_ENV, "").split(",")]:
        raise InvalidArgumentError(f"paramstore: this engine does not use the registry the request names; list it "
                                   f"in the engine's environment: {REGISTRIES_ENV}=redis://...")
    # A reader never creates a store; a shared registry's cache root is made only under a listed directory.
    create = None if registry is None or listed else False
    if shared:
        return open_store(root, registry, name, create=create)
    return ParamStore(root, registry=registry, name=name, create=create)


def close_stores() -> None:
    """Close every store this process opened through an integration (their in-flight commits finish
    first). Registered with :mod:`atexit`; the next use opens them again."""
    with _stores_lock:
        mine = [(k, s) for k, (s, _) in _stores.items() if k[0] == os.getpid()]
        for k, _ in mine:
            del _stores[k]
    for _, store in mine:
        store.close()


atexit.register(close_stores)
