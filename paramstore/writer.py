"""Who writes a store: one trainer (a run) at a time.

The registry keeps the current writer (``get_meta("writer")``): its run id, host, pid and process
start time. A store's first commit claims it. Another process that commits later is refused with
:class:`~paramstore.errors.WriterConflictError` while that writer's process is alive (or, when it
ran on another host, unless it has the same run id), so two trainers started on one root by
mistake never interleave their steps. The writer's run id is recorded with every version it
commits (``Version.writer``; ``paramstore ls`` shows it).

Taking over is explicit (``ParamStore(takeover=True)``) except in one case: a writer on this host
whose process is gone (a crashed trainer, restarted) is replaced with a ParamStoreWarning, since
nobody can write through it anymore. A restarted trainer that passes the same ``run_id`` as before
takes its store back silently, and processes sharing one ``run_id`` count as one writer (the ranks
of one trainer): the run id, not the process, is what two trainers must not share.

Liveness is judged by host name, pid and process start time, as for leases: processes in separate
PID namespaces that share a host name and a tmpfs would see each other's writer as gone.

In a group store (``shared_group=True``) only the root's owner writes: its folders are not
group-writable (see :mod:`paramstore.root`), and a member's commit is refused at once with
:class:`~paramstore.errors.UnsafeStoreError`, before anything is staged.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass

from . import liveness
from .errors import InvalidArgumentError, ParamStoreWarning, UnsafeStoreError, WriterConflictError
from .text import warn
from .format import loads

__all__ = ["Writer", "claim", "release", "check_owner", "check_run_id", "new_run_id"]

_RUN_ID = re.compile(r"[A-Za-z0-9._:@+-]{1,128}\Z")


def check_run_id(run_id: object) -> str:
    """``run_id`` if it is 1-128 letters, digits or ``._:@+-``, else InvalidArgumentError."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise InvalidArgumentError(f"run_id must be 1-128 letters, digits or '._:@+-', got {run_id!r}")
    return run_id


def new_run_id() -> str:
    """This process's default run id: ``<host>-<8 hex digits>``, the same for every store it opens."""
    global _PROCESS_RUN_ID
    if _PROCESS_RUN_ID is None or _PROCESS_RUN_ID[0] != os.getpid():  # a forked child is another run
        host = re.sub(r"[^A-Za-z0-9.-]", "-", liveness.HOST)[:64] or "host"
        _PROCESS_RUN_ID = (os.getpid(), f"{host}-{uuid.uuid4().hex[:8]}")
    return _PROCESS_RUN_ID[1]


_PROCESS_RUN_ID: tuple[int, str] | None = None


@dataclass(frozen=True)
class Writer:
    """The process that writes a store now."""

    run_id: str
    host: str
    pid: int
    start: float | None  # the process's start time (see paramstore.liveness)
    since: float  # when it claimed the store (seconds since the epoch)

    @classmethod
    def this_process(cls, run_id: str) -> "Writer":
        pid, start = liveness.this_process()
        return cls(run_id, liveness.HOST, pid, start, time.time())

    def to_text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_text(cls, text: str) -> "Writer | None":
        """The writer recorded as ``text``; None if the record is unreadable (then anyone may claim)."""
        try:
            d = loads(text, dict, "the writer record")
            w = cls(check_run_id(d["run_id"]), str(d["host"]), int(d["pid"]),
                    None if d["start"] is None else float(d["start"]), float(d["since"]))
            time.localtime(w.since)  # describe() shows it: a time out of range is unreadable too
            return w
        except (ValueError, KeyError, TypeError, OverflowError, OSError, InvalidArgumentError):
            return None

    def alive(self) -> bool:
        """Whether its process may still write: on this host, checked; on another, assumed."""
        return self.host != liveness.HOST or liveness.alive(self.pid, self.start)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"run {self.run_id} (pid {self.pid} on {self.host}, writing since {when})"


def claim(registry: object, run_id: str, *, takeover: bool = False, root: str = "") -> Writer:
    """Make this process the store's writer (see the module's doc); returns the writer recorded.

    Raises:
        WriterConflictError: another live writer holds the store and ``takeover`` is false.
        UnsafeStoreError: ``root`` is a group store another member owns (only its owner writes).
    """
    if root:
        check_owner(root)
    me = Writer.this_process(run_id)
    for _ in range(8):  # a compare-and-set loop: retried only when another process changed it meanwhile
        raw = registry.get_meta("writer")  # type: ignore[attr-defined]
        current = None if raw is None else Writer.from_text(raw)
        if current is not None and (current.run_id, current.host, current.pid) == (run_id, me.host, me.pid):
            return current
        if current is not None and (current.host, current.pid, current.start) == (me.host, me.pid, me.start):
            takeover = True  # this very process, under another run id: not a second trainer
        if current is not None and current.run_id != run_id and not takeover:
            if current.alive():
                raise WriterConflictError(
                    f"store {root} is written by {current.describe()}; this process (run {run_id}) may not commit "
                    "to it. Use another root for a second trainer, or take it over on purpose: "
                    "ParamStore(..., takeover=True)")
            warn(f"store {root}: taking over from {current.describe()}, whose process is gone", ParamStoreWarning)
        if registry.swap_meta("writer", raw, me.to_text()) == me.to_text():  # type: ignore[attr-defined]
            return me
    raise WriterConflictError(f"store {root}: could not claim it as writer (another process keeps changing it)")


def check_owner(root: str) -> None:
    """Refuse to write the store at ``root`` unless this user owns it (UnsafeStoreError): another
    user's root opens only as a group store, which its members read but never write."""
    owner = os.stat(root).st_uid
    if owner != os.geteuid():
        raise UnsafeStoreError(
            f"the group store at {root} belongs to uid {owner}: only its owner commits to it (its folders are "
            "not group-writable, so that no member can plant an object or a descriptor); members read, lease and "
            f"check out. Commit as uid {owner}, or to a store of your own (uid {os.geteuid()})")


def release(registry: object, run_id: str) -> None:
    """Give the store up if this process is its writer (on close: the next trainer starts silently)."""
    raw = registry.get_meta("writer")  # type: ignore[attr-defined]
    current = None if raw is None else Writer.from_text(raw)
    me = Writer.this_process(run_id)
    if current is not None and (current.run_id, current.host, current.pid) == (run_id, me.host, me.pid):
        registry.swap_meta("writer", raw, "")  # type: ignore[attr-defined]
