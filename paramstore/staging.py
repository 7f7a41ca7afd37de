"""Staging buffers: where a commit (or a peer fetch) writes bytes before they become an object.

A *slab* is a file in the local tier's ``tmp/`` directory, mapped read-write. The committer copies
tensors straight into a slab, hashes them there, and the local tier renames the slab into
``objects/`` (see :meth:`paramstore.backends.tiers.local.LocalTier.put`): that copy is the only one,
readers map the same pages.

Fresh tmpfs pages are slow to touch (first-touch page faults run at ~1.25 GB/s against ~10 GB/s for
faulted pages), so :class:`SlabPool` creates and faults the slabs the next commits will need in a
background thread (``madvise(MADV_POPULATE_WRITE)``, in chunks), from the sizes of the last
commit's layout: two commits' worth (``copies``), so that commits in quick succession all find
faulted slabs (``store.prepare`` asks for more up front: see :meth:`SlabPool.prepare`). Slabs a
commit did not need (every tensor deduplicated) go back to the pool. Slab mappings are not
inherited by forked children (``MADV_DONTFORK``).

Faulting is not free: ~0.3 s per GiB of page-table setup even when the pages exist (mapping an
existing file anew), more when they are new; it competes with the training process for CPU and
for its memory-map lock. A pool with ``recycle=True`` avoids it in steady state by *recycling*
mappings:

1. After a commit is published, its slabs stay mapped in this process (:meth:`SlabPool.retire`),
   held apart (nothing writes to them) up to ``keep_mapped`` versions' worth; older ones are
   unmapped. So do the objects a collective checkout received into slabs of this pool. (Not write-protected: ``mprotect`` there and back costs ~40 ms per GiB, which on 2
   cores made back-to-back commits ~1.25x a bare copy instead of ~1.05x.)
2. When this process's GC sweeps such an object (its version was pruned; GC holds the exclusive
   GC lock, so no version references it and no commit can start to), :meth:`SlabPool.recycle`
   renames it into ``tmp/`` under a slab name of this process (``slab-<pid>-<start>-<n>``: if the
   process dies, GC deletes it as a dead owner's leftover) instead of unlinking it.
3. The pool reuses it only if no other open file or mapping of it exists anywhere (a reader may
   keep tensors of a closed snapshot, and an unlinked object must stay readable to it). The test
   is a write lease (``fcntl(F_SETLEASE, F_WRLCK)``), which the kernel grants only when the file
   is open nowhere else: every mapping holds the file open, in every process and PID namespace.
   Where leases are unavailable, or the kernel does not count read-only opens (checked once per
   process), ``/proc/*/fd`` and ``/proc/*/maps`` are scanned instead (a process that cannot be
   read counts as a user). A slab in use, or one of a size no commit wants, is deleted.
4. Then it is pooled for the next commit: its pages and page tables are still there, so the copy
   runs at memory speed with no fault at all, and nothing was unmapped or faulted in between.
   After a commit (or a fetch: :meth:`SlabPool.prepare`) the pool waits :data:`RECYCLE_GRACE_S`
   for GC to hand slabs back before it faults new ones for what is still missing.

Pinning (:mod:`paramstore.pinning`): in a process that stages accelerator tensors (the committer
calls :meth:`SlabPool.pin_for` when a commit holds one), commit slabs are registered as page-locked
host memory (``cudaHostRegister``, portable) so that a device-to-host copy runs asynchronously:
lazily when a commit takes an unpinned slab, and in the background thread (its device set first)
for the slabs prepared after that. A slab is registered once for as long as it is mapped: retired,
recycled and reused slabs keep their registration, so steady-state commits pin nothing;
:meth:`Slab.close` (reached by pool close, trimming, discarding, and a dropped slab's garbage
collection) unregisters it. A fetch never pins a slab (it takes them without ``pinned=True``; in a
process that also commits, a prepared slab of a commit's size it takes may already be pinned), and
the pools of processes that only read pin nothing: those processes never initialise a device runtime.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from paramstore import liveness, pinning
from paramstore.errors import StorageError, StorageFullError
from paramstore.retire import later
from paramstore.liveness import libc

__all__ = ["Slab", "SlabPool", "tmp_name", "recyclers", "storage_error", "mount_point", "address"]

_counter = itertools.count()


@dataclass
class Slab:
    """A writable buffer backed by a file in the tier's ``tmp/`` directory.

    ``pinned``: registered as page-locked memory (:meth:`pin`) until :meth:`close`."""

    path: str
    size: int
    map: mmap.mmap
    pinned: bool = False
    #: a descriptor of the very open file the mapping holds (recycling's write-lease test needs
    #: it), open as long as the mapping; -1 once closed
    fd: int = -1
    #: whether ``fd`` is the slab's to close (else the mapping object's own: see :func:`_map_fd`)
    owns_fd: bool = False
    #: whether its space is reserved and its pages faulted; False: a slab :meth:`SlabPool.take`
    #: made with ``reserve=False``, whose user calls :meth:`reserve` on each range before writing it
    reserved: bool = True
    #: unregisters the pinned mapping if the slab is garbage-collected without close()
    _unpin_at_gc: Any = field(default=None, repr=False, compare=False)

    def reserve(self, begin: int, end: int, what: str = "a peer fetch") -> None:
        """Reserve the space of bytes ``[begin, end)`` and fault their pages in (what
        :meth:`SlabPool.new` does for a whole slab), so that writing them neither faults on the
        hot path nor raises SIGBUS on a full filesystem (``begin``: a multiple of the page size;
        the range must not have been written yet). Raises StorageFullError (``what`` says for
        what, in the message) or StorageError."""
        if begin % mmap.PAGESIZE:
            raise ValueError(f"a reservation starts on a page boundary, not at byte {begin}")
        try:
            os.posix_fallocate(self.fd, begin, end - begin)
        except OSError as e:
            raise storage_error(e, os.path.dirname(self.path), end - begin, what) from e
        _populate_range(address(self.map) + begin, end - begin)

    def pin(self, device: Any) -> bool:
        """Register the mapping as page-locked memory for copies with ``device`` (an accelerator),
        once: True if it is pinned (now or already). False (unpinned, still usable): a CPU device,
        an empty slab, a forked child, no runtime, or the runtime refused (one warning)."""
        if self.pinned:
            return True
        if self.size == 0 or self.map.closed:
            return False
        addr = address(self.map)
        if not pinning.register(addr, self.size, device):
            return False
        self.pinned = True
        self._unpin_at_gc = weakref.finalize(self, pinning.unregister, addr)
        self._unpin_at_gc.atexit = False  # at exit the process unmaps and unpins everything anyway
        return True

    def _unpin(self) -> None:
        # Before the mapping goes (or shrinks): a registration must never outlive its pages.
        if self.pinned:
            self._unpin_at_gc.detach()
            self._unpin_at_gc = None
            pinning.unregister(address(self.map))
            self.pinned = False

    def truncate(self, size: int) -> None:
        """Shrink the file (and the usable buffer) to ``size`` bytes.

        The file is unmapped and mapped again at the new size, so a pinned slab is unregistered
        first and the new mapping is unpinned: a truncated slab is one compacted for publishing,
        never staged into again (if recycling brings it back for a commit of its new size, that
        commit pins it again when it takes it)."""
        if size == self.size:
            return
        self._unpin()
        os.truncate(self.path, size)
        self.close()
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        self.map, self.fd, self.owns_fd = _map_fd(fd, size)
        self.size = size

    def close(self) -> None:
        """Unmap (the file stays); a pinned slab is unregistered first."""
        self._unpin()
        unmap(self.map)
        if self.owns_fd:
            os.close(self.fd)
        self.fd, self.owns_fd = -1, False

    def discard(self) -> None:
        """Unmap and delete the file."""
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _map_fd(fd: int, size: int) -> tuple[mmap.mmap, int, bool]:
    """Map ``fd`` (a fresh descriptor, which this takes over) shared and writable.

    Returns the mapping, a descriptor of the same open file that stays open exactly as long as
    the mapping, and whether the caller must close it. CPython's ``mmap`` keeps a private ``dup``
    of the descriptor (before 3.13, always): that one is found (the file is a new slab of this
    process: no other descriptor of it exists) and ``fd`` closed, so a slab costs one descriptor,
    as it did before recycling.
    """
    flags, prot = mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
    try:
        if sys.version_info >= (3, 13):
            m, own = mmap.mmap(fd, size, flags=flags, prot=prot, trackfd=False), fd
        else:
            m = mmap.mmap(fd, size, flags=flags, prot=prot)
            st = os.fstat(fd)
            own = fd
            for name in os.listdir("/proc/self/fd"):
                try:
                    other = os.fstat(int(name))
                except OSError:
                    continue
                if int(name) != fd and (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                    own = int(name)
                    break
    except BaseException:
        os.close(fd)
        raise
    if own != fd:
        os.close(fd)
    if size:
        # A forked child (a data-loader worker...) does not inherit staging buffers: it has no use
        # for them, and its copy of the mapping would keep a deleted slab's memory allocated.
        libc().madvise(ctypes.c_void_p(address(m)), ctypes.c_size_t(size), _MADV_DONTFORK)
    return m, own, own == fd


#: The address of a writable mapping's first byte (for madvise, memmove, cudaHostRegister).
address = pinning.address_of


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_MADV_HUGEPAGE = 14
_MADV_DONTFORK = 10


def _lower_priority(nice: int) -> None:
    """Give the calling thread nice value ``nice`` if it runs at a higher priority (Linux applies
    ``setpriority(PRIO_PROCESS, tid)`` to that thread alone; elsewhere, or where refused, nothing)."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def _populate(m: mmap.mmap) -> None:
    """Allocate and fault every page of a writable mapping, without holding the GIL.

    ``MAP_POPULATE`` would do it inside ``mmap()``, which holds the GIL for the whole time; this
    uses ``madvise(MADV_POPULATE_WRITE)`` through ctypes (which releases the GIL) and, on older
    kernels, writes zeros with ``memset`` (also outside the GIL). In chunks: the kernel holds the
    process's memory-map lock while it populates, and ``mmap``/``munmap``/``mprotect`` anywhere
    in the process (the allocator of the training thread, a commit publishing) wait for it.
    """
    addr = address(m)
    size = len(m)
    libc().madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), _MADV_HUGEPAGE)  # on huge=advise tmpfs
    _populate_range(addr, size)


