"""Peer-to-peer between hosts: serve this host's objects, fetch the ones it lacks. No torch.

* :class:`PeerServer` — one per host (``paramstore serve``, or ``store.serve()`` in a process).
  It maps every object of the host's shared-memory tier read-only, registers the mappings with
  the transport and announces ``{object digest: address}`` in the (shared) registry; it follows
  commits, pulls and GC. It serves only registered object memory, and only objects it announced.
* :func:`fetch` — what a checkout runs for the objects of a version its host lacks: each object is
  read straight into a slab of the local tier (registered memory, no intermediate copy). An
  object the version's manifest covers end to end is *relayed* (``paramstore/relay.py``: blocks
  verified the moment they land and passed on along a chain or tree of the hosts that fetch it, in
  the order the registry gave them); so is one whose digests something else lists (a patch
  object's own header, a derived object's record) and any other of at most a block, checked
  whole. The rest (an object over a block that nothing lists the digests of: a patch object
  written before they did, an object a version references only part of) are read whole here
  (:class:`_Fetch`): slices from the hosts that hold it, hashed as they arrive, verified whole,
  with blame found by re-reading (:meth:`_Fetch.recover`). Objects no peer
  could deliver are left for the remote tier. Then the object is announced by this process's
  server, if it runs one.

Delta comes from content addressing: unchanged tensors stay in the objects a host already holds, so
only objects with changed tensors move.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Iterable, Mapping

import blake3

from . import liveness, relay
from .errors import ParamStoreError, TransferError
from .format import ObjectHasher, rehash
from .relay import WHOLE_BLOCK_BYTES, Relay, Retries, blame, holders_of
from .reports import FetchReport
from .retire import retire
from .root import StoreRoot
from .staging import SlabPool

from paramstore.backends.registries.base import Peer
from paramstore.backends.transports.base import Transport

__all__ = ["PeerServer", "fetch", "FETCH_CONCURRENCY"]

#: Objects a fetch reads at once.
FETCH_CONCURRENCY = 4

SLICE_BYTES = 4 << 20  # unit of spreading one object over several peers (a read batches its slices)


class PeerServer:
    """Serves this host's objects to other hosts through ``transport``.

    Args:
        root: the host's store.
        transport: this process's transport (its ``session`` is announced).
        interval: seconds between rescans of the tier when nothing wakes the server earlier (a
            commit or prune wakes it at once).
    """

    def __init__(self, root: StoreRoot, transport: Transport, *, interval: float = 1.0) -> None:
        self._root = root
        self._transport = transport
        self._interval = interval
        self.peer = Peer(uuid.uuid4().hex, transport.session, liveness.HOST, os.getpid(), time.time())
        self._served: dict[str, tuple[mmap.mmap, int]] = {}  # digest -> (read-only map, address)
        self._lock = threading.RLock()  # held across sync() and serve(): the rescan thread and callers
        self._stop = threading.Event()
        root.registry.announce_peer(self.peer)
        self.sync()
        self._thread = threading.Thread(target=self._loop, name="paramstore-peer", daemon=True)
        self._thread.start()

    def sync(self) -> None:
        """Serve every object the tier holds now; stop serving those GC removed."""
        with self._lock:
            if self._stop.is_set():
                return
            present = set(self._root.tier.list())
            gone = [d for d in self._served if d not in present]
            if gone:
                self._root.registry.withdraw_objects(self.peer.id, gone)
                for d in gone:
                    self._drop(d)
            self.serve(present)

    def serve(self, digests: Iterable[str]) -> None:
        """Map, register and announce these local objects (those already served are skipped)."""
        with self._lock:
            if self._stop.is_set():
                return  # closed: a relay that verified its object after that serves nothing
            new: dict[str, int] = {}
            for d in digests:
                if d in self._served:
                    continue
                try:
                    m = self._root.tier.map(d, private=False)
                except FileNotFoundError:
                    continue  # collected meanwhile
                self._served[d] = (m, self._transport.register(m))
                new[d] = self._served[d][1]
            if new:
                self._root.registry.announce_objects(self.peer.id, new)

    def _drop(self, digest: str) -> None:
        with self._lock:
            entry = self._served.pop(digest, None)
        if entry is not None:
            retire(self._transport, entry[1], entry[0].close)

    def _loop(self) -> None:
        try:
            with self._root.registry.watch() as watch:
                while not self._stop.is_set():
                    watch.wait(self._interval)
                    if self._stop.is_set():
                        return
                    try:
                        self.sync()
                    except Exception as e:  # noqa: BLE001 - keep serving; say why once in a while
                        warnings.warn(f"paramstore peer: rescan failed: {e}", RuntimeWarning, stacklevel=1)
        except Exception:  # noqa: BLE001 - the registry closed under a server closed before it
            if not self._stop.is_set():
                raise

    @property
    def served(self) -> list[str]:
        """Digests this server announces."""
        with self._lock:
            return sorted(self._served)

    def close(self) -> None:
        """Withdraw the peer and release every registration (idempotent). Returns without waiting
        for the rescan thread, which may be waiting on the registry for up to ``interval``: once
        this is called it serves nothing more (:meth:`sync` and :meth:`serve` do nothing) and ends
        at its next wake-up (measured: ``store.close()`` of a rollout host that served took 1.7 s,
        0.85 s of it joining that thread)."""
        with self._lock:  # a sync() or serve() under way finishes first; none starts after
            if self._stop.is_set():
                return
            self._stop.set()
        with contextlib.suppress(ParamStoreError, OSError, RuntimeError):
            self._root.registry.withdraw_peer(self.peer.id)
        for d in list(self._served):
            with contextlib.suppress(ParamStoreError, OSError):
                self._drop(d)


def fetch(root: StoreRoot, transport: Transport, objects: Mapping[str, int], *, pool: SlabPool,
          report: FetchReport, server: PeerServer | None = None, concurrency: int | None = None,
          extents: Mapping[str, int] | None = None, excluded: set[str] | None = None,
          spans: Mapping[str, Mapping[tuple[int, int], str]] | None = None,
          pieces: Mapping[str, Mapping[tuple[int, int], str]] | None = None) -> None:
    """Fetch the ``objects`` (digest -> size) the local tier lacks from the peers that hold them.

    The caller holds a lease on the version. Each object is read into a slab of ``pool`` (pages
    faulted ahead of time when the pool prepared one of that size; a relayed object's fresh slab
    is reserved and faulted just ahead of the blocks that arrive, see :class:`paramstore.relay._Space`). A size (the registry's word)
    is believed before anything of that size is allocated only where it is the object's extent in
    the version's manifest (``extents``: digest -> end of the last byte range it references);
    otherwise the object's own safetensors header must say the same size first (read by its
    relay, :meth:`Relay.run`), so a wrong or hostile size allocates nothing. ``server``: this process's
    peer server, if it runs one: it then serves what a relay verified as it arrives (other hosts
    fetching the same version read it from here) and each object once verified. ``report`` (the
    checkout's) gets the objects delivered intact (``from_peers``), bytes per peer and rejections;
    an object no peer delivered intact is simply not in the local tier afterwards. ``excluded``:
    ids of peers not to ask (caught serving bad bytes earlier in the same checkout); a peer caught
    now is added, so neither the other objects of this fetch nor the caller's later sources for
    the same version ask it again.

    ``spans`` and ``pieces`` (a version's :meth:`~paramstore.manifest.Manifest.spans` and
    :meth:`~paramstore.manifest.Manifest.piece_spans`, or the same of a derived record's outputs:
    :func:`~paramstore.manifest.object_spans`): an object whose tensors they cover, end to
    end, is *relayed* (:class:`~paramstore.relay.Relay`: blocks verified one by one against them, read from the
    nearest fetcher ahead in a chain, and served on once verified); so is an object whose own
    header lists its piece digests (patch objects: :func:`~paramstore.format.listed_digests`,
    checked against its name; the header itself is relayed too, so hosts fetching it at once
    read it from the origin once) and any other of at most :data:`~paramstore.relay.WHOLE_BLOCK_BYTES`, as
    one block checked whole against its name (:meth:`Relay.whole`), once its size is believed; a
    larger one (an older patch object, an object the version references only part of) is fetched
    as a whole (:class:`_Fetch`).
    """
    concurrency = FETCH_CONCURRENCY if concurrency is None else concurrency
    todo = sorted((d for d in objects if not root.tier.exists(d)), key=lambda d: -objects[d])
    lock = threading.Lock()
    excluded = set() if excluded is None else excluded
    random.shuffle(todo)  # hosts fetching at once start on different objects
    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="paramstore-fetch") as readers, \
            ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="paramstore-hash") as hashers:
        def one(digest: str) -> None:
            size = objects[digest]
            plan = Relay.plan(digest, size, spans, pieces)
            believed = extents is not None and extents.get(digest) == size  # the version's manifest says so
            if plan is None and believed and size <= WHOLE_BLOCK_BYTES:  # one block, checked whole against its name
                plan = Relay.whole(size)
            placed, whole = False, plan is None and believed
            if not whole:  # planned, or its own header gives the plan (and says its size first)
                r = Relay(root, transport, pool, digest, size, server, report, lock, excluded, plan)
                placed, whole = r.run(), r.unlisted
            if whole:  # fetched whole, slice by slice, checked at the end
                placed = _Fetch(root, transport, pool, digest, size, server, report, lock, hashers, excluded).run()
            if placed:
                with lock:
                    report.from_peers.append(digest)

        list(readers.map(one, todo))


class _Fetch:
    """One object read whole from the hosts that hold it, and checked against its name at the end.

    The path for an object the relay cannot check block by block: over a block, and nothing lists
    the digests of all its bytes (an object a version references only in part, e.g. frozen tensors
    deduplicated into an older version's object; a patch object written before patches listed
    their digests). Nothing of it is served before it verifies. Slices are read in rounds of up to
    :data:`BURST_SLICES`, each slice from a holder drawn at random, and hashed as they arrive
    (:class:`ObjectHasher`), so little hashing is left after the last one. A holder whose read
    fails is put aside; where nobody else holds the object it is asked again after a back-off
    (:class:`~paramstore.relay.Retries`), as a relay does. Who served each slice is kept
    (:attr:`served`): the object's digest says only that some byte is wrong, so blame needs to know
    whose it was (:meth:`recover`).
    """

    def __init__(self, root: StoreRoot, transport: Transport, pool: SlabPool, digest: str, size: int,
                 server: PeerServer | None, report: FetchReport, lock: threading.Lock,
                 hashers: ThreadPoolExecutor, excluded: set[str]) -> None:
        self.root, self.transport, self.pool, self.digest, self.size = root, transport, pool, digest, size
        self.server, self.report, self.lock, self.hashers = server, report, lock, hashers
        self.me = server.peer.id if server is not None else None
        n = -(-size // SLICE_BYTES)
        start = random.randrange(n)  # hosts fetching at once start on different slices
        self.order = [(start + i) % n for i in range(n)]
        self.bad: set[str] = set()  # peers put aside for this object (failed reads, or blamed)
        self.retries = Retries()  # of them, those that only failed reads: asked again after a back-off
        self.excluded = excluded  # peers caught serving bad bytes: asked nothing more in this fetch (shared)
        self.served: dict[int, Peer] = {}  # slice -> the peer whose bytes are in the slab there
        self.prints: dict[tuple[int, str], tuple[Peer, bytes]] = {}  # (slice, peer id) -> its bytes' hash
        self.culprits: set[str] = set()  # peers blamed for this object (each counted once)
        self.hashing: list[Future[None]] = []
        # A read that timed out may leave slices in flight that write later: the file is then
        # never verified nor published (the object is left to another source).
        self.tainted = False

    def run(self) -> bool:
        slab = self.pool.take(self.size)
        placed = False
        try:
            try:
                self.addr = self.transport.register(slab.map)
            except BaseException:
                slab.close()
                raise
            buf = memoryview(slab.map)
            try:
                self.hasher = ObjectHasher(buf)
                if self._read_all() and not self.tainted:
                    placed = self._hashed() == self.digest
                if not placed:
                    placed = self.recover(buf)
            finally:
                wait(self.hashing)
                buf.release()
                retire(self.transport, self.addr, slab.close)
        finally:
            if placed:
                self.root.tier.put(self.digest, slab.path, move=True)
                if self.server is not None:
                    self.server.serve([self.digest])
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(slab.path)
        return placed

    def _hashed(self) -> str:
        wait(self.hashing)
        try:
            return self.hasher.digest()
        except ValueError as e:
            return str(e)

    def recover(self, buf: memoryview) -> bool:
        """The read did not verify (or stopped short): find a good copy, and who served bad bytes.

        When every slice arrived, some peer served wrong bytes, but the object's digest does not say
        whose: each slice is fingerprinted with who served it, then each peer's slices are read again
        from another holder, one peer at a time, until the object verifies (:meth:`_substitute`);
        failing that, it is read whole from one holder at a time. Once a copy verifies, a peer is
        blamed only for a slice whose bytes differ from it (:meth:`_blame_differing`), or for a
        read it served alone that failed: never an honest one.
        """
        wait(self.hashing)  # no hash thread reads the slab while it is overwritten
        if self.tainted:
            return False
        placed = False
        if len(self.served) == len(self.order):  # all there, and wrong
            self._fingerprint(buf, list(self.served))
            self._convict_sole_server()
            placed = self._substitute(buf)
        placed = placed or self._one_peer_at_a_time(buf)
        if placed:
            self._blame_differing(buf)
        return placed

    def _substitute(self, buf: memoryview) -> bool:
        """Read each contributing peer's slices again from another holder (a peer already caught in
        this fetch first: the likeliest culprit), one peer at a time, until the object verifies;
        True once it does.

        A replacement that does not verify the object is undone (the slices it overwrote were kept
        aside: at most one uncaught peer's share of the object, in memory, only on this path), so each slice
        is read again once at most: the extra bytes are at most the object's size.
        """
        peers = list({p.id: p for p in self.served.values()}.values())
        random.shuffle(peers)
        peers.sort(key=lambda p: p.id not in self.excluded)
        for peer in peers:
            mine = [i for i, p in self.served.items() if p.id == peer.id]
            others = [h for h in self._holders() if h[0].id != peer.id]
            if not mine or not others:
                continue
            # a peer already caught: its slices are not worth putting back if the replacement fails
            kept = {} if peer.id in self.excluded else {i: (bytes(buf[self._span(i)]), self.served[i]) for i in mine}
            other, addr = random.choice(others)
            got = self._read({other: [(i, addr) for i in mine]})
            if self.tainted:
                return False  # a late write may still land: nothing here can be trusted
            if len(got) == len(mine) and self._verified(buf):
                return True
            self._fingerprint(buf, got)
            self._convict_sole_server()
            for i, (data, server) in kept.items():
                buf[self._span(i)] = data
                self.served[i] = server
        return False

    def _one_peer_at_a_time(self, buf: memoryview) -> bool:
        """Read the whole object from one holder at a time; a holder whose copy fails is blamed."""
        for peer, addr in self._holders():
            if self.tainted:
                return False
            if len(self._read({peer: [(i, addr) for i in self.order]})) < len(self.order):
                continue  # it failed to serve (dead, refused): not a bad copy
            if self.tainted:
                return False
            if self._verified(buf):
                return True
            self._blame(peer)
        return False

    def _verified(self, buf: memoryview) -> bool:
        try:
            return rehash(buf)[0] == self.digest
        except ValueError:
            return False

    def _span(self, i: int) -> slice:
        return slice(i * SLICE_BYTES, min(self.size, (i + 1) * SLICE_BYTES))

    def _slice(self, buf: memoryview, i: int) -> bytes:
        """blake3 of slice ``i`` as it is in the slab now."""
        return blake3.blake3(buf[self._span(i)], max_threads=1).digest()

    def _fingerprint(self, buf: memoryview, slices: Iterable[int]) -> None:
        """Keep a hash of these slices as served, with who served them, for :meth:`_blame_differing`."""
        for i in slices:
            peer = self.served[i]
            self.prints[i, peer.id] = (peer, self._slice(buf, i))

    def _convict_sole_server(self) -> None:
        """If one holder served every slice now in the slab (which failed), blame it."""
        servers = {p.id: p for p in self.served.values()}
        if len(self.served) == len(self.order) and len(servers) == 1:
            self._blame(next(iter(servers.values())))

    def _blame_differing(self, buf: memoryview) -> None:
        """The slab verified: blame each peer that served some slice with other bytes than these."""
        truth: dict[int, bytes] = {}
        for (i, _), (peer, fingerprint) in self.prints.items():
            if peer.id not in self.culprits:
                truth[i] = truth[i] if i in truth else self._slice(buf, i)
                if fingerprint != truth[i]:
                    self._blame(peer)

    def _blame(self, peer: Peer) -> None:
        blame(self, peer, "bytes")  # excluded from now on: never asked again, not even after a back-off

    def _holders(self) -> list[tuple[Peer, int]]:
        """Holders of the whole object but this host and those put aside: ``(peer, address)``."""
        return holders_of(self.root.registry, [self.digest], self.me, self.bad | self.excluded).get(self.digest, [])

    def _read_all(self) -> bool:
        """Read every slice, each from a holder drawn at random; True once all arrived. With
        nobody left to ask but holders whose reads failed, waits out their back-off and asks again."""
        pending = list(self.order)
        while pending:
            if self.tainted:
                return False  # a late write may still land: nothing read now could be trusted
            holders = self._holders()
            if not holders:
                if not self._back_off():
                    return False  # nobody (left) holds it
                continue
            plan: dict[Peer, list[tuple[int, int]]] = {}
            for i in pending[:BURST_SLICES]:
                peer, addr = random.choice(holders)
                plan.setdefault(peer, []).append((i, addr))
            done = self._read(plan)
            if done:
                self.hashing.append(self.hashers.submit(self._arrived, done))
            arrived = set(done)
            pending = [i for i in pending if i not in arrived]
        return True

    def _back_off(self) -> bool:
        """Re-admit the holders put aside after failed reads whose back-off is over, sleeping until
        the first is due; False once none is left to ask."""
        with self.lock:
            due, later = self.retries.due(self.bad, self.excluded)
        if not due:
            if later is None:
                return False
            time.sleep(later)
            with self.lock:
                due, _ = self.retries.due(self.bad, self.excluded)
        with self.lock:
            self.bad.difference_update(due)
        return True

    def _arrived(self, done: list[int]) -> None:
        for i in sorted(done):
            span = self._span(i)
            self.hasher.arrived(span.start, span.stop)

    def _read(self, plan: Mapping[Peer, list[tuple[int, int]]]) -> list[int]:
        """Read from each peer its slices, ``(slice, address of the object's first byte there)``
        (in parallel across peers); returns the slices that arrived (and records who served them in
        :attr:`served`). A peer whose read fails is put aside (:attr:`bad`), its failure counted
        once per stall (the reads in flight to it fail together) for :meth:`_back_off`."""
        done: list[int] = []

        def read(item: tuple[Peer, list[tuple[int, int]]]) -> None:
            peer, mine = item
            ranges = [(self.addr + i * SLICE_BYTES, addr + i * SLICE_BYTES, min(SLICE_BYTES, self.size - i * SLICE_BYTES))
                      for i, addr in mine]
            try:
                self.transport.read(peer.session, _contiguous(ranges))
                if relay._TEST_DELAY_S:
                    time.sleep(relay._TEST_DELAY_S)  # tests: a slow link
            except TransferError as e:
                with self.lock:
                    if peer.id not in self.bad:
                        self.retries.failed_read(peer.id)
                        self.report.failed[peer.session] += 1
                    self.bad.add(peer.id)
                    self.tainted = self.tainted or e.code == -2
                    for i, _ in mine:  # part of it may have landed: nobody's bytes for sure
                        self.served.pop(i, None)
                return
            with self.lock:
                self.report.bytes_from[peer.session] += sum(n for _, _, n in ranges)
                done.extend(i for i, _ in mine)
                self.served.update((i, peer) for i, _ in mine)

        if len(plan) == 1:
            read(next(iter(plan.items())))
        else:
            with ThreadPoolExecutor(len(plan)) as pool:
                list(pool.map(read, plan.items()))
        return done


#: Slices a round of :meth:`_Fetch._read_all` reads at most (64 MiB): between rounds the holders
#: are looked up again (new ones join, failed ones are left out).
BURST_SLICES = 16


def _contiguous(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Reads ``(local, remote, n)`` with each run contiguous on both sides merged into one."""
    out: list[tuple[int, int, int]] = []
    for local, remote, n in ranges:
        if out and out[-1][0] + out[-1][2] == local and out[-1][1] + out[-1][2] == remote:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((local, remote, n))
    return out
