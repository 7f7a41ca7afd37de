"""How a process opens a store root: lazily, never creating one for a reader, then its slab pool.

:class:`Opening` holds a :class:`~paramstore.ParamStore`'s root while it is not open yet (a
trainer's first commit creates it; a reader waits for it to appear) and once it is (the
:class:`~paramstore.root.StoreRoot`, the process's :class:`~paramstore.staging.SlabPool` and the
background scrubber). The read and write sides ask it for the root; each registers what it starts
once the root is open (:meth:`Opening.on_open`).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Callable

from . import maintenance
from .errors import ParamStoreWarning, StoreClosedError, WaitTimeoutError
from .text import warn
from .options import StoreOptions
from .root import MARKER, StoreRoot, check_creatable, open_root
from .scrub import Scrubber
from .staging import SlabPool

if TYPE_CHECKING:
    from .remote import Remote

__all__ = ["Opening"]

_STORE_POLL_S = 0.1  # how often a reader waiting for a store to be created looks for it


class Opening:
    """The root of one store as this process opens it (see the module docstring)."""

    def __init__(self, path: str, opts: StoreOptions, remote: "Remote | None") -> None:
        self.path, self.opts, self.remote = path, opts, remote
        self.opened: StoreRoot | None = None
        self.pool: SlabPool | None = None
        self.ahead = 0  # versions ahead ``prepare`` faults buffers for (recycling keeps that many)
        self.scrubber: Scrubber | None = None
        self.closed = False
        self.owner = os.getpid()
        self.lock = threading.Lock()  # held while opening and while close() marks the store closed
        self._hooks: list[Callable[[StoreRoot, SlabPool], None]] = []
        self._received: list[Callable[..., None]] = []
        _warn_if_not_shared_memory(path)  # before anything is opened
        if opts.create is not None or os.path.exists(os.path.join(path, MARKER)):
            self.attach(create=bool(opts.create))  # create=False: the store must exist now
        else:
            check_creatable(path)  # a file or a directory of other files: refused at once

    def on_open(self, hook: Callable[[StoreRoot, SlabPool], None]) -> None:
        """Call ``hook(root, pool)`` when the store opens (at once if it is open)."""
        self._hooks.append(hook)
        if self.opened is not None and self.pool is not None:
            hook(self.opened, self.pool)

    def on_received(self, hook: Callable[..., None]) -> None:
        """Call ``hook(wait=...)`` each time a version's bytes came to this host (:meth:`received`)."""
        self._received.append(hook)

    def received(self, *, wait: float | None = None) -> None:
        """Bytes of a version came to this host (a fetch, a pull, a collective checkout): the read
        side says so, and retention runs (``ParamStore(retention=)``: :meth:`Maintainer.received
        <paramstore.maintenance.Maintainer.received>`); ``wait``: seconds to wait for it."""
        for hook in self._received:
            hook(wait=wait)

    @property
    def shared(self) -> bool:
        """Whether this root is a local cache of a store that lives elsewhere (a remote or a
        shared registry): a reader then makes it on first use, to pull or fetch into."""
        return self.remote is not None or self.opts.registry is not None

    def attach(self, *, create: bool) -> StoreRoot:
        """Open the store (creating it if ``create``) and the parts that work on it; idempotent."""
        with self.lock:
            if self.opened is not None:
                return self.opened
            self.check_open()
            opts = self.opts
            root = open_root(self.path, create=create, registry=opts.registry, name=opts.name or "",
                             shared_group=opts.shared_group)
            try:
                local = opts.policies.get("local")  # recycling needs GC in this process
                # Versions retention keeps (up to 3): published buffers stay mapped one commit longer
                # (GC sweeps a version once that many newer ones exist); prepare() faults that many more.
                kept = min(maintenance.versions_kept(local), 3)
                self.pool = SlabPool(root.tier.tmp_dir, pin=opts.pin_memory, keep_mapped=kept + 1,
                                     recycle=opts.recycle_buffers and opts.prepare_buffers and local is not None)
                self.ahead = kept if self.pool.recycling else 0
                for hook in self._hooks:
                    hook(root, self.pool)
                if opts.scrub_rate is not None:
                    self.scrubber = Scrubber(root, opts.scrub_rate)
            except BaseException:
                root.close()
                raise
            self.opened = root
            return root

    @property
    def root(self) -> StoreRoot:
        """The open store; a reader's first use opens it. A reader creates nothing, except a
        local cache of a store that exists elsewhere (:attr:`shared`)."""
        if self.opened is not None:
            return self.opened
        return self.attach(create=self.shared and self.opts.create is not False)

    def await_root(self, timeout: float | None) -> float | None:
        """Wait until the store exists (a rollout started before its trainer); returns the time left.

        Raises WaitTimeoutError naming the path when ``timeout`` passes first.
        """
        if self.opened is not None or self.shared:
            self.root  # noqa: B018 -- open it (a cache of a remote or shared store is made here)
            return timeout
        start, marker = time.monotonic(), os.path.join(self.path, MARKER)
        while not os.path.exists(marker):
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                raise WaitTimeoutError(f"no store exists at {self.path} (waited {timeout:.4g} s for one to appear; a "
                                       "reader never creates a store): check the path, and that the trainer started")
            self.check_open()
            time.sleep(_STORE_POLL_S if timeout is None else min(_STORE_POLL_S, max(0.0, timeout - waited)))
        self.root  # noqa: B018 -- open it
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))

    def exists(self) -> bool:
        """Whether the store is open here or exists at the path."""
        return self.opened is not None or os.path.exists(os.path.join(self.path, MARKER))

    def not_created(self) -> bool:
        """No store exists at the root yet, and this handle's first commit would create it: the
        trainer's own calls before that commit (``latest``, ``leases``, ``wait_for_readers``) answer
        "none" instead of a reader's NotAStoreError."""
        return self.opts.create is None and not self.shared and not self.exists()

    def check_open(self) -> None:
        """StoreClosedError once the store is closed."""
        if self.closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def mark_closed(self) -> bool:
        """Mark the store closed (a thread inside :meth:`attach` finishes first); False if it was."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            return True

    def close(self) -> None:
        """Stop the scrubber, release the pool's buffers and close the registry (after the sides)."""
        if self.opened is None:
            return
        if os.getpid() != self.owner:
            # A forked child: the threads and the pool's files belong to the parent. Only this
            # process's registry handle is released.
            self.opened.close()
            return
        if self.scrubber is not None:
            self.scrubber.close()
        if self.pool is not None:
            self.pool.close()
        self.opened.close()


def _warn_if_not_shared_memory(path: str) -> None:
    """Warn once per root that is not on a memory filesystem (tmpfs): it works, but objects live in
    a disk's page cache, commits write to disk, and checkouts are not zero-copy views of shared memory."""
    fstype = _fstype(path)
    if fstype is None or fstype in _MEMORY_FILESYSTEMS or path in _warned_roots:
        return
    _warned_roots.add(path)
    warn(
        f"store root {path} is on a {fstype} filesystem, not tmpfs: commits and checkouts work, but objects "
        "are written to that filesystem and checkouts map its page cache instead of shared memory (slower, "
        "and evictable). Put the root on /dev/shm (or another tmpfs) for zero-copy shared memory.",
        ParamStoreWarning)


_MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "hugetlbfs"}
_warned_roots: set[str] = set()


def _fstype(path: str) -> str | None:
    """The filesystem type of the mount holding ``path`` (from /proc/self/mounts), or None if unknown."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[:3] for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, fstype = "", None
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, fstype = point, fields[2]
    return fstype