def _populate_range(addr: int, size: int) -> None:
    """:func:`_populate` of the ``size`` bytes at ``addr`` (their space reserved)."""
    for off in range(0, size, _POPULATE_CHUNK):
        n = min(_POPULATE_CHUNK, size - off)
        if libc().madvise(ctypes.c_void_p(addr + off), ctypes.c_size_t(n), _MADV_POPULATE_WRITE) != 0:
            ctypes.memset(addr + off, 0, n)  # the space is reserved (posix_fallocate): no SIGBUS


#: Populating holds the memory-map lock (read mode) for a chunk at a time: a colocated reader's
#: ``mmap`` (write mode) waits at most one chunk (2 MiB: ~0.5 ms at first touch here; 32 MiB
#: chunks made a checkout taken while the next commit's slabs were prepared wait 37 ms per object).
_POPULATE_CHUNK = 2 << 20
_MADV_DONTNEED = 4
_ZAP_CHUNK = 4 << 20


def unmap(m: mmap.mmap) -> None:
    """Unmap ``m`` without holding the process's memory-map lock for long.

    ``munmap`` of a faulted-in mapping tears down all its page-table entries with the lock held
    in write mode (~25 ms per 256 MiB here), and every ``mmap``/``munmap`` of the process (a
    colocated reader's checkout, the allocator) waits for it. Dropping the pages first with
    ``madvise(MADV_DONTNEED)``, a chunk at a time, does that work with the lock in read mode; the
    ``munmap`` then has nothing left to tear down. For a shared mapping the data stays in the file;
    a private one loses what was written to it, so call this only on a mapping nothing else uses.
    A read-only mapping (no address to take) is simply closed; a closed one is left alone.
    """
    if m.closed:
        return
    try:
        addr = address(m)
    except TypeError:  # read-only: ctypes takes the address of writable buffers only
        m.close()
        return
    size = len(m)
    for off in range(0, size, _ZAP_CHUNK):
        libc().madvise(ctypes.c_void_p(addr + off), ctypes.c_size_t(min(_ZAP_CHUNK, size - off)), _MADV_DONTNEED)
    m.close()


