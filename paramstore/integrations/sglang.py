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

**Installed equals committed.** :func:`loaded_versions` (the step a worker reports as loaded) changes
only once the model's ``load_weights`` has taken every tensor of the version: a load that fails part
way leaves it at the last complete install (the model may then hold part of the new version, which
:func:`check_installed` shows). :func:`check_installed` compares what the model holds with a version,
tensor by tensor, bit for bit, through the model's own ``load_weights`` (its name mapping and the
weight loaders that fill fused parameters such as ``qkv_proj`` and ``gate_up_proj``): every parameter
is pointed, for the check, at a scratch tensor, the version is loaded into those, the parameters get
their own tensors back, and each scratch tensor (the bytes the loader placed) is compared with the
engine's. Run it in a worker, or send a check request through the same loader::

    update_weights(engine, "/dev/shm/run", check=True)   # each worker compares with the step it loaded
    update_weights(engine, "/dev/shm/run", version=7, check=True)

A check request writes none of the model's parameters and never raises for a mismatch: each worker
logs its report (a WARNING naming the tensors that differ) and keeps it in :func:`last_checks`; SGLang
returns no value from a custom loader, so the report does not reach the caller.

**Unverified against SGLang**: SGLang has no CPU build, and no GPU was available where this was
written. What is tested (``tests/integrations/test_sglang.py``): the request's encoding, and
:func:`load_weights` on a module exposing ``load_weights(iterable)`` as SGLang's models do, with a
real store and real processes, and the prefetch across two hosts' stores (a shared Redis registry
and a remote). What is not: a running SGLang engine, its serializer and its
tensor-parallel workers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from typing import Any, Iterable

import torch

from paramstore.errors import InvalidArgumentError, ParamStoreError
from paramstore.format import loads
from paramstore.integrations._compare import differs
from paramstore.integrations._prefetch import NextVersion
from paramstore.integrations._stores import request_store

__all__ = ["REQUEST_NAME", "LOADER", "request", "load_weights", "update_weights", "loaded_versions",
           "last_fetches", "check_installed", "last_checks"]

logger = logging.getLogger(__name__)

#: The name of the one tensor a request is made of.
REQUEST_NAME = "paramstore.request"
#: A request is a few hundred bytes; a larger tensor under its name is not decoded.
MAX_REQUEST_BYTES = 64 << 10
_FIELDS = {"root", "version", "min_step", "timeout", "registry", "name", "check", "recipe"}
#: The dotted path to give SGLang's ``--custom-weight-loader`` and ``load_format``.
LOADER = "paramstore.integrations.sglang.load_weights"

_loaded: dict[int, int] = {}  # id(model) -> step loaded last
_fetches: dict[int, Any] = {}  # id(model) -> the FetchReport of its last load's checkout
_sources: dict[int, tuple[str, Any, Any, Any]] = {}  # id(model) -> (root, registry, name, recipe) of its last load
_checks: dict[int, dict[str, Any]] = {}  # id(model) -> the report of its last check request
_next: dict[int, NextVersion] = {}  # id(store) -> its prefetch of the version after the one loaded
_lock = threading.RLock()  # (re-entered by _forget, a finalizer that may run inside a with-block)
_watched: set[int] = set()  # id(model) of the models whose entries above go when they are collected


def _remember(model: Any) -> int:
    """``id(model)``, the key of its entries above; with the lock held. They are dropped when the
    model is garbage-collected: another object may get its id later (it would find them)."""
    key = id(model)
    if key not in _watched:
        try:
            weakref.finalize(model, _forget, key)
        except TypeError:  # not weakly referenceable: its entries stay
            return key
        _watched.add(key)
    return key


def _forget(key: int) -> None:
    with _lock:
        for table in (_loaded, _fetches, _sources, _checks):
            table.pop(key, None)
        _watched.discard(key)


