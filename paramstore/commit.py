"""The commit path: where a byte goes between ``store.commit`` and a visible version.

1. **Stage** (stager thread; ``handle.staged`` completes at the end). Lay the tensors out in
   shards (:func:`paramstore.format.plan_shards`), take one pre-faulted (or recycled: see
   :mod:`paramstore.staging`) slab per shard from the pool, write the safetensors header and
   ``copy_`` every tensor into its place. This is the only copy of the bytes. After it the trainer
   may change its parameters; a tensor changed in place before its copy was done (torch's in-place
   version counter moved since ``commit()``) fails the commit with TornCommitError (:class:`_Watch`).
2. **Hash** (hash threads, one per core: :class:`HashQueue`). blake3 of each piece's bytes in
   the slab (:mod:`paramstore.format`): one read pass, no byte hashed twice, each piece on one
   thread (a 1 GiB tensor is 512 independent pieces, in 128 units of four, so no blake3 thread
   pool is needed). CPU tensors are hashed as they are staged: the stager hands each unit of
   pieces (and each batch of small
   tensors) to the hash threads as soon as it is copied; while a copy runs only
   :func:`staging_hashers` of them hash (the stager holds a core), all of them after. The
   publisher then only waits for the last pieces and computes the tensor digests (roots over
   pieces). Device copies are still in flight when their loop ends: those tensors are hashed by the
   publisher, after staging.
3. **Deduplicate.** Tensors whose digest the store already holds (in an earlier version, or
   earlier in this commit) are not stored again: a shard with no new tensor goes back to the pool;
   a shard with some is compacted in place (``memmove`` of its new tensors, the header rewritten)
   and truncated.
4. **Publish.** Each remaining slab is fsynced and renamed to ``objects/<digest>.safetensors``;
   then the version, its manifest and its index entries are written in one registry transaction.
   Only then is ``handle.committed`` completed. The published slabs are then unmapped, or kept
   mapped for recycling, and the pool prepares the next commits' slabs.

A crash before step 4's transaction leaves only unreferenced files (slabs in ``tmp/``, or objects
no version names), which ``paramstore verify`` reports and GC reclaims.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import warnings
import threading
import time
from concurrent import futures
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping

import torch

from . import accel
from .errors import (
    CommitGroupError, CorruptObjectError, InvalidArgumentError, ParamStoreError, StorageFullError, TornCommitError, UnregisteredObjectsError,
    WaitTimeoutError,
)
from .following import StagingJournal
from .format import (
    ITEMSIZE, Placement, ShardPlan, TensorSpec, cores, layout, object_digest, pieces_root,
    plan_shards,
)
from .hashing import (INLINE_HASH_BYTES, OVERLAP_HASH_MIN_CPUS, EarlyHash, Hashed, HashQueue, Unit, hash_bytes,
                      piece_spans, staging_hashers)
from .manifest import ASSET_PREFIX, Manifest, TensorEntry, Version, check_manifest
from .sharded import CommitGroup, check_part, decode, encode, merge_parts
from .staging import Slab, SlabPool, address, storage_error
from .tensors import ST_TO_TORCH, Collected, Taker, check_pair, in_place_version
from .text import plural

from paramstore.backends.registries.base import ObjectInfo, Registry, TensorLocation
from paramstore.backends.tiers.local import LocalTier

__all__ = ["CommitHandle", "Committer"]

#: Commits' worth of slabs the pool keeps prepared: commits in quick succession each find one
#: faulted while the next is being prepared (or recycled).
PREPARE_COPIES = 2
#: How many times a commit that finds the filesystem full frees space and tries again before it
#: fails with StorageFullError: it waits for the commit before it to be published, deletes the
#: pool's spare slabs and has retention + GC run (see :meth:`Committer._reclaim`). Twice: a slab
#: GC hands back to the pool may still be being checked for reuse at the first retry.
RECLAIM_ATTEMPTS = 2
#: Seconds a commit that found the filesystem full waits for one prune + gc run.
RECLAIM_TIMEOUT_S = 120.0


class CommitHandle:
    """What ``store.commit`` returns at once.

    Attributes:
        step: the step being committed.
        staged: completes (with None) when the snapshot copy is taken: the trainer may then
            change its parameters.
        committed: completes with the :class:`~paramstore.Version` when the version is visible
            to every process on the host; fails with the error if the commit failed.
        persisted: with a remote configured, completes with the version when its objects and
            manifest are durable in the remote (fails with a RemoteError after retries, or if the
            commit failed); None without a remote.

    Example:
        >>> handle = store.commit(2, model)
        >>> handle.staged.result(timeout=60)  # the copy is taken: the trainer may change model
        >>> handle.committed.result(timeout=60).step
        2
        >>> handle, handle.persisted  # no remote: nothing to persist
        (CommitHandle(step=2, committed), None)
    """

    def __init__(self, step: int, *, persist: bool = False) -> None:
        self.step = step
        self.staged: Future[None] = Future()
        self.committed: Future[Version] = Future()
        self.persisted: Future[Version] | None = Future() if persist else None
        # device -> an event recorded on the side stream after this commit's last device copy;
        # set once every copy is queued (before they finish: see fence())
        self._queued: Future[dict[Any, Any]] = Future()
        self._watch: _Watch | None = None  # the sources' in-place versions (set by the committer)

    def fence(self) -> None:
        """Let the caller change its parameters once this commit's copy of them is taken.

        For tensors on an accelerator, the caller's current streams are made to wait, on the
        device, for the commit's device-to-host copies: the calling thread is held only until
        those copies are *queued* (not done), so the training loop goes on at once and only the
        kernels it queues next (the optimizer step that overwrites the weights) wait for the
        copies on the device. For CPU tensors, and when a commit failed, it waits for ``staged``.
        ``store.guard(optimizer)`` calls it before every ``optimizer.step()``. Commit errors are
        not raised here (see ``result()``).

        Example:
            >>> handle = store.commit(2, model)
            >>> handle.fence()  # CPU tensors: returns once staged
            >>> handle.staged.done()
            True
        """
        futures.wait([self._queued, self.staged], return_when=futures.FIRST_COMPLETED)
        if self._queued.done() and self._queued.exception() is None and self._queued.result():
            if self._watch is not None:  # changes from here on are ordered after the copies
                self._watch.fence()
            for dev, event in self._queued.result().items():
                accel.current_stream(dev).wait_event(event)
            return
        futures.wait([self.staged])

    def result(self, timeout: float | None = None) -> Version:
        """Wait until the version is committed and return it (re-raises a commit's error).

        Raises:
            WaitTimeoutError: not committed within ``timeout`` seconds.

        Example:
            >>> version = store.commit(2, model, metrics={"loss": 0.25}).result(timeout=60)
            >>> version.step, version.metrics
            (2, {'loss': 0.25})
        """
        try:
            return self.committed.result(timeout)
        except FutureTimeout:
            raise WaitTimeoutError(f"step {self.step} not committed within {timeout:.4g} s") from None

    def done(self) -> bool:
        """Whether the commit has finished (successfully or not).

        Example:
            >>> handle = store.commit(2, model)
            >>> _ = handle.result()
            >>> handle.done()
            True
        """
        return self.committed.done()

    def __repr__(self) -> str:
        state = "committed" if self.committed.done() else "staged" if self.staged.done() else "staging"
        return f"CommitHandle(step={self.step}, {state})"


@dataclass
class _Job:
    handle: CommitHandle
    collected: Collected
    tags: tuple[str, ...]
    metrics: dict[str, float]
    metadata: dict[str, Any]
    plans: list[ShardPlan] = field(default_factory=list)
    slabs: list[Slab] = field(default_factory=list)  # staged, not yet published or pooled
    published: list[Slab] = field(default_factory=list)  # renamed into objects, still mapped
    created_at: float = 0.0
    ready_events: dict = field(default_factory=dict)  # device -> event recorded on the caller's stream at commit()
    device: Any = None  # an accelerator this commit copies from (a streaming commit: once one arrives)
    early: dict = field(default_factory=dict)  # (shard, placement) -> Hashed, hashed while staging
    units: list = field(default_factory=list)  # the _Units handed to the hash threads while staging
    piece_digests: dict = field(default_factory=dict)  # tensor digest -> its piece digests (tensors over a piece)
    group: CommitGroup | None = None  # several ranks commit this version together (paramstore.sharded)
    error: BaseException | None = None  # a group job's staging error: it still takes part in the group
    staged: bool = False  # staged on the caller's thread already (a streaming commit)
    layout_sizes: list[int] = field(default_factory=list)  # slab sizes the next commit of this layout takes
    watch: "_Watch | None" = None  # the sources' in-place versions at commit() (not for a streaming commit)
    journal: StagingJournal | None = None  # a streaming commit's staged tensors, for same-host readers (following)


class Committer:
    """Runs commits in order on two threads: a stager (copy) and a publisher (hash, publish).

    Staging of commit ``n+1`` overlaps the hashing and publishing of commit ``n``.
    """

    def __init__(self, tier: LocalTier, registry: Registry, pool: SlabPool, shard_size_bytes: int,
                 *, gc_lock: Callable[[], ContextManager[None]], prepare_buffers: bool = True,
                 on_commit: Callable[[Version, CommitHandle], None] | None = None, writer: str = "",
                 reclaim: Callable[[float], bool] | None = None,
                 announce: Callable[[list[str]], None] | None = None) -> None:
        self._writer = writer  # run id recorded with each version
        # Serves the objects this host stored to other hosts before the version (or this rank's
        # part) becomes visible, so whoever it wakes finds them announced (a process's peer server).
        self._announce = announce
        self._reclaim_space = reclaim  # retention + GC now, waited for (False: none ran)
        self._tier = tier
        self._gc_lock = gc_lock
        self._on_commit = on_commit
        self._registry = registry
        self._pool = pool
        self._shard_size = shard_size_bytes
        self._prepare = prepare_buffers
        self._stock = PREPARE_COPIES  # commits' worth the pool may hold (prepare() may ask for more)
        self._layout: tuple[list[TensorSpec], list[ShardPlan]] = ([], [])
        self._handed: CommitHandle | None = None  # the last commit the stager handed to the publisher
        self._stage_q: queue.Queue[_Job | None] = queue.Queue()
        # Bounded: staging may run at most one commit ahead of publishing, so slabs cannot pile up
        # in shared memory; beyond that `staged` waits (and guard() pushes back on the trainer).
        self._publish_q: queue.Queue[_Job | None] = queue.Queue(maxsize=1)
        self._hash_threads = cores()
        # One hash thread per core; while the stager copies, only staging_hashers() of them run.
        self._hashers = HashQueue(self._hash_threads, staging_hashers(self._hash_threads))
        self._serial_copy = self._hash_threads < OVERLAP_HASH_MIN_CPUS
        self._stager = threading.Thread(target=self._run, args=(self._stage_q, self._stage), name="paramstore-stager", daemon=True)
        self._publisher = threading.Thread(target=self._run, args=(self._publish_q, self._publish), name="paramstore-publisher", daemon=True)
        self._stager.start()
        self._publisher.start()

    def submit(self, step: int, collected: Collected, tags: tuple[str, ...], metrics: dict[str, float],
               metadata: dict[str, Any], *, persist: bool = False, group: CommitGroup | None = None) -> CommitHandle:
        """Queue a commit of ``collected``: staged on the stager thread, then published."""
        handle = CommitHandle(step, persist=persist)
        ready = _ready_events(collected.sources)
        job = _Job(handle, collected, tags, metrics, metadata, created_at=time.time(),
                   ready_events=ready, group=group, device=next(iter(ready), None))
        job.watch = handle._watch = _Watch(collected)
        if job.device is not None:  # this process stages accelerator tensors: pin its commit slabs
            self._pool.pin_for(job.device)
        self._stage_q.put(job)
        return handle

    def submit_stream(self, step: int, pairs: Any, taker: Taker, tags: tuple[str, ...], metrics: dict[str, float],
                      metadata: dict[str, Any], *, persist: bool = False, group: CommitGroup | None = None,
                      ranks: tuple[int, ...] = ()) -> CommitHandle:
        """Stage an iterable of ``(name, tensor)`` here, on the caller's thread, as it yields (see
        :meth:`_stage_stream`), then queue it for publishing. Returns once every tensor is copied:
        ``handle.staged`` is then done (or failed)."""
        handle = CommitHandle(step, persist=persist)
        job = _Job(handle, Collected([], [], {}), tags, metrics, metadata, created_at=time.time(), group=group,
                   staged=True)
        interrupt: BaseException | None = None
        try:
            if group is None:  # readers on this host may follow it (paramstore.following)
                job.journal = StagingJournal(self._tier.tmp_dir, step)
            self._stage_stream(job, pairs, taker, ranks)
            handle.staged.set_result(None)
        except BaseException as e:  # noqa: BLE001 - delivered through the futures (and to the group)
            self._staging_failed(job, e)
            interrupt = None if isinstance(e, Exception) else e  # Ctrl-C, SystemExit: raised here too
            if group is None:
                if interrupt is not None:
                    raise
                return handle
        self._stage_q.put(job)  # in order with the commits before it; the stager hands it on
        if interrupt is not None:
            raise interrupt
        return handle

    def prepare(self, collected: Collected, *, ahead: int = 0) -> None:
        """Have slabs for this model's layout created and faulted in the background:
        :data:`PREPARE_COPIES` + ``ahead`` commits' worth. ``ahead``: the commits that will take
        new slabs before recycled ones come back (the versions retention keeps); the pool keeps
        that many, and refills up to :data:`PREPARE_COPIES` after each commit."""
        self._stock = PREPARE_COPIES + max(0, ahead)
        self._pool.prepare([p.size for p in self._plan(collected.specs)], copies=self._stock)

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Wait until the slabs :meth:`prepare` asked for are ready; False on timeout."""
        return self._pool.wait_prepared(timeout)

    def _plan(self, specs: list[TensorSpec]) -> list[ShardPlan]:
        # A training run commits the same names, dtypes and shapes every time: lay them out once.
        # One tuple, swapped whole: prepare() (caller's thread) and the stager both call this.
        cached_specs, cached_plans = self._layout
        if specs == cached_specs:
            return cached_plans
        # Assets get objects of their own: a set of files that does not change (a model's config)
        # is then one small object every version shares, never a shard of tensors kept alive by it.
        files = [s for s in specs if s.name.startswith(ASSET_PREFIX)]
        plans = plan_shards([s for s in specs if not s.name.startswith(ASSET_PREFIX)], self._shard_size)
        plans += plan_shards(files, self._shard_size) if files else []
        self._layout = (list(specs), plans)
        return plans

    def close(self) -> None:
        """Finish every submitted commit, then stop the threads."""
        self._stage_q.put(None)
        self._stager.join()
        self._publish_q.put(None)
        self._publisher.join()
        self._hashers.close()

    @staticmethod
    def _run(q: "queue.Queue[_Job | None]", work: Callable[[_Job], None]) -> None:
        while (job := q.get()) is not None:
            work(job)

    # -- 1. stage ----------------------------------------------------------------------------
    def _stage(self, job: _Job) -> None:
        if not job.staged:
            try:
                job.plans = self._plan(job.collected.specs)
                job.layout_sizes = [p.size for p in job.plans]
                sources = dict(zip((s.name for s in job.collected.specs), job.collected.sources))
                if job.device is not None:
                    # Before this thread's first device call (a slab's registration, a stream):
                    # otherwise it would create a context on device 0, on every rank.
                    accel.set_device(job.device)
                # Device copies are still in flight when a tensor's copy is queued: those are
                # hashed by the publisher. Without a spare core, nothing is hashed while copying.
                early = None
                if not job.ready_events and self._hashers.while_staging:
                    early = EarlyHash(job, self._hashers, job.early)
                with self._hashers.staging():
                    _copy_into_slabs(job, sources, lambda size: self._take(job, size), early=early,
                                     serial=self._serial_copy)
                job.collected = job.collected.without_sources()  # drop refs
                job.handle.staged.set_result(None)
            except BaseException as e:  # noqa: BLE001 - delivered to the caller through the futures
                self._staging_failed(job, e)
                if job.group is None:
                    return
        self._handed = job.handle
        self._publish_q.put(job)

    def _staging_failed(self, job: _Job, e: BaseException) -> None:
        """Drop what ``job`` staged and fail its futures; a group job still goes on to the
        publisher (with ``job.error``) so that the other ranks learn of it."""
        # No hash thread may still read a slab: pieces not started are dropped, the others waited for.
        futures.wait([u.future for u in self._hashers.cancel(job.units)])
        for slab in job.slabs:
            slab.discard()
        job.slabs, job.plans, job.early, job.units = [], [], {}, []
        job.collected = job.collected.without_sources()
        if job.journal is not None:
            job.journal.end(e)
        if job.group is None:
            _fail(job.handle, e)
        else:
            job.error = e
            if not job.handle.staged.done():
                job.handle.staged.set_exception(e)

    def _stage_stream(self, job: _Job, pairs: Any, taker: Taker, ranks: tuple[int, ...]) -> None:
        """Copy each tensor of ``pairs`` into staging as it arrives, and drop it.

        A tensor found in the layout of the previous commit (same name, dtype and shape) goes to
        its place in that layout's shards (their slabs taken when their first tensor arrives, so
        prepared and recycled buffers serve streaming commits too); any other tensor gets an object
        of its own. At the end the shards are compacted to the tensors that arrived, and the layout
        of what arrived becomes the next commit's. Extra memory: the tensor being copied (device
        copies run on a side stream, ``record_stream`` keeping the source's memory until copied).
        The assets (``taker.assets``) follow the last tensor.
        """
        _, plans = self._layout
        where = {p.spec.name: (i, p) for i, plan in enumerate(plans) for p in plan.placements}
        arrived: dict[int, set[str]] = {}
        taken: dict[int, Slab] = {}
        extras: list[tuple[ShardPlan, Slab]] = []
        specs: list[TensorSpec] = []
        copier = _Copier({})
        journal = job.journal
        in_flight: list[tuple[Slab, Placement]] = []  # device copies, announced once synchronized
        # With cores to spare, CPU tensors go to the hash threads as they are copied (device copies
        # are still in flight: the publisher hashes those); keyed by name until the shards are final.
        # Not on smaller hosts: this copy runs on the caller's (the trainer's) thread, and a hash
        # thread beside it would take the core it copies on (2 cores, verl: the trainer held 0.088 ->
        # 0.125 s for a publish 0.086 -> 0.032 s sooner, the rollout's pause the same).
        hashed: dict[str, Hashed] = {}
        spare = self._hashers.while_staging and not self._serial_copy
        early = EarlyHash(job, self._hashers, hashed) if spare else None

        def place(spec: TensorSpec, src: torch.Tensor) -> None:
            """Copy ``src`` to its place in the previous layout, or into an object of its own."""
            specs.append(spec)
            if job.device is None and accel.is_accelerator(src.device):
                # On the caller's thread, whose current device is its own: no set_device here.
                job.device = src.device
                self._pool.pin_for(job.device)
            i, p = where.pop(spec.name, (None, None))
            if p is not None and p.spec == spec:
                if i not in taken:
                    taken[i] = self._take_shard(job, plans[i])
                slab = taken[i]
                arrived.setdefault(i, set()).add(spec.name)
            else:
                plan = layout([spec])
                slab = self._take_shard(job, plan)
                extras.append((plan, slab))
                p = plan.placements[0]
            if job.device is not None and not slab.pinned:  # taken before the first device tensor came
                self._pool.pin(slab)
            copier.copy(_slab_view(slab, p), src, follow=True, pinned=slab.pinned)
            if early is not None and not accel.is_accelerator(src.device):
                early.copied(spec.name, p, slab)
            if journal is not None:
                if accel.is_accelerator(src.device):
                    in_flight.append((slab, p))
                else:
                    journal.staged(slab.path, p)

        try:
            with self._hashers.staging():
                for item in pairs:
                    name, value = check_pair(item)
                    del item
                    got = taker.take(name, value)
                    del value
                    if got is not None:  # None: another rank stores it
                        place(*got)
                    del got
                if not taker.names:
                    raise InvalidArgumentError("the commit's iterable yielded no tensors")
                for spec, src in taker.take_assets():
                    place(spec, src)
                if early is not None:
                    early.flush()
        finally:
            copier.synchronize()
        if journal is not None:
            for slab, p in in_flight:
                journal.staged(slab.path, p)
        job.plans, job.slabs = [], []
        for i in sorted(taken):
            plan, slab = plans[i], taken[i]
            keep = [p for p in plan.placements if p.spec.name in arrived[i]]
            if journal is not None and len(keep) != len(plan.placements):
                journal.seal("compact a shard that lost tensors")  # _compact moves announced bytes
            if len(keep) != len(plan.placements):
                futures.wait([u.future for u in job.units])  # no hash thread reads what _compact moves
            header, offsets = _compact(slab, plan, keep)
            job.plans.append(ShardPlan(header, tuple(Placement(p.spec, o, p.nbytes) for p, o in zip(keep, offsets))))
            job.slabs.append(slab)
        for plan, slab in extras:
            job.plans.append(plan)
            job.slabs.append(slab)
        # a tensor's digest is of its bytes, wherever _compact moved them
        job.early = {(i, j): hashed[p.spec.name] for i, plan in enumerate(job.plans)
                     for j, p in enumerate(plan.placements) if p.spec.name in hashed}
        job.collected = Collected(specs, [], {}, dict(taker.names) if taker.sharded else {}, dict(taker.blocks),
                                  ranks if taker.sharded else ())
        job.layout_sizes = [p.size for p in self._plan(specs)]  # the next commit's layout, prepared after this one
        self._stock = max(self._stock, PREPARE_COPIES)

    def _take_shard(self, job: _Job, plan: ShardPlan) -> Slab:
        """A slab for ``plan``, with its header written, counted in ``job.slabs`` until the end
        (so a failure discards it)."""
        job.plans.append(plan)  # for _take's message on a full filesystem
        slab = self._take(job, plan.size)
        job.slabs.append(slab)
        slab.map[: len(plan.header)] = plan.header
        return slab

    def _take(self, job: _Job, size: int) -> Slab:
        """A slab for ``job``'s next shard. On a full filesystem, free space (:meth:`_reclaim`) and
        try again, up to :data:`RECLAIM_ATTEMPTS` times; then fail with a StorageFullError that
        names what the rest of the commit needs."""
        reclaimed = False
        for attempt in range(RECLAIM_ATTEMPTS + 1):
            try:
                return self._pool.take(size, pinned=job.device is not None)
            except StorageFullError as e:
                if attempt == RECLAIM_ATTEMPTS:
                    need = sum(p.size for p in job.plans[len(job.slabs):])
                    what = f"step {job.handle.step}" + (", after retention and GC ran," if reclaimed else "")
                    raise storage_error(OSError(e.errno, os.strerror(e.errno or 0)), self._tier.tmp_dir,
                                        need, what) from e
                reclaimed = self._reclaim(job) or reclaimed
        raise AssertionError("unreachable")  # pragma: no cover

    def _reclaim(self, job: _Job) -> bool:
        """Free space for ``job``, which found the filesystem full: wait until the commit before
        it is published (only then may retention prune the version before that), delete the
        pool's spare slabs (keeping those of ``job``'s remaining shards) and have this process's
        retention thread, if any, run prune + gc now. Returns whether retention ran.

        No lock is held here: GC takes the GC lock exclusive, which a publishing commit holds
        shared, and the publisher never waits for the stager."""
        previous = self._handed
        if previous is not None:
            futures.wait([previous.committed])
        self._pool.shed([p.size for p in job.plans[len(job.slabs):]])
        return self._reclaim_space is not None and self._reclaim_space(RECLAIM_TIMEOUT_S)

    # -- 2-4. hash, deduplicate, publish -----------------------------------------------------
    def _publish(self, job: _Job) -> None:
        try:
            version = self._hash_dedup_publish(job)
        except BaseException as e:  # noqa: BLE001
            for slab in job.slabs:  # the slabs not yet published or pooled
                slab.discard()
            for slab in job.published:
                slab.close()
            if job.journal is not None:
                job.journal.end(e)
            _fail(job.handle, e)
            return
        if job.journal is not None:
            job.journal.end()
        job.handle.committed.set_result(version)
        try:
            for slab in job.published:  # unmap only now (or keep it mapped for recycling)
                self._pool.retire(slab)
            job.published = []
            if self._on_commit is not None:
                self._on_commit(version, job.handle)
            if self._prepare:
                # The next commits' buffers, faulted (or recycled) in the background once this one
                # is visible (so the page faults do not compete with hashing on the visibility path).
                self._pool.prepare(job.layout_sizes, copies=PREPARE_COPIES, keep=self._stock)
        except Exception as e:  # noqa: BLE001 - the version is committed; keep the thread alive
            warnings.warn(f"paramstore: after committing step {version.step}: {e}", RuntimeWarning, stacklevel=1)

    def _hash_dedup_publish(self, job: _Job) -> Version:
        if job.group is not None:
            return self._group_publish(job, job.group)
        digests = self._hash_all(job)
        # From the dedup lookup to the publish, GC must not delete what this commit will reference.
        with self._gc_lock():
            entries, new_objects, new_tensors, reused = self._store(job, digests)
            self._serve(new_objects)
            manifest = Manifest.of(entries, job.collected.aliases)
            version = self._version(job, manifest)
            self._publish_version(version, manifest, new_objects, new_tensors, reused)
            return version

    def _serve(self, objects: Mapping[str, object]) -> None:
        """Announce the objects just stored here (when this process serves peers), before anyone
        can see a version naming them."""
        if self._announce is not None:
            self._announce(sorted(objects))

    def _publish_version(self, version: Version, manifest: Manifest, new_objects: dict[str, ObjectInfo],
                         new_tensors: dict[str, TensorLocation], reused: Mapping[str, int]) -> None:
        """Publish ``version``; when the registry no longer records objects this commit deduplicated
        against (``reused``: object -> size; UnregisteredObjectsError: GC on another host of a shared
        registry forgot them between the dedup lookup and now), register them again with the
        version and publish once more.

        Registering them again is correct and enough: dedup only uses objects whose file lies on
        the host of the rank that stores the tensor (see :meth:`_store`), and that host's GC cannot
        delete the file while the commit holds its GC lock (shared), from the lookup to the publish.
        So the bytes are there, whole and named by their digest; the registry gets back the
        object's size and the tensors this version places in it (with their index entries). The
        alternative, storing those tensors again, would need a copy of every deduplicated tensor
        kept until the publish (the slabs are compacted or pooled by then). Each retry registers at
        least one more object, so it ends; an object missing that this commit never used (a bug)
        fails the commit with the registry's error.
        """
        while True:
            try:
                self._registry.publish(version, manifest, new_objects, new_tensors)
                return
            except UnregisteredObjectsError as e:
                if not e.digests or not e.digests <= set(reused) - set(new_objects):
                    raise
                spans = manifest.spans()
                for o in e.digests:
                    new_objects[o] = ObjectInfo(reused[o], tuple(d for _, d in sorted(spans[o].items())))
                    new_tensors.update({d: TensorLocation(o, b, end - b) for (b, end), d in spans[o].items()})

    def _group_publish(self, job: _Job, group: CommitGroup) -> Version:
        """One version from the parts of every rank (see :mod:`paramstore.sharded`): each stores its
        objects and sends its part; the lead merges and publishes; all learn the outcome. The GC
        lock is held until then: the objects stored here are referenced by no version before."""
        part: dict[str, Any] = {}
        try:
            if job.error is not None:
                raise job.error
            digests = self._hash_all(job)
        except BaseException as e:  # noqa: BLE001 - sent to the other ranks, then raised
            job.error = e
        with contextlib.ExitStack() as held:
            store_id = ""
            try:  # whatever fails here, this rank still takes part in the exchange, with its error
                held.enter_context(self._gc_lock())
                if job.error is None:
                    entries, new_objects, new_tensors, reused = self._store(job, digests)
                    self._serve(new_objects)
                    part = job.collected.part(entries) | {
                        "objects": {o: [i.size, list(i.tensors)] for o, i in new_objects.items()},
                        "tensors": {d: list(loc) for d, loc in new_tensors.items()},
                        "reused": reused,
                    }
                store_id = self._registry.get_meta("store_id") or ""
            except BaseException as e:  # noqa: BLE001
                job.error = job.error or e
            if job.error is not None:
                part = {"error": f"{type(job.error).__name__}: {job.error}"}
            part |= {"step": job.handle.step, "store": store_id}
            parts = [decode(p) for p in group.all_gather(encode(part))]
            said = self._merge_and_publish(job, group, parts) if group.is_lead else b""
            try:
                outcome = decode(group.broadcast(said))
            except CommitGroupError as e:  # the version may be published all the same
                outcome = self._outcome_without_broadcast(job, group, said, part, e)
        return _outcome_version(outcome, job.error)

    def _outcome_without_broadcast(self, job: _Job, group: CommitGroup, said: bytes, part: dict[str, Any],
                                   error: CommitGroupError) -> dict[str, Any]:
        """The outcome when the broadcast of it failed (a member died after the exchange): the
        lead knows it (a version it published stays published: only a warning); another rank
        looks in the registry for a version at this step holding its own blocks."""
        if group.is_lead:
            outcome = decode(said)
            if "version" in outcome:
                warnings.warn(f"paramstore: step {job.handle.step} is published, but not every rank could be told: "
                              f"{error}", RuntimeWarning, stacklevel=2)
                return outcome
            raise error
        step = job.handle.step
        try:
            version, manifest = self._registry.get_version(step), self._registry.get_manifest(step)
        except Exception:  # noqa: BLE001 - not published (or unreadable): the group's error stands
            raise error from None
        have = {(c.digest, c.object) for _, e in manifest.stored() for c in e.pieces()}
        mine = {(c["digest"], c["object"]) for blocks in part.get("blocks", {}).values() for c in blocks}
        if "error" in part or not mine <= have:
            raise error
        return {"version": version.to_json(), "tags": list(version.tags)}

    def _merge_and_publish(self, job: _Job, group: CommitGroup, parts: list[dict[str, Any]]) -> bytes:
        """The lead: check the parts agree, merge them into one manifest and publish it; returns the
        outcome to broadcast (the version, or the error, as JSON)."""
        try:
            for rank, part in zip(group.ranks, parts):
                if "error" in part:
                    raise CommitGroupError(f"rank {rank} failed to stage step {job.handle.step}: {part['error']}")
            for rank, part in zip(group.ranks, parts):
                if part["step"] != job.handle.step:
                    raise CommitGroupError(f"rank {rank} committed step {part['step']} while rank {group.lead} "
                                           f"committed step {job.handle.step}: every rank must commit the same steps")
                if part["store"] != parts[0]["store"]:
                    raise CommitGroupError(f"rank {rank} commits to another store than rank {group.lead}: ranks "
                                           "on several hosts need one shared registry (registry='redis://...')")
            for rank, part in zip(group.ranks, parts):
                check_part(part, rank)
            entries = merge_parts(parts, group.ranks)
            new_objects = {o: ObjectInfo(size, tuple(ts)) for p in parts for o, (size, ts) in p["objects"].items()}
            new_tensors = {d: TensorLocation(*loc) for p in parts for d, loc in p["tensors"].items()}
            reused = {o: size for p in parts for o, size in p["reused"].items()}
            manifest = Manifest.of(entries, job.collected.aliases)
            version = self._version(job, manifest)
            try:  # every chunk: its length that of its dtype and sizes, inside an object a rank stored or holds
                check_manifest(manifest, version, {**reused, **{o: i.size for o, i in new_objects.items()}},
                               where="merged from the ranks' parts")
            except CorruptObjectError as e:
                raise CommitGroupError(f"the ranks' parts do not make a valid version: {e}") from None
            self._publish_version(version, manifest, new_objects, new_tensors, reused)
        except BaseException as e:  # noqa: BLE001 - every rank fails with it
            job.error = job.error or e
            return encode({"error": f"step {job.handle.step}: {e}"})
        return encode({"version": version.to_json(), "tags": list(version.tags)})

    def _version(self, job: _Job, manifest: Manifest) -> Version:
        return Version(
            step=job.handle.step,
            created_at=job.created_at,
            nbytes=manifest.nbytes,
            digest=manifest.digest(),
            num_tensors=len(manifest.tensors) + len(manifest.aliases),
            tags=tuple(sorted(set(job.tags))),
            metrics=job.metrics,
            metadata=job.metadata,
            writer=self._writer,
        )

    def _hash_all(self, job: _Job) -> list[list[str]]:
        """Every tensor's digest, per shard (and ``job.piece_digests`` of the tensors larger than a
        piece): pieces of large tensors and tensors of 1 MiB or more in parallel on the hash threads.

        Largest first, one thread each (blake3 releases the GIL); a tensor larger than a piece is
        hashed piece by piece, consecutive pieces up to 8 MiB a unit of work
        (:func:`~paramstore.hashing.piece_spans`), so all the hash threads share even one large
        tensor and no byte is hashed twice. Tensors under 1 MiB are hashed right
        here, meanwhile: handing them to a thread would cost more than hashing them. Tensors handed
        to the hash threads as they were staged (``job.early``: all of a CPU commit's, a streaming
        commit's CPU tensors) are only waited for.
        """
        work = [(i, j, k, slab, spans, sum(n for _, n in spans))
                for i, (plan, slab) in enumerate(zip(job.plans, job.slabs))
                for j, p in enumerate(plan.placements) if (i, j) not in job.early
                for k, spans in enumerate(piece_spans(p.offset, p.nbytes))]
        work.sort(key=lambda w: -w[5])
        large = [w for w in work if w[5] >= INLINE_HASH_BYTES]
        small = work[len(large):]
        units = [Unit(w[3], w[4]) for w in large]
        self._hashers.put(units)
        try:
            small_digests = [[hash_bytes(w[3], o, n) for o, n in w[4]] for w in small]
        except BaseException:  # no hash thread may still read a slab once this returns
            futures.wait([u.future for u in self._hashers.cancel(units)])
            raise
        hashed = [u.future.result() for u in units]
        got: list[list[dict[int, list[str]]]] = [[{} for _ in plan.placements] for plan in job.plans]
        for (i, j, k, *_), ds in zip(large + small, [*hashed, *small_digests]):
            got[i][j][k] = ds
        got = [[[d for k in sorted(g) for d in g[k]] for g in row] for row in got]  # type: ignore[misc]
        return [[self._digest_of(job, job.early[(i, j)].result() if (i, j) in job.early else (p.nbytes, ds))
                 for j, (p, ds) in enumerate(zip(plan.placements, got[i]))]
                for i, plan in enumerate(job.plans)]

    @staticmethod
    def _digest_of(job: _Job, hashed: tuple[int, list[str]]) -> str:
        """A tensor's digest from its length and piece digests (recorded in ``job.piece_digests``
        when there are several)."""
        nbytes, ds = hashed
        if len(ds) == 1:
            return ds[0]
        digest = pieces_root(ds, nbytes)
        job.piece_digests[digest] = tuple(ds)
        return digest

    def _store(self, job: _Job, digests: list[list[str]]
               ) -> tuple[dict[str, TensorEntry], dict[str, ObjectInfo], dict[str, TensorLocation], dict[str, int]]:
        """Deduplicate and place ``job``'s shards as objects (the caller holds the GC lock).

        Returns each spec's manifest entry, the objects stored and the index entries of their
        tensors (for :meth:`Registry.publish`), and the sizes of the objects on this host that the
        entries point into without storing them (deduplicated against: see :meth:`_publish_version`)."""
        flat = [d for ds in digests for d in ds]
        # Only bytes this host holds: with a registry shared by hosts the index also names objects
        # that live elsewhere. One stat per object.
        held: dict[str, int | None] = {}
        known = {d: loc for d, loc in self._registry.locate_tensors(sorted(set(flat))).items()
                 if self._held_size(held, loc.object) is not None}
        located: dict[str, TensorLocation] = {}  # digests stored by this commit
        new_objects: dict[str, ObjectInfo] = {}
        entries: dict[str, TensorEntry] = {}

        for plan, ds in zip(job.plans, digests):
            keep: list[tuple[Placement, str]] = []
            repeats: list[tuple[Placement, str]] = []  # same bytes as a tensor kept in this shard
            kept_here: set[str] = set()
            # An object of assets is deduplicated whole: the same files make the same object (its
            # digest covers its header and bytes), which put() finds already there. An asset never
            # points into another object, where it would keep a shard of old tensors alive.
            files = all(p.spec.name.startswith(ASSET_PREFIX) for p in plan.placements)
            for p, d in zip(plan.placements, ds):
                loc = None if files else located.get(d) or known.get(d)
                if d in kept_here:
                    repeats.append((p, d))
                elif loc is not None and loc.offset % ITEMSIZE[p.spec.dtype] == 0:
                    entries[p.spec.name] = _entry(p, d, loc, job.piece_digests.get(d, ()))
                else:
                    keep.append((p, d))
                    kept_here.add(d)
            slab = job.slabs.pop(0)  # from here on this shard's slab is handled below
            if job.journal is not None and len(keep) != len(plan.placements):
                job.journal.seal("deduplicate")  # the slab is compacted or pooled: announced bytes change
            if not keep:
                self._pool.give_back(slab)
                continue
            try:
                header, placed = _compact(slab, plan, [p for p, _ in keep])
                obj = object_digest(header, [d for _, d in keep])
                size = slab.size
                fresh = self._tier.put(obj, slab.path, move=True)
            except BaseException:
                slab.discard()
                raise
            if fresh:
                job.published.append(slab)
            else:  # the very same object is there already (the same assets): this copy is gone
                slab.discard()
            new_objects[obj] = ObjectInfo(size, tuple(d for _, d in keep))
            for (p, d), off in zip(keep, placed):
                located[d] = TensorLocation(obj, off, p.nbytes)
            # Within a shard, larger item sizes come first, so a repeat is always aligned.
            for p, d in keep + repeats:
                entries[p.spec.name] = _entry(p, d, located[d], job.piece_digests.get(d, ()))

        # Index what this commit stored (also bytes known only at an offset misaligned for their dtype).
        new_tensors = {e.digest: TensorLocation(e.object, e.offset, e.nbytes) for e in entries.values()
                       if e.object in new_objects}
        reused = {e.object: held[e.object] for e in entries.values() if e.object not in new_objects}
        return entries, new_objects, new_tensors, reused  # type: ignore[return-value]

    def _held_size(self, held: dict[str, int | None], obj: str) -> int | None:
        """The size of object ``obj`` on this host (None: not here), looked up once per commit."""
        if obj not in held:
            try:
                held[obj] = self._tier.size(obj)
            except FileNotFoundError:
                held[obj] = None
        return held[obj]