def tmp_name() -> str:
    """A fresh name for a file in ``tmp/``: ``slab-<pid>-<start time>-<n>``; GC deletes the files
    of owners that are no longer alive."""
    pid, start = liveness.this_process()
    return f"slab-{pid}-{start}-{next(_counter)}"


#: How long, after a commit or a fetch, a recycling pool waits for GC to hand back the slabs of the
#: version that one pushed out of retention before it faults new ones instead.
RECYCLE_GRACE_S = 0.5
#: Bytes the background thread reserves and faults at a time (:meth:`SlabPool.new` with ``stop``):
#: between two of them it sees a :meth:`SlabPool.close` or :meth:`SlabPool.shed` (which wait for
#: it), at most ~5 ms of its CPU later here, however low its priority.
_RESERVE_CHUNK = 8 << 20


class _Stopped(Exception):
    """The background thread gave up the slab it was making: the pool closes, or stands back."""


#: The nice value of the pool's background thread (Linux, per thread; 19 is the lowest priority).
#: What it does is work ahead of need (faulting the next version's slabs): where the cores are
#: busy, a foreground thread comes first. A rollout host that just received a version faults the
#: next one's destination while the hosts behind it still read that version from it, and its
#: inference engine runs; a trainer's next commit slabs wait for its busy cores alike. A ``take``
#: that finds nothing ready faults on the spot, on the caller's thread, at the caller's priority.
FILL_NICE = 19
#: How long :meth:`SlabPool.shed` waits for the slab the background thread is creating or checking.
SHED_WAIT_S = 30.0


