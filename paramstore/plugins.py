"""Backends found by name: Python entry points, as a third party declares them. No torch.

Two groups name the pluggable backends (remote tiers are not among them: they are fsspec URLs):

* ``paramstore.registries``: a registry per URL scheme (see :mod:`paramstore.backends.registries`);
* ``paramstore.transports``: a transport per name (see :mod:`paramstore.backends.transports`).

paramstore's own backends are declared in its ``pyproject.toml`` exactly as another distribution's
would be, so a third party adds one by declaring it in its own package metadata::

    [project.entry-points."paramstore.registries"]
    etcd = "paramstore_etcd:from_url"

When paramstore's own distribution metadata is not installed (a plain checkout on ``PYTHONPATH``,
as on the GPU machine), its declarations are read from the checkout's ``pyproject.toml`` instead,
so the built-ins are found the same way; other distributions' entry points are read from their
installed metadata either way.

Example:
    >>> from paramstore.plugins import entry_points
    >>> sorted(entry_points("paramstore.registries"))[:3]
    ['lmdb', 'redis', 'rediss']
"""

from __future__ import annotations

import functools
import importlib.metadata as metadata
import os
import re
import sys
from typing import Any

from .errors import InvalidArgumentError

__all__ = ["REGISTRIES", "TRANSPORTS", "entry_points", "load"]

#: The entry-point group of registries: name = URL scheme, value = a registry factory.
REGISTRIES = "paramstore.registries"
#: The entry-point group of transports: name = transport name, value = a transport factory.
TRANSPORTS = "paramstore.transports"

_DIST = "paramstore"
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def entry_points(group: str) -> dict[str, metadata.EntryPoint]:
    """The entry points of ``group`` by name: every installed distribution's, paramstore's own from
    its ``pyproject.toml`` when its metadata is not installed. A name two distributions declare is
    the first one found (in ``sys.path`` order). Found once per ``sys.path``."""
    return dict(_discover(group, tuple(sys.path)))


def load(group: str, name: str, what: str) -> Any:
    """The object the entry point ``name`` of ``group`` names, imported.

    ``what`` says what it is in messages (``"registry URL scheme"``, ``"transport"``).

    Raises:
        InvalidArgumentError: no such name (the message lists the installed ones), or its module
            cannot be imported (with ``pip install 'dist[extra]'`` when the entry point declares the
            extra that provides what is missing).
    """
    found = entry_points(group)
    ep = found.get(name) or found.get(name.lower())
    if ep is None:
        raise InvalidArgumentError(f"unknown {what} {name!r}: installed: {', '.join(sorted(found)) or 'none'} "
                                   f"(entry-point group {group!r}; a backend package declares its own there)")
    try:
        return ep.load()
    except ImportError as e:
        dist = ep.dist.name if getattr(ep, "dist", None) is not None else _DIST
        hint = (f": pip install '{dist}[{','.join(ep.extras)}]'" if ep.extras
                else f"; is {dist} installed with what it needs?")
        raise InvalidArgumentError(f"the {what} {name!r} ({ep.value}) cannot be imported ({e}){hint}") from e


@functools.lru_cache(maxsize=8)
def _discover(group: str, path: tuple[str, ...]) -> tuple[tuple[str, metadata.EntryPoint], ...]:
    del path  # the cache key: a changed sys.path may hold other distributions
    eps = list(metadata.entry_points(group=group))
    try:
        metadata.distribution(_DIST)
    except metadata.PackageNotFoundError:
        eps = _from_pyproject(group) + eps
    out: dict[str, metadata.EntryPoint] = {}
    for ep in eps:
        out.setdefault(ep.name.lower(), ep)
    return tuple(out.items())


def _from_pyproject(group: str) -> list[metadata.EntryPoint]:
    """paramstore's declarations of ``group`` in the checkout's ``pyproject.toml`` (none if absent)."""
    path = os.path.join(_CHECKOUT, "pyproject.toml")
    try:
        with open(path, "rb") as f:
            text = f.read().decode()
    except OSError:
        return []
    table = _toml_entry_points(text)
    return [metadata.EntryPoint(name=n, value=v, group=group) for n, v in table.get(group, {}).items()]


def _toml_entry_points(text: str) -> dict[str, dict[str, str]]:
    """``[project.entry-points.*]`` of a pyproject.toml: tomllib where there is one (Python 3.11+),
    else the subset of TOML these tables use (``name = "value"`` lines).

    Example:
        >>> _toml_entry_points('[project]\\nname = "x"\\n[project.entry-points."a.b"]\\nk = "m:f [e]"\\n')
        {'a.b': {'k': 'm:f [e]'}}
    """
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tables: dict[str, dict[str, str]] = {}
        current: dict[str, str] | None = None
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            head = re.fullmatch(r'\[project\.entry-points\."?([^"\]]+)"?\]', line)
            if head:
                current = tables.setdefault(head.group(1), {})
            elif line.startswith("["):
                current = None
            elif current is not None:
                kv = re.fullmatch(r'"?([\w.-]+)"?\s*=\s*"([^"]*)"', line)
                if kv:
                    current[kv.group(1)] = kv.group(2)
        return tables
    return dict(tomllib.loads(text).get("project", {}).get("entry-points", {}))
