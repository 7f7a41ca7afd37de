"""Write-through to the remote: each committed version is pushed in the background.

The :class:`Persister` takes a local lease on a version the moment it is committed (so local
retention cannot prune it before it is durable remotely), then pushes versions in commit order on
one thread. Three rules keep a slow or absent remote from filling shared memory:

* **A bounded backlog that never skips what the remote is to keep.** Besides the version being
  pushed, ``backlog`` versions may wait (with their leases). When one more is committed, the
  oldest waiting version *that the remote's retention policy would not keep* is skipped: it leaves
  the queue, its lease is released so local retention may prune it, a RuntimeWarning says so (and
  why: commits come faster than uploads, with the last upload's rate, or the remote is failing,
  with its error), and its ``handle.persisted`` fails with a RemoteError saying it was skipped
  because of the backlog. A version the remote policy keeps (``keeps``: a ``KeepEvery``
  milestone, one of ``KeepLast(n)``, a best by ``KeepBest``...) is never skipped: when every
  waiting version is such a one, the queue grows past ``backlog`` instead (said once, with a
  RuntimeWarning). We keep rather than apply backpressure: blocking the commit path would stall
  the trainer for as long as an outage lasts (up to ``retry_for`` per version), while keeping
  costs shared memory only for versions the remote policy keeps. So the uploader holds at most
  ``backlog + 1`` versions the remote policy would not keep, plus those it keeps that are not yet
  uploaded: with ``KeepLast(n)`` or ``KeepBest(n)`` at most ``n``, with ``KeepEvery(k)`` one
  commit in ``k`` while uploads lag (each is given up ``retry_for`` after it was queued if the
  remote keeps failing; local retention still keeps it, see :class:`~paramstore.maintenance.Maintainer`,
  and the first push that goes through afterwards queues it again: it is uploaded once the remote
  is back, and local retention may then prune it).
  Without a remote policy (the remote keeps every version) the oldest waiting version is skipped,
  so exactly ``backlog + 1`` versions are held.
* **One retry loop for the whole queue.** Transient failures (the endpoint down, timeouts,
  server errors) are retried with exponential backoff (0.5 s doubling to 30 s), always on the
  oldest waiting version; each version gives up ``retry_for`` seconds after it was queued (its
  future fails with the last error), so a long outage fails a backlog at once, not one
  ``retry_for`` after another. Refusals (missing bucket, access denied, another version at that
  step in the remote) fail that version at once, and it is not queued again in this run.
* **Resume.** A store opened with a remote queues, in the background, the uploads a previous run
  left unfinished: local versions not marked persisted for this remote, whose objects are on this
  host, at or above the remote's newest step (older ones were skipped or failed for good), and
  not being pushed by another live process — the newest ``backlog`` of them.

Either way a version stays usable locally, ``ls`` shows it as not persisted, and the error is on
``handle.persisted``. No torch.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Callable, Container, Iterable

from .errors import InvalidArgumentError, ParamStoreError, RemoteError, StepOrderError, VersionNotFoundError
from .manifest import Version
from .remote import Remote
from .root import StoreRoot

__all__ = ["Persister", "DEFAULT_BACKLOG", "check_backlog"]

_HOLDER = "paramstore push"
#: Versions that may wait for upload besides the one being pushed (``ParamStore(persist_backlog=)``).
DEFAULT_BACKLOG = 2
_FIRST_DELAY, _MAX_DELAY = 0.5, 30.0  # seconds between retries while the remote is down


def check_backlog(backlog: object) -> int:
    """``backlog`` if it is an int >= 1 (``ParamStore(persist_backlog=)``); else InvalidArgumentError."""
    if isinstance(backlog, bool) or not isinstance(backlog, int) or backlog < 1:
        raise InvalidArgumentError(f"persist_backlog must be an int >= 1 (versions that may wait for upload), "
                                   f"got {backlog!r}")
    return backlog


@dataclass
class _Upload:
    """A version queued for upload, and the local lease that keeps it meanwhile."""

    step: int
    lease_id: str
    future: Future[Version]
    deadline: float  # time.monotonic() after which transient failures are not retried any more
    resumed: bool = False  # queued by the resume scan: nobody holds its future, so failures are warned
    skipped: bool = False  # taken off the queue because of the backlog


class Persister:
    """Pushes committed versions to ``remote`` on a background thread, in order.

    Args:
        root: the local store.
        remote: where versions go.
        retry_for: seconds after it is queued that a version stops being retried through
            transient failures (its future then fails with the last error).
        backlog: versions that may wait besides the one being pushed (an int >= 1); when one
            more is queued, the oldest waiting one that the remote policy would not keep is
            skipped (see the module docstring).
        resume: queue, in the background, the uploads a previous run left unfinished (at once;
            else when :meth:`resume` is called: the store calls it when it first commits, so
            readers and CLI commands never upload).
        on_persisted: called (on the push thread) with each version once it is durable remotely.
        on_released: called (no arguments) when the uploader lets go of a version that is not the
            newest local one, so that local retention may prune it.
        keeps: returns the local steps the remote's retention policy keeps and the remote has not
            received (the store passes ``Maintainer.awaiting_remote``): the backlog never skips
            them. None: no remote policy (the oldest waiting version is skipped).
        gather: called with a step before it is pushed, to make every object of the version
            present in the local tier (a sharded version committed on several hosts has blocks
            elsewhere: the store fetches them from its peers). An error fails that upload.

    Raises:
        InvalidArgumentError: ``backlog`` is not an int >= 1.
    """

    def __init__(self, root: StoreRoot, remote: Remote, *, retry_for: float = 900.0,
                 backlog: int = DEFAULT_BACKLOG, resume: bool = True,
                 on_persisted: Callable[[Version], None] | None = None,
                 on_released: Callable[[], None] | None = None,
                 gather: Callable[[int], object] | None = None,
                 keeps: Callable[[], Container[int]] | None = None) -> None:
        self._gather = gather  # makes a version's objects present here first (blocks on other hosts)
        self._root = root
        self._remote = remote
        self._retry_for = retry_for
        self._backlog = check_backlog(backlog)
        self._on_persisted = on_persisted
        self._on_released = on_released
        self._keeps = keeps
        self._cond = threading.Condition()  # guards everything below
        self._waiting: collections.deque[_Upload] = collections.deque()  # oldest first
        self._pending = 0  # versions queued or being pushed, until their future is resolved
        self._resume_below: int | None = None  # newest step when resume() was called
        self._resuming = False
        self._resume_asked = False
        self._closing = False
        self._outage: RemoteError | None = None  # the last transient failure, until a push succeeds
        self.last_error: BaseException | None = None
        self.resumed: list[int] = []  #: steps queued by the resume scan, or again after an outage
        self._refused: set[int] = set()  # steps the remote refused outright: never queued again
        self.skipped = 0  #: versions skipped because of the backlog, since the open
        self._pushing: tuple[int, float] | None = None  # (step, time.monotonic() it started) of the push under way
        self._last_push: tuple[int, float] | None = None  # (bytes, seconds) of the last upload that moved bytes
        self._said_over = False  # the queue grew past the backlog (for versions the remote keeps): said once
        self._said_skip = False  # with a remote policy, skips (of versions it does not keep) are warned once
        self._thread = threading.Thread(target=self._loop, name="paramstore-persist", daemon=True)
        self._thread.start()
        if resume:
            self.resume()

    def resume(self) -> None:
        """Queue, in the background, the uploads a previous run left unfinished (once; later calls
        do nothing)."""
        with self._cond:
            if self._resume_asked:
                return
            self._resume_asked = True
            self._resume_below = self._root.registry.latest_step()
            self._resuming = self._resume_below is not None
            self._cond.notify_all()

    def submit(self, step: int, future: Future[Version] | None = None) -> Future[Version]:
        """Queue version ``step`` for upload; its local lease is taken now. Returns its future.

        If more than ``backlog`` versions would then wait, the oldest waiting one that the remote
        policy would not keep is skipped (its lease released before this one is taken); versions
        the remote policy keeps are never skipped (see the module docstring)."""
        future = future if future is not None else Future()
        with self._cond:
            self._pending += 1
            skipped = self._trim(room=1)
        for u in skipped:
            self._finish(u, error=self._skip_error(u))
        try:
            lease = self._root.registry.acquire_lease(step, _HOLDER)
        except BaseException:
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            self._waiting.append(_Upload(step, lease.id, future, time.monotonic() + self._retry_for))
            skipped = self._trim()  # a failed push may have come back to the queue meanwhile
            self._cond.notify_all()
        for u in skipped:
            self._finish(u, error=self._skip_error(u))
        return future

    @property
    def pending(self) -> int:
        """Versions queued or being pushed (plus one while the resume scan has not run)."""
        return self._pending + self._resuming

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued version is pushed (or failed). False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending + self._resuming == 0, timeout)

    def close(self) -> None:
        """Finish every queued push (each retried up to ``retry_for`` after it was queued), then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    # -- the push thread ---------------------------------------------------------------------
    def _resume_once(self) -> None:
        below, self._resume_below = self._resume_below, None
        try:
            if below is not None:
                self._resume(below)
        except Exception as e:  # noqa: BLE001 - resuming is best effort; the next open tries again
            _warn(f"paramstore: resuming unfinished uploads to {self._remote.url} failed: {e}",
                          RuntimeWarning, stacklevel=1)
        finally:
            with self._cond:
                self._resuming = False
                self._cond.notify_all()

    def _loop(self) -> None:
        delay = _FIRST_DELAY
        while True:
            with self._cond:
                while not self._waiting and not self._closing and not self._resuming:
                    self._cond.wait()
                resume = self._resuming
            if resume:
                self._resume_once()
                continue
            with self._cond:
                if not self._waiting:
                    return
                upload = self._waiting.popleft()
                self._pushing = (upload.step, time.monotonic())
            try:
                if self._gather is not None:
                    self._gather(upload.step)
                report = self._remote.push(self._root, upload.step, show_progress=False)
                version = self._root.registry.get_version(upload.step)
                if report.bytes:
                    self._last_push = (report.bytes, report.seconds)
            except (RemoteError, StepOrderError) as e:
                # A StepOrderError (the remote holds another run's version at this step) is a refusal
                # for good too: not retried after each later push.
                if isinstance(e, StepOrderError) or not e.transient:
                    self._refused.add(upload.step)
                    self._finish(upload, error=e)
                elif self._retry_later(upload, e, delay):
                    time.sleep(delay)  # one wait for the whole queue
                    delay = min(delay * 2, _MAX_DELAY)
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                self._finish(upload, error=e)
            else:
                delay = _FIRST_DELAY
                with self._cond:
                    self._outage = None
                # Before this upload counts as done: wait() (and whoever saw handle.persisted resolve)
                # must not find the queue empty in between, with a version about to be queued again.
                self._requeue_left_behind(upload.step)
                self._finish(upload, version=version)
            finally:
                self._pushing = None

    def _requeue_left_behind(self, pushed: int) -> None:
        """A push went through, so the remote works: queue again the versions older than ``pushed``
        that the remote policy keeps and the remote still lacks (their uploads were given up during
        an outage; local retention keeps them for the remote, so without this they would wait in
        shared memory until the next open). Versions the remote refused outright are not retried."""
        if self._keeps is None:
            return
        try:
            kept = self._keeps()
        except Exception:  # noqa: BLE001 - cannot tell now: the next successful push asks again
            return
        with self._cond:
            busy = {u.step for u in self._waiting} | self._refused
        self._queue_first(s for s in kept if s < pushed and s not in busy)

    def _retry_later(self, upload: _Upload, error: RemoteError, delay: float) -> bool:
        """Put ``upload`` back at the head of the queue after a transient failure; fail the
        versions whose time is up and skip those over the backlog. True if any still waits."""
        with self._cond:
            first = self._outage is None
            self._outage = error
            self._waiting.appendleft(upload)
            horizon = time.monotonic() + delay  # a version that would not get another try fails now
            expired = [u for u in self._waiting if u.deadline <= horizon]
            for u in expired:
                self._waiting.remove(u)
            skipped = self._trim()
            waiting = len(self._waiting)
        if first and waiting:
            _warn(f"paramstore: pushing step {upload.step} to {self._remote.url} failed ({error}); retrying "
                  f"the {waiting} waiting versions for up to {self._retry_for:.0f} s after each was committed "
                  f"(meanwhile at most {self._backlog} wait besides those the remote retention policy keeps)",
                  RuntimeWarning, stacklevel=1)
        for u in expired:
            self._finish(u, error=error)
        for u in skipped:
            self._finish(u, error=self._skip_error(u))
        return waiting > 0

    def _trim(self, room: int = 0) -> list[_Upload]:
        """Take the oldest waiting versions the remote policy would not keep off the queue until at
        most ``backlog - room`` wait (the caller holds ``_cond`` and finishes them outside it).
        Versions the remote policy keeps stay, even past the backlog (see the module docstring)."""
        excess = len(self._waiting) - (self._backlog - room)
        if excess <= 0:
            return []
        kept = self._kept()
        out = [u for u in self._waiting if u.step not in kept][:excess]
        for u in out:
            self._waiting.remove(u)
            u.skipped = True
        self.skipped += len(out)
        if len(out) < excess and not self._said_over:
            self._said_over = True
            steps = ", ".join(str(u.step) for u in self._waiting) + (" and the one just committed" if room else "")
            _warn(f"paramstore: {len(self._waiting) + room} versions wait for upload to {self._remote.url}, more "
                  f"than persist_backlog={self._backlog}, because the remote retention policy keeps them (steps "
                  f"{steps}); {self._why()}. They stay in shared memory until uploaded; this is said once",
                  RuntimeWarning, stacklevel=1)
        return out

    def _kept(self) -> Container[int]:
        """Steps the remote policy keeps and the remote lacks (never skipped); empty if unknown."""
        if self._keeps is None:
            return ()
        try:
            return self._keeps()
        except Exception as e:  # noqa: BLE001 - cannot tell: keep every waiting version (bounded by retry_for)
            _warn(f"paramstore: cannot tell which versions the remote policy keeps ({e}); none is skipped",
                  RuntimeWarning, stacklevel=1)
            return {u.step for u in self._waiting}

    def _why(self) -> str:
        """Why versions pile up: the remote failing (with its error) or commits outpacing uploads."""
        outage = self._outage
        if outage is not None:
            return f"the remote is failing (last error: {outage}); the waiting versions are retried"
        pushing, last = self._pushing, self._last_push
        rate = (f"the last upload moved {last[0] / 1e6:.1f} MB at {last[0] / 1e6 / max(last[1], 1e-6):.1f} MB/s"
                if last is not None else "no upload has finished yet")
        now = (f"; step {pushing[0]} has been uploading for {time.monotonic() - pushing[1]:.1f} s"
               if pushing is not None else "")
        return f"commits come faster than uploads ({rate}{now})"

    def _skip_error(self, upload: _Upload) -> RemoteError:
        which = ("the remote retention policy does not keep it" if self._keeps is not None else
                 "without a remote retention policy the oldest waiting version is skipped")
        n = self._backlog
        return RemoteError(
            f"step {upload.step} was not uploaded to {self._remote.url}: skipped because the upload backlog was "
            f"full ({n} version{'s wait' if n != 1 else ' waits'} besides the one being pushed: "
            f"ParamStore(persist_backlog=)); {self._why()}; {which}. It stays in the local store until local "
            f"retention prunes it (until then store.push({upload.step}) uploads it). To upload more versions, raise "
            "persist_backlog or commit less often; a remote retention policy (e.g. KeepEvery) names the versions "
            "never to skip", transient=False)

    def _finish(self, upload: _Upload, *, version: Version | None = None,
                error: BaseException | None = None) -> None:
        """Resolve ``upload``'s future, release its lease, and count it done."""
        try:
            if error is not None:
                self.last_error = error
                if upload.skipped and self._keeps is not None:  # the remote would not keep it: said once
                    if not self._said_skip:
                        self._said_skip = True
                        _warn(f"paramstore: {error} (said once: later versions the remote policy does not keep may "
                              "be skipped the same way; each one's handle.persisted says so)", RuntimeWarning,
                              stacklevel=1)
                elif upload.resumed or upload.skipped:
                    _warn(f"paramstore: {error}" if upload.skipped else
                                  f"paramstore: resuming the upload of step {upload.step} failed: {error}",
                                  RuntimeWarning, stacklevel=1)
                try:
                    upload.future.set_exception(error)
                except InvalidStateError:
                    pass
            else:
                assert version is not None
                try:
                    upload.future.set_result(version)
                except InvalidStateError:
                    pass
                if self._on_persisted is not None:
                    try:
                        self._on_persisted(version)
                    except Exception as e:  # noqa: BLE001
                        _warn(f"paramstore: after persisting step {upload.step}: {e}", RuntimeWarning,
                                      stacklevel=1)
        finally:
            try:
                self._root.registry.release_lease(upload.lease_id)
                if self._on_released is not None and upload.step != self._root.registry.latest_step():
                    self._on_released()
            except (ParamStoreError, RuntimeError, OSError):
                pass
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def _resume(self, below: int) -> None:
        """Queue the uploads a previous run left unfinished (see the module docstring): local
        versions up to step ``below`` not persisted to this remote, with their objects here, at or
        above the remote's newest step, not leased by another uploader; the newest ``backlog``."""
        delay, deadline = _FIRST_DELAY, time.monotonic() + self._retry_for
        while True:
            try:
                self._remote.create()  # the writer's first commit makes the remote (a read never does)
                remote_steps = self._remote.steps()
                break
            except RemoteError as e:
                with self._cond:
                    closing = self._closing
                if not e.transient or closing or time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, _MAX_DELAY)
        reg = self._root.registry
        floor = remote_steps[-1] - 1 if remote_steps else None  # the remote's newest may lack its mark here
        persisted = reg.persisted()
        busy = {lease.step for lease in reg.leases() if lease.holder.startswith(_HOLDER)}
        chosen: list[int] = []
        for v in reversed(list(reg.versions(after=floor))):
            if len(chosen) == self._backlog:
                break
            if v.step <= below and persisted.get(v.step) != self._remote.url and v.step not in busy \
                    and self._objects_here(v.step):
                chosen.append(v.step)
        self._queue_first(chosen)

    def _queue_first(self, steps: Iterable[int]) -> None:
        """Queue ``steps`` (older than anything waiting) ahead of the queue, each under a lease taken
        now; nobody holds their futures (failures are warned). A step pruned meanwhile (or that the
        registry refuses to lease) is left out: the next open or successful push tries again."""
        uploads = []
        for step in sorted(steps):
            try:
                lease = self._root.registry.acquire_lease(step, _HOLDER)
            except ParamStoreError:
                continue
            uploads.append(_Upload(step, lease.id, Future(), time.monotonic() + self._retry_for, resumed=True))
        with self._cond:
            self._pending += len(uploads)
            self._waiting.extendleft(reversed(uploads))
            self.resumed.extend(u.step for u in uploads)
            skipped = self._trim()
            self._cond.notify_all()
        for u in skipped:
            self._finish(u, error=self._skip_error(u))

    def _objects_here(self, step: int) -> bool:
        """Whether every object of local version ``step`` is on this host (a shared registry
        lists versions whose bytes are elsewhere)."""
        try:
            objects = self._root.registry.get_manifest(step).objects()
        except VersionNotFoundError:
            return False
        return all(self._root.tier.exists(o) for o in objects)


def _warn(message: str, category: type[Warning], stacklevel: int = 1) -> None:
    """warnings.warn on the push thread: a warning filter set to "error" must not end the thread
    (a version would stay queued with its lease held)."""
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Warning:
        pass