class SlabPool:
    """Slabs created and page-faulted ahead of time, keyed by exact size.

    ``prepare(sizes, copies=n)`` fills the pool in a background thread; ``take(size)`` returns a
    prepared slab of that size or, if none is ready, creates one on the spot (slower: faults on
    the hot path).

    With ``recycle=True`` (see the module docstring), published slabs stay mapped
    (:meth:`retire`, at most ``keep_mapped`` versions' worth) and GC hands them back when it sweeps
    them (:meth:`recycle`); they are reused, once nothing else has them open or mapped, before any
    new slab is faulted.
    """

    def __init__(self, tmp_dir: str, *, pin: bool = True, recycle: bool = False, keep_mapped: int = 4) -> None:
        self._tmp = tmp_dir
        self._pin = pin  # False: never pin (ParamStore(pin_memory=False))
        self._pin_device: Any = None  # set by pin_for(): commit slabs are pinned for this device
        self._free: dict[int, list[Slab]] = {}
        self._lock = threading.Lock()
        self._want: dict[str, list[int]] = {}  # purpose ("commit", "fetch") -> sizes to have ready
        self._keep: dict[str, list[int]] = {}  # purpose -> sizes that may stay pooled (a superset)
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._owner = os.getpid()
        self.recycling = recycle
        self._keep_mapped = keep_mapped
        self._layout_bytes: dict[str, int] = {}  # "commit"/"fetch" -> one version's worth (its last prepare)
        self._retired: dict[tuple[int, int], Slab] = {}  # (st_dev, st_ino) -> published slab, oldest first
        self._lent: dict[tuple[int, int], tuple[Slab, int]] = {}  # retired slabs being read (lent), how many times
        self._recycled: list[Slab] = []  # swept by GC into tmp/, not yet checked
        self._grace_until = 0.0
        # Set when the background thread failed to create a slab (a full tmpfs: ENOSPC), or when a
        # commit that ran out of space asked it to stand back (shed()): it then creates no new
        # slab until the next prepare() (recycled ones are still checked). The thread never ends on
        # an error: the error is kept in _fill_error (see prefault_error) instead.
        self._stalled = False
        self._busy = False  # the background thread holds a slab outside _free and _recycled
        self._fill_error: BaseException | None = None
        self._fill_warned = False
        # recycled: handed back by GC; reused: then written again; in_use: refused (open or mapped
        # elsewhere: deleted); unwanted: no commit wanted its size (deleted); created: new slabs
        # faulted (on_the_spot: by take(), on the hot path, none being ready)
        self.stats = {"recycled": 0, "reused": 0, "in_use": 0, "unwanted": 0, "created": 0, "on_the_spot": 0, "lent": 0}
        if recycle:
            _register(self)

    def new(self, size: int, *, what: str = "a staging buffer", reserve: bool = True,
            stop: Callable[[], bool] | None = None) -> Slab:
        """Create a slab of ``size`` bytes now: space reserved, every page faulted in
        (``reserve=False``: neither; the file only has its size, see :meth:`Slab.reserve`).
        ``stop`` (the background thread's): the space is reserved :data:`_RESERVE_CHUNK` bytes at a
        time, and once ``stop()`` is true between two of them the slab is deleted and
        :class:`_Stopped` raised.

        Raises StorageFullError (the filesystem is full; ``what`` says for what, in the
        message) or StorageError."""
        if stop is not None and reserve:
            slab = self.new(size, what=what, reserve=False)
            try:
                for begin in range(0, size, _RESERVE_CHUNK):
                    if stop():
                        raise _Stopped
                    slab.reserve(begin, min(size, begin + _RESERVE_CHUNK), what)
            except BaseException:
                slab.discard()
                raise
            slab.reserved = True
            return slab
        path = os.path.join(self._tmp, tmp_name())
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as e:  # ENOSPC here: out of inodes
            raise storage_error(e, self._tmp, size, what) from e
        try:
            # Reserve the space now: a full tmpfs then fails here with ENOSPC (an error on the
            # commit) instead of SIGBUS when the copy touches a page that cannot be allocated.
            if reserve:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise storage_error(e, self._tmp, size, what) from e
        try:
            m, mfd, owned = _map_fd(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        if reserve:
            _populate(m)
        else:
            libc().madvise(ctypes.c_void_p(address(m)), ctypes.c_size_t(size), _MADV_HUGEPAGE)
        slab = Slab(path, size, m, fd=mfd, owns_fd=owned, reserved=reserve)
        self.stats["created"] += 1
        return slab

    # -- pinning -----------------------------------------------------------------------------
    def pin_for(self, device: Any) -> bool:
        """This process stages tensors of ``device`` (an accelerator): from now on commit slabs are
        pinned for it (see the module docstring). Returns whether pinning is on: False when the
        pool was made with ``pin=False``, for the CPU, or in a forked child of a process that used
        a device runtime. Loads nothing: the first registration does.

        Example:
            >>> import tempfile
            >>> pool = SlabPool(tempfile.mkdtemp(), pin=False)
            >>> pool.pin_for("cuda:0"), pool.pin_for("cpu")
            (False, False)
            >>> pool.close()
        """
        if not self._pin or os.getpid() != self._owner or not pinning.can_pin(device):
            return False
        self._pin_device = device
        return True

    @property
    def pin_device(self) -> Any:
        """The device commit slabs are pinned for (None: this pool pins nothing)."""
        return self._pin_device

    def pin(self, slab: Slab) -> bool:
        """Pin ``slab`` for :meth:`pin_for`'s device if it is not yet (on the calling thread: a
        commit's); returns whether it is pinned."""
        device = self._pin_device
        if device is None or os.getpid() != self._owner:
            return slab.pinned
        return slab.pin(device)

    def take(self, size: int, *, pinned: bool = False, reserve: bool = True) -> Slab:
        """A slab of ``size`` bytes: a prepared (or recycled) one if there is one, else a new one
        made on the spot. ``pinned=True`` (a commit of accelerator tensors): pinned for
        :meth:`pin_for`'s device before it is returned (a no-op for one that already is).
        ``reserve=False``: one made on the spot is returned at once, its space neither reserved
        nor faulted (:attr:`Slab.reserved` False: the caller reserves each range before writing it,
        e.g. a peer fetch, ahead of the bytes it receives)."""
        slab = self._take(size, reserve)
        if pinned:
            self.pin(slab)
        return slab

    def _take(self, size: int, reserve: bool = True) -> Slab:
        while True:
            with self._lock:
                free = self._free.get(size)
                if free:
                    return free.pop()
                # A recycled slab GC just handed over: check it here rather than fault a new one.
                slab = next((s for s in self._recycled if s.size == size), None)
                if slab is None:
                    break
                self._recycled.remove(slab)
            if self._reusable(slab):
                return slab
        self.stats["on_the_spot"] += 1
        return self.new(size, reserve=reserve)

    def _pin_prepared(self, slab: Slab) -> None:
        """The background thread: pin a slab prepared for the next commits, if this process stages
        accelerator tensors and the slab's size is one of the commit layout's (never a fetch's
        only). The thread's current device is set first (no context on device 0)."""
        device = self._pin_device
        if device is None or slab.pinned:
            return
        with self._lock:
            for_commit = slab.size in self._want.get("commit", ())
        if for_commit and pinning.bind_thread(device):
            slab.pin(device)

    def give_back(self, slab: Slab) -> None:
        """Return an unused slab for a later commit."""
        with self._lock:
            if not self._closed:
                self._free.setdefault(slab.size, []).append(slab)
                return
        slab.discard()

    # -- recycling ---------------------------------------------------------------------------
    def retire(self, slab: Slab) -> None:
        """A published slab (its file is now an object): keep it mapped for :meth:`recycle`
        (nothing writes to it meanwhile); or just unmap it (recycling off, or beyond
        ``keep_mapped``)."""
        drop = [slab]
        if self.recycling and os.getpid() == self._owner and slab.fd >= 0:
            st = os.fstat(slab.fd)
            with self._lock:
                if not self._closed and st.st_nlink:  # unlinked: same bytes were already an object
                    self._retired[(st.st_dev, st.st_ino)] = slab
                    drop = self._trim_retired()
        for s in drop:
            s.close()

    def retire_later(self, slab: Slab) -> None:
        """:meth:`retire` on the process's retirement thread (:func:`paramstore.retire.later`), off
        the caller's path: tearing down the page tables of a faulted mapping costs ~25 ms per
        256 MiB here. For slabs whose file is an object now (or was dropped): nothing reads them
        any more, and a view still exported leaves the slab mapped."""
        def run() -> None:
            with contextlib.suppress(BufferError, OSError, StorageError):
                self.retire(slab)

        later(time.monotonic(), run)

    @contextlib.contextmanager
    def lent(self, path: str) -> Iterator[mmap.mmap | None]:
        """The mapping this pool keeps of the published slab that is now the object at ``path``
        (:meth:`retire`: its pages were written here, so reading it faults nothing), held for the
        block (neither unmapped nor recycled meanwhile), or None where the pool keeps none. For
        reads only: the mapping is shared and writable, and what is written lands in the object.

        A collective checkout's source sends from it instead of mapping the object anew (page-table
        setup, see the module docstring, on the cores the receivers hash on)."""
        slab = None
        if self.recycling and os.getpid() == self._owner:
            try:
                st = os.stat(path)
            except OSError:
                st = None
            if st is not None:
                key = (st.st_dev, st.st_ino)
                with self._lock:
                    if key in self._lent:
                        slab, n = self._lent[key]
                        self._lent[key] = (slab, n + 1)
                    elif not self._closed and key in self._retired:
                        slab = self._retired.pop(key)
                        self._lent[key] = (slab, 1)
                    if slab is not None:
                        self.stats["lent"] += 1
        if slab is None:
            yield None
            return
        try:
            yield slab.map
        finally:
            drop: list[Slab] = []
            with self._lock:
                _, n = self._lent[key]
                if n > 1:
                    self._lent[key] = (slab, n - 1)
                else:
                    del self._lent[key]
                    if self._closed:
                        drop = [slab]
                    else:  # back among the retired (the newest), trimmed as a retirement would be
                        self._retired[key] = slab
                        drop = self._trim_retired()
            for x in drop:
                x.close()

    def _trim_retired(self) -> list[Slab]:
        # With the lock held: forget mappings of files deleted meanwhile (by another process's GC:
        # the memory is only freed once unmapped), then the oldest beyond keep_mapped versions (of
        # the larger layout of the commits' and the fetches' this pool prepares for).
        drop = []
        for key, s in list(self._retired.items()):
            try:
                gone = os.fstat(s.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                drop.append(self._retired.pop(key))
        budget = self._keep_mapped * max(self._layout_bytes.values(), default=0)
        total = sum(s.size for s in self._retired.values())
        for key in list(self._retired):
            if total <= budget:
                break
            s = self._retired.pop(key)
            total -= s.size
            drop.append(s)
        return drop

    def recycle(self, path: str) -> bool:
        """Called by GC (under the exclusive GC lock) for an object file it is about to delete:
        if it is one of this pool's retired slabs, take it back into ``tmp/`` and return True (the
        caller then leaves it alone); otherwise return False."""
        if not self.recycling or os.getpid() != self._owner:
            return False
        try:
            st = os.stat(path)
        except OSError:
            return False
        with self._lock:
            if self._closed:
                return False
            slab = self._retired.pop((st.st_dev, st.st_ino), None)
            if slab is None:
                return False
            new = os.path.join(self._tmp, tmp_name())
            try:
                os.rename(path, new)  # from here on a leftover of this process (GC's to delete if it dies)
            except OSError:
                self._retired[(st.st_dev, st.st_ino)] = slab
                return False
            slab.path = new
            self._recycled.append(slab)
            self.stats["recycled"] += 1
            self._wake.notify_all()
        return True

    def _reusable(self, slab: Slab) -> bool:
        """Whether a recycled slab may be written: nobody else has it open or mapped. Deleted if
        not."""
        if _unshared(slab, self._tmp):
            self.stats["reused"] += 1
            return True
        self.stats["in_use"] += 1
        slab.discard()
        return False

    # -- preparing ---------------------------------------------------------------------------
    def prepare(self, sizes: list[int], *, purpose: str = "commit", copies: int = 1,
                keep: int | None = None) -> None:
        """Make sure ``copies`` slabs of each of these sizes are ready, in the background.

        ``purpose`` names whose next use they are for (``"commit"``: the next commits' layout;
        ``"fetch"``: the objects of the version a peer fetch was last for): a call replaces that
        purpose's sizes. Pooled slabs beyond ``keep`` copies (default ``copies``) of all purposes'
        sizes are deleted.
        With recycling, once published slabs are mapped (something may come back), new ones are
        faulted only :data:`RECYCLE_GRACE_S` after this call: GC sweeps the objects of the version
        this commit (or fetch) pushed out of retention meanwhile. Retired slabs stay mapped up to
        ``keep_mapped`` times the larger of the last commit's and fetch's layouts (other purposes,
        e.g. ``"derive"``, set neither).
        """
        with self._lock:
            self._want[purpose] = list(sizes) * max(1, copies)
            self._keep[purpose] = list(sizes) * max(1, copies, keep or 0)
            self._stalled = False  # try again: space may have been freed since a failure
            if purpose in ("commit", "fetch"):  # a version's layout, whose slabs retention hands back
                self._layout_bytes[purpose] = sum(sizes)
                if self.recycling and self._retired:
                    self._grace_until = time.monotonic() + RECYCLE_GRACE_S
            budget: dict[int, int] = {}
            for s in (s for sizes in self._keep.values() for s in sizes):
                budget[s] = budget.get(s, 0) + 1
            extra = []
            for s, free in self._free.items():
                while len(free) > budget.get(s, 0):
                    extra.append(free.pop())
            unmap = self._trim_retired()
            if self._thread is None:
                self._thread = threading.Thread(target=self._fill, name="paramstore-slabs", daemon=True)
                self._thread.start()
            self._wake.notify_all()
        for slab in extra:
            slab.discard()
        for slab in unmap:  # published objects: unmapped, not deleted
            slab.close()

    def _fill(self) -> None:
        """The background thread: check recycled slabs, create and fault missing ones.

        It never ends on an error (only on :meth:`close`): a failure is recorded
        (:attr:`prefault_error`) and the thread stops creating slabs until the next
        :meth:`prepare`. A full filesystem is no news for the caller here: the commit that then
        finds no prepared slab creates one itself and reports the error. Any other error is also
        reported once as a warning (never a traceback on stderr)."""
        _lower_priority(FILL_NICE)
        while True:
            recycled = None
            with self._lock:
                while True:
                    if self._closed:
                        return
                    if self._recycled:
                        recycled = self._recycled.pop(0)
                        break
                    missing = [] if self._stalled else self._missing()
                    if missing:
                        wait = self._grace_until - time.monotonic()
                        if wait <= 0:
                            break
                        self._wake.wait(wait)
                    else:
                        self._wake.wait()
                self._busy = True  # a slab in hand that neither take() nor shed() can see
            try:
                if recycled is not None:
                    self._check_recycled(recycled)
                else:
                    slab = self.new(missing[0], what="preparing the next commits' buffers",
                                    stop=lambda: self._closed or self._stalled)
                    try:
                        self._pin_prepared(slab)
                    except BaseException:
                        slab.discard()
                        raise
                    self._add(slab)
                    self._fill_error = None
            except _Stopped:  # closing, or a commit out of space asked it to stand back
                pass
            except Exception as e:  # noqa: BLE001 - kept for the caller; the thread must live on
                if recycled is not None and not recycled.map.closed:
                    try:
                        recycled.discard()
                    except OSError:
                        pass
                self._fill_failed(e)
            finally:
                with self._lock:
                    self._busy = False
                    self._wake.notify_all()  # shed()

    def _check_recycled(self, slab: Slab) -> None:
        """Pool a slab GC handed back if a commit wants its size and nobody else uses it; else
        delete it."""
        with self._lock:
            wanted = slab.size in self._missing()
        if not wanted:
            self.stats["unwanted"] += 1
            slab.discard()
        elif self._reusable(slab):
            self._pin_prepared(slab)  # a no-op for a recycled slab: it kept its registration
            self._add(slab)

    def _fill_failed(self, e: Exception) -> None:
        """Record a failure of the background thread and stop it creating slabs until the next
        :meth:`prepare`."""
        with self._lock:
            self._fill_error = e
            self._stalled = True
            self._wake.notify_all()  # wait_prepared() reports it
        if not isinstance(e, StorageFullError) and not self._fill_warned:
            self._fill_warned = True
            warnings.warn(f"paramstore: preparing staging buffers failed (commits create their own): {e!r}",
                          RuntimeWarning, stacklevel=1)

    @property
    def prefault_error(self) -> BaseException | None:
        """The last error of the background thread (None once it has created a slab again)."""
        return self._fill_error

    def shed(self, keep: list[int]) -> int:
        """Free the shared memory this pool holds beyond ``keep`` (slab sizes a commit that ran out
        of space still needs, one slab each): pooled and recycled slabs of other sizes are deleted,
        mappings of objects deleted meanwhile (by another process's GC) are dropped, and the
        background thread creates no new slab until the next :meth:`prepare`, so it does not take
        the space back. Returns the bytes of the slabs deleted."""
        budget: dict[int, int] = {}
        for size in keep:
            budget[size] = budget.get(size, 0) + 1
        with self._lock:
            self._stalled = True
            # A slab being created (or a recycled one being checked) ends up pooled, or its space
            # freed: wait for that before the commit tries again.
            self._wake.wait_for(lambda: not self._busy or self._closed, SHED_WAIT_S)
            drop = []
            for size, free in self._free.items():
                while len(free) > budget.get(size, 0):
                    drop.append(free.pop())
                budget[size] = budget.get(size, 0) - len(free)
            for slab in list(self._recycled):
                if budget.get(slab.size, 0) > 0:
                    budget[slab.size] -= 1
                else:
                    self._recycled.remove(slab)
                    drop.append(slab)
            unmap = self._trim_retired()
        for slab in drop:
            slab.discard()
        for slab in unmap:  # objects deleted by another process: their memory goes with the mapping
            slab.close()
        return sum(s.size for s in drop)

    def _add(self, slab: Slab) -> None:
        with self._lock:
            wanted = not self._closed and slab.size in self._missing()
            if wanted:
                self._free.setdefault(slab.size, []).append(slab)
                self._wake.notify_all()  # wait_prepared()
        if not wanted:  # closed, or prepare() changed its mind meanwhile
            slab.discard()

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Wait until every slab :meth:`prepare` asked for is ready; False on timeout.

        Raises the background thread's error (StorageFullError: they do not fit) if it gave up."""
        with self._lock:
            done = self._wake.wait_for(
                lambda: self._closed or not self._missing() or (self._stalled and self._fill_error is not None),
                timeout)
            if done and not self._closed and self._missing() and self._fill_error is not None:
                raise self._fill_error
            return done

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
        """Stop preparing, delete every pooled and recycled slab and unmap the retired ones (in a
        forked child: just forget them)."""
        if os.getpid() != self._owner:  # the parent still owns these files
            self._free.clear()
            self._retired.clear()
            self._lent.clear()
            self._recycled.clear()
            self._closed = True
            return
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            slabs = [s for v in self._free.values() for s in v] + self._recycled
            retired = list(self._retired.values())
            self._free.clear()
            self._recycled = []
            self._retired.clear()
        if self._thread is not None:
            self._thread.join()
        for s in slabs:
            s.discard()
        for s in retired:  # published objects: unmapped, never deleted here
            s.close()


# -- is a recycled slab open or mapped anywhere else? ------------------------------------------
_F_SETSIG = 10
_F_SETLEASE = 1024


def _lease(fd: int) -> bool | None:
    """Try a write lease on ``fd`` and drop it at once. The kernel grants it only if no other open
    file of the inode exists (a mapping holds its file open), in any process or PID namespace.
    True: granted; False: the file is open elsewhere; None: leases unavailable here."""
    try:
        # Were an open to race with the lease, its holder gets a signal: SIGURG (ignored unless
        # handled) rather than the default SIGIO, which would kill this process.
        fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_WRLCK)
    except OSError as e:
        return False if e.errno in (errno.EAGAIN, errno.EBUSY) else None
    fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
    return True


_lease_trust: dict[int, bool] = {}  # st_dev of a tmp directory -> the lease test is exact there


def _lease_exact(tmp_dir: str) -> bool:
    """Whether a write lease on this filesystem is refused while another descriptor has the file
    open read-only (Linux counts read-only opens for leases since 5.7; earlier kernels only with
    IMA). Probed once per filesystem and process, on a scratch file of this process's own."""
    dev = os.stat(tmp_dir).st_dev
    if dev not in _lease_trust:
        path = os.path.join(tmp_dir, tmp_name())
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:  # no inode left (a full tmpfs): not known to be exact, probe again later
            return False
        try:
            ro = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                refused = _lease(fd) is False
            finally:
                os.close(ro)
            _lease_trust[dev] = refused and _lease(fd) is True
        finally:
            os.close(fd)
            os.unlink(path)
    return _lease_trust[dev]


def _unshared(slab: Slab, tmp_dir: str) -> bool:
    """Whether no process but this pool has ``slab``'s file open or mapped."""
    granted = _lease(slab.fd)
    if granted is False:
        return False
    if granted and _lease_exact(tmp_dir):
        return True
    return not _used_elsewhere(slab)


def _used_elsewhere(slab: Slab) -> bool:
    """The ``/proc`` scan: does any process other than this pool's mapping hold the slab's file
    (an open descriptor or a mapping)? A process that cannot be inspected counts as one that does.

    After the rename into ``tmp/`` nobody can open the file by name, so a process can only still
    be getting to it through a descriptor it had (descriptors are looked at before mappings, so a
    descriptor closed after mapping is seen as one or the other) or by forking (processes started
    during the scan are scanned too)."""
    st = os.fstat(slab.fd)
    me = os.getpid()
    lo = address(slab.map) if slab.size else 0
    seen: set[int] = set()
    for _ in range(2):
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in seen]
        for pid in pids:
            seen.add(pid)
            if _holds(pid, st.st_dev, st.st_ino, (lo, lo + slab.size, slab.fd) if pid == me else None):
                return True
    return False


