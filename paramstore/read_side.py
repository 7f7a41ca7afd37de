"""The rollout's half of a store in this process: resolve, wait, lease, obtain the bytes, map;
and prefetch (obtain the bytes ahead of the checkout that maps them).

:class:`ReadSide` owns what reading starts: the fetcher that obtains the objects this host lacks
(patches, peers, the remote: :mod:`paramstore.checkout`), this process's transport and peer server
(:mod:`paramstore.peer`), and the device copies of checked-out versions (:mod:`paramstore.device`).
:class:`~paramstore.ParamStore` delegates to it and closes it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
import queue
import sys
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Iterator

from . import derived, metrics
from .checkout import Fetcher, check_checkout_args, map_version, release_lease
from .errors import InvalidArgumentError, ParamStoreError, VersionNotFoundError, WaitTimeoutError
from .manifest import Version
from .objects import read_manifest
from .peer import PeerServer
from .reports import FetchReport, TransferReport
from .opening import Opening
from .root import StoreRoot, VersionSpec
from .staging import SlabPool
from .validate import check_bound, check_timeout

from paramstore.backends.transports import open_transport
from paramstore.backends.transports.base import Transport
from paramstore.backends.transports.collective import TorchCollective

if TYPE_CHECKING:
    from .device import DeviceCache
    from .snapshot import Snapshot

__all__ = ["ReadSide"]

#: How long a prefetch that brought bytes waits, its version still leased, for the retention run
#: that follows (so that the run cannot prune what was just prefetched).
RETENTION_WAIT_S = 30.0
_CLOSE_POLL_S = 0.5  # how often a wait for a version looks whether the store was closed meanwhile


class ReadSide:
    """Reads of one store by one process (see the module docstring)."""

    def __init__(self, opening: Opening) -> None:
        self._open, self._opts = opening, opening.opts
        self._parts_lock = threading.Lock()
        self.fetcher: Fetcher | None = None
        self.peer: PeerServer | None = None
        self.transport: Transport | None = None
        self._transport_host = os.environ.get("PARAMSTORE_HOST", "127.0.0.1")
        self.devices: DeviceCache | None = None  # made by the first device checkout
        self._prefetcher: _Serial | None = None  # made by the first prefetch
        metrics.attach(opening)  # ParamStore(metrics=True)
        opening.on_open(self._opened)

    def _opened(self, root: StoreRoot, pool: SlabPool) -> None:
        self.fetcher = Fetcher(root, pool, remote=self._open.remote, transport=self.get_transport,
                               server=lambda: self.peer, prepare_buffers=self._opts.prepare_buffers,
                               patches=self._opts.use_patches)

    # -- naming and waiting ------------------------------------------------------------------
    def resolve(self, version: VersionSpec) -> int:
        """The step ``version`` names here, else in the remote (an empty store, an unknown tag)."""
        try:
            return self._open.root.resolve(version)
        except VersionNotFoundError:
            if self._open.remote is None:
                raise
            return self._open.remote.resolve(version)

    def wait_for(self, step: int, timeout: float | None) -> Version:
        """:meth:`ParamStore.wait_for <paramstore.ParamStore.wait_for>`."""
        check_timeout(timeout)
        check_bound(step, "step")
        left = self._open.await_root(timeout)
        reg = self._open.root.registry
        latest = reg.latest_step()
        if latest is not None and latest >= step:  # there already: no watch to arm (a few ms)
            return reg.get_version(latest)
        deadline = None if left is None else time.monotonic() + left
        with reg.watch() as watch:
            while True:
                latest = reg.latest_step()
                if latest is not None and latest >= step:
                    return reg.get_version(latest)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WaitTimeoutError(f"no version with step >= {step} within {timeout:.4g} s (latest: {latest})")
                watch.wait(_CLOSE_POLL_S if left is None else min(left, _CLOSE_POLL_S))
                self._open.check_open()  # a wait (a prefetch's, say) ends when the store closes

    def subscribe(self, min_step: int | None, timeout: float | None) -> Iterator[Version]:
        """:meth:`ParamStore.subscribe <paramstore.ParamStore.subscribe>`."""
        if min_step is not None:
            check_bound(min_step, "min_step")
        check_timeout(timeout)
        existed = self._open.exists()
        left = self._open.await_root(timeout)  # WaitTimeoutError naming the path if no store appears
        reg = self._open.root.registry
        watch = reg.watch()  # armed now: nothing committed after this call is missed
        if min_step is None:
            latest = reg.latest_step() if existed else None  # a store made since the call: all of it is new
            last = -1 if latest is None else latest
        else:
            last = max(min_step - 1, -1)
        gen = self._follow(watch, last, left)
        weakref.finalize(gen, watch.close)  # a subscription dropped before its first next() frees its watch
        return gen

    def _follow(self, watch: Any, last: int, timeout: float | None) -> Iterator[Version]:
        reg = self._open.root.registry
        with watch:
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                new = list(reg.versions(after=last))
                for v in new:
                    last = v.step
                    yield v
                if new and timeout is not None:
                    deadline = time.monotonic() + timeout  # the timeout counts idle time
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                watch.wait(left)  # woken by any change (leases too): re-read and loop
                self._open.check_open()

    # -- prefetch ----------------------------------------------------------------------------
    def prefetch(self, version: VersionSpec, min_step: int | None, timeout: float | None,
                 recipe: Any = None) -> Future[Version]:
        """:meth:`ParamStore.prefetch <paramstore.ParamStore.prefetch>`: on this side's prefetch
        thread, one version after another, in the order asked."""
        check_checkout_args(version, min_step, timeout)
        if recipe is not None:
            recipe = derived.resolve_recipe(recipe)  # an unknown name fails the call, not the future
        with self._parts_lock:
            if self._prefetcher is None:
                self._prefetcher = _Serial("paramstore-prefetch")
            return self._prefetcher.submit(self._prefetch, version, min_step, timeout, recipe)

    @metrics.observed("prefetch")
    def _prefetch(self, version: VersionSpec, min_step: int | None, timeout: float | None,
                  recipe: Any = None) -> Version:
        """Resolve (or wait for) the version, lease it while its objects come here (and, with a
        recipe, its derived objects are made), let go."""
        if min_step is not None:
            timeout = self._open.await_root(timeout)
        root = self._open.root
        step, lease_id, pulled = self._lease(version, min_step, timeout, f"prefetch (pid {os.getpid()})", None)
        try:
            record = root.registry.get_version(step)
            assert self.fetcher is not None
            manifest = read_manifest(root, step, version=record)
            report = self.fetcher.fetch(step, manifest)
            report.absorb(pulled)  # what a pull of this version placed already
            metrics.fetched(self, report, manifest)
            if report.fetched:  # retention, waited for while the lease keeps this version from it
                self._open.received(wait=RETENTION_WAIT_S)
            if recipe is not None:
                derived.derive_manifest(root, manifest, recipe, elsewhere=self.fetcher.elsewhere(report),
                                        pool=self.fetcher.write_pool)
        finally:
            release_lease(root.registry, lease_id, os.getpid())
        return record

    # -- checkout ----------------------------------------------------------------------------
    @metrics.observed("checkout")
    def checkout(self, version: VersionSpec, *, min_step: int | None, timeout: float | None, holder: str | None,
                 verify: bool, device: Any, group: Any, src: int | None, bucket_bytes: int | None,
                 recipe: Any = None, fetch: str = "eager") -> Snapshot:
        """:meth:`ParamStore.checkout <paramstore.ParamStore.checkout>`."""
        check_checkout_args(version, min_step, timeout)
        lazy = _check_fetch(fetch, verify=verify, device=device, group=group, recipe=recipe)
        if recipe is not None:
            recipe = derived.resolve_recipe(recipe)
        place = self._device_placer(device)
        if group is None and (src is not None or bucket_bytes is not None):
            raise InvalidArgumentError("src= and bucket_bytes= are for a collective checkout: pass group= too")
        if min_step is not None:
            timeout = self._open.await_root(timeout)
        collective = None if group is None else self._collective(group, 0 if src is None else src, version,
                                                                 min_step, timeout, bucket_bytes)
        root = self._open.root  # opened first: that makes the fetcher
        given = collective() if collective is not None else None
        step, lease_id, pulled = self._lease(version, None if group is not None else min_step, timeout,
                                             holder or f"pid {os.getpid()}", given)
        snap = map_version(root, self.fetcher, step, lease_id, given=given, pulled=pulled, verify=verify, lazy=lazy)
        if snap.fetch.fetched:  # (its lease keeps it from the retention this may run)
            self._open.received()
        if recipe is not None:
            assert self.fetcher is not None
            snap = derived.checkout(root, snap, recipe,  # closes snap; the lease passes to the derived one
                                    elsewhere=self.fetcher.elsewhere(snap.fetch), pool=self.fetcher.write_pool)
            if verify:
                derived.verify_or_forget(root, snap)
        if place is None:
            return snap
        try:
            return place(snap)
        except BaseException:
            snap.close()  # unmaps, and releases the lease
            raise

    def _lease(self, version: VersionSpec, min_step: int | None, timeout: float | None, holder: str,
               given: FetchReport | None) -> tuple[int, str, TransferReport | None]:
        """Resolve ``version`` (or wait for ``min_step``; or take the step a collective checkout
        delivered) and lease it: ``(step, lease id, the pull that placed it, if any)``. A version
        pruned between resolving and leasing is resolved again; one found only in the remote is
        pulled first."""
        reg = self._open.root.registry
        deadline = None if timeout is None else time.monotonic() + timeout
        pulled: TransferReport | None = None
        while True:
            if given is not None:
                step = given.step
            elif min_step is not None:
                step = self.wait_for(min_step, None if deadline is None else max(0.0, deadline - time.monotonic())).step
            else:
                step = self.resolve(version)
            try:
                return step, reg.acquire_lease(step, holder).id, pulled
            except VersionNotFoundError:
                if given is not None:  # pruned here right after the group delivered it
                    raise
                if min_step is None:
                    pulled = self._pull_if_remote(step)
                    if pulled is not None:
                        continue  # pulled from the remote: lease it now
                    # pruned between resolving "latest" (or a tag) and leasing: resolve again,
                    # unless the step was named explicitly (an int, or a string from a config file)
                    if isinstance(version, int) or (isinstance(version, str) and version.lstrip("-").isdigit()):
                        raise

    def _device_placer(self, device: Any) -> "Callable[[Snapshot], Snapshot] | None":
        """What turns a checked-out snapshot into one on ``device`` (None: stay a CPU snapshot)."""
        if device is None:
            return None
        from . import accel

        dev = accel.as_device(device)
        if dev.type == "cpu":
            return None
        return lambda snap: self._device_cache().place(snap, dev, self._open.root)

    def _device_cache(self) -> DeviceCache:
        with self._parts_lock:
            if self.devices is None:
                from .device import DeviceCache

                self.devices = DeviceCache(self._opts.device_bucket_bytes)
            return self.devices

    def _collective(self, group: Any, src: int, version: VersionSpec, min_step: int | None,
                    timeout: float | None, bucket_bytes: int | None) -> Callable[[], Any]:
        """The broadcast of a collective checkout (run before the version is leased here)."""
        from .collective import broadcast_version

        if isinstance(src, bool) or not isinstance(src, int) or src < 0:
            raise InvalidArgumentError(f"src must be a rank (an int >= 0) in the group, got {src!r}")
        if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                         or bucket_bytes <= 0):
            raise InvalidArgumentError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")

        def resolve(v: VersionSpec) -> int:  # called on src only
            return self.wait_for(min_step, timeout).step if min_step is not None else self.resolve(v)

        extra = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
        return lambda: broadcast_version(self._open.root, self._open.pool, TorchCollective(group), src, version,
                                         resolve=resolve, **extra)

    def _pull_if_remote(self, step: int) -> TransferReport | None:
        if self._open.remote is None:
            return None
        try:
            return self._open.remote.pull(self._open.root, step)
        except VersionNotFoundError:
            return None

    def gather(self, step: int) -> None:
        """Make every object of version ``step`` present on this host (from peers, else the
        remote), under a lease: before a push of a version whose blocks were committed on
        several hosts."""
        root = self._open.root
        assert self.fetcher is not None
        with root.leased([step], holder="paramstore gather"):
            self.fetcher.fetch(step, root.registry.get_manifest(step))

    # -- peers -------------------------------------------------------------------------------
    def serve(self, host: str, transport: Transport | None) -> PeerServer:
        """:meth:`ParamStore.serve <paramstore.ParamStore.serve>`."""
        if self.peer is None:
            if transport is not None:
                self.transport = transport
            self._transport_host = host
            self.peer = PeerServer(self._open.root, self.get_transport())
        return self.peer

    def announce(self, digests: list[str]) -> None:
        """Serve these objects of this host to other hosts now, if this process serves (:meth:`serve`).
        A registry that fails here fails the peer server's rescans too, which retry and say so: the
        caller (a commit, a patch) goes on."""
        if self.peer is not None:
            with contextlib.suppress(ParamStoreError):
                self.peer.serve(digests)

    def get_transport(self) -> Transport:
        """This process's transport, made on first use by the entry point ``$PARAMSTORE_TRANSPORT``
        names (default ``mooncake``; see :func:`paramstore.backends.transports.open_transport`)."""
        if self.transport is None:
            self.transport = open_transport(None, self._transport_host)
        return self.transport

    def close(self) -> None:
        """End the prefetches (one waiting for a version ends at once), release the device
        copies, stop serving, close the transport; the closed snapshots' mappings are dropped by
        the time it returns."""
        if self._prefetcher is not None:
            self._prefetcher.close()
        for part in (self.devices, self.peer, self.transport):
            if part is not None:
                part.close()
        snapshot = sys.modules.get("paramstore.snapshot")  # never imported here: no snapshot was made, and
        if snapshot is not None:  # importing it would load torch at the close of every metadata command
            snapshot.release_mappings(timeout=60)


def _check_fetch(fetch: Any, *, verify: bool, device: Any, group: Any, recipe: Any) -> bool:
    """Whether ``fetch`` asks for a lazy checkout; InvalidArgumentError for another value than
    ``"eager"`` or ``"lazy"``, and for ``"lazy"`` with what it does not support (yet)."""
    if fetch not in ("eager", "lazy"):
        raise InvalidArgumentError(f"fetch must be 'eager' or 'lazy', got {fetch!r}")
    if fetch == "eager":
        return False
    refused = [what for what, given in (
        ("verify=True (a lazy read verifies each piece as it arrives; snap.verify() re-hashes what arrived)", verify),
        (f"device={str(device)!r} (lazy checkouts are CPU only: copy what you read to the device)",
         device is not None and str(device) != "cpu"),
        ("group= (a collective checkout moves the whole version)", group is not None),
        ("recipe= (deriving reads whole source objects)", recipe is not None)) if given]
    if refused:
        raise InvalidArgumentError("fetch='lazy' is not supported with " + "; nor with ".join(refused))
    return True


class _Serial:
    """Runs calls one after another on a daemon thread, each with a Future. Unlike a
    ``ThreadPoolExecutor``'s worker, an exiting interpreter does not wait for it (a prefetch waiting
    for a version that never comes must not hold the process at exit: the store's close ends it)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - the caller's, through the future
                    future.set_exception(e)

    def close(self) -> None:
        """Cancel the calls not started, then wait for the running one (the store is closed by
        then: a wait in it ends within a poll)."""
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call[0].cancel()
        self._calls.put(None)
        self._thread.join()
