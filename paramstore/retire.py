"""Memory registered with a transport, given back only once remote reads in flight are done.

A host withdraws an announcement before it frees what it announced, but another host that looked
the holders up just before may still be reading it: the memory stays registered (and mapped) for
:data:`RETIRE_AFTER_S` more, then :func:`retire` unregisters and closes it, on one daemon thread
per process (a forked child starts its own). :func:`later` runs any action on that thread.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import threading
import time
import warnings
from typing import Callable

from .errors import ParamStoreError

from paramstore.backends.transports.base import Transport

__all__ = ["RETIRE_AFTER_S", "later", "retire"]


#: How long memory stays registered after its announcement is withdrawn: a host that looked the
#: holders up just before may still be reading it.
RETIRE_AFTER_S = 2.0


def retire(transport: Transport, addr: int, close: Callable[[], None], after: float | None = None) -> None:
    """Unregister the memory at ``addr``, then ``close`` it, after ``after`` seconds (default
    :data:`RETIRE_AFTER_S`; longer where readers may act on an older registry answer) on the
    process's retirement thread."""
    def done() -> None:
        with contextlib.suppress(ParamStoreError):
            transport.unregister(addr)
        with contextlib.suppress(BufferError):
            close()

    _retirements.add(time.monotonic() + (RETIRE_AFTER_S if after is None else after), done)


class _Retirements:
    """The retirements due in this process, run in due order by one daemon thread (started on
    first use, then idle while none is due)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, Callable[[], None]]] = []  # heap of (due, seq, action)
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, due: float, action: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._due, (due, next(self._seq), action))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="paramstore-retire", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._cond.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _, _, action = heapq.heappop(self._due)
            try:
                action()
            except Exception as e:  # noqa: BLE001 - one failure must not stop the later retirements
                warnings.warn(f"paramstore: retiring a peer buffer failed: {e}", RuntimeWarning, stacklevel=1)


def later(due: float, action: Callable[[], None]) -> None:
    """Run ``action`` at ``time.monotonic()`` ``due`` or after, on the process's retirement thread."""
    _retirements.add(due, action)


def _fresh_retirements() -> None:
    """In a forked child: the parent's thread and due retirements stay the parent's (its lock
    may even have been held at the fork); the child starts its own on its first retirement."""
    global _retirements
    _retirements = _Retirements()


_retirements = _Retirements()
os.register_at_fork(after_in_child=_fresh_retirements)
