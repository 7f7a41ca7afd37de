"""A minimal Linux inotify watch on one file, through ctypes (no polling loop).

Used by the LMDB registry: every publish rewrites a small ``events`` file, and every waiting
process has an inotify watch on it, so a subscriber sleeps in ``select`` until a change.
Where inotify is unavailable (not Linux, or the instance limit is reached), :class:`FileWatch`
falls back to checking the file's mtime and size every ``fallback_interval`` seconds.
"""

from __future__ import annotations

import os
import select
import time

from paramstore import liveness

_IN_MODIFY = 0x00000002
_IN_ATTRIB = 0x00000004
_IN_CLOSE_WRITE = 0x00000008
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000

class FileWatch:
    """Wakes up when ``path`` is modified. ``wait`` returns True on a change, False on timeout."""

    def __init__(self, path: str, fallback_interval: float = 0.05) -> None:
        self._path = path
        self._fd = -1
        self._interval = fallback_interval
        self._stamp = self._stat()
        try:
            libc = liveness.libc()
            fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
            if fd < 0:
                return
            if libc.inotify_add_watch(fd, os.fsencode(path), _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE) < 0:
                os.close(fd)
                return
            self._fd = fd
        except (OSError, AttributeError):
            self._fd = -1

    def _stat(self) -> tuple[int, int]:
        try:
            st = os.stat(self._path)
            return st.st_mtime_ns, st.st_size
        except FileNotFoundError:
            return 0, 0

    def wait(self, timeout: float | None) -> bool:
        if self._fd >= 0:
            poller = select.poll()  # not select(): that fails for descriptors >= 1024
            poller.register(self._fd, select.POLLIN)
            if not poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
                return False
            try:
                while os.read(self._fd, 4096):
                    pass
            except BlockingIOError:
                pass
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            stamp = self._stat()
            if stamp != self._stamp:
                self._stamp = stamp
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(self._interval)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
