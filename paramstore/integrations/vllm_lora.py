"""LoRA adapter versions in a vLLM engine: the newest ``eta + 1`` registered through vLLM's LoRA API.

A trainer that trains a LoRA adapter commits each step as an *adapter version* on a base version
(``store.commit(step, peft_model, base=base_step)``, see :mod:`paramstore.adapters`). In the rollout
process, :class:`LoRAVersions` owns the adapters of one ``vllm.LLM`` started with
``enable_lora=True``: :meth:`~LoRAVersions.update` checks an adapter version out of the store,
writes it as a PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``) under a
working directory it owns, registers it with the engine (``llm.llm_engine.add_lora``) and returns
the ``LoRARequest`` to generate with. It keeps the newest ``eta + 1`` adapter versions registered,
so a rollout that started under step ``s`` finishes under step ``s`` while the trainer is at most
``eta`` steps ahead (TRL's ``max_staleness + 1``); older ones are removed from the engine
(``remove_lora``) and their directories deleted::

    from vllm import LLM
    from paramstore import ParamStore
    from paramstore.integrations.vllm_lora import LoRAVersions

    llm = LLM(model="/path/to/base", enable_lora=True, max_loras=2, max_lora_rank=16)
    with ParamStore("/dev/shm/run-42") as store, LoRAVersions(llm, store, eta=1, base=0) as loras:
        req = loras.update("latest")              # or a step, a tag, min_step=..., timeout=...
        outs = llm.generate(prompts, params, lora_request=req)
        ...
        req = loras.request(12)                   # the request of a step still registered
        loras.registered()                        # [12, 13]
        loras.info(13).bytes_moved                # what the checkout of step 13 moved to this host

**The base.** The engine's own weights must be the adapter's base. ``base=`` says which version of
the store they are: a step (e.g. the engine was started from ``paramstore export`` of that version),
``"engine"`` (the default: the engine's weight version, which is the step loaded when the engine's
weights come from this store through the ``"paramstore"`` weight-transfer backend, see
:mod:`paramstore.integrations.vllm`; an engine whose weight version is not a step, e.g.
``"default"`` at start-up, has an unknown base) or None (not checked). An adapter version whose
base is not the engine's is refused when the engine's base is known; when it is not, the adapter's
base step is still recorded (:meth:`LoRAVersions.info`, ``base_step``) for the caller to check.

**Bytes moved.** An adapter version holds only the adapter's tensors (the base stays where it is),
so an update moves at most the adapter's bytes to this host, and with a shared registry or a
remote only the objects this host lacks: an adapter whose tensors did not change moves nothing.
Each update records what its checkout moved (``snap.fetch``: ``bytes_moved``, ``moved``), the
adapter's size (``adapter_bytes``) and the bytes of tensors that differ from the newest adapter
registered before (``changed_bytes``). The engine then reads the adapter from the local directory
(its own copy, as vLLM's LoRA loader always does).

**Limits.** The directory is on this host: every vLLM worker must see the same file system (one
node). ``eta + 1`` must fit in the engine's adapter cache (``max_cpu_loras``, by default
``max_loras``), or vLLM itself would evict registered adapters; it is checked. Adapters are
registered in step order: a step older than the ``eta + 1`` newest is refused. Removing an
adapter a request still uses is the caller's to avoid (that is what ``eta`` is for): vLLM reloads
it from its directory, which is gone.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paramstore import ParamStore, adapters
from paramstore.errors import InvalidArgumentError

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

    from paramstore import Snapshot

__all__ = ["AdapterInfo", "LoRAVersions"]

logger = logging.getLogger(__name__)

# LoRA ids must be unique per engine; one counter per process, above the small ids callers pick.
_IDS = itertools.count(1 << 20)
_IDS_LOCK = threading.Lock()


@dataclass(frozen=True)
class AdapterInfo:
    """One adapter version as :class:`LoRAVersions` registered it.

    Attributes:
        step: the adapter version.
        request: the ``LoRARequest`` to generate with.
        path: its PEFT directory.
        base_step, base_digest: the base version the adapter applies to.
        adapter_bytes: bytes of the adapter's tensors.
        bytes_moved: bytes the checkout moved to this host (0: every object was here already).
        moved: whether the checkout moved anything.
        changed_bytes: bytes of tensors absent from, or different in, the newest adapter version
            registered before (all of ``adapter_bytes`` for the first one).
        checkout_s, write_s, register_s: seconds spent checking out, writing the directory and
            registering it with the engine.
    """

    step: int
    request: LoRARequest
    path: str
    base_step: int
    base_digest: str | None
    adapter_bytes: int
    bytes_moved: int
    moved: bool
    changed_bytes: int
    checkout_s: float
    write_s: float
    register_s: float
    digests: dict[str, str] = field(default_factory=dict, repr=False)  # tensor name -> digest

    def as_dict(self) -> dict[str, Any]:
        """The plain fields (no request, no digests), e.g. for a log line."""
        return {k: getattr(self, k) for k in ("step", "path", "base_step", "adapter_bytes", "bytes_moved",
                                              "moved", "changed_bytes", "checkout_s", "write_s", "register_s")}


class LoRAVersions:
    """The adapter versions of a store registered in one ``vllm.LLM`` (``enable_lora=True``): the
    newest ``eta + 1``. See the module docstring.

    Thread-safe: updates run one at a time, and :meth:`request`, :meth:`info` and
    :meth:`registered` answer while an update waits for its version (``min_step``).

    Args:
        llm: the engine, started with ``enable_lora=True`` and a ``max_lora_rank`` of at least
            the adapters' ``r``.
        store: a :class:`~paramstore.ParamStore`, or the root of one (opened here with
            ``create=False`` and closed by :meth:`close`).
        eta: how many steps a rollout may lag behind the newest adapter: ``eta + 1`` are kept.
        base: the version the engine's own weights are: a step, ``"engine"`` (the engine's
            weight version when it is a step; else unknown) or None (not checked).
        workdir: the directory the adapter directories are written in (created if missing;
            default: a new temporary directory, removed by :meth:`close`).
        name: prefix of the ``lora_name`` of each request (``"<name>-<step>"``); vLLM tells
            adapters apart by name, so two instances on one engine need different names.

    Raises:
        InvalidArgumentError: the engine has no LoRA support enabled, or ``eta + 1`` adapters do
            not fit in its adapter cache, or a bad argument.
    """

    def __init__(self, llm: Any, store: ParamStore | str | os.PathLike[str], *, eta: int = 0,
                 base: int | str | None = "engine", workdir: str | os.PathLike[str] | None = None,
                 name: str = "paramstore") -> None:
        if isinstance(eta, bool) or not isinstance(eta, int) or eta < 0:
            raise InvalidArgumentError(f"eta must be an int >= 0, got {eta!r}")
        if not (base is None or base == "engine" or (isinstance(base, int) and not isinstance(base, bool))):
            raise InvalidArgumentError(f"base must be a step, 'engine' or None, got {base!r}")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"name must be a non-empty string, got {name!r}")
        lora = getattr(getattr(llm.llm_engine, "vllm_config", None), "lora_config", None)
        if lora is None:
            raise InvalidArgumentError("the vLLM engine was started without LoRA: pass enable_lora=True "
                                       "(and max_lora_rank >= the adapters' r) to vllm.LLM")
        capacity = lora.max_cpu_loras or lora.max_loras
        if eta + 1 > capacity:
            raise InvalidArgumentError(f"eta={eta} keeps {eta + 1} adapters registered but the engine's adapter "
                                       f"cache holds {capacity} (max_cpu_loras); start vllm.LLM with "
                                       f"max_cpu_loras >= {eta + 1}")
        self.llm = llm
        self.eta = eta
        self.name = name
        self.max_rank = int(lora.max_lora_rank)
        self._base = base
        self._owns_store = not hasattr(store, "checkout")
        if self._owns_store:
            store = ParamStore(os.fspath(store), create=False)
        self.store = store
        if workdir is None:
            self.workdir, self._owns_workdir = tempfile.mkdtemp(prefix="paramstore-lora-"), True
        else:
            self.workdir, self._owns_workdir = os.fspath(workdir), not os.path.exists(workdir)
            os.makedirs(self.workdir, exist_ok=True)
        self._held: dict[int, AdapterInfo] = {}
        self._lock = threading.Lock()  # _held and _closed
        self._updating = threading.Lock()
        self._closed = False
        self.last: AdapterInfo | None = None
        """The adapter version of the last :meth:`update`."""

    # -- what is registered ---------------------------------------------------------------------
    def registered(self) -> list[int]:
        """The steps registered, oldest first (at most ``eta + 1``)."""
        with self._lock:
            return sorted(self._held)

    def request(self, step: int) -> LoRARequest:
        """The ``LoRARequest`` of a registered step: a rollout that started under ``step`` keeps
        generating with it. Raises KeyError if ``step`` is not registered (never, or evicted)."""
        return self.info(step).request

    def info(self, step: int) -> AdapterInfo:
        """What :meth:`update` recorded of a registered step (base, bytes moved, path...).
        Raises KeyError if ``step`` is not registered."""
        with self._lock:
            try:
                return self._held[step]
            except KeyError:
                raise KeyError(f"step {step} is not registered (registered: {sorted(self._held)})") from None

    @property
    def engine_base(self) -> int | None:
        """The step the engine's own weights are, as far as known (see ``base=``); None: unknown."""
        if self._base is None or isinstance(self._base, int):
            return self._base
        get = getattr(self.llm, "get_weight_version", None) or self.llm.llm_engine.get_weight_version
        version = get()
        return int(version) if isinstance(version, str) and version.isdigit() else None

    # -- updates ------------------------------------------------------------------------------------
    def update(self, version: int | str = "latest", *, min_step: int | None = None,
               timeout: float | None = None) -> LoRARequest:
        """Register an adapter version with the engine and return its ``LoRARequest``.

        ``version`` is a step, ``"latest"`` or a tag; or ``min_step`` (with an optional
        ``timeout`` in seconds) waits for the newest version with a step at least that. The version
        is checked out, checked (an adapter version whose base is the engine's and whose rank fits),
        written as a PEFT directory under :attr:`workdir` and added with
        ``llm.llm_engine.add_lora``; then only the newest ``eta + 1`` stay registered (older
        ones are removed from the engine and their directories deleted). A step already registered
        returns its request again.

        Raises:
            InvalidArgumentError: the version is not an adapter version, its base is not the
                engine's, its rank exceeds the engine's ``max_lora_rank``, or its step is older
                than the ``eta + 1`` newest registered. Nothing registered changes.
            VersionNotFoundError, TimeoutError...: as ``store.checkout`` raises them.
            RuntimeError: the engine refused the adapter (the adapters that fell out of the
                window were removed already; the new directory is deleted).
        """
        from vllm.lora.request import LoRARequest

        with self._updating:  # one update at a time; request() and info() are not held up meanwhile
            with self._lock:
                if self._closed:
                    raise InvalidArgumentError("this LoRAVersions is closed")
                held = dict(self._held)  # only updates (serialized here) and close() change it
            t0 = time.perf_counter()
            snap = self.store.checkout(version, min_step=min_step, timeout=timeout,
                                       holder=f"vLLM LoRA, pid {os.getpid()}")
            with snap:
                t1 = time.perf_counter()
                step = snap.step
                if step in held:
                    return held[step].request
                base_step, base_digest, config = self._check(snap)
                keep = sorted([*held, step])[-(self.eta + 1):]
                if step not in keep:
                    raise InvalidArgumentError(f"step {step} is older than the {self.eta + 1} newest adapter "
                                               f"versions registered {sorted(held)}: not registered")
                digests = {n: e.digest for n, e in snap.manifest.tensors.items()}
                sizes = {n: e.nbytes for n, e in snap.manifest.tensors.items()}
                newest = held[max(held)] if held else None
                changed = sum(n for k, n in sizes.items() if newest is None or newest.digests.get(k) != digests[k])
                path = self._write(step, snap, config)
                fetch = snap.fetch
            t2 = time.perf_counter()
            with self._lock:
                if self._closed:  # closed while this update checked out and wrote
                    shutil.rmtree(path, ignore_errors=True)
                    raise InvalidArgumentError("this LoRAVersions was closed during the update")
                for old in sorted(set(self._held) - set(keep)):  # room first: the engine's cache is eta + 1
                    self._evict(old)
                with _IDS_LOCK:
                    lora_id = next(_IDS)
                request = LoRARequest(lora_name=f"{self.name}-{step}", lora_int_id=lora_id, lora_path=path)
                try:
                    if not self.llm.llm_engine.add_lora(request):
                        raise RuntimeError(f"vLLM did not register the adapter of step {step} ({path})")
                except BaseException:
                    shutil.rmtree(path, ignore_errors=True)
                    raise
                t3 = time.perf_counter()
                info = AdapterInfo(step=step, request=request, path=path, base_step=base_step,
                                   base_digest=base_digest, adapter_bytes=sum(sizes.values()),
                                   bytes_moved=int(fetch.bytes), moved=bool(fetch.moved), changed_bytes=changed,
                                   checkout_s=t1 - t0, write_s=t2 - t1, register_s=t3 - t2, digests=digests)
                self._held[step] = self.last = info
                registered = sorted(self._held)
            logger.info("paramstore: LoRA step %d (base %d) registered as %r: %d bytes moved, %d of %d bytes "
                        "changed; registered %s", step, base_step, request.lora_name, info.bytes_moved, changed,
                        info.adapter_bytes, registered)
            return request

    def _check(self, snap: Snapshot) -> tuple[int, str | None, bytes]:
        """The base (step, digest) and config bytes of an adapter version; refuse what the engine
        cannot serve."""
        step, metadata = snap.step, snap.version.metadata or {}
        base_step = adapters.base_of(metadata)
        if base_step is None:
            raise InvalidArgumentError(f"version {step} is not an adapter version (it names no base); commit adapters "
                                       "with store.commit(step, adapter, base=version)")
        base_digest = metadata[adapters.BASE_KEY].get("digest")
        engine = self.engine_base
        if engine is not None and engine != base_step:
            raise InvalidArgumentError(f"version {step} is an adapter on base step {base_step}, but the engine's "
                                       f"weights are step {engine}: not registered")
        if engine is not None and isinstance(self._base, int) and base_digest is not None:
            try:
                held = self.store.get(engine).digest
            except Exception:  # the engine's version is no longer in the store: the step is all we know
                held = None
            if held is not None and held != base_digest:
                raise InvalidArgumentError(f"version {step} names base step {base_step} with digest {base_digest}, "
                                           f"but step {engine} of this store is {held}: not registered")
        assets = snap.assets
        config = assets.get(adapters.ADAPTER_CONFIG)
        if config is None:
            raise InvalidArgumentError(f"adapter version {step} has no {adapters.ADAPTER_CONFIG}")
        try:
            parsed = json.loads(config)
        except ValueError as e:
            raise InvalidArgumentError(f"adapter version {step}: {adapters.ADAPTER_CONFIG} is not JSON ({e})") from e
        if not isinstance(parsed, dict) or parsed.get("peft_type") != "LORA":
            raise InvalidArgumentError(f"adapter version {step} is not a LoRA adapter (peft_type "
                                       f"{parsed.get('peft_type') if isinstance(parsed, dict) else None!r})")
        rank = parsed.get("r")
        if isinstance(rank, int) and rank > self.max_rank:
            raise InvalidArgumentError(f"adapter version {step} has rank {rank}, above the engine's max_lora_rank "
                                       f"{self.max_rank}: start vllm.LLM with max_lora_rank >= {rank}")
        return base_step, base_digest, config

    def _write(self, step: int, snap: Snapshot, config: bytes) -> str:
        """Write the adapter directory (under a temporary name, then renamed: the engine never sees
        half of one); returns its path."""
        path = os.path.join(self.workdir, f"step-{step}")
        tmp = tempfile.mkdtemp(prefix=f".step-{step}-", dir=self.workdir)
        try:
            adapters.write_peft(tmp, dict(snap), config)
            if os.path.lexists(path):  # left by an instance that did not close: ours to replace
                shutil.rmtree(path)
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def _evict(self, step: int) -> None:
        """Remove a step from the engine and delete its directory (under the lock)."""
        info = self._held.pop(step)
        try:
            self.llm.llm_engine.remove_lora(info.request.lora_int_id)
        finally:
            shutil.rmtree(info.path, ignore_errors=True)
        logger.info("paramstore: LoRA step %d removed (%r)", step, info.request.lora_name)

    # -- the end ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every adapter this object registered from the engine, delete their directories
        (and the working directory if it made it), close the store if it opened it. Idempotent;
        the engine itself is left running."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            errors = []
            for step in sorted(self._held):
                try:
                    self._evict(step)
                except Exception as e:  # the engine is gone: still delete the rest
                    errors.append(e)
            if self._owns_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
            if self._owns_store:
                self.store.close()
        if errors:
            logger.warning("paramstore: %d adapters could not be removed from the engine: %s", len(errors), errors[0])

    def __enter__(self) -> LoRAVersions:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LoRAVersions(eta={self.eta}, registered={sorted(self._held)}, workdir={self.workdir!r})"
