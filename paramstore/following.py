"""Following a commit in progress from the same host: each tensor readable as soon as it is staged.

A streaming commit (``store.commit(step, iterable)``) copies each tensor into a slab in ``tmp/``
and then hashes and publishes the version. A reader on the same host can install each tensor
while the trainer is still copying the next ones, instead of waiting for the version to be
visible (:meth:`paramstore.ParamStore.follow_commit`). What makes that safe:

- **The journal.** While it stages, the committer appends one line per tensor whose copy is done
  (its slab file, offset, dtype and shape) to ``tmp/journal-<pid>-<start>-<step>`` (its owner in
  the name: GC deletes the journal of a writer that died), then the outcome: ``published`` once
  the registry transaction is done, or ``failed`` with the error. The file is unlinked after the
  outcome is written; a reader that opened it still reads it.
- **Announced bytes never change unsealed.** A slab region named in the journal holds exactly the
  bytes the version's digest will cover: the commit hashes them in place afterwards. The only
  writes to such a region are compactions (a shard whose tensors were partly deduplicated, or a
  layout that lost tensors) and handing a wholly deduplicated slab back to the pool. Before any
  of them the committer *seals* the journal: it appends ``sealed``, then takes the journal's
  ``flock`` exclusively (and drops it). A reader holds the lock shared while the caller consumes a
  tensor (from the ``yield`` until it asks for the next one) and reads the journal again after
  taking it: once sealed, it reads nothing more from slabs. So the committer waits at most for
  the one tensor being consumed, and the kernel's lock orders the two sides on any architecture. A reader that holds the lock for :data:`SEAL_WAIT_S` fails that commit instead of
  letting its bytes change under it.
- **Nothing unverified crosses hosts.** The journal names files of this host's ``tmp/``; a reader
  elsewhere never finds it and simply waits for the version (its objects are then fetched and
  verified as any checkout's).
- **The end is the version.** Iteration ends only once the version is published; then the reader
  checks the version out (a lease) and yields, from it, every tensor the journal did not serve
  (after a seal, tied names, a slab already renamed). A failed commit raises
  :class:`~paramstore.errors.VersionNotFoundError` naming the writer's error; the caller knows
  which names it was given (:attr:`FollowedCommit.served`) and may restore them.

Sharded (group) commits and commits of whole state dicts keep no journal: a reader of those waits
for the version.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import fcntl
import json
import mmap
import os
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from . import liveness
from .errors import NotAStoreError, ParamStoreError, VersionNotFoundError, WaitTimeoutError
from .format import Placement

if TYPE_CHECKING:
    import torch

    from .manifest import Version
    from .snapshot import Snapshot
    from .store import ParamStore

__all__ = ["FollowedCommit", "StagingJournal", "SEAL_WAIT_S"]

#: Seconds the committer waits for a reader that holds a journal's lock (consuming one tensor)
#: before it seals; past that it fails the commit rather than change bytes being read.
SEAL_WAIT_S = 60.0
#: Seconds between a reader's looks at a journal (or for one) when nothing new is there.
POLL_S = 0.0005
_LIVENESS_EVERY_S = 0.2
_PREFIX = "journal"


def journal_name(step: int) -> str:
    """The journal's file name for ``step``, owned by this process (``journal-<pid>-<start>-<step>``)."""
    pid, start = liveness.this_process()
    return f"{_PREFIX}-{pid}-{start}-{step}"


def journal_owner_dead(name: str) -> bool | None:
    """For a journal's file name: whether its writer is gone (None: not a journal's name)."""
    parts = name.split("-")
    if len(parts) != 4 or parts[0] != _PREFIX or not all(p.isdigit() for p in parts[1:]):
        return None
    return not liveness.alive(int(parts[1]), int(parts[2]))


