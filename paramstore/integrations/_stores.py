"""One store per process per ``(root, registry, name)``, shared by the integrations' engines.

Opening a :class:`paramstore.ParamStore` per sync would throw away its prepared staging buffers and
registry handle; every engine of a process (a trainer and a rollout colocated, engines built over
time, SGLang's loader called at every update) uses the one this module keeps.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

from paramstore.errors import InvalidArgumentError

__all__ = ["open_store", "close_stores"]

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
    from paramstore.store import ParamStore

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