def _holds(pid: int, dev: int, ino: int, own: tuple[int, int, int] | None) -> bool:
    """Whether process ``pid`` has the file ``(dev, ino)`` open or mapped; ``own``: in this
    process, the pool's mapping (start, end) and descriptor, which do not count."""
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if own is not None and int(fd) == own[2]:
                continue
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except (FileNotFoundError, ProcessLookupError):
                continue
            if st.st_ino == ino and st.st_dev == dev:
                return True
        with open(f"/proc/{pid}/maps", "rb") as f:
            maps = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False  # exited
    except OSError:
        return True  # cannot be inspected: may map it
    key = b" %d " % ino
    for line in maps.splitlines():
        if key not in line:
            continue
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or int(fields[4]) != ino:
            continue
        major, minor = (int(x, 16) for x in fields[3].split(b":"))
        if os.makedev(major, minor) != dev:
            continue
        start, end = (int(x, 16) for x in fields[0].split(b"-"))
        if own is not None and own[0] <= start and end <= own[1]:
            continue  # the pool's own mapping
        return True
    return False


# -- which pools recycle into which tmp/ directory (for GC in this process) --------------------
_pools: dict[str, weakref.WeakSet[SlabPool]] = {}
_pools_lock = threading.Lock()


def _register(pool: SlabPool) -> None:
    with _pools_lock:
        _pools.setdefault(os.path.realpath(pool._tmp), weakref.WeakSet()).add(pool)