class StagingJournal:
    """The writer's side: what a streaming commit has staged, for readers on this host (internal:
    the committer keeps one per streaming commit; see the module docstring)."""

    def __init__(self, tmp_dir: str, step: int) -> None:
        self.path = os.path.join(tmp_dir, journal_name(step))
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self.sealed = False
        self._write({"step": step})

    def _write(self, record: dict[str, Any]) -> None:
        if self._fd >= 0:
            os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def staged(self, slab_path: str, p: Placement) -> None:
        """Tensor ``p.spec`` is completely copied into ``slab_path`` at ``p.offset``."""
        if not self.sealed:
            self._write({"t": p.spec.name, "slab": os.path.basename(slab_path), "off": p.offset, "n": p.nbytes,
                         "dtype": p.spec.dtype, "shape": list(p.spec.shape)})

    def seal(self, why: str) -> None:
        """Before any announced byte may change: tell readers to read no more from the slabs, then
        wait until none is still consuming a tensor (once; a no-op when sealed or ended).

        The line goes first, so that readers stop taking the lock (a stream of readers cannot
        starve the commit); the exclusive lock then waits only for the tensor being consumed.

        Raises:
            ParamStoreError: a reader held the lock for :data:`SEAL_WAIT_S` (the commit fails).
        """
        if self.sealed or self._fd < 0:
            return
        self._write({"sealed": why})
        self.sealed = True
        deadline = time.monotonic() + SEAL_WAIT_S
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise ParamStoreError(
                        f"a reader following this commit ({self.path}) held it for {SEAL_WAIT_S:.0f} s without "
                        f"taking the next tensor; the commit cannot {why} under it") from None
                time.sleep(0.001)
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def end(self, error: BaseException | None = None) -> None:
        """Write the outcome (published, or the error), close and unlink the journal (once)."""
        if self._fd < 0:
            return
        try:
            self._write({"failed": f"{type(error).__name__}: {error}"} if error is not None else {"published": True})
        finally:
            os.close(self._fd)
            self._fd = -1
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class _Journal:
    """A reader's open journal: lines parsed as they are appended."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.tmp_dir = os.path.dirname(path)
        self._pending = b""
        self.owner = tuple(int(x) for x in os.path.basename(path).split("-")[1:3])

    def read(self) -> list[dict[str, Any]]:
        """The complete lines appended since the last call."""
        chunks = [self._pending]
        while chunk := os.read(self.fd, 1 << 16):
            chunks.append(chunk)
        data = b"".join(chunks)
        *lines, self._pending = data.split(b"\n")
        return [json.loads(line) for line in lines if line]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FollowedCommit:
    """The tensors of version ``step`` as its commit stages them; see
    :meth:`paramstore.ParamStore.follow_commit` (which makes it) and the module docstring.

    Iterate it once (``for``, or ``async for`` in an event loop): ``(name, tensor)`` pairs, CPU
    tensors mapping shared memory copy-on-write,
    each valid (and unchanging) until the next pair is asked for: copy it before that. Iteration
    ends once the version is published and every one of its tensors was yielded; then
    :attr:`version` is the version and :attr:`snapshot` its checkout (leased until :meth:`close`).

    Attributes:
        step: the step followed.
        served: the names yielded so far, in order.
        early: how many of them came from staging (before the version was visible).
        version: the :class:`~paramstore.Version` once iteration ended; None before.
        snapshot: the version's :class:`~paramstore.Snapshot` once iteration ended (this object
            closes it in :meth:`close`: take it with :meth:`detach_snapshot` to keep it).
    """

    def __init__(self, store: "ParamStore", step: int, *, timeout: float | None, holder: str | None) -> None:
        self.step = step
        self.served: list[str] = []
        self.early = 0
        self.version: Version | None = None
        self.snapshot: Snapshot | None = None
        self._store, self._timeout, self._holder = store, timeout, holder
        self._maps: dict[str, mmap.mmap | None] = {}
        self._journal: _Journal | None = None
        self._started = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self._run():
            if item is None:
                time.sleep(POLL_S)
            else:
                yield item

    async def __aiter__(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The same pairs for an asyncio consumer: the waits are ``asyncio.sleep`` (the event loop
        runs meanwhile); reading the journal and the slabs never blocks, and the checkout at the end
        (of a version published on this host) takes about a millisecond."""
        for item in self._run():
            if item is None:
                await asyncio.sleep(POLL_S)
            else:
                yield item

    def _run(self) -> Iterator[tuple[str, torch.Tensor] | None]:
        """The iteration: pairs, and None wherever it has to wait a moment (the caller sleeps)."""
        if self._started:
            raise ParamStoreError("a FollowedCommit is iterated once")
        self._started = True
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        try:
            self._journal = yield from self._find(deadline)
            if self._journal is not None:
                yield from self._staged(self._journal, deadline)
            self._close_journal()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            snap = self._store.checkout(self.step, timeout=left, holder=self._holder)
            self.snapshot, self.version = snap, snap.version
            done = set(self.served)
            for name in snap:
                if name not in done:
                    self.served.append(name)
                    yield name, snap[name]
        finally:
            self._close_journal()

    def _find(self, deadline: float | None) -> Iterator[None]:
        """Return the journal of this step's commit on this host; None once the version is there
        (or when its commit keeps none). Yields None while waiting."""
        suffix = f"-{self.step}"
        tmp_dir = None
        while True:
            names: list[str] = []
            try:
                if tmp_dir is None:
                    tmp_dir = self._store._root.tier.tmp_dir
                names = [n for n in os.listdir(tmp_dir) if n.startswith(_PREFIX + "-") and n.endswith(suffix)]
            except (FileNotFoundError, NotAStoreError):  # no store yet: the trainer's first commit makes it
                pass
            for name in names:
                if journal_owner_dead(name) is False:
                    try:
                        return _Journal(os.path.join(str(tmp_dir), name))
                    except FileNotFoundError:  # ended meanwhile: the version (or its failure) is there
                        pass
            latest = self._store.latest()
            if latest is not None and latest.step >= self.step:
                return None  # published (or skipped: the checkout says which)
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeoutError(f"step {self.step} was neither committed nor being committed on this host "
                                       f"within {self._timeout:.4g} s (latest: {None if latest is None else latest.step})")
            for _ in range(4):  # a look at tmp/ and the registry every ~2 ms
                yield None

    def _staged(self, journal: _Journal, deadline: float | None) -> Iterator[tuple[str, torch.Tensor] | None]:
        """Yield each tensor the journal announces until it is sealed (None while waiting); return
        once the commit is published; raise if it failed."""
        queued: collections.deque[dict[str, Any]] = collections.deque()
        state: dict[str, Any] = {}  # "sealed", "published", "failed": as read so far

        def pull() -> None:
            for r in journal.read():
                if "t" in r:
                    queued.append(r)
                else:
                    state.update(r)

        checked = time.monotonic()
        while True:
            pull()
            if "failed" in state:
                raise VersionNotFoundError(f"step {self.step} was not committed: its commit failed ({state['failed']})")
            if queued and "sealed" not in state:
                r = queued.popleft()
                fcntl.flock(journal.fd, fcntl.LOCK_SH)
                try:
                    pull()  # a seal appended before the lock was granted ends slab reads
                    if "sealed" in state or "failed" in state or (view := self._view(journal.tmp_dir, r)) is None:
                        continue
                    self.served.append(r["t"])
                    self.early += 1
                    yield r["t"], view
                    del view
                finally:
                    fcntl.flock(journal.fd, fcntl.LOCK_UN)
                continue
            if "published" in state:
                return
            now = time.monotonic()
            if now - checked > _LIVENESS_EVERY_S:
                checked = now
                if not liveness.alive(*journal.owner):
                    raise VersionNotFoundError(f"step {self.step}: its writer (pid {journal.owner[0]}) died while "
                                               "committing it; nothing was published")
            if deadline is not None and now > deadline:
                raise WaitTimeoutError(f"step {self.step} was not published within {self._timeout:.4g} s")
            yield None

    def _view(self, tmp_dir: str, r: dict[str, Any]) -> torch.Tensor | None:
        """The tensor a journal line announces, mapped from its slab (None: the slab is gone)."""
        slab = r["slab"]
        if slab not in self._maps:
            try:
                fd = os.open(os.path.join(tmp_dir, slab), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # renamed into objects/ (published) or discarded: served later
                self._maps[slab] = None
            else:
                try:
                    self._maps[slab] = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE,
                                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
                except ValueError:  # an empty file
                    self._maps[slab] = None
                finally:
                    os.close(fd)
        m = self._maps[slab]
        if m is None or r["off"] + r["n"] > len(m):
            return None
        import torch  # noqa: PLC0415 - a reader of the journal alone (GC, the CLI) never loads torch

        from .tensors import ST_TO_TORCH

        dtype = ST_TO_TORCH[r["dtype"]]
        if not r["n"]:
            return torch.empty(r["shape"], dtype=dtype)
        return torch.frombuffer(m, dtype=torch.uint8, count=r["n"], offset=r["off"]).view(dtype).view(r["shape"])

    def _close_journal(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        self._maps = {}  # each mapping goes with the last view of it

    def detach_snapshot(self) -> "Snapshot | None":
        """Hand the version's snapshot (its lease) to the caller, who then closes it."""
        snap, self.snapshot = self.snapshot, None
        return snap

    def close(self) -> None:
        """Release the journal, the slab mappings and the snapshot (tensors handed over stay valid)."""
        self._close_journal()
        if self.snapshot is not None:
            self.snapshot.close()
            self.snapshot = None

    def __enter__(self) -> "FollowedCommit":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