def _outcome_version(outcome: dict[str, Any], error: BaseException | None) -> Version:
    """The version a sharded commit's lead announced, or its error raised (CommitGroupError, also
    for an outcome that is neither: a member never trusts a malformed message)."""
    if "error" in outcome:
        raise CommitGroupError(str(outcome["error"])) from error
    tags = outcome.get("tags")
    try:
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise ValueError("tags are not a list of names")
        return Version.from_json(outcome.get("version"), tuple(tags))
    except (ValueError, KeyError, TypeError, ParamStoreError) as e:
        raise CommitGroupError(f"the lead's outcome of a sharded commit is malformed: {e}") from error


def _fail(handle: CommitHandle, e: BaseException) -> None:
    if not handle.staged.done():
        handle.staged.set_exception(e)
    handle.committed.set_exception(e)
    if handle.persisted is not None:
        handle.persisted.set_exception(e)


def _entry(p: Placement, digest: str, loc: TensorLocation, piece_digests: tuple[str, ...]) -> TensorEntry:
    return TensorEntry(p.spec.dtype, p.spec.shape, digest, loc.object, loc.offset, p.nbytes, (), piece_digests)


def _copy_into_slabs(job: _Job, sources: Mapping[str, torch.Tensor], take: Callable[[int], Slab],
                     early: EarlyHash | None = None, serial: bool = False) -> None:
    """Take a slab per shard (``take(size)``), write its header and copy every tensor into place,
    handing each to ``early`` (the hash threads) as soon as its copy is done (CPU sources only).
    ``serial``: copy CPU tensors on this thread alone (see :class:`_Copier`).

    Device tensors are copied on one side stream per device (``non_blocking=True`` into a pinned
    slab), ordered after the work the caller had queued when it called ``commit``
    (``job.ready_events``), and all streams are synchronized before returning, also on error (the
    slabs must not be unmapped under a running DMA). Not exercised on a GPU yet.
    """
    copier = _Copier(job.ready_events, serial=serial)
    watch = job.watch
    try:
        for i, plan in enumerate(job.plans):
            slab = take(plan.size)
            job.slabs.append(slab)
            slab.map[: len(plan.header)] = plan.header
            for j, p in enumerate(plan.placements):
                if p.nbytes:
                    src = sources[p.spec.name]
                    copier.copy(_slab_view(slab, p), src, pinned=slab.pinned)
                    if watch is not None:
                        watch.copied(p.spec.name, src)
                if early is not None:
                    early.copied((i, j), p, slab)
            if early is not None:
                early.flush()
        job.handle._queued.set_result(copier.done_events())  # fence() may now order the caller's streams
    finally:
        copier.synchronize()
    if watch is not None:
        watch.synchronized()
        watch.check(job.handle.step)


