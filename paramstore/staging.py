"""Staging buffers: where a commit (or a peer fetch) writes bytes before they become an object.

A *slab* is a file in the local tier's ``tmp/`` directory, mapped read-write. The committer copies
tensors straight into a slab, hashes them there, and the local tier renames the slab into
``objects/`` (see :meth:`paramstore.backends.tiers.local.LocalTier.put`): that copy is the only one,
readers map the same pages.

Fresh tmpfs pages are slow to touch (first-touch page faults run at ~1.25 GB/s against ~10 GB/s for
faulted pages), so :class:`SlabPool` creates and faults the slabs the *next* commit will need in a
background thread (``madvise(MADV_POPULATE_WRITE)``), from the sizes of the last commit's layout.
Slabs a commit did not need (every tensor deduplicated) go back to the pool.

With CUDA present, slabs are registered as pinned host memory (``cudaHostRegister``) so a
device-to-host copy runs asynchronously.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import threading
import warnings
from dataclasses import dataclass

from paramstore import liveness
from paramstore.liveness import libc

__all__ = ["Slab", "SlabPool", "tmp_name"]

_counter = itertools.count()


@dataclass
class Slab:
    """A writable buffer backed by a file in the tier's ``tmp/`` directory."""

    path: str
    size: int
    map: mmap.mmap
    pinned: bool = False

    def truncate(self, size: int) -> None:
        """Shrink the file (and the usable buffer) to ``size`` bytes."""
        if size == self.size:
            return
        _unpin(self)
        self.map.close()
        os.truncate(self.path, size)
        self.size = size
        self.map = _map_file(self.path, size, populate=False)

    def close(self) -> None:
        """Unmap (the file stays)."""
        _unpin(self)
        self.map.close()

    def discard(self) -> None:
        """Unmap and delete the file."""
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _map_file(path: str, size: int, *, populate: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if populate:
        _populate(m)
    return m


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_MADV_HUGEPAGE = 14


def _populate(m: mmap.mmap) -> None:
    """Allocate and fault every page of a writable mapping, without holding the GIL.

    ``MAP_POPULATE`` would do it inside ``mmap()``, which holds the GIL for the whole time; this
    uses ``madvise(MADV_POPULATE_WRITE)`` through ctypes (which releases the GIL) and, on older
    kernels, writes zeros with ``memset`` (also outside the GIL).
    """
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc().madvise(ctypes.c_void_p(addr), ctypes.c_size_t(len(m)), _MADV_HUGEPAGE)  # on huge=advise tmpfs
    if libc().madvise(ctypes.c_void_p(addr), ctypes.c_size_t(len(m)), _MADV_POPULATE_WRITE) != 0:
        ctypes.memset(addr, 0, len(m))  # the space is reserved (posix_fallocate): no SIGBUS


_pin_warned = False


def _pin(slab: Slab) -> None:
    """Register the slab as page-locked memory with CUDA, once; warn once if refused.

    Pinned host memory lets a device-to-host copy run asynchronously at full PCIe bandwidth.
    Skipped without CUDA. (Not exercised on the CPU-only hosts this was developed on.)
    """
    global _pin_warned
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    if not torch.cuda.is_available() or slab.size == 0:
        return
    addr = ctypes.addressof(ctypes.c_char.from_buffer(slab.map))
    err = torch.cuda.cudart().cudaHostRegister(addr, slab.size, 0)
    if int(err) == 0:
        slab.pinned = True
    elif not _pin_warned:
        _pin_warned = True
        warnings.warn(
            f"cudaHostRegister refused {slab.size} bytes (error {int(err)}; memlock limit?); "
            "staging into unpinned shared memory",
            RuntimeWarning,
            stacklevel=2,
        )


def _unpin(slab: Slab) -> None:
    if slab.pinned:
        import torch

        addr = ctypes.addressof(ctypes.c_char.from_buffer(slab.map))
        torch.cuda.cudart().cudaHostUnregister(addr)
        slab.pinned = False


def tmp_name() -> str:
    """A fresh name for a file in ``tmp/``: ``slab-<pid>-<start time>-<n>``; GC deletes the files
    of owners that are no longer alive."""
    pid, start = liveness.this_process()
    return f"slab-{pid}-{start}-{next(_counter)}"


class SlabPool:
    """Slabs created and page-faulted ahead of time, keyed by exact size.

    ``prepare(sizes)`` fills the pool in a background thread; ``take(size)`` returns a prepared
    slab of that size or, if none is ready, creates one on the spot (slower: faults on the hot path).
    """

    def __init__(self, tmp_dir: str, *, pin: bool = True) -> None:
        self._tmp = tmp_dir
        self._pin = pin
        self._free: dict[int, list[Slab]] = {}
        self._lock = threading.Lock()
        self._want: dict[str, list[int]] = {}  # purpose ("commit", "fetch") -> sizes
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._owner = os.getpid()

    def new(self, size: int) -> Slab:
        """Create a slab of ``size`` bytes now: space reserved, every page faulted in."""
        path = os.path.join(self._tmp, tmp_name())
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            # Reserve the space now: a full tmpfs then fails here with ENOSPC (an error on the
            # commit) instead of SIGBUS when the copy touches a page that cannot be allocated.
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise OSError(e.errno, f"cannot reserve {size} bytes of shared memory in {self._tmp}: "
                                   f"{e.strerror} (free space in /dev/shm, or use a smaller model/shard)") from e
        os.close(fd)
        slab = Slab(path, size, _map_file(path, size, populate=True))
        if self._pin:
            _pin(slab)
        return slab

    def take(self, size: int) -> Slab:
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        return self.new(size)

    def give_back(self, slab: Slab) -> None:
        """Return an unused slab for a later commit."""
        with self._lock:
            if not self._closed:
                self._free.setdefault(slab.size, []).append(slab)
                return
        slab.discard()

    def prepare(self, sizes: list[int], *, purpose: str = "commit") -> None:
        """Make sure slabs of these sizes (one per entry) are ready, in the background.

        ``purpose`` names whose next use they are for (``"commit"``: the next commit's layout;
        ``"fetch"``: the objects of the version a peer fetch was last for): a call replaces that
        purpose's sizes.
        Pooled slabs beyond all purposes' sizes are deleted: the pool holds at most one commit's
        and one fetch's worth.
        """
        with self._lock:
            self._want[purpose] = list(sizes)
            budget: dict[int, int] = {}
            for s in self._wanted():
                budget[s] = budget.get(s, 0) + 1
            extra = []
            for s, free in self._free.items():
                while len(free) > budget.get(s, 0):
                    extra.append(free.pop())
            if self._thread is None:
                self._thread = threading.Thread(target=self._fill, name="paramstore-slabs", daemon=True)
                self._thread.start()
            self._wake.notify()
        for slab in extra:
            slab.discard()

    def _fill(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._missing():
                    self._wake.wait()
                if self._closed:
                    return
                size = self._missing()[0]
            slab = self.new(size)
            with self._lock:
                wanted = not self._closed and size in self._missing()
                if wanted:
                    self._free.setdefault(size, []).append(slab)
                    self._wake.notify_all()  # wait_prepared()
            if not wanted:  # closed, or prepare() changed its mind meanwhile
                slab.discard()

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Wait until every slab :meth:`prepare` asked for is ready; False on timeout."""
        with self._lock:
            return self._wake.wait_for(lambda: self._closed or not self._missing(), timeout)

    def _missing(self) -> list[int]:
        # Sizes wanted but not yet in the pool (called with the lock held).
        have = {s: len(v) for s, v in self._free.items()}
        out = []
        for s in self._wanted():
            if have.get(s, 0) > 0:
                have[s] -= 1
            else:
                out.append(s)
        return out

    def _wanted(self) -> list[int]:
        return [s for sizes in self._want.values() for s in sizes]

    def close(self) -> None:
        """Stop preparing and delete every pooled slab (in a forked child: just forget them)."""
        if os.getpid() != self._owner:  # the parent still owns these files
            self._free.clear()
            self._closed = True
            return
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            slabs = [s for v in self._free.values() for s in v]
            self._free.clear()
        if self._thread is not None:
            self._thread.join()
        for s in slabs:
            s.discard()
