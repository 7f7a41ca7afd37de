"""Is a process still alive? By pid *and* start time, so a recycled pid does not count.

Leases on a single host are owned by a process: the lease is live while its process is, and a
dead process's leases count as released with nobody's help (no heartbeat thread). Linux gives a
process's start time, in clock ticks since boot, as field 22 of ``/proc/<pid>/stat``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
from functools import lru_cache

__all__ = ["start_time", "this_process", "alive", "HOST", "libc"]

HOST = socket.gethostname()


def _stat(pid: int) -> tuple[bytes, int] | None:
    """(state, start time) of ``pid`` from /proc, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after its last closing parenthesis.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0], int(fields[19])  # fields 3 and 22 overall


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if there is no such process."""
    st = _stat(pid)
    return None if st is None else st[1]


@lru_cache(maxsize=4)
def _this(pid: int) -> tuple[int, int]:
    return pid, start_time(pid) or 0


def this_process() -> tuple[int, int]:
    """(pid, start time) of the calling process (recomputed after fork)."""
    return _this(os.getpid())


def alive(pid: int, start: int) -> bool:
    """Whether process ``pid`` started at ``start`` still runs (a zombie counts as dead)."""
    st = _stat(pid)
    return st is not None and st[1] == start and st[0] not in (b"Z", b"X")


@lru_cache(maxsize=1)
def libc() -> ctypes.CDLL:
    """The C library, for the few Linux calls Python does not wrap (madvise, inotify)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
