"""SGLang: load a version into a running SGLang engine from each worker's host store.

SGLang's ``update_weights_from_tensor(named_tensors, load_format=...)`` hands ``named_tensors`` to
every tensor-parallel worker and, when ``load_format`` is a dotted path listed in the server's
``--custom-weight-loader``, calls ``loader(model, named_tensors)`` there. paramstore uses that hook
to send a *request* instead of the weights: one small tensor naming the store and the version. Each
worker's :func:`load_weights` checks that version out of its own host's store (zero-copy shared
memory; fetched from peers first with a shared registry) and feeds it to the model's own
``load_weights``, which shards it for tensor parallelism as it does a checkpoint. No weight crosses
SGLang's serializer, and only what the host lacks crosses the network.

Once a worker has loaded step ``s`` it prefetches the next version (``>= s + 1``) in the background,
while the engine generates (:meth:`paramstore.ParamStore.prefetch`: from peers or the remote, with a
shared registry); the next request for a version the prefetch covers waits for it, so the update
pauses the engine only to install (the checkout moves nothing: :func:`last_fetches`). A request with
``min_step`` still takes the newest version within the bound present when it arrives, without
waiting for a newer one. On one host every object is already in the store and there is nothing to
prefetch.

Set-up (the server and the trainer; nothing else changes)::

    python -m sglang.launch_server --model-path MODEL_DIR \\
        --custom-weight-loader paramstore.integrations.sglang.load_weights

    from paramstore.integrations.sglang import update_weights
    update_weights(engine, "/dev/shm/run", version=7)        # an sglang.Engine, in-process
    update_weights(engine, "/dev/shm/run", min_step=t - eta)  # the newest version within the bound

(With the HTTP server, post :func:`request`'s ``named_tensors`` to ``/update_weights_from_tensor``
with SGLang's own serializer, as its docs show for tensors.)

**Unverified against SGLang**: SGLang has no CPU build, and no GPU was available where this was
written. What is tested (``tests/integrations/test_sglang.py``): the request's encoding, and
:func:`load_weights` on a module exposing ``load_weights(iterable)`` as SGLang's models do, with a
real store and real processes, and the prefetch across two hosts' stores (a shared Redis registry
and a remote). What is not: a running SGLang engine, its serializer and its
tensor-parallel workers.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Iterable

import torch

from paramstore.errors import InvalidArgumentError, ParamStoreError
from paramstore.format import loads
from paramstore.integrations._prefetch import NextVersion
from paramstore.integrations._stores import request_store

__all__ = ["REQUEST_NAME", "LOADER", "request", "load_weights", "update_weights", "loaded_versions",
           "last_fetches"]

#: The name of the one tensor a request is made of.
REQUEST_NAME = "paramstore.request"
#: A request is a few hundred bytes; a larger tensor under its name is not decoded.
MAX_REQUEST_BYTES = 64 << 10
_FIELDS = {"root", "version", "min_step", "timeout", "registry", "name"}
#: The dotted path to give SGLang's ``--custom-weight-loader`` and ``load_format``.
LOADER = "paramstore.integrations.sglang.load_weights"

_loaded: dict[int, int] = {}  # id(model) -> step loaded last
_fetches: dict[int, Any] = {}  # id(model) -> the FetchReport of its last load's checkout
_next: dict[int, NextVersion] = {}  # id(store) -> its prefetch of the version after the one loaded
_lock = threading.Lock()


def request(root: str | os.PathLike[str], *, version: int | str | None = None, min_step: int | None = None,
            timeout: float | None = None, registry: str | None = None,
            name: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` that ask every worker to load a version from its host's store.

    Args:
        root: the store's root on each worker's host (the same path on every host).
        version: a step, ``"latest"`` or a tag (default ``"latest"``); or
        min_step: instead, the newest version with step ≥ ``min_step``, waiting up to
            ``timeout`` seconds for one.
        registry, name: a shared registry (``redis://...``) and the store's name in it.

    Example:
        >>> [(n, t)] = request("/dev/shm/run", min_step=5, timeout=30)
        >>> n, t.dtype, json.loads(bytes(t.tolist()))["min_step"]
        ('paramstore.request', torch.uint8, 5)
    """
    if version is not None and min_step is not None:
        raise InvalidArgumentError("give version= or min_step=, not both")
    body = {"root": os.fspath(root), "version": "latest" if version is None and min_step is None else version,
            "min_step": min_step, "timeout": timeout, "registry": registry, "name": name}
    data = json.dumps(body).encode()
    return [(REQUEST_NAME, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


def load_weights(model: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader: decode the request (:func:`request`), check the version out of
    this host's store, and load it with ``model.load_weights``; the snapshot (and its lease) is
    released as soon as the model holds the weights. Then the next version (step + 1) is prefetched
    in the background while the engine generates; the next request waits for that prefetch when it
    asks for a version it covers, so its checkout moves nothing (:func:`last_fetches`). Raises
    InvalidArgumentError for anything but a request, and the store's errors (WaitTimeoutError,
    VersionNotFoundError...) as they are."""
    items = list(named_tensors)
    if len(items) != 1 or items[0][0] != REQUEST_NAME:
        raise InvalidArgumentError(f"the paramstore loader takes one {REQUEST_NAME!r} tensor made by "
                                   f"paramstore.integrations.sglang.request(), got {[n for n, _ in items][:3]}")
    body = _body(items[0][1])
    store = request_store(body["root"], body["registry"], body["name"])
    with _lock:
        nxt = _next.setdefault(id(store), NextVersion())
    if body["min_step"] is not None:
        # The newest version within the bound as soon as there is one; the prefetch's bytes if it covers it.
        version = store.wait_for(body["min_step"], timeout=body["timeout"])
        nxt.settle(version.step, body["timeout"])
        snap = store.checkout(min_step=body["min_step"], timeout=body["timeout"])
    else:
        try:
            step = store.get(body["version"]).step
        except ParamStoreError:
            step = None  # the checkout raises what is wrong
        if step is not None:
            nxt.settle(step, body["timeout"])
        snap = store.checkout(body["version"])
    with snap:
        model.load_weights(iter(snap.items()))
        with _lock:
            _loaded[id(model)] = snap.step  # only once the model holds every tensor
            _fetches[id(model)] = snap.fetch
    nxt.start(store, snap.step + 1)


def _body(t: torch.Tensor) -> dict[str, Any]:
    """The request a loader tensor carries, every field checked (it comes from the engine's HTTP
    route: anyone who reaches it); InvalidArgumentError for anything else."""
    try:
        if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() > MAX_REQUEST_BYTES:
            raise ValueError("not a request tensor")
        body = loads(t.detach().cpu().numpy().tobytes(), dict, "the request")
        if set(body) != _FIELDS:
            raise ValueError(f"fields {sorted(body)[:8]}")
        version, min_step, timeout = body["version"], body["min_step"], body["timeout"]
        if not (version is None or isinstance(version, str) or type(version) is int) \
                or not (min_step is None or type(min_step) is int) \
                or not (timeout is None or (type(timeout) in (int, float) and timeout >= 0)):
            raise ValueError("version, min_step or timeout of the wrong type")
    except ValueError as e:
        raise InvalidArgumentError(f"not a paramstore request ({e}): make it with "
                                   "paramstore.integrations.sglang.request()") from None
    return body


def loaded_versions() -> dict[int, int]:
    """In a worker process: ``id(model)`` -> the step :func:`load_weights` last loaded into it."""
    with _lock:
        return dict(_loaded)


def last_fetches() -> dict[int, Any]:
    """In a worker process: ``id(model)`` -> the :class:`paramstore.FetchReport` of the checkout of
    its last :func:`load_weights` (``moved`` False: the bytes were here, prefetched or local)."""
    with _lock:
        return dict(_fetches)


def update_weights(engine: Any, root: str | os.PathLike[str], **kwargs: Any) -> Any:
    """Have a running ``sglang.Engine`` load a version from its workers' host stores: calls
    ``engine.update_weights_from_tensor`` with :func:`request`\\ ``(root, **kwargs)`` and
    ``load_format=LOADER`` (the server must list it in ``--custom-weight-loader``). Returns what
    the engine returns."""
    return engine.update_weights_from_tensor(named_tensors=request(root, **kwargs), load_format=LOADER)
