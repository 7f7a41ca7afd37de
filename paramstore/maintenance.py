"""Prune and garbage-collect: keep shared memory small without deleting anything in use. No torch.

* :func:`prune` applies a retention policy: it removes the versions the policy does not keep. The
  latest version and every leased version are always kept, and the registry re-checks both inside
  the removing transaction, so a reader that leases a version concurrently either wins or sees
  ``VersionNotFoundError``. Objects are not touched.
* :func:`gc` is a mark-and-sweep over the local tier, under the host's GC lock (exclusive; every
  commit holds it shared from its dedup lookup to its publish, so nothing an in-flight commit will
  reference can be swept). Mark: the objects any surviving version references. Sweep: registered
  objects nobody references (dropped from the registry first, so dedup stops pointing at them),
  object files never registered (a crashed commit's), and slabs in ``tmp/`` whose owning process
  is dead. The derived objects of referenced objects (what a recipe made of them:
  :mod:`paramstore.derived`) are marked too; the records of derived objects whose source is
  swept are deleted, so those are swept with it. A swept file is unlinked: on tmpfs a reader
  that still maps it keeps its bytes. Except
  in a process whose slab pool recycles (``ParamStore(recycle_buffers=True)``, the trainer's own
  retention thread): an object of a pruned version that the pool still has mapped is handed back
  to it (renamed into ``tmp/`` as a slab of that process), and the pool reuses it only once no
  other process has it open or mapped (see :mod:`paramstore.staging`).
* :func:`prune_remote` and :func:`gc_remote` do the same for a remote tier (S3...). Remote GC takes
  the remote's exclusive lock, so it never runs while a push or pull is in progress (see
  :mod:`paramstore.remote`), and spares unreferenced objects younger than ``grace`` seconds.
* :class:`Maintainer` runs prune + gc in the background after each commit (``ParamStore(retention=)``)
  and after each version this host received (gc alone with a registry shared by hosts),
  and remote prune + gc after each version persisted to the remote. A commit that finds the
  filesystem full asks it for a run and waits (:meth:`Maintainer.reclaim`) before it gives up.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Mapping

from . import derived, liveness, metrics
from .errors import InvalidArgumentError
from .following import journal_owner_dead
from .manifest import Version
from .reports import GcReport, PruneReport
from .retention import Policy, decide, missing_metrics
from .root import StoreRoot
from .staging import recyclers

if TYPE_CHECKING:
    from .remote import Remote

__all__ = ["prune", "gc", "prune_remote", "gc_remote", "Maintainer",
           "tier_policies", "TIERS"]

#: Runs of a Maintainer on the local tier: prune + gc, and gc alone (a version received with a
#: registry shared by hosts).
_LOCAL_RUNS = ("local", "sweep")

#: Tiers a retention policy can name: ``"local"`` (shared memory) and ``"remote"`` (S3...).
TIERS = ("local", "remote")


def tier_policies(retention: Policy | Mapping[str, Policy] | None) -> dict[str, Policy]:
    """Normalize ``ParamStore(retention=...)``: one policy (for the local tier) or one per tier name."""
    if retention is None:
        return {}
    if isinstance(retention, Policy):
        return {"local": retention}
    if isinstance(retention, Mapping):
        out = {}
        for tier, policy in retention.items():
            if tier not in TIERS:
                raise InvalidArgumentError(f"unknown tier {tier!r} in retention; known tiers: {', '.join(TIERS)}")
            if not isinstance(policy, Policy):
                raise InvalidArgumentError(f"retention for {tier!r} must be a policy, got {policy!r}")
            out[tier] = policy
        return out
    raise InvalidArgumentError(f"retention must be a policy or a mapping of tier names to policies, got {retention!r}")


def prune(root: StoreRoot, policy: Policy, *, dry_run: bool = False, now: float | None = None) -> PruneReport:
    """Remove the versions ``policy`` does not keep (never the latest, never a leased one).

    An explicit prune refuses (InvalidArgumentError, nothing removed) a policy that ranks by a
    metric no version has: a misspelt ``KeepBest`` metric. Background retention (:class:`Maintainer`)
    applies such a policy anyway: versions without the metric are not ranked, its other rules apply.
    """
    versions = list(root.registry.versions())
    _check_metrics(policy, versions)
    return _prune(root, policy, versions, dry_run=dry_run, now=now)


def _check_metrics(policy: Policy, versions: list[Version]) -> None:
    if not isinstance(policy, Policy):
        raise InvalidArgumentError(f"prune needs a retention policy, got {policy!r}")
    missing = missing_metrics(policy, versions)
    if missing:
        raise InvalidArgumentError(f"no version has the metric {missing[0]!r}; check its name (nothing was pruned)")


@metrics.observed("prune")
def _prune(root: StoreRoot, policy: Policy, versions: list[Version], *, dry_run: bool = False,
           now: float | None = None, hold: Mapping[int, list[str]] | None = None) -> PruneReport:
    """:func:`prune` without the metric check; ``hold``: steps kept besides the policy, with reasons."""
    reg = root.registry
    leased = [lease.step for lease in reg.leases()]
    decision = decide(policy, versions, leased, time.time() if now is None else now, hold=hold)
    removed = decision.remove if dry_run else reg.remove_versions(decision.remove)
    spared = sorted(set(decision.remove) - set(removed))
    return PruneReport(decision.keep, removed, dry_run, str(policy), spared)


def awaiting_remote(policy: Policy, local: list[Version], remote: list[Version], received: Mapping[int, str],
                    url: str, now: float) -> dict[int, list[str]]:
    """The local versions that the remote's retention ``policy`` keeps (applied to the local and
    remote versions together) and that the remote has not received (``received``: the registry's
    persisted marks, step -> remote URL), with reasons. Local retention keeps them and the upload
    backlog never skips them: a version the remote is to keep is never lost from both tiers.

    Example:
        >>> from paramstore.retention import AnyOf, KeepEvery, KeepLast
        >>> local = [Version(s, created_at=0.0, nbytes=0, digest="", num_tensors=0) for s in (4, 5, 6, 7)]
        >>> awaiting_remote(AnyOf(KeepLast(1), KeepEvery(5)), local, [], {4: "file:///r", 7: "file:///r"},
        ...                 "file:///r", now=0.0)
        {5: ['kept for the remote (step divisible by 5), not uploaded yet']}
    """
    present = {v.step for v in local}
    versions = sorted({**{v.step: v for v in remote}, **{v.step: v for v in local}}.values(), key=lambda v: v.step)
    kept = policy.keep(versions, now)
    return {s: [f"kept for the remote ({'; '.join(why)}), not uploaded yet"] for s, why in sorted(kept.items())
            if s in present and received.get(s) != url}


@metrics.observed("gc")
def gc(root: StoreRoot, *, dry_run: bool = False) -> GcReport:
    """Mark and sweep the local tier: delete what no surviving version references."""
    reg, tier = root.registry, root.tier
    with root.gc_lock(exclusive=True):
        referenced = reg.referenced_objects()
        referenced |= derived.mark(root, referenced, dry_run=dry_run)  # what recipes made of them
        registered = reg.objects()
        unreferenced = set(registered) - referenced
        never_registered = set(tier.list()) - referenced - set(registered)
        doomed = sorted(unreferenced | never_registered)
        freed = 0
        for d in doomed:
            try:
                freed += tier.size(d)
            except FileNotFoundError:
                pass
        if not dry_run:
            reg.forget_objects(unreferenced)  # first: dedup must not find them any more
            pools = recyclers(tier.tmp_dir) if unreferenced else []
            for d in doomed:
                if not (d in unreferenced and _recycled(pools, tier.object_path(d))):
                    tier.delete(d)
    leftovers = [f for f in tier.leftovers() if _owner_dead(f)]
    if not dry_run:
        for f in leftovers:
            try:
                os.unlink(os.path.join(tier.tmp_dir, f))
            except FileNotFoundError:
                pass
    return GcReport(doomed, freed, leftovers, dry_run)


def prune_remote(remote: "Remote", policy: Policy, *, dry_run: bool = False,
                 now: float | None = None) -> PruneReport:
    """Remove the remote versions ``policy`` does not keep (never the remote's latest).

    Only records and manifests go; :func:`gc_remote` reclaims the objects. A version kept whose
    objects are stored as patches keeps its base versions (transitively) too: they are listed as
    ``spared``.
    """
    versions = remote.versions()
    _check_metrics(policy, versions)
    return _prune_remote(remote, policy, versions, dry_run=dry_run, now=now)


@metrics.observed("remote_prune")
def _prune_remote(remote: "Remote", policy: Policy, versions: list[Version], *, dry_run: bool = False,
                  now: float | None = None) -> PruneReport:
    """:func:`prune_remote` without the metric check."""
    decision = decide(policy, versions, [], time.time() if now is None else now)
    bases = remote.bases(list(decision.keep))
    remove = [s for s in decision.remove if s not in bases]
    if not dry_run:
        remote.remove(remove)
    kept = {**decision.keep, **{b: ["base of a patched version"] for b in bases if b not in decision.keep}}
    return PruneReport(kept, remove, dry_run, str(policy), sorted(set(decision.remove) & bases))


@metrics.observed("remote_gc")
def gc_remote(remote: "Remote", *, dry_run: bool = False, grace: float | None = None,
              timeout: float = 60.0) -> GcReport:
    """Delete remote objects no version references, under the remote's exclusive lock.

    Also deletes manifests without a record (a push that died) and stale locks. Objects and
    manifests younger than ``grace`` seconds (default: the remote's ``grace``) are spared.
    Raises WaitTimeoutError if pushes or another GC hold the remote for ``timeout`` seconds.
    """
    grace = remote.grace if grace is None else grace
    with remote.exclusive_lock(timeout):
        now = time.time()
        steps = set(remote.steps())
        referenced = remote.referenced()
        objects = remote.tier.objects()
        doomed = sorted(d for d, (_, mtime) in objects.items() if d not in referenced and now - mtime > grace)
        manifests = [f"manifests/{name}" for name, mtime in remote.tier.records("manifests").items()
                     if name.endswith(".json") and name[:-5].isdigit() and int(name[:-5]) not in steps
                     and now - mtime > grace]
        stale = [f"locks/{k}" for k in remote.stale_locks()]
        if not dry_run:
            remote.tier.delete_objects(doomed)
            remote.tier.delete_records(manifests + stale)
    return GcReport(doomed, sum(objects[d][0] for d in doomed), manifests + stale, dry_run)


def versions_kept(policy: Policy | None, *, upto: int = 8) -> int:
    """How many versions ``policy`` keeps of a run of ``upto`` fresh commits without metrics or
    tags (the latest included; 0 without a policy): how many commits' buffers are in use before
    GC starts to hand old ones back."""
    if policy is None:
        return 0
    now = time.time()
    versions = [Version(step, created_at=now, nbytes=0, digest="", num_tensors=0) for step in range(1, upto + 1)]
    try:
        return len(decide(policy, versions, [], now).keep)
    except Exception:  # noqa: BLE001 - a Policy of the user's own that fails on a fresh run: assume it keeps all
        return upto


def _recycled(pools: list[Any], path: str) -> bool:
    """Hand an object file being swept to a slab pool of this process that still maps it (the
    pool renames it into ``tmp/``); False if none takes it."""
    for pool in pools:
        try:
            if pool.recycle(path):
                return True
        except OSError:
            pass
    return False


def _owner_dead(name: str) -> bool:
    # Slabs are named slab-<pid>-<start time>-<n> (see backends/tiers/local.py), commit journals
    # journal-<pid>-<start time>-<step> (see paramstore.following).
    journal = journal_owner_dead(name)
    if journal is not None:
        return journal
    parts = name.split("-")
    if len(parts) != 4 or parts[0] != "slab" or not (parts[1].isdigit() and parts[2].isdigit()):
        return False  # not ours to judge
    return not liveness.alive(int(parts[1]), int(parts[2]))


class Maintainer:
    """Runs retention on a background thread; never on the training thread.

    :meth:`poke` (after each commit) asks for prune + gc of the local tier, :meth:`received`
    (after each version a checkout or prefetch brought here) for the same, or for gc alone with a
    registry shared by hosts; :meth:`poke_remote`
    (after each version persisted) for prune + gc of the remote. Bursts coalesce into one run.
    :meth:`reclaim` (a commit that found the filesystem full; the store hands it to its committer) asks for a
    local run and waits for it.

    With a remote policy, a local prune also keeps what :meth:`awaiting_remote` lists: the versions
    the remote policy keeps that the remote has not received. So during a long outage shared memory
    holds, besides the local policy's versions, those the remote policy keeps (with ``KeepEvery(5)``,
    one commit in five) until they are uploaded (``store.push(step)``) or pruned explicitly
    (``store.prune(...)`` does not hold them).
    A policy whose ``KeepBest`` metric no version has still applies (versions without it are not
    ranked). Errors are reported once as warnings and kept in ``last_error``; the next poke retries.
    """

    def __init__(self, root: StoreRoot, policies: Mapping[str, Policy], remote: "Remote | None" = None) -> None:
        self._root = root
        self._policies = dict(policies)
        self._remote = remote
        # The remote's versions as last listed (by a remote run, or once by the first local run):
        # awaiting_remote() never lists the remote itself (it is called on the publisher thread).
        self._remote_versions: list[Version] | None = None
        # Guards _pending and _stop; the loop waits on it. A poke adds to _pending under it, the loop
        # takes _pending under it, so no poke is lost, and only close() (_stop) ends the loop.
        self._cond = threading.Condition()
        self._pending: set[str] = set()
        self._stop = False
        self._idle = threading.Event()
        self._idle.set()
        self.last_error: BaseException | None = None
        self.runs = 0  # completed runs, for monitoring
        # Local runs asked for / finished (under _cond): reclaim() waits for a run asked after it.
        self._local_asked = 0
        self._local_done = 0
        self._thread = threading.Thread(target=self._loop, name="paramstore-retention", daemon=True)
        self._thread.start()

    def poke(self, *_: object) -> None:
        """Ask for a run on the local tier (called after each commit)."""
        self._ask("local")

    def received(self, *, wait: float | None = None) -> None:
        """A version's bytes came to this host (a checkout or a prefetch fetched, pulled or was sent
        them): ask for a run on the local tier, as after a commit. With a registry shared by hosts,
        the run only sweeps (GC: the objects of versions the registry no longer holds): pruning
        that registry is for the hosts that commit to it, by their policies and their remote's
        holds. ``wait``: seconds to wait for the run (a prefetch, whose version is leased only
        until then, so that this run cannot prune it)."""
        ticket = self._ask("sweep" if self._root.registry.shared else "local")
        if wait:
            self._served(ticket, wait)

    def poke_remote(self, *_: object) -> None:
        """Ask for a run on the remote tier (called after each version persisted)."""
        if self._remote is not None:
            self._ask("remote")

    def _ask(self, tier: str) -> int | None:
        # Returns the number of the local run that will serve this ask (None: closed, or remote).
        with self._cond:
            if self._stop:  # closed: nobody would run it (and wait_idle would never return)
                return None
            self._idle.clear()
            self._pending.add(tier)
            self._cond.notify_all()  # the loop (reclaim() callers wait on the same condition)
            if tier in _LOCAL_RUNS:
                self._local_asked += 1
                return self._local_asked
            return None

    def awaiting_remote(self) -> dict[int, list[str]]:
        """The local versions the remote's policy keeps (over the local versions and the remote's
        as last listed) that the remote has not received, with reasons (see :func:`awaiting_remote`);
        empty without a remote policy. The uploader never skips them; local retention keeps them."""
        policy = self._policies.get("remote")
        if policy is None or self._remote is None:
            return {}
        reg = self._root.registry
        return awaiting_remote(policy, list(reg.versions()), self._remote_versions or [], reg.persisted(),
                               self._remote.url, time.time())

    def reclaim(self, timeout: float | None = None) -> bool:
        """Run prune + gc of the local tier now and wait for it: a commit that found the
        filesystem full calls this before it gives up (retention otherwise runs only after a
        successful commit or a version received). A run already in progress does not count (it may have looked at the
        registry before the latest commit). True when a run asked for after this call finished
        within ``timeout`` seconds (its errors are in ``last_error``); False if not, or if closed.

        Must not be called with the GC lock held (GC takes it exclusive)."""
        if threading.current_thread() is self._thread:  # from a run: nothing to ask, nothing to wait for
            return False
        return self._served(self._ask("local"), timeout)

    def _served(self, ticket: int | None, timeout: float | None) -> bool:
        """Wait until the local run that serves ``ticket`` (:meth:`_ask`) finished; False at
        ``timeout``, without a ticket (closed), or on this object's own thread (from a run)."""
        if ticket is None or threading.current_thread() is self._thread:
            return False
        with self._cond:
            return self._cond.wait_for(lambda: self._local_done >= ticket, timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no run is pending or in progress."""
        return self._idle.wait(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if not self._pending:  # closed, and every run asked for is done
                    self._idle.set()
                    return
                pending, self._pending = self._pending, set()
                serving = self._local_asked  # every local ask so far is served by this run
            if "local" in pending:
                pending.discard("sweep")  # (a local run sweeps too)
            error = None  # reported once, retried on the next poke
            for tier in sorted(pending):
                error = self._run(tier) or error
            if error is not None and self.last_error is None:
                warnings.warn(f"paramstore retention failed: {error}", RuntimeWarning, stacklevel=1)
            self.last_error = error
            with self._cond:
                self.runs += 1
                if pending & set(_LOCAL_RUNS):
                    self._local_done = serving
                    self._cond.notify_all()  # reclaim()
                if not self._pending:  # else a poke came during the run: run again first
                    self._idle.set()

    def _run(self, tier: str) -> BaseException | None:
        error = None
        policy = self._policies.get(tier)
        try:
            if tier == "local":
                self._prune_local(policy)
            elif self._remote is not None and policy is not None:
                self._remote_versions = self._remote.versions()
                _prune_remote(self._remote, policy, self._remote_versions)
        except Exception as e:  # noqa: BLE001
            error = e
        try:  # even when prune failed (e.g. the registry was busy); "sweep": GC alone
            if tier in _LOCAL_RUNS:
                gc(self._root)
            elif self._remote is not None and policy is not None:
                gc_remote(self._remote)
        except Exception as e:  # noqa: BLE001
            error = error or e
        return error

    def _prune_local(self, policy: Policy | None) -> None:
        """Prune the local tier by ``policy``, holding what the remote still awaits."""
        if self._remote is not None and "remote" in self._policies and self._remote_versions is None:
            try:  # once: later the remote runs keep the list current
                self._remote_versions = self._remote.versions()
            except Exception:  # noqa: BLE001 - unreachable: the local versions alone (holds more, not less)
                self._remote_versions = []
        if policy is not None:
            _prune(self._root, policy, list(self._root.registry.versions()), hold=self.awaiting_remote())

    def close(self) -> None:
        """Finish the current run and any run asked for, then stop."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:  # a reclaim() still waiting: nothing more will run
            self._local_done = self._local_asked
            self._cond.notify_all()