def request(root: str | os.PathLike[str], *, version: int | str | None = None, min_step: int | None = None,
            timeout: float | None = None, registry: str | None = None,
            name: str | None = None, check: bool = False, recipe: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` that ask every worker to load a version from its host's store.

    Args:
        root: the store's root on each worker's host (the same path on every host).
        version: a step, ``"latest"`` or a tag (default ``"latest"``); or
        min_step: instead, the newest version with step ≥ ``min_step``, waiting up to
            ``timeout`` seconds for one.
        registry, name: a shared registry (``redis://...``) and the store's name in it.
        check: instead of loading, compare what each worker's model holds with ``version``
            (default: the step it loaded last) with :func:`check_installed`; the report goes to
            the worker's log and :func:`last_checks`.
        recipe: load (or check) the version as this recipe derives it (:mod:`paramstore.recipes`,
            e.g. ``"fp8-block128"`` for an engine started from an FP8 export); None: as committed
            (a check then takes the form of the last load). The next version is prefetched in
            the form of the last load.

    Example:
        >>> [(n, t)] = request("/dev/shm/run", min_step=5, timeout=30)
        >>> n, t.dtype, json.loads(bytes(t.tolist()))["min_step"]
        ('paramstore.request', torch.uint8, 5)
        >>> [(n, t)] = request("/dev/shm/run", check=True)
        >>> {k: v for k, v in json.loads(bytes(t.tolist())).items() if k in ("version", "check")}
        {'version': None, 'check': True}
    """
    if version is not None and min_step is not None:
        raise InvalidArgumentError("give version= or min_step=, not both")
    if type(check) is not bool:
        raise InvalidArgumentError(f"check must be True or False, got {check!r}")
    if recipe is not None and (not isinstance(recipe, str) or not recipe):
        raise InvalidArgumentError(f"recipe must be a recipe's name, got {recipe!r}")
    if check and min_step is not None:
        raise InvalidArgumentError("a check compares with one version: give version= (or nothing: the step "
                                   "loaded), not min_step=")
    if check:
        version_field = version
    else:
        version_field = "latest" if version is None and min_step is None else version
    body = {"root": os.fspath(root), "version": version_field,
            "min_step": min_step, "timeout": timeout, "registry": registry, "name": name, "check": check,
            "recipe": recipe}
    data = json.dumps(body).encode()
    return [(REQUEST_NAME, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


def load_weights(model: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader: decode the request (:func:`request`), check the version out of
    this host's store, and load it with ``model.load_weights``; the snapshot (and its lease) is
    released as soon as the model holds the weights. Then the next version (step + 1) is prefetched
    in the background while the engine generates; the next request waits for that prefetch when it
    asks for a version it covers, so its checkout moves nothing (:func:`last_fetches`).

    :func:`loaded_versions` reports the new step only once ``model.load_weights`` has returned
    (every tensor taken); a load that raises part way leaves it at the step before.

    A check request (``request(..., check=True)``) loads nothing: it runs :func:`check_installed`
    (scratch tensors in host memory) and keeps the report in :func:`last_checks`, logged at WARNING
    when the model does not hold the version; a mismatch is not raised.

    Raises InvalidArgumentError for anything but a request, and the store's errors
    (WaitTimeoutError, VersionNotFoundError...) and the model's as they are.

    Example (``Policy`` loads as SGLang's models do: ``load_weights`` over ``(name, tensor)``)::

        >>> class Policy(torch.nn.Sequential):
        ...     def load_weights(self, weights):
        ...         for name, tensor in weights:
        ...             self.get_parameter(name).data.copy_(tensor)
        >>> with paramstore.ParamStore(root) as trainer:
        ...     trainer.commit(3, model).result().step
        3
        >>> engine_model = Policy(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> load_weights(engine_model, request(root, version=3))
        >>> loaded_versions()[id(engine_model)], torch.equal(engine_model[0].weight, model[0].weight)
        (3, True)
        >>> load_weights(engine_model, request(root, check=True))  # compares, loads nothing
        >>> last_checks()[id(engine_model)]["ok"]
        True
        >>> from paramstore.integrations._stores import close_stores; close_stores()
    """
    items = list(named_tensors)
    if len(items) != 1 or items[0][0] != REQUEST_NAME:
        raise InvalidArgumentError(f"the paramstore loader takes one {REQUEST_NAME!r} tensor made by "
                                   f"paramstore.integrations.sglang.request(), got {[n for n, _ in items][:3]}")
    body = _body(items[0][1])
    if body.get("check"):
        _check_request(model, body)
        return
    store = request_store(body["root"], body["registry"], body["name"])
    with _lock:
        nxt = _next.setdefault(id(store), NextVersion())
    if body["min_step"] is not None:
        # The newest version within the bound as soon as there is one; the prefetch's bytes if it covers it.
        version = store.wait_for(body["min_step"], timeout=body["timeout"])
        nxt.settle(version.step, body["timeout"])
        snap = store.checkout(min_step=body["min_step"], timeout=body["timeout"], recipe=body["recipe"])
    else:
        try:
            step = store.get(body["version"]).step
        except ParamStoreError:
            step = None  # the checkout raises what is wrong
        if step is not None:
            nxt.settle(step, body["timeout"])
        snap = store.checkout(body["version"], recipe=body["recipe"])
    with snap:
        model.load_weights(iter(snap.items()))
        with _lock:
            key = _remember(model)
            _loaded[key] = snap.step  # only once the model holds every tensor
            _fetches[key] = snap.fetch
            _sources[key] = (body["root"], body["registry"], body["name"], body["recipe"])
    nxt.start(store, snap.step + 1, recipe=body["recipe"])


def _check_request(model: Any, body: dict[str, Any]) -> None:
    """A check request: compare, keep the report, log it; a mismatch is not raised."""
    version = body["version"]
    if version is not None and type(version) is not int:
        version = request_store(body["root"], body["registry"], body["name"]).get(version).step
    report = check_installed(model, version, root=body["root"], registry=body["registry"], name=body["name"],
                             device="cpu", recipe=body["recipe"])
    with _lock:
        _checks[_remember(model)] = report
    if report["ok"]:
        logger.info("paramstore: the model holds step %d (%d tensors compared)", report["step"], report["tensors"])
    else:
        logger.warning("paramstore: the model does not hold step %d: %d tensors differ %s, not loaded %s",
                       report["step"], len(report["mismatched"]), sorted(report["mismatched"])[:8],
                       report["not_loaded"][:8])


def check_installed(model: Any, step: int | None = None, *, root: str | os.PathLike[str] | None = None,
                    registry: str | None = None, name: str | None = None,
                    device: str | torch.device | None = None, recipe: str | None = None) -> dict[str, Any]:
    """Compare what ``model`` holds with a version, tensor by tensor, bit for bit (in the worker).

    The version goes through the model's own ``load_weights``, as an update does (its name mapping,
    and the weight loaders that fill fused parameters such as ``qkv_proj`` and ``gate_up_proj`` or
    take a tensor-parallel shard), but into scratch tensors: every parameter is pointed at a scratch
    tensor of its shape and dtype (all bytes 0xFF) for the load, then gets its own tensor back, and
    each scratch tensor, the bytes the loader placed, is compared with the engine's. None of the
    model's parameters is written (tensors a ``load_weights`` derives outside its parameters after
    loading are, from the version, as an update would). Run it where no forward pass runs (a
    request through the loader does: SGLang runs it between batches).

    Args:
        model: the engine's model (SGLang's ``load_weights(iterable of (name, tensor))``).
        step: the version to compare with (default: the step :func:`load_weights` last loaded into it).
        root, registry, name: the store (default: the one the model's last load came from), opened
            as a request's is (``PARAMSTORE_ENGINE_ROOTS``...).
        device: where the scratch tensors live (default: each parameter's device; ``"cpu"`` spares
            the accelerator a copy of the weights, and each parameter is then read back to compare).
        recipe: the form of the version to compare with (:mod:`paramstore.recipes`; default: the
            form of the model's last load from that store, None if it loaded none).

    Returns:
        ``{"step", "ok", "tensors" (parameters compared), "mismatched" ({parameter name: what
        differs}), "not_loaded" (parameters the version does not reach)}``; ``ok`` when both are
        empty. A parameter the loader filled in part (a fused one short of a piece) is mismatched.

    Raises:
        InvalidArgumentError: the model loaded no version and no ``step`` or ``root`` is given.
        VersionNotFoundError: the version is not (or no longer) in the store; the model's own
            errors when its ``load_weights`` refuses the version.

    Example (``Policy``, a model that loads as SGLang's do, and ``engine_model`` as in :func:`load_weights`)::

        >>> with paramstore.ParamStore(root) as trainer:
        ...     trainer.commit(3, model).result().step
        3
        >>> engine_model = Policy(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> load_weights(engine_model, request(root, version=3))
        >>> check_installed(engine_model)
        {'step': 3, 'ok': True, 'tensors': 4, 'mismatched': {}, 'not_loaded': []}
        >>> with torch.no_grad():
        ...     engine_model[2].bias[0] += 1
        >>> check_installed(engine_model)["mismatched"]
        {'2.bias': '1 of 2 elements differ'}
        >>> load_weights(engine_model, request(root, version=3)); check_installed(engine_model)["ok"]
        True
        >>> from paramstore.integrations._stores import close_stores; close_stores()
    """
    with _lock:
        source, loaded = _sources.get(id(model)), _loaded.get(id(model))
    if root is None:
        if source is None:
            raise InvalidArgumentError("check_installed: this model loaded no version from a store: name one (root=...)")
        root, registry, name = source[:3]
    if recipe is None and source is not None and source[:3] == (os.fspath(root), registry, name):
        recipe = source[3]
    if step is None:
        if loaded is None:
            raise InvalidArgumentError("check_installed: this model holds no version loaded whole: pass step=")
        step = loaded
    store = request_store(os.fspath(root), registry, name)
    with store.checkout(step, holder=f"sglang check pid {os.getpid()}", recipe=recipe) as snap:
        return _compare(model, snap, device)


def _compare(model: Any, snap: Any, device: str | torch.device | None) -> dict[str, Any]:
    """Load ``snap`` through ``model.load_weights`` into scratch tensors and compare them with the
    model's (see :func:`check_installed`)."""
    params = list(model.named_parameters())  # a tied parameter once
    held = [p.data for _, p in params]
    scratch = [_unset(t, device) for t in held]
    try:
        for (_, p), t in zip(params, scratch):
            p.data = t
        with torch.no_grad():
            model.load_weights(iter(snap.items()))
    finally:  # also when the loader refuses the version midway
        for (_, p), t in zip(params, held):
            p.data = t
    mismatched: dict[str, str] = {}
    not_loaded = []
    for (key, _), have, want in zip(params, held, scratch):
        if want.numel() and _untouched(want):
            not_loaded.append(key)
            continue
        why = differs(have, want)
        if why:
            mismatched[key] = why
    return {"step": snap.step, "ok": not mismatched and not not_loaded, "tensors": len(params) - len(not_loaded),
            "mismatched": mismatched, "not_loaded": sorted(not_loaded)}


def _unset(t: torch.Tensor, device: str | torch.device | None) -> torch.Tensor:
    """A contiguous tensor of ``t``'s shape and dtype, every byte 0xFF (no loader writes that: an
    all-0xFF floating-point weight is all NaN)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device if device is None else device)
    out.reshape(-1).view(torch.uint8).fill_(0xFF)
    return out


def _untouched(t: torch.Tensor) -> bool:
    return bool((t.reshape(-1).view(torch.uint8) == 0xFF).all())


def _body(t: torch.Tensor) -> dict[str, Any]:
    """The request a loader tensor carries, every field checked (it comes from the engine's HTTP
    route: anyone who reaches it); InvalidArgumentError for anything else."""
    try:
        if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() > MAX_REQUEST_BYTES:
            raise ValueError("not a request tensor")
        body = loads(t.detach().cpu().numpy().tobytes(), dict, "the request")
        if set(body) != _FIELDS:
            raise ValueError(f"fields {sorted(body)[:8]}")
        version, min_step, timeout, check, recipe = (body["version"], body["min_step"], body["timeout"], body["check"],
                                                     body["recipe"])
        if not (version is None or isinstance(version, str) or type(version) is int) \
                or not (min_step is None or type(min_step) is int) \
                or not (timeout is None or (type(timeout) in (int, float) and timeout >= 0)) \
                or type(check) is not bool or not (recipe is None or (isinstance(recipe, str) and recipe)):
            raise ValueError("version, min_step, timeout, check or recipe of the wrong type")
        if check and min_step is not None:
            raise ValueError("a check with min_step")
    except ValueError as e:
        raise InvalidArgumentError(f"not a paramstore request ({e}): make it with "
                                   "paramstore.integrations.sglang.request()") from None
    return body


def loaded_versions() -> dict[int, int]:
    """In a worker process: ``id(model)`` -> the step :func:`load_weights` last loaded into it
    completely (a load that failed part way is not reported: the step before it stays)."""
    with _lock:
        return dict(_loaded)


def last_fetches() -> dict[int, Any]:
    """In a worker process: ``id(model)`` -> the :class:`paramstore.FetchReport` of the checkout of
    its last :func:`load_weights` (``moved`` False: the bytes were here, prefetched or local)."""
    with _lock:
        return dict(_fetches)


def last_checks() -> dict[int, dict[str, Any]]:
    """In a worker process: ``id(model)`` -> the report (:func:`check_installed`) of the last check
    request (``request(..., check=True)``) run on it."""
    with _lock:
        return dict(_checks)


def update_weights(engine: Any, root: str | os.PathLike[str], **kwargs: Any) -> Any:
    """Have a running ``sglang.Engine`` load a version from its workers' host stores: calls
    ``engine.update_weights_from_tensor`` with :func:`request`\\ ``(root, **kwargs)`` and
    ``load_format=LOADER`` (the server must list it in ``--custom-weight-loader``). Returns what
    the engine returns. With ``check=True`` the workers compare instead of loading (see
    :func:`request`)."""
    return engine.update_weights_from_tensor(named_tensors=request(root, **kwargs), load_format=LOADER)
