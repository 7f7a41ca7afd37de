"""Transports: how object bytes move between processes and hosts.

:class:`Transport` is the contract (register memory, read a peer's registered memory);
:class:`MooncakeTransport` implements it with the Mooncake transfer engine (``paramstore[mooncake]``,
imported only when a transport is created). :class:`Collective` is the contract of a process
group's transfers (broadcast, all-gather of short messages); :class:`TorchCollective` implements it
over ``torch.distributed`` (gloo, NCCL, HCCL; torch imported only when one is created).

A store finds its transport by name with :func:`open_transport`, among the entry points of the
group ``paramstore.transports`` (see :mod:`paramstore.plugins`): the name given, else
``$PARAMSTORE_TRANSPORT``, else :data:`DEFAULT_TRANSPORT` (``mooncake``). paramstore declares its
own in its ``pyproject.toml`` exactly as a third party would::

    [project.entry-points."paramstore.transports"]
    mooncake = "paramstore.backends.transports.mooncake:MooncakeTransport"

An entry point names a **transport factory**, a callable (function or class) with this signature::

    def make(host: str) -> Transport: ...

``host`` is the address other hosts reach this process at (``ParamStore.serve(host)``, else
``$PARAMSTORE_HOST``, else ``127.0.0.1``). The factory starts its engine there and returns a
:class:`Transport` whose ``session`` peers read from; it raises TransferError when the engine
cannot start (with what to install, for a missing one). A third party's NIXL transport, for
instance, ships ``paramstore_nixl.NixlTransport(host)`` (a :class:`Transport`) and declares::

    [project.entry-points."paramstore.transports"]
    nixl = "paramstore_nixl:NixlTransport"

then ``PARAMSTORE_TRANSPORT=nixl`` makes every store in the process use it.

A name may carry the factory's keyword options as a URL query: ``mooncake?protocol=rdma&device=mlx5_0``
(Mooncake over RDMA on that NIC; see :class:`MooncakeTransport`), ``mooncake?timeout=120``. Values
that read as numbers are passed as numbers; an option the factory does not take is refused with
the ones it does.
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from paramstore.errors import InvalidArgumentError
from paramstore.plugins import TRANSPORTS, load

from .base import Buffer, Read, Transport
from .collective import Collective, Pending, TorchCollective

if TYPE_CHECKING:
    from .mooncake import MooncakeTransport

__all__ = ["Transport", "Buffer", "Read", "MooncakeTransport", "Collective", "Pending", "TorchCollective",
           "open_transport", "parse_transport", "DEFAULT_TRANSPORT"]

#: The transport used when neither a name nor ``$PARAMSTORE_TRANSPORT`` gives one.
DEFAULT_TRANSPORT = "mooncake"


def open_transport(name: str | None, host: str) -> Transport:
    """A transport listening on ``host``, made by the entry point ``name`` (None:
    ``$PARAMSTORE_TRANSPORT``, else :data:`DEFAULT_TRANSPORT`).

    Raises:
        InvalidArgumentError: no installed transport has that name (the message lists those that
            are), or its module cannot be imported.
        TransferError: the engine cannot start.

    Example:
        >>> open_transport("nixl", "127.0.0.1")
        Traceback (most recent call last):
        ...
        paramstore.errors.InvalidArgumentError: unknown transport 'nixl': installed: mooncake ...
    """
    spec = name or os.environ.get("PARAMSTORE_TRANSPORT", "").strip() or DEFAULT_TRANSPORT
    name, options = parse_transport(spec)
    factory = load(TRANSPORTS, name, "transport")
    try:
        inspect.signature(factory).bind(host, **options)
    except TypeError as e:
        raise InvalidArgumentError(f"transport {spec!r}: {e}; {name}'s factory takes "
                                   f"{_keywords(factory) or 'no options'}") from None
    except ValueError:  # no signature to check (a builtin): the call says what is wrong
        pass
    return factory(host, **options)


def parse_transport(spec: str) -> tuple[str, dict[str, Any]]:
    """``(name, options)`` of a transport spec ``name[?key=value&...]``; numbers become numbers.

    Example:
        >>> parse_transport("mooncake?protocol=rdma&device=mlx5_0&timeout=120")
        ('mooncake', {'protocol': 'rdma', 'device': 'mlx5_0', 'timeout': 120})
        >>> parse_transport("mooncake")
        ('mooncake', {})
    """
    name, _, query = spec.partition("?")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise InvalidArgumentError(f"transport {spec!r}: options go as ?key=value&key=value") from None
    options: dict[str, Any] = {}
    for key, value in pairs:
        if not key.isidentifier() or key in options:
            raise InvalidArgumentError(f"transport {spec!r}: bad or repeated option {key!r}")
        options[key] = _number(value)
    return name.strip(), options


def _number(value: str) -> Any:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _keywords(factory: Any) -> str:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return ""
    return ", ".join(p.name for p in params if p.kind is p.KEYWORD_ONLY)


def __getattr__(name: str) -> Any:
    """The shipped transport, imported when named (the core finds it through its entry point)."""
    if name == "MooncakeTransport":
        from .mooncake import MooncakeTransport

        return MooncakeTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