class _Watch:
    """Finds the tensors a caller changed in place while its commit copied them.

    A version must hold exactly the bytes passed to ``commit()``. Every tensor carries torch's
    in-place version counter (:func:`~paramstore.tensors.in_place_version`), read here at
    ``commit()`` on the caller's thread: a CPU tensor is checked again right after its copy; an
    accelerator's tensor once its copy has run on the device, or, if the caller fenced the commit
    first (:meth:`CommitHandle.fence`, which ``store.guard`` calls: the kernels it queues next wait
    for the copies on the device), as of that fence. A moved counter fails the commit with
    :class:`~paramstore.errors.TornCommitError` (:meth:`check`). Cost: one integer read per tensor
    at each end. Changes made through ``tensor.data`` do not move the counter and are not seen.
    """

    def __init__(self, collected: Collected) -> None:
        self._at_commit: dict[str, int] = {}
        self._device: dict[str, torch.Tensor] = {}  # accelerator sources, until their copies are checked
        for spec, t in zip(collected.specs, collected.sources):  # on the caller's thread: ~0.1 us a tensor
            v = in_place_version(t)
            if v is not None:
                self._at_commit[spec.name] = v
                if not t.is_cpu and accel.is_accelerator(t.device):
                    self._device[spec.name] = t
        self._fenced: dict[str, int | None] | None = None
        self._lock = threading.Lock()
        self.changed: list[str] = []

    def copied(self, name: str, t: torch.Tensor) -> None:
        """``t``'s copy is queued: a CPU tensor's is done, so note it if it changed since
        ``commit()`` (an accelerator's is checked at :meth:`synchronized`)."""
        if name in self._at_commit and name not in self._device and in_place_version(t) != self._at_commit[name]:
            self.changed.append(name)

    def fence(self) -> None:
        """The caller's later device work waits for the copies: what changes after this is safe."""
        with self._lock:
            if self._fenced is None and self._device:
                self._fenced = {n: in_place_version(t) for n, t in self._device.items()}

    def synchronized(self) -> None:
        """The device copies have run: note the accelerator tensors changed before (or, if the
        commit was fenced, before the fence), and drop the references to them."""
        with self._lock:
            now = self._fenced if self._fenced is not None else {
                n: in_place_version(t) for n, t in self._device.items()}
            self.changed += [n for n, v in now.items() if v != self._at_commit[n]]
            self._device, self._fenced = {}, {}

    def check(self, step: int) -> None:
        """Raise TornCommitError naming the changed tensors, if any."""
        if self.changed:
            names = ", ".join(repr(n) for n in self.changed[:5]) + (", ..." if len(self.changed) > 5 else "")
            raise TornCommitError(
                f"step {step}: {plural(len(self.changed), 'tensor')} changed in place while the commit was copying "
                f"{'them' if len(self.changed) > 1 else 'it'} ({names}), so the version would mix two steps; nothing "
                "was published. Change parameters only once the copy is taken: call store.guard(optimizer) once "
                "(optimizer.step() then waits for it), or wait for handle.staged.result() (store.wait_staged()) "
                "before any other in-place update")