def recyclers(tmp_dir: str) -> list[SlabPool]:
    """The open pools of this process that recycle slabs into ``tmp_dir``."""
    with _pools_lock:
        pools = list(_pools.get(os.path.realpath(tmp_dir), ()))
    return [p for p in pools if p.recycling and not p._closed and p._owner == os.getpid()]


def _forget_pools_in_child() -> None:
    # A forked child recycles nothing of its parent's (and the lock may have been held at the fork).
    global _pools_lock
    _pools_lock = threading.Lock()
    _pools.clear()


os.register_at_fork(after_in_child=_forget_pools_in_child)


def storage_error(e: OSError, directory: str, needed: int, what: str = "a staging buffer") -> "StorageError":
    """The package's error for a failed reservation of ``needed`` bytes in ``directory``: a
    StorageFullError (ENOSPC, EDQUOT) that names the filesystem (its mount point and the
    directory), what ``what`` needs and what is free, else a StorageError."""
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return StorageError(e.errno, f"cannot reserve {needed} bytes in {directory}: {e.strerror}", directory)
    try:
        st = os.statvfs(directory)
        free = f"{_size(st.f_bavail * st.f_frsize)} free of {_size(st.f_blocks * st.f_frsize)}"
    except OSError:
        free = "free space unknown"
    full = "is over quota" if e.errno == errno.EDQUOT else "is full"
    return StorageFullError(
        e.errno, f"the filesystem mounted at {mount_point(directory)} (holding {directory}) {full}: {what} "
        f"needs {_size(needed)} ({free}). Free space there (prune and gc old versions: retention=, "
        "`paramstore prune`, `paramstore gc`), or give the store a larger filesystem", directory)


def mount_point(path: str) -> str:
    """The mount point of the filesystem holding ``path`` (the highest ancestor on the same device)."""
    path = os.path.realpath(path)
    try:
        dev = os.stat(path).st_dev
        while path != os.path.dirname(path) and os.stat(os.path.dirname(path)).st_dev == dev:
            path = os.path.dirname(path)
    except OSError:
        pass
    return path


def _size(n: int) -> str:
    """Bytes for a message: MiB with one decimal, KiB below 0.1 MiB."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 // 10 or n == 0 else f"{n / 2**10:.1f} KiB"
