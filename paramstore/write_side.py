"""The trainer's half of a store in this process: commit, then upload, patch, export and retain.

:class:`WriteSide` owns what a commit starts: the committer (staging into shared memory, hashing,
publishing: :mod:`paramstore.commit`), the process groups of sharded commits, the writer claim, the
uploads to a remote (:mod:`paramstore.persist`), the patch maker (:mod:`paramstore.delta`), the
device copy of the latest version (:mod:`paramstore.device`) and background retention
(:mod:`paramstore.maintenance`). :class:`~paramstore.ParamStore` delegates to it and closes it.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from . import adapters, derived, metrics
from .assets import AssetsArg, model_assets, read_assets
from .delta import Patcher
from .errors import (
    InvalidArgumentError,
    ParamStoreError,
    StepOrderError,
    StoreClosedError,
    VersionNotFoundError,
    WaitTimeoutError,
)
from .maintenance import Maintainer
from .manifest import Version
from .opening import Opening
from .persist import Persister
from .retention import check_commit_metrics
from .root import StoreRoot
from .staging import SlabPool
from .validate import check_bound, check_metadata, check_metrics, check_step, check_tag, check_timeout
from .writer import check_run_id, claim, new_run_id, release

if TYPE_CHECKING:
    import torch

    from .commit import CommitHandle, Committer
    from .device import LatestExporter

__all__ = ["WriteSide"]

#: How long a push waits for the patches of its version before it uploads whole objects.
PATCH_WAIT_S = 60.0
_DEATH_POLL_S = 0.2  # how often wait_for_readers re-checks for readers that died


class WriteSide:
    """Commits of one process to one store, and what follows each (see the module docstring).

    ``opening`` opens the store (the first commit creates it); ``gather(step)`` makes every object
    of a version present on this host (the read side's), before it is pushed; ``announce(objects)``
    serves objects just stored to other hosts, if this process serves (the read side's), before
    the version or patch record naming them is published; ``prefetch(step, recipe)`` (the read
    side's) makes a version's derived objects (``StoreOptions.derive``), returning a Future.
    """

    def __init__(self, opening: Opening, gather: Callable[[int], None], announce: Callable[[list[str]], None],
                 prefetch: "Callable[[int, str], Future[Any]] | None" = None) -> None:
        self._open, self._opts, self._gather, self._announce = opening, opening.opts, gather, announce
        self._prefetch = prefetch
        if self._opts.derive:
            for recipe in self._opts.derive:
                derived.resolve_recipe(recipe)  # an unknown name fails the store's creation
        self._deriving: Future[Any] | None = None  # the derivations of one version in flight
        self._derive_next: int | None = None  # the newest step committed meanwhile (derived next)
        self._derived_up_to = -1  # derivations of every step up to this one are done (or failed)
        self._derived_last: dict[str, int] = {}  # recipe -> the last step derived here (patches' base)
        self._derive_done = threading.Condition()
        self.run_id = new_run_id() if self._opts.run_id is None else check_run_id(self._opts.run_id)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a streaming commit is queued
        self._parts_lock = threading.Lock()
        self._streaming = 0  # streaming commits being staged on callers' threads (close() waits)
        self._groups: dict[tuple[int, ...], Any] = {}  # ranks -> CommitGroup (sharded commits)
        self._broken_groups: list[Any] = []  # failed groups, destroyed at close
        self._settled_metrics: set[str] = set()  # KeepBest metrics commit() no longer questions
        self._claimed = False
        self._last_step: int | None = None  # highest step submitted by this process
        self.last_handle: CommitHandle | None = None
        self.maintainer: Maintainer | None = None
        self.persister: Persister | None = None
        self.committer: Committer | None = None
        self.patcher: Patcher | None = None
        self.exporter: LatestExporter | None = None
        metrics.attach(opening)  # ParamStore(metrics=True)
        opening.on_open(self._opened)

    def _opened(self, root: StoreRoot, pool: SlabPool) -> None:
        """The store is open: start retention and the upload queue (which resumes nothing until
        this process commits)."""
        opts, policies, remote = self._opts, self._opts.policies, self._open.remote
        self.maintainer = Maintainer(root, policies, remote) if policies else None
        m = self.maintainer
        if m is not None:  # a host that receives versions keeps to its retention as one that commits
            self._open.on_received(m.received)
        self.persister = None if remote is None else Persister(
            root, remote, retry_for=opts.persist_retry_for, backlog=opts.persist_backlog, resume=False,
            on_persisted=m.poke_remote if m is not None else None, on_released=m.poke if m is not None else None,
            gather=self._before_push, keeps=m.awaiting_remote if m is not None and "remote" in policies else None)

    # -- commit ------------------------------------------------------------------------------
    @metrics.observed("commit")
    def commit(self, step: int, model: Any, *, tags: Iterable[str] | str, metrics: Mapping[str, float] | None,
               metadata: Mapping[str, Any] | None, dtype: "torch.dtype | None", group: Any,
               assets: AssetsArg, base: Any = None, adapter_config: Any = None) -> CommitHandle:
        """:meth:`ParamStore.commit <paramstore.ParamStore.commit>`."""
        from .tensors import Taker, check_cast, collect, commit_ranks, is_stream, model_items

        if base is not None or adapter_config is not None:  # an adapter version (paramstore.adapters)
            return self._commit_adapter(step, model, base, adapter_config, tags=tags, metrics=metrics,
                                        metadata=metadata, dtype=dtype, assets=assets)
        # First who commits together (no validation yet: a rank that fails any check below must
        # still tell the others, in the group's exchange for this step).
        stream = is_stream(model)
        if stream:
            pairs, ranks = _stream_ranks(model, group)
        else:
            items = model_items(model)
            ranks = commit_ranks([v for _, v in items], group)
        commit_group = self._commit_group(ranks) if len(ranks) > 1 else None
        try:
            check_step(step)
            tags_t = tuple(check_tag(t) for t in ([tags] if isinstance(tags, str) else tags))
            metrics_d, metadata_d = check_metrics(metrics), check_metadata(metadata)
            if metrics_d and self._opts.policies:  # a KeepBest metric that looks misspelt: refused here
                check_commit_metrics(self._opts.policies.values(), metrics_d, lambda: () if self._open.opened is None
                                     else self._open.opened.registry.versions(), self._settled_metrics)
            cast = check_cast(dtype)
            files = {**read_assets(assets), **({} if stream else model_assets(model, cast))}
            if os.getpid() != self._open.owner:
                raise ParamStoreError("this store was opened in the parent process; open a new ParamStore "
                                      "after fork to commit from the child")
            if stream:
                taker = Taker(cast=cast, sharded=commit_group is not None, ranks=ranks,
                              writes_plain=commit_group is None or commit_group.is_lead, assets=files)
            else:
                collected = collect(items, dtype=cast, ranks=ranks, assets=files)
            root = self._open.attach(create=self._opts.create is not False)
            with self._lock:
                persist, previous, committer = self._admit(root, step, commit_group)
                if stream:
                    self._streaming += 1  # close() waits for it: it is staged outside the lock
                else:
                    handle = committer.submit(step, collected, tags_t, metrics_d, metadata_d, persist=persist,
                                              group=commit_group)
        except BaseException as e:
            if commit_group is not None:  # the other ranks are committing this step: they must learn of it
                self._fail_in_group(commit_group, step, e)
            raise
        if stream:  # staged here, on the caller's thread, outside the lock
            try:
                handle = committer.submit_stream(step, pairs, taker, tags_t, metrics_d, metadata_d,
                                                 persist=persist, group=commit_group, ranks=ranks)
            finally:
                with self._lock:
                    self._streaming -= 1
                    self._idle.notify_all()
        self.last_handle = handle
        handle.committed.add_done_callback(lambda f: f.exception() and self._forget_step(step, previous))
        return handle

    def _commit_adapter(self, step: int, adapter: Any, base: Any, adapter_config: Any, *,
                        metadata: Mapping[str, Any] | None, assets: AssetsArg, **kw: Any) -> CommitHandle:
        """An adapter version: the adapter's tensors, its ``adapter_config.json`` as an asset, and
        its base in the metadata. The base is leased until the version is visible (or the commit
        failed), so no prune removes it before an adapter version that names it exists."""
        if base is None:
            raise InvalidArgumentError("adapter_config= makes an adapter version: pass base= too (the version the "
                                       "adapter applies to)")
        made = adapters.adapter_of(adapter, adapter_config)
        meta = dict(metadata or {})
        if adapters.BASE_KEY in meta:
            raise InvalidArgumentError(f"metadata key {adapters.BASE_KEY!r} is the store's (base=)")
        files = dict(read_assets(assets))
        files[adapters.ADAPTER_CONFIG] = adapters.config_bytes(made.config)
        root = self._open.attach(create=False)
        reg = root.registry
        base_step = base.step if isinstance(base, Version) else root.resolve(base)
        lease = reg.acquire_lease(base_step, f"adapter commit of step {step}, pid {os.getpid()}")
        try:
            based = reg.get_version(base_step)
            if isinstance(base, Version) and base.digest != based.digest:
                raise InvalidArgumentError(f"base: version {base_step} in this store is not the Version passed")
            if adapters.base_of(based.metadata) is not None:
                raise InvalidArgumentError(f"base: version {base_step} is itself an adapter version; an adapter "
                                           "applies to a full version")
            meta[adapters.BASE_KEY] = {"step": base_step, "digest": based.digest}
            handle = self.commit(step, made.tensors, metadata=meta, group=None, assets=files, **kw)
        except BaseException:
            reg.release_lease(lease.id)
            raise
        handle.committed.add_done_callback(lambda _f: reg.release_lease(lease.id))
        return handle

    def _admit(self, root: StoreRoot, step: int, group: Any) -> tuple[bool, int | None, Committer]:
        """Under the lock: claim the store as its writer (the lead of a group), check the step
        order and take the step. Returns (whether to persist, the step before, the committer)."""
        lead = group is None or group.is_lead
        if lead:  # the lead publishes: it is the writer
            claim(root.registry, self.run_id, takeover=self._opts.takeover, root=self._open.path)
            self._claimed = True
        persist = self.persister is not None and lead
        if persist:
            self.persister.resume()  # the writer finishes what its previous run left unpushed
        latest = root.registry.latest_step()
        floor = max(x for x in (latest, self._last_step, -1) if x is not None)
        if step <= floor:
            raise StepOrderError(f"step {step} must be above the latest step {floor}")
        previous, self._last_step = self._last_step, step
        if self._opts.device_latest is not None:
            self._exporter()  # there before the commit resolves: its export is submitted after
        return persist, previous, self._get_committer()

    def _fail_in_group(self, group: Any, step: int, error: BaseException) -> None:
        """This rank's commit of ``step`` failed before it was queued: take part in the group's
        exchange with the error (after this process's earlier commits), so every rank fails this
        step instead of waiting, and later steps stay in step."""
        if self.last_handle is not None:
            wait([self.last_handle.committed])
        try:
            group.fail(step, error)
        except ParamStoreError:
            pass  # the group is broken anyway: the others learn it from their own collectives

    def _commit_group(self, ranks: tuple[int, ...]) -> Any:
        """The gloo group of ``ranks`` for sharded commits, made at their first one (collectively:
        every rank of ``ranks`` calls this at the same commit). A group that failed (a member died
        or timed out) is replaced at the next commit; the failed one is kept until close, so the
        new one gets a fresh name on every rank."""
        from .sharded import CommitGroup

        group = self._groups.get(ranks)
        if group is not None and group.broken:
            self._broken_groups.append(self._groups.pop(ranks))
            group = None
        if group is None:
            # the store as every rank names it: its shared name, or its root on this host
            identity = self._opts.name if self._opts.registry else os.path.realpath(self._open.path)
            group = self._groups[ranks] = CommitGroup(ranks, self._opts.group_timeout, identity)
        return group

    def _forget_step(self, step: int, previous: int | None) -> None:
        # A failed commit does not use up its step: it may be retried.
        with self._lock:
            if self._last_step == step:
                self._last_step = previous

    def prepare(self, model: Any, wait: bool, timeout: float | None) -> None:
        """:meth:`ParamStore.prepare <paramstore.ParamStore.prepare>`."""
        from .tensors import collect

        self._open.attach(create=self._opts.create is not False)
        committer = self._get_committer()
        committer.prepare(collect(model, assets=model_assets(model)), ahead=self._open.ahead)
        if wait and not committer.wait_prepared(timeout):
            raise WaitTimeoutError(f"buffers not prepared within {timeout:.4g} s")

    def wait_staged(self, timeout: float | None) -> None:
        """Block until the last commit of this process is staged (re-raises its error)."""
        handle = self.last_handle
        if handle is not None:
            try:
                handle.staged.result(timeout)
            except FutureTimeout:
                raise WaitTimeoutError(f"commit of step {handle.step} not staged within {timeout:.4g} s") from None

    def flush(self, timeout: float | None) -> Version | None:
        """Wait until every commit of this process is visible, and its patches and derived objects
        made (``StoreOptions.derive``); the last version."""
        handle = self.last_handle
        if handle is None:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        version = handle.result(timeout)  # raises WaitTimeoutError
        if self._opts.use_patches and self._patcher().wait(
                version.step, None if deadline is None else max(0.0, deadline - time.monotonic())) is False:
            raise WaitTimeoutError(f"the patches of step {version.step} were not made within {timeout:.4g} s")
        if self._opts.derive and self._prefetch is not None and not self.wait_derived(
                version.step, None if deadline is None else max(0.0, deadline - time.monotonic())):
            raise WaitTimeoutError(f"step {version.step} was not derived ({', '.join(self._opts.derive)}) "
                                   f"within {timeout:.4g} s")
        return version

    def wait_persisted(self, timeout: float | None) -> None:
        """Block until every version committed so far is pushed (or failed)."""
        self.flush(timeout)
        if self.persister is not None and not self.persister.wait(timeout):
            n = self.persister.pending
            raise WaitTimeoutError(f"{n} version{'' if n == 1 else 's'} not persisted within {timeout:.4g} s")

    def wait_for_readers(self, min_step: int, timeout: float | None) -> None:
        """:meth:`ParamStore.wait_for_readers <paramstore.ParamStore.wait_for_readers>`."""
        check_timeout(timeout)
        check_bound(min_step, "min_step")
        if self._open.not_created():
            return
        reg = self._open.root.registry
        deadline = None if timeout is None else time.monotonic() + timeout
        with reg.watch("leases") as watch:
            while True:
                old = [lease for lease in reg.leases() if lease.step < min_step]
                if not old:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    who = "1 reader still holds a version" if len(old) == 1 else f"{len(old)} readers still hold versions"
                    raise WaitTimeoutError(f"{who} older than step {min_step} after {timeout:g} s (oldest: step "
                                           f"{min(lease.step for lease in old)}, held by {old[0].holder})")
                # releases wake us; deaths are noticed by polling
                watch.wait(_DEATH_POLL_S if left is None else min(left, _DEATH_POLL_S))

    # -- after a commit ----------------------------------------------------------------------
    def _before_push(self, step: int) -> None:
        """On the persister's thread, before a push: the objects other hosts hold come here (a shared
        registry), and the version's patches and derived objects (``derive=``) are made first (for
        up to a minute each), so the remote can get patches instead of whole objects, and the
        derived forms with the version."""
        if self._opts.registry is not None:
            self._gather(step)
        if self._opts.use_patches and self.patcher is not None:
            self.patcher.wait(step, PATCH_WAIT_S, submitted=False)
        if self._opts.derive and self._prefetch is not None:
            self.wait_derived(step, PATCH_WAIT_S)  # its derived forms go with it (Remote.push)

    def _exporter(self) -> LatestExporter:
        with self._parts_lock:
            if self.exporter is None:
                from .device import LatestExporter

                assert self._open.opened is not None and self._opts.device_latest is not None
                self.exporter = LatestExporter(self._open.opened, self._opts.device_latest,
                                               bucket_bytes=self._opts.device_bucket_bytes)
            return self.exporter

    def _patcher(self) -> Patcher:
        with self._parts_lock:
            if self.patcher is None:
                assert self._open.opened is not None
                self.patcher = Patcher(self._open.opened, self.run_id, announce=self._announce)
            return self.patcher

    def _get_committer(self) -> Committer:
        if self.committer is None:
            from .commit import Committer

            root, m = self._open.opened, self.maintainer
            assert root is not None and self._open.pool is not None
            self.committer = Committer(
                root.tier, root.registry, self._open.pool, self._opts.shard_size_bytes, gc_lock=root.gc_lock,
                prepare_buffers=self._opts.prepare_buffers, on_commit=self._after_commit, writer=self.run_id,
                reclaim=m.reclaim if m is not None else None, announce=self._announce)
        return self.committer

    def _after_commit(self, version: Version, handle: CommitHandle) -> None:
        # On the publisher thread, before retention runs: the push's lease keeps the version
        # from being pruned locally until it is durable in the remote. Patches are asked for
        # first: the push waits for them.
        if self._opts.use_patches:
            self._patcher().submit(version.step, version.writer)
        if self._opts.device_latest is not None and version.writer == self.run_id:
            self._exporter().submit(version.step)
        if self._opts.derive and self._prefetch is not None:
            self._derive(version.step)
        if self.persister is not None and handle.persisted is not None:
            try:
                self.persister.submit(version.step, handle.persisted)
            except BaseException as e:  # noqa: BLE001 - reported through the future
                handle.persisted.set_exception(e)
        if self.maintainer is not None:
            self.maintainer.poke()

    def _derive(self, step: int) -> None:
        """Derive ``step`` in every recipe of ``StoreOptions.derive`` (the read side's prefetch
        thread), unless derivations are in flight: then the newest step waits for them."""
        with self._derive_done:
            if self._deriving is not None and not self._deriving.done():
                self._derive_next = step if self._derive_next is None else max(step, self._derive_next)
                return
        assert self._prefetch is not None
        futures = [self._prefetch(step, recipe) for recipe in self._opts.derive]
        with self._derive_done:
            self._deriving = futures[-1]  # (one after another on the prefetch thread: the last ends them)
        futures[-1].add_done_callback(lambda f, step=step: self._derived(step, futures))

    def _derived(self, step: int, futures: list[Future[Any]]) -> None:
        for recipe, f in zip(self._opts.derive, futures):
            error = None if f.cancelled() else f.exception()
            if error is not None and not isinstance(error, (VersionNotFoundError, StoreClosedError)):
                warnings.warn(f"paramstore: deriving step {step} with recipe {recipe!r} failed: "
                              f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=1)
            if error is None and self._opts.use_patches:
                self._derived_patches(recipe, step)
        with self._derive_done:
            self._derived_up_to = max(self._derived_up_to, step)
            nxt, self._derive_next = self._derive_next, None
            self._derive_done.notify_all()
        if nxt is not None:
            self._derive(nxt)

    def _derived_patches(self, recipe: str, step: int) -> None:
        """Patches for ``step``'s derived objects against the last step derived here
        (:func:`paramstore.derived.make_patches`), so hosts holding that one move patches."""
        base, self._derived_last[recipe] = self._derived_last.get(recipe), step
        if base is None or base >= step:
            return
        try:
            derived.make_patches(self._open.opened, recipe, base, step, announce=self._announce)
        except (VersionNotFoundError, StoreClosedError):
            pass  # pruned meanwhile: its hosts move whole objects
        except Exception as e:  # noqa: BLE001 - a patch is never needed; the thread goes on
            warnings.warn(f"paramstore: the patches of step {step} in recipe {recipe!r} were not made: "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=1)

    def wait_derived(self, step: int, timeout: float | None) -> bool:
        """Block until the derivations of ``step`` (or of a newer version) are done; False on timeout."""
        with self._derive_done:
            return self._derive_done.wait_for(lambda: self._derived_up_to >= step, timeout)

    # -- closing -----------------------------------------------------------------------------
    def wait_streaming(self) -> None:
        """Wait until no streaming commit is being staged on another thread (it is queued first)."""
        with self._lock:
            while self._streaming:
                self._idle.wait()

    def close(self) -> None:
        """Finish in-flight commits, patches and uploads; give up the writer claim; stop retention."""
        for part in (self.committer, self.patcher, self.exporter):
            if part is not None:
                part.close()
        if self._claimed and self._open.opened is not None:
            try:
                release(self._open.opened.registry, self.run_id)  # the next trainer starts without a warning
            except ParamStoreError:
                pass  # the registry is gone or damaged: nothing to give up
        if self.persister is not None:
            self.persister.close()  # every committed version is pushed (or has failed) first
        if self.maintainer is not None:
            self.maintainer.close()
        self.destroy_groups()

    def destroy_groups(self) -> None:
        """Destroy the process groups of sharded commits (also when the store never opened)."""
        for group in [*self._groups.values(), *self._broken_groups]:
            group.destroy()


def _stream_ranks(model: Iterable[Any], group: Any) -> tuple[Iterator[Any], tuple[int, ...]]:
    """The pairs of a streaming commit and the ranks committing it: ``group``'s, or those of
    the first tensor's mesh when it is a DTensor (a later DTensor must lie in them)."""
    from .tensors import check_pair, commit_ranks

    it = iter(model)
    first = next(it, None)
    if first is None:
        raise InvalidArgumentError("the commit's iterable yielded no tensors")
    ranks = commit_ranks([check_pair(first)[1]], group)
    return _prepend([first], it), ranks


def _prepend(box: list[Any], rest: Iterator[Any]) -> Iterator[Any]:
    """The item in ``box``, then ``rest``; the item is let go of once handed over (``itertools.chain``
    would keep it until the end: the first tensor of a streaming commit alive for the whole commit)."""
    yield box.pop()
    yield from rest
