"""A verl checkpoint-engine backend named ``"paramstore"``: trainer → rollout weight sync through a store.

The trainer's master rank commits the weights verl hands it as one version per step (a streaming
commit: each full tensor is copied into shared memory as it is gathered, then dropped); every
rollout worker checks out the newest version no older than ``global_steps - eta`` and hands its
tensors, zero-copy views of the same shared memory, to the inference server. There is no process
group between trainer and rollouts: the store is the rendezvous, so rollouts may come and go and
a rollout may lag the trainer by up to ``eta`` steps.

Enable it in a verl config (``actor_rollout_ref.rollout.checkpoint_engine`` is verl's
:class:`verl.workers.config.CheckpointEngineConfig`; ``custom_backend_module`` is imported on every
worker before the backend is built, which registers it)::

    actor_rollout_ref:
      rollout:
        checkpoint_engine:
          backend: paramstore
          custom_backend_module: paramstore.integrations.verl
          engine_kwargs:
            paramstore:
              root: /dev/shm/run-42        # the store (a tmpfs directory), the same on every worker
              eta: 0                       # staleness bound: rollouts at step t accept versions >= t - eta
              timeout: 600                 # seconds a rollout waits for that version
              # registry: redis://:pw@10.0.0.2:6379/0   # several hosts: a shared registry...
              # name: run-42                            # ...and the store's name there
              # keep_last: 1               # versions retention keeps (None: keep every one)
              # dtype: bfloat16            # store floating-point weights in this dtype
              # prefetch: true             # fetch the next version while the rollout generates
              # follow: false              # install as the trainer stages (one host; see below)
              # recipe: fp8-block128       # rollouts receive each version in this form (FP8 servers)
              # derive: [fp8-block128]     # ...which the trainer makes as it commits (a ParamStore option)

or on the command line::

    python -m verl.trainer.main_ppo ... \\
        actor_rollout_ref.rollout.checkpoint_engine.backend=paramstore \\
        actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=paramstore.integrations.verl \\
        +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.paramstore.root=/dev/shm/run-42

(``engine_kwargs`` is empty by default, hence the ``+`` that adds a key to it.) verl's default,
``backend: naive``, hands the weights over inside one process (trainer and rollout colocated) and
runs no checkpoint engine; a backend such as this one serves the trainers whose rollouts run in
other processes (``trainer/ppo/v1/trainer_separate_async.py``, ``experimental/separation``, ...):
there ``CheckpointEngineManager.update_weights(global_steps)`` runs ``send_weights`` on every trainer
rank and ``receive_weights`` on every rollout worker, then ``finalize`` on all.

**Arguments** (:class:`ParamStoreCheckpointEngine`): verl passes ``bucket_size`` (unused: nothing is
bucketed, each tensor goes to shared memory whole) and, on trainer ranks, ``is_master`` (rank 0);
the rest are ``engine_kwargs.paramstore``: ``root`` (required), ``registry``, ``name``, ``eta``,
``timeout``, ``keep_last``, ``dtype``, ``prefetch``, ``follow``, ``recipe``, and any other keyword argument of
:class:`paramstore.ParamStore` (``shard_size_bytes``, ``remote``, ``storage_options``, ``run_id``,
...), passed on to it. An unknown key is refused at once with the list of accepted ones.

**Decisions.**

- *Only the master rank commits* (it is the store's writer); the other trainer ranks drain the
  weights generator in order, because each ``next()`` is a collective gather across the trainer
  ranks. ``commit(..., group=)`` (every rank drains, the first stores, a failure raises on every rank)
  is not used: verl's ``CheckpointEngineManager`` already collects every trainer rank's result with
  ``ray.get``, so a failed commit on the master fails the sync on the controller anyway; and
  ``group=`` would need a store opened on every trainer rank plus a gloo group of their own, and
  with the single-host registry it fails outright when the trainer spans hosts (the ranks would
  write to different stores), while master-only works whenever the rollouts share the master's
  host or a ``registry``. The master drains whatever its commit left unread even when the commit
  fails, so the other ranks' gathers always complete.
- *The asyncio loop.* The streaming commit pulls the generator on the loop's thread, as verl's own
  NCCL backend does (its ``split_weight_chunks`` iterates the same synchronous generator there): the
  generator runs the training engine's collectives and device copies, which belong on the thread
  that owns the device. Waiting for the version to be published (hash, dedup, rename, registry
  transaction, on paramstore's threads) is awaited without blocking the loop, as is the rollout's
  wait for a version (the checkout runs on a worker thread).
- *Re-sending a committed step* (verl re-sends ``global_steps`` after resuming from a checkpoint)
  is a no-op: the generator is drained, nothing is written, and the metrics say so
  (``paramstore/written`` 0). The weights are not compared with the stored ones. Sending a step below
  the store's latest that it does not hold raises StepOrderError (the store holds a newer run's
  versions: use a fresh root).
- *Staleness.* With ``eta >= 1`` a rollout does not wait for the step being sent when a version
  within the bound is already there: in a ``CheckpointEngineManager`` sync, where trainer and
  rollouts run at the same time, it takes the newest version present at that moment (possibly the
  previous step) and returns at once. ``eta=0`` waits for the step itself (up to ``timeout``).
- ``global_steps=None``: the trainer commits the store's latest step + 1 (0 for an empty store);
  a rollout takes the newest version there is (waiting up to ``timeout`` for one).
- *The install overlaps the commit (one host; ``follow: true``).* In a ``CheckpointEngineManager``
  sync the send and the receive start together. With ``follow``, when no version within the bound
  is there yet (``eta`` 0) and the store is this host's (no ``registry``), ``receive_weights``
  follows the trainer's commit of ``global_steps``
  (:meth:`paramstore.ParamStore.follow_commit`): it hands each tensor to the server as soon as the
  trainer has copied it into shared memory, so the server's copies run alongside the trainer's, and
  it ends only once the version is published (the rest of it, if any, from the published version).
  Those bytes never leave the trainer's host and are the very bytes the version's digests cover.
  If the commit fails part-way, the receive hands the tensors it already gave back as they are in
  the installed version, then raises: the engine holds its previous version again, bit for bit
  (with no version installed before, what it got stays, and the error says so). Off by default:
  the overlap pays only where one copy does not use the host's whole memory bandwidth. On the
  2-core VM of docs/benchmarks.md two concurrent 1 GiB copies take 0.124 s each against 0.058 s for
  one alone, so the trainer's staging doubled under the rollout's copies (0.17–0.22 s against
  0.10 s) and the pause was not shorter (0.27–0.51 s, median of 7 runs 0.42 s, against 0.32–0.51 s
  for the published-version path: the verl-manager block's prose). On a host with bandwidth to
  spare the rollout's copies would hide behind the trainer's (not measured). Without it the
  rollout waits for the published version, then copies.
- *Prefetch: the pause is the install.* As soon as a rollout has handed over every tensor of step
  ``s``, it prefetches the next version (:meth:`paramstore.ParamStore.prefetch`): a background
  thread waits for the first version with step ``>= s + 1`` and brings its objects to this host
  (from patches, peers or the remote, verified) while the server generates. The next
  ``receive_weights`` first finds the version the staleness bound allows (as before: with ``eta >=
  1`` the newest one present, without waiting for the prefetch's), waits for the prefetch only when
  that prefetch covers it, then checks out: the checkout maps bytes already here and moves nothing
  (:attr:`~ParamStoreCheckpointEngine.last_fetch` ``.moved`` False). A failed prefetch only means the
  checkout fetches itself. On one host (trainer and rollouts share the store's root) every object is
  already here and the prefetch has nothing to do; it matters with a shared registry across hosts.
  ``prefetch: false`` turns it off.
- *Installed equals committed.* :attr:`~ParamStoreCheckpointEngine.installed_step` (the version
  reported as installed) changes only once a receive has handed over every tensor; an install
  stopped part-way leaves it as it was. :meth:`~ParamStoreCheckpointEngine.check_installed` compares
  what the inference engine holds, through the loader's name mapping (renamed and fused tensors
  included), with that version bit for bit and names what differs.
- *Leases.* A rollout holds its snapshot (a lease: the version cannot be pruned) from
  ``receive_weights`` until ``finalize()`` or its next ``receive_weights``/``get_weights``; tensors
  already handed over stay valid after that (they keep their mapping).
- *Stores* are opened lazily, one per process per ``(root, registry, name)``, shared by every engine
  of the process, and closed at exit (or by :func:`close_stores`): reopening per sync would throw
  away the pre-faulted and recycled staging buffers that make commits run at memory speed.
- *Retention*: ``keep_last`` (default 1) versions besides the ones rollouts hold; ``keep_last:
  null`` keeps every version (shared memory then grows by a model size per step of changed
  weights).
- *Devices.* The trainer's tensors may be on a GPU (verl's FSDP engine gathers them there): the
  commit copies each into pinned shared memory on a side stream. The rollout's tensors are CPU views
  of shared memory; the server adapter moves them to its device (as it does with the other
  backends' received buckets).
- *The trainer is held for the copy only.* ``send_weights`` returns once every tensor is staged
  (copied into shared memory); hashing, deduplication and the publish run on paramstore's threads
  meanwhile. The next call on the master (its ``finalize`` at the end of the sync, or the next
  ``send_weights``) waits for that publish and raises its error, noting the step; a failed publish
  published nothing, and the rollouts following it restore what they had installed.
- *Metrics* (the master's dict from ``send_weights``, merged into the trainer's by verl; other
  ranks return ``{}`` so as not to overwrite it). Of this call: ``paramstore/step``,
  ``paramstore/written`` (1, or 0 for a re-send), ``paramstore/tensors``, ``paramstore/send_s`` (the
  whole call: the time the trainer was held). Of the version the previous call committed, published
  since (absent on the first call): ``paramstore/published_step``, ``paramstore/bytes`` (its logical
  size), ``paramstore/new_bytes``, ``paramstore/publish_s`` (from its send's return to the version
  visible). ``new_bytes`` is the tensor bytes that lie in
  objects no version before this commit references: what the commit stored after deduplication. It
  is exact except when a tensor matches one of a version pruned but not yet garbage-collected (its
  bytes are then counted as new though the object is reused; retention runs prune and GC together,
  so the window is short).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time
import warnings
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
try:
    from verl.checkpoint_engine.base import (
        CheckpointEngineRegistry,
        CheckpointEngineWithCache,
    )
except ImportError as e:  # an optional extra: say how to get it
    raise ImportError(f"paramstore.integrations.verl needs verl>=0.9.1: pip install 'paramstore[verl]' ({e})",
                      name=e.name) from e

from paramstore.derived import resolve_recipe
from paramstore.errors import (
    InvalidArgumentError,
    NotAStoreError,
    StepOrderError,
    VersionNotFoundError,
    WaitTimeoutError,
)
from paramstore.following import FollowedCommit
from paramstore.integrations._compare import differs
from paramstore.integrations._prefetch import NextVersion
from paramstore.integrations._stores import close_stores, open_store
from paramstore.options import StoreOptions
from paramstore.retention import KeepLast
from paramstore.store import ParamStore

__all__ = ["BACKEND", "ParamStoreCheckpointEngine", "close_stores", "open_store"]

#: The name verl's config uses for this backend (``checkpoint_engine.backend``).
BACKEND = "paramstore"
#: Default seconds a rollout waits for the version it needs.
DEFAULT_TIMEOUT_S = 600.0
#: Default number of versions retention keeps (besides those rollouts hold).
DEFAULT_KEEP_LAST = 1

_OWN_KEYS = ("root", "registry", "name", "eta", "timeout", "keep_last", "dtype", "prefetch", "follow", "recipe")




def _plain(value: Any) -> Any:
    """An OmegaConf container (verl's config) as plain Python; anything else as it is."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def _store_options() -> tuple[str, ...]:
    """The ParamStore options the engine passes through (its own keys set root, registry and name)."""
    return tuple(f.name for f in dataclasses.fields(StoreOptions) if f.name not in ("registry", "name"))


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


# -- the engine --------------------------------------------------------------------------------
@CheckpointEngineRegistry.register(BACKEND)
class ParamStoreCheckpointEngine(CheckpointEngineWithCache):
    """verl checkpoint engine that moves weights through a paramstore store (see the module docstring).

    verl builds it on every trainer rank (``is_master`` on rank 0) and every rollout worker with
    ``CheckpointEngineRegistry.new("paramstore", bucket_size=..., [is_master=...,] **engine_kwargs["paramstore"])``.

    Args:
        bucket_size: verl's transfer bucket in bytes; unused (tensors go to shared memory whole).
        is_master: this trainer rank commits (verl passes ``rank == 0`` on trainer ranks; rollout
            workers get the default, False).
        root: the store's directory, on a tmpfs (``/dev/shm/...``); every worker of the run names
            the same store (with ``registry``, each host its own root).
        registry: None for the single-host registry (trainer master and rollouts on one host), or a
            ``redis://`` URL shared by several hosts.
        name: the store's name in a shared registry (required with ``registry``).
        eta: staleness bound, an int >= 0: a rollout syncing for step ``t`` takes the newest
            version whose step is >= ``t - eta`` (with ``eta=0``: step ``t`` itself, or newer).
        timeout: seconds a rollout waits for that version (None: forever).
        keep_last: versions retention keeps besides leased ones (an int >= 1), or None to keep all.
            Ignored when ``retention`` (a :mod:`paramstore.retention` policy) is passed.
        dtype: store floating-point weights in this dtype (``"bfloat16"``, ``torch.bfloat16``), cast
            while copying; None keeps the trainer's dtypes.
        prefetch: a rollout prefetches the next version (step + 1) as soon as a receive completes, so
            the next receive only installs (default True; False: the whole fetch happens inside
            ``receive_weights``).
        follow: a rollout (with ``eta`` 0, the single-host registry) installs each tensor of the step
            being sent as soon as the trainer has staged it, instead of once the version is
            published (default False: see the module docstring).
        recipe: a rollout receives each version as this recipe derives it (:mod:`paramstore.recipes`,
            e.g. ``"fp8-block128"`` for an FP8 inference server) and prefetches the next one in that
            form (its derived objects made, or fetched from the host that made them); None: as
            committed. Not with ``follow`` (which installs the tensors as the trainer stages them).
        **store_options: other :class:`paramstore.ParamStore` keyword arguments.

    Raises:
        InvalidArgumentError: a missing ``root``, a bad ``eta``, ``timeout``, ``keep_last`` or
            ``dtype``, or an unknown keyword argument (the message lists the accepted ones).
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, *, root: str | None = None,
                 registry: str | None = None, name: str | None = None, eta: int = 0,
                 timeout: float | None = DEFAULT_TIMEOUT_S, keep_last: int | None = DEFAULT_KEEP_LAST,
                 dtype: str | torch.dtype | None = None, prefetch: bool = True, follow: bool = False,
                 recipe: str | None = None, **store_options: Any) -> None:
        if not root:
            raise InvalidArgumentError(
                "the paramstore checkpoint engine needs a store root: set "
                "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.paramstore.root (e.g. /dev/shm/run-42)")
        allowed = _store_options()
        unknown = sorted(k for k in store_options if k not in allowed)
        if unknown:
            raise InvalidArgumentError(
                f"unknown engine_kwargs.paramstore option(s) {unknown}: accepted are {sorted(_OWN_KEYS)} and the "
                f"ParamStore options {sorted(allowed)}")
        if isinstance(eta, bool) or not isinstance(eta, int) or eta < 0:
            raise InvalidArgumentError(f"eta must be an int >= 0 (the staleness bound in steps), got {eta!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise InvalidArgumentError(f"timeout must be seconds >= 0 or None, got {timeout!r}")
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise InvalidArgumentError(f"keep_last must be an int >= 1 or None (keep every version), got {keep_last!r}")
        if not isinstance(prefetch, bool):
            raise InvalidArgumentError(f"prefetch must be true or false, got {prefetch!r}")
        if not isinstance(follow, bool):
            raise InvalidArgumentError(f"follow must be true or false, got {follow!r}")
        if recipe is not None:
            recipe = resolve_recipe(recipe).name  # an unknown name lists the known ones
            if follow:
                raise InvalidArgumentError("recipe and follow do not go together: follow installs the tensors as the "
                                           "trainer stages them, before any recipe could derive them")
        if registry and not name:
            raise InvalidArgumentError("a shared registry needs engine_kwargs.paramstore.name: the store's name there, "
                                       "the same on every worker")
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.root = os.fspath(root)
        self.registry = registry or None
        self.name = name or None
        self.eta = eta
        self.timeout = None if timeout is None else float(timeout)
        self.keep_last = keep_last
        self.dtype = _dtype(dtype)
        self._options = {k: _plain(v) for k, v in store_options.items()}
        if "retention" not in self._options and keep_last is not None:
            self._options["retention"] = KeepLast(keep_last)
        self.prefetch = prefetch
        self.follow = follow
        self.recipe: str | None = recipe
        self._snapshot: Any = None  # the rollout's leased version, held until finalize
        self._next = NextVersion()  # the rollout's prefetch of the version after the one it installed
        #: The step of the version this rollout last handed to the inference server *completely*
        #: (every tensor of it consumed from :meth:`receive_weights` or :meth:`get_weights`); None
        #: before the first. It does not change when an install stops part-way.
        self.installed_step: int | None = None
        #: The :class:`paramstore.FetchReport` of the last receive's checkout (``moved`` False: the
        #: bytes were here already, brought by the prefetch or committed on this host).
        self.last_fetch: Any = None
        self._objects: dict[int, frozenset[str]] = {}  # step -> objects its manifest references (immutable)
        self._publishing: _Publishing | None = None  # the master's last commit, published in the background
        self.rank: int | None = None

    def __repr__(self) -> str:
        where = self.root if self.registry is None else f"{self.name} in {self.registry} (root {self.root})"
        return f"ParamStoreCheckpointEngine({where}, is_master={self.is_master}, eta={self.eta})"

    @property
    def store(self) -> Any:
        """This process's :class:`paramstore.ParamStore` for the configured store (opened on first use)."""
        return open_store(self.root, self.registry, self.name, **self._options)

    def _where(self) -> str:
        return f"store {self.root}" if self.registry is None else f"store {self.name!r} (registry {self.registry}, root {self.root})"

    # -- topology: no process group; the store is the rendezvous ---------------------------------
    def prepare(self) -> dict[str, Any]:
        """What :meth:`build_topology` checks: this worker's host and the store it names. Allocates nothing."""
        return {"backend": BACKEND, "is_master": self.is_master, "boot_id": _boot_id(),
                "host": socket.gethostname(), "root": os.path.abspath(self.root), "registry": self.registry,
                "name": self.name}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Check that trainer and rollouts can meet in one store; return each worker's rank.

        ``metadata`` is :meth:`prepare`'s dict from every trainer rank, then every rollout worker.
        Exactly one trainer rank must be the master, and every worker must name the same store: the
        same ``registry`` and ``name``, and, with the single-host registry, the same ``root`` on the
        master's host (a rollout elsewhere could never see the master's commits).

        Raises:
            InvalidArgumentError: they cannot (the message says which worker and why).
        """
        if len(metadata) != trainer_world_size + rollout_world_size:
            raise InvalidArgumentError(f"expected {trainer_world_size + rollout_world_size} workers' metadata, "
                                       f"got {len(metadata)}")
        trainers, rollouts = metadata[:trainer_world_size], metadata[trainer_world_size:]
        masters = [i for i, m in enumerate(trainers) if m.get("is_master")]
        if len(masters) != 1:
            raise InvalidArgumentError(f"exactly one trainer rank must be the paramstore writer (is_master), got "
                                       f"ranks {masters}")
        master = trainers[masters[0]]
        for i, m in enumerate(rollouts):
            who = f"rollout worker {i} on {m.get('host')}"
            if m.get("backend") != BACKEND:
                raise InvalidArgumentError(f"{who} does not run the paramstore backend")
            if (m.get("registry"), m.get("name")) != (master.get("registry"), master.get("name")):
                raise InvalidArgumentError(
                    f"{who} names registry {m.get('registry')!r}, store {m.get('name')!r}; the trainer names "
                    f"{master.get('registry')!r}, {master.get('name')!r}: give every worker the same engine_kwargs")
            if master.get("registry") is None:
                if m.get("boot_id") != master.get("boot_id"):
                    raise InvalidArgumentError(
                        f"{who} is not on the trainer master's host {master.get('host')}: the single-host registry "
                        "needs trainer and rollouts on one host; for several hosts set "
                        "engine_kwargs.paramstore.registry=redis://... and name=...")
                if m.get("root") != master.get("root"):
                    raise InvalidArgumentError(f"{who} uses store {m.get('root')}, the trainer {master.get('root')}: "
                                               "they must name the same root")
        return ({"rank": list(range(trainer_world_size))}, {"rank": list(range(rollout_world_size))})

    def init_process_group(self, rank: int | None = None, **kwargs: Any) -> None:
        """Nothing to connect: records this worker's rank (from :meth:`build_topology`)."""
        self.rank = rank

    def finalize(self) -> None:
        """End of a sync: a rollout releases the version it holds (its lease); the trainer's master
        waits for its last commit to be published (raising its error). The store stays open."""
        snap, self._snapshot = self._snapshot, None
        if snap is not None:
            snap.close()
        p = self._publishing
        if p is not None:
            try:
                p.result()
            except BaseException:
                self._publishing = None  # raised here, not again at the next send
                raise

    # -- trainer ----------------------------------------------------------------------------------
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                           global_steps: int | None = None) -> dict[str, float]:
        """Commit ``weights`` as the version of step ``global_steps`` (master rank); drain them elsewhere.

        Every trainer rank calls this with the same generator, which gathers one full tensor at a time
        collectively: every rank pulls it to the end, in order. The master streams it into one version
        (each tensor copied into shared memory as it arrives) and returns once every tensor is staged:
        the hash and the publish finish in the background (rollouts on this host install the tensors
        as they are staged, and see the version once it is published). The first call after it (this
        engine's :meth:`finalize`, or the next send) waits for that publish and raises its error.
        ``global_steps=None`` commits the store's latest step + 1 (0 when empty). A step already
        committed is not written again (the generator is still drained).

        Returns:
            On the master, metrics for verl's logger (see the module docstring); ``{}`` elsewhere.

        Raises:
            StepOrderError: ``global_steps`` is below the store's latest step and not in the store.
            The commit's errors (StorageFullError, WriterConflictError, InvalidTensorError...): nothing
            was published for this step; or for the previous step, whose publish failed after its send
            returned (the error says so; these weights were then not committed either).
        """
        start = time.perf_counter()
        stream = _Drainable(weights)
        if not self.is_master:
            stream.drain()
            return {}
        try:
            published = await asyncio.to_thread(self._published)
            store = self.store
            step = self._step_to_send(store, global_steps)
            done = self._committed(store, step)
            if done is not None:
                stream.drain()
                if (latest := store.latest()) is not None and latest.step > step:
                    warnings.warn(f"paramstore: step {step} is already in {self._where()}, but so is the newer step "
                                  f"{latest.step} (a run resumed from an older checkpoint?): rollouts will take "
                                  f"step {latest.step}", RuntimeWarning, stacklevel=2)
                return {**self._metrics(step, start, written=False, tensors=stream.count), **published}
            before = self._objects_before(store)
            try:
                handle = store.commit(step, stream, dtype=self.dtype,
                                      metadata={"verl_global_steps": global_steps})
            except StepOrderError as e:
                raise StepOrderError(f"cannot commit step {step} to {self._where()}: {e}; the store holds newer "
                                     "versions (an earlier run's?): give this run a fresh root") from e
        finally:
            stream.drain()  # whatever a failed commit left unread: the other ranks' gathers must complete
        handle.staged.result()  # a streaming commit is staged (or failed) when commit() returns
        publishing = self._publishing = _Publishing(handle, time.perf_counter(), before)
        handle.committed.add_done_callback(lambda _: setattr(publishing, "visible_at", time.perf_counter()))
        return {**self._metrics(step, start, written=True, tensors=stream.count), **published}

    def _published(self) -> dict[str, float]:
        """Wait for the last commit's publish (if any is pending) and return its metrics; raise its
        error, saying which step it was (nothing of that step was published)."""
        p, self._publishing = self._publishing, None
        if p is None:
            return {}
        version = p.result()
        return {"paramstore/published_step": version.step, "paramstore/bytes": version.nbytes,
                "paramstore/new_bytes": self._new_bytes(self.store, version.step, p.before),
                "paramstore/publish_s": (p.visible_at or time.perf_counter()) - p.staged_at}

    def _step_to_send(self, store: Any, global_steps: int | None) -> int:
        if global_steps is not None:
            return int(global_steps)
        try:
            latest = store.latest()
        except NotAStoreError:
            latest = None
        return 0 if latest is None else latest.step + 1

    @staticmethod
    def _committed(store: Any, step: int) -> Any:
        try:
            return store.get(step)
        except (VersionNotFoundError, NotAStoreError):
            return None

    def _objects_of(self, store: Any, step: int) -> frozenset[str] | None:
        objs = self._objects.get(step)
        if objs is None:
            try:
                objs = self._objects[step] = frozenset(store.manifest(step).objects())
            except VersionNotFoundError:
                return None  # pruned meanwhile
        return objs

    def _objects_before(self, store: Any) -> set[str]:
        """Objects the store's versions reference now (manifests are immutable: cached per step)."""
        try:
            steps = [v.step for v in store.versions()]
        except NotAStoreError:
            return set()
        for gone in set(self._objects) - set(steps):
            del self._objects[gone]
        out: set[str] = set()
        for step in steps:
            out |= self._objects_of(store, step) or frozenset()
        return out

    def _new_bytes(self, store: Any, step: int, before: set[str]) -> int:
        try:
            manifest = store.manifest(step)
        except VersionNotFoundError:
            return 0
        self._objects[step] = frozenset(manifest.objects())
        where = {(c.object, c.offset, c.nbytes) for _, e in manifest.stored() for c in e.pieces()
                 if c.object not in before}
        return sum(n for _, _, n in where)

    @staticmethod
    def _metrics(step: int, start: float, *, written: bool, tensors: int) -> dict[str, float]:
        return {
            "paramstore/step": step,
            "paramstore/written": int(written),
            "paramstore/tensors": tensors,
            "paramstore/send_s": time.perf_counter() - start,
        }

    # -- rollout ----------------------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None
                              ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield ``(name, tensor)`` of the newest version whose step is >= ``global_steps - eta``.

        Waits up to ``timeout`` for it (off the event loop). The tensors are zero-copy views of the
        store's shared memory (CPU; read-only in spirit: a write copies the page, privately), each
        valid until the next is asked for (copy it before). With ``follow``, when none is there yet
        and the store is this host's, the tensors of ``global_steps`` come as the trainer stages them
        (see the module docstring). The version stays leased until :meth:`finalize` or the next receive.
        ``global_steps=None``: the newest version there is.

        Raises:
            WaitTimeoutError: no such version within ``timeout``; the message names the store, the step
                waited for and the latest one there.
            VersionNotFoundError: (``follow``) the commit being followed failed; the tensors already handed over
                were handed over again as in the installed version first.
        """
        min_step = 0 if global_steps is None else max(0, int(global_steps) - self.eta)
        followed = None if global_steps is None else await asyncio.to_thread(self._follow, min_step, int(global_steps))
        if followed is not None:
            async for item in self._install_followed(followed, min_step):
                yield item
            return
        snap = await asyncio.to_thread(self._checkout_min, min_step, global_steps)
        self._hold(snap)
        for name in snap:
            yield name, snap[name]
        self._installed(snap)

    def _follow(self, min_step: int, step: int) -> FollowedCommit | None:
        """The commit of ``step`` to install as the trainer stages it, when no version within the
        bound is there yet and trainer and rollout share this host's store (None: check out)."""
        if not self.follow or self.registry is not None or min_step != step:
            # Across hosts the version is fetched and verified once published; with eta >= 1 the
            # first version within the bound is taken, whichever step it is.
            return None
        try:
            latest = self.store.latest()
        except NotAStoreError:
            latest = None  # the trainer has not created it yet
        if latest is not None and latest.step >= min_step:
            return None  # the staleness contract: the newest version within the bound, at once
        return self.store.follow_commit(step, timeout=self.timeout, holder=self._holder())

    async def _install_followed(self, followed: FollowedCommit, min_step: int) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield each tensor of ``followed`` as the trainer stages it; the version becomes the
        installed one only once it is published and every tensor was handed over. A failed commit
        hands the tensors already handed over back as they were in the installed version, then raises."""
        try:
            async for item in followed:  # waits yield to the event loop; nothing else blocks
                yield item
        except (WaitTimeoutError, VersionNotFoundError) as e:
            if followed.served and self.installed_step is not None:
                async for item in self._restore(followed.served):
                    yield item
            if isinstance(e, WaitTimeoutError):
                raise self._timed_out(e, min_step, followed.step) from e
            installed = "no version" if self.installed_step is None else f"step {self.installed_step}"
            held = (f"{installed} still" if not followed.served else f"{installed} again" if self.installed_step
                    is not None else f"{len(followed.served)} tensors of it over weights of no version")
            raise VersionNotFoundError(f"paramstore verl backend: step {followed.step} was not installed: {e}; "
                                       f"the engine holds {held}") from e
        finally:
            snap = followed.detach_snapshot()
            followed.close()
        self._hold(snap)
        self._installed(snap)

    async def _restore(self, names: list[str]) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """The installed version's tensors of ``names`` (those it has)."""
        prev = await asyncio.to_thread(self.store.checkout, self.installed_step,
                                       holder=f"{self._holder()} restore", recipe=self.recipe)
        try:
            for name in names:
                if name in prev:
                    yield name, prev[name]
        finally:
            prev.close()

    async def get_weights(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield ``(name, tensor)`` of the latest version this host holds (verl's cached-weights hook).

        The version stays leased until :meth:`finalize` or the next receive.

        Raises:
            VersionNotFoundError: the store holds no version yet (or NotAStoreError: there is no store).
        """
        snap = await asyncio.to_thread(self._checkout_latest)
        self._hold(snap)
        for name in snap:
            yield name, snap[name]
        self._installed(snap)

    def _holder(self) -> str:
        return f"verl rollout pid {os.getpid()}"

    def _checkout_min(self, min_step: int, global_steps: int | None) -> Any:
        store = self.store
        try:
            # The newest version within the bound, as soon as there is one (the staleness contract);
            # then, if the prefetch started after the last receive covers it, its bytes (here or
            # arriving): the checkout below maps them and moves nothing.
            version = store.wait_for(min_step, timeout=self.timeout)
            self._next.settle(version.step, self.timeout)
            return store.checkout(min_step=min_step, timeout=self.timeout, holder=self._holder(), recipe=self.recipe)
        except WaitTimeoutError as e:
            raise self._timed_out(e, min_step, global_steps) from e

    def _timed_out(self, e: WaitTimeoutError, min_step: int, global_steps: int | None) -> WaitTimeoutError:
        """The error for a receive that waited ``timeout`` in vain: what it waited for, and the latest step."""
        try:
            latest = self.store.latest()
        except Exception:  # noqa: BLE001 - only for the message
            latest = None
        asked = "any version" if global_steps is None else (
            f"step >= {min_step} (global_steps {global_steps} - eta {self.eta})")
        return WaitTimeoutError(
            f"paramstore verl backend: no version with {asked} in {self._where()} within {self.timeout:.4g} s "
            f"(latest: {None if latest is None else latest.step}): is the trainer sending weights to the same "
            f"store, and did its send_weights succeed? ({e})")

    def _checkout_latest(self) -> Any:
        store = self.store
        try:
            return store.checkout("latest", holder=self._holder(), recipe=self.recipe)
        except VersionNotFoundError as e:
            raise VersionNotFoundError(f"paramstore verl backend: {self._where()} holds no version yet: "
                                       f"nothing cached to load ({e})") from e

    def _hold(self, snap: Any) -> None:
        old, self._snapshot = self._snapshot, snap
        if old is not None:
            old.close()
        self.last_fetch = snap.fetch

    def _installed(self, snap: Any) -> None:
        """Every tensor of ``snap`` was handed over: it is the installed version now; the next one
        is prefetched while the server generates."""
        self.installed_step = snap.step
        if self.prefetch:
            self._next.start(self.store, snap.step + 1, recipe=self.recipe)

    # -- installed equals committed ---------------------------------------------------------------
    def check_installed(self, installed: Any, *, rename: Mapping[str, Any] | Callable[[str], Any] | None = None,
                        step: int | None = None) -> list[str]:
        """Compare what the inference engine holds with the version, tensor by tensor, bit for bit.

        Run it on the rollout side after an update (as Miles' ``--check-weight-update-equal``): a
        loader that skipped a tensor, a bucket overwritten before it was read, an install stopped
        part-way all show here.

        Args:
            installed: the engine's tensors: a ``torch.nn.Module`` (its ``state_dict()``), a mapping
                of name to tensor, or an iterable of ``(name, tensor)`` pairs; on any device.
            rename: how the loader names the version's tensors in the engine (its name mapping): a
                mapping or a callable from the version's name to the engine's name; or to ``(name,
                index)`` for a tensor the loader placed inside a fused one (``installed[name][index]``
                holds its bytes, e.g. ``("qkv_proj.weight", slice(0, 64))``); or to None for a tensor
                not to compare. None: the same names.
            step: the version to compare with (default :attr:`installed_step`), in the form the
                rollout receives (its ``recipe``, if any).

        Returns:
            The version's names whose installed tensor is missing or differs (shape, or any byte
            after casting the version's tensor to the engine's dtype, as a loader's ``copy_`` does),
            sorted; ``[]`` when the engine holds the version exactly.

        Raises:
            InvalidArgumentError: no version installed yet and no ``step``.
            VersionNotFoundError: the version was pruned meanwhile.
        """
        step = self.installed_step if step is None else step
        if step is None:
            raise InvalidArgumentError("check_installed: this rollout has installed no version yet: pass step=")
        if isinstance(installed, torch.nn.Module):
            installed = installed.state_dict(keep_vars=False)
        elif not isinstance(installed, Mapping):
            installed = dict(installed)
        name_of: Callable[[str], Any]
        if rename is None:
            name_of = lambda n: n  # noqa: E731
        elif isinstance(rename, Mapping):
            name_of = lambda n: rename.get(n, n)  # noqa: E731
        else:
            name_of = rename
        differ = []
        with self.store.checkout(step, holder=f"{self._holder()} check_installed", recipe=self.recipe) as snap:
            for name in snap:
                target = name_of(name)
                if target is None:
                    continue
                key, index = target if isinstance(target, tuple) else (target, None)
                have = installed.get(key)
                if have is None:
                    differ.append(name)
                    continue
                have = have.detach()
                if index is not None:
                    have = have[index]
                if differs(have, snap[name].to(device=have.device, dtype=have.dtype)):  # as a loader's copy_ casts
                    differ.append(name)
        return sorted(differ)


@dataclasses.dataclass
class _Publishing:
    """A commit ``send_weights`` returned from once staged: its publish runs in the background."""

    handle: Any  # its CommitHandle
    staged_at: float  # time.perf_counter() when send_weights returned
    before: set[str]  # the objects earlier versions referenced (for new_bytes)
    visible_at: float | None = None  # when the version became visible

    def result(self) -> Any:
        """Wait for the version; raise the commit's error, saying which step it was."""
        try:
            return self.handle.committed.result()
        except BaseException as e:
            e.add_note(f"paramstore: step {self.handle.step} was staged, then its publish failed (send_weights "
                       "returned once staged): nothing of that step was published")
            raise


class _Drainable:
    """An iterator over verl's weights generator that counts what passed and can be drained to the end.

    It keeps no reference to the items it hands on (the commit drops each tensor once copied).
    """

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._it: Iterator[tuple[str, torch.Tensor]] = iter(weights)
        self.count = 0

    def __iter__(self) -> _Drainable:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        item = next(self._it)
        self.count += 1
        return item

    def drain(self) -> None:
        """Pull the remaining items (each a collective gather on the trainer ranks) and drop them."""
        for _ in self:
            pass


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    got = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(got, torch.dtype) or not got.is_floating_point:
        raise InvalidArgumentError(f"dtype must name a floating-point torch dtype (e.g. 'bfloat16'), got {dtype!r}")
    return got