def _slab_view(slab: Slab, p: Placement) -> torch.Tensor:
    """The tensor of placement ``p`` in ``slab``: a view of the mapping (dtype and shape of the spec)."""
    buf = torch.frombuffer(slab.map, dtype=torch.uint8, count=p.nbytes, offset=p.offset) if p.nbytes else \
        torch.empty(0, dtype=torch.uint8)
    return buf.view(ST_TO_TORCH[p.spec.dtype]).view(p.spec.shape)


class _Copier:
    """Copies tensors into staging, on any accelerator (:mod:`paramstore.accel`: CUDA, NPU...).

    CPU tensors are copied at once. An accelerator's tensors are copied on one side stream per
    device, ordered after ``ready`` (device -> event recorded on the caller's current stream when
    ``commit`` was called) or, with ``follow=True``, after the work queued on the caller's current
    stream so far (a streaming commit: each tensor is made just before it is copied;
    ``record_stream`` keeps its memory from being reused before the copy has run).
    :meth:`synchronize` before the slabs are read or unmapped (also on error).

    ``non_blocking=True`` only into pinned memory (``pinned``): only there is a device-to-host
    copy a true asynchronous DMA. Into pageable memory an asynchronous copy gains nothing (the
    driver stages it through a bounce buffer) and when its bytes may be read is up to the backend
    (CUDA returns once they are there; an NPU backend may not), so the copy is blocking there;
    it still runs on the side stream, so it stays ordered after ``ready``. Every stream is
    synchronized before ``staged`` completes either way.

    ``serial``: a contiguous CPU tensor is copied with one ``memmove`` on this thread (the GIL
    released), not on torch's intra-op threads, which would contend with the hash threads for
    the cores (see :data:`paramstore.hashing.OVERLAP_HASH_MIN_CPUS`).
    """

    def __init__(self, ready: Mapping[torch.device, Any], *, serial: bool = False) -> None:
        self._serial = serial
        self._streams: dict[torch.device, Any] = {}
        for dev, event in ready.items():
            self._stream(dev).wait_event(event)

    def _stream(self, dev: torch.device) -> Any:
        if dev not in self._streams:
            self._streams[dev] = accel.new_stream(dev)
        return self._streams[dev]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, follow: bool = False, pinned: bool = False) -> None:
        if not accel.is_accelerator(src.device):
            if (self._serial and src.device.type == "cpu" and src.dtype == dst.dtype and src.is_contiguous()
                    and dst.is_contiguous() and not src.is_conj() and not src.is_neg()
                    and src.nbytes == dst.nbytes and src.layout == torch.strided):
                ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)
            else:
                dst.copy_(src)
            return
        stream = self._stream(src.device)
        if follow:
            stream.wait_stream(accel.current_stream(src.device))
            src.record_stream(stream)
        with accel.on_stream(stream):
            dst.copy_(src, non_blocking=pinned)

    def done_events(self) -> dict[torch.device, Any]:
        """Per device, an event recorded after every copy queued so far."""
        return {dev: accel.record_event(stream) for dev, stream in self._streams.items()}

    def synchronize(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()


def _ready_events(sources: list[torch.Tensor]) -> dict[torch.device, Any]:
    """On the caller's thread: an event per accelerator, recorded on its current stream (the work
    queued so far, e.g. the optimizer step that produced the weights), so that the copy cannot
    read them early. Empty for CPU tensors (no device call at all)."""
    events: dict[torch.device, Any] = {}
    for t in sources:
        dev = t.device
        if dev not in events and accel.is_accelerator(dev):
            events[dev] = accel.record_event(accel.current_stream(dev))
    return events


def _compact(slab: Slab, plan: ShardPlan, keep: list[Placement]) -> tuple[bytes, list[int]]:
    """Rewrite ``slab`` to hold only ``keep`` (a subsequence of the plan's placements).

    Returns the new header and the new offsets. When every tensor is kept nothing moves. Otherwise
    each kept tensor moves to a lower or equal offset (the new header is no longer and the order is
    the same), so moving them front to back never overwrites a tensor not yet moved.
    """
    if len(keep) == len(plan.placements):
        return plan.header, [p.offset for p in keep]
    new = layout([p.spec for p in keep])
    base = address(slab.map)
    for old, moved in zip(keep, new.placements):
        if moved.offset != old.offset and old.nbytes:
            ctypes.memmove(base + moved.offset, base + old.offset, old.nbytes)
    slab.map[: len(new.header)] = new.header
    slab.truncate(new.size)
    return new.header, [p.offset for p in new.placements]
