"""Peer-to-peer between hosts: serve this host's objects, fetch the ones it lacks. No torch.

* :class:`PeerServer` — one per host (``paramstore serve``, or ``store.serve()`` in a process).
  It maps every object of the host's shared-memory tier read-only, registers the mappings with
  the transport and announces ``{object digest: address}`` in the (shared) registry; it follows
  commits, pulls and GC. It serves only registered object memory, and only objects it announced.
* :func:`fetch` — what a checkout runs for the objects of a version its host lacks: each object is
  read straight into a slab of the local tier (registered memory, no intermediate copy):
  pre-faulted when the pool prepared one (a version of a layout seen before); else, for a relayed
  object, one reserved and faulted just ahead of the blocks as they arrive (:class:`_Space`). An object the version's manifest covers end to end is *relayed* (:class:`_Relay`): read in
  blocks (its header, then its pieces, up to 8 MiB each), each verified the moment it lands
  (pieces against the manifest's piece digests, the header against the object's name) and only
  then announced, so the next host reads it from here while the rest still arrives. Hosts that
  fetch the same object form a chain in the order they joined; each reads from the nearest one
  ahead (waiting for it: every host sends each block about once, the origin each block once), the
  first from a holder of the whole object; a dead or stalled upstream is passed over and the
  fetch goes on from its own blocks; a block that fails blames exactly the peer that served it.
  Other objects (patch objects, objects a version references only part of) are read whole
  (:class:`_Fetch`): slices from every peer that announced the object or the slice, hashed as they
  arrive, verified whole, with blame found by re-reading (:meth:`_Fetch.recover`). Objects no peer
  could deliver are left for the remote tier. Then the object is announced by this process's
  server, if it runs one.

Delta comes from content addressing: unchanged tensors stay in the objects a host already holds, so
only objects with changed tensors move.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import mmap
import os
import random
import struct
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

import blake3

from . import liveness
from .errors import ParamStoreError, TransferError
from .format import PIECE_SIZE, ObjectHasher, object_digest, piece_digest, rehash, tensor_spans
from .reports import FetchReport
from .root import StoreRoot
from .staging import Slab, SlabPool

from paramstore.backends.registries.base import Peer
from paramstore.backends.transports.base import Transport

__all__ = ["PeerServer", "fetch", "FETCH_CONCURRENCY"]

#: Logger of the relay's decisions at DEBUG (who served each block, why an upstream was passed
#: over, why a block was read from a whole holder): ``logging.getLogger("paramstore.peer")``.
log = logging.getLogger(__name__)

#: Objects a fetch reads at once.
FETCH_CONCURRENCY = 4
#: Bytes first read of an object's header to check the size a registry records (:meth:`_Fetch.sized`).
PROBE_BYTES = 4 << 10
_HEADER_CAP = 8 + 100_000_000  # the format's header length cap (format.read_header), plus its length field

SLICE_BYTES = 4 << 20  # unit of spreading one object over several peers (a read batches its slices)
#: Whether a whole-object fetch (:class:`_Fetch`) announces its slices as they arrive, before the
#: object verified (a swarm of unverified bytes). Off: nothing unverified is served; only objects a
#: manifest does not cover whole (patch objects, mostly small) take that path, each host reading
#: them from whole holders. It still reads slices that other (older) hosts announce.
ANNOUNCE_SLICES = False


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
            _retire(self._transport, entry[1], entry[0].close)

    def _loop(self) -> None:
        with self._root.registry.watch() as watch:
            while not self._stop.is_set():
                watch.wait(self._interval)
                if self._stop.is_set():
                    return
                try:
                    self.sync()
                except Exception as e:  # noqa: BLE001 - keep serving; say why once in a while
                    warnings.warn(f"paramstore peer: rescan failed: {e}", RuntimeWarning, stacklevel=1)

    @property
    def served(self) -> list[str]:
        """Digests this server announces."""
        with self._lock:
            return sorted(self._served)

    def close(self) -> None:
        """Withdraw the peer and release every registration (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
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
    is reserved and faulted just ahead of the blocks that arrive, see :class:`_Space`). A size (the registry's word)
    is believed before anything of that size is allocated only where it is the object's extent in
    the version's manifest (``extents``: digest -> end of the last byte range it references);
    otherwise a holder's own safetensors header must say the same size first (:meth:`_Fetch.sized`),
    so a wrong or hostile size allocates nothing. ``server``: this process's
    peer server, if it runs one: it then announces each slice as it arrives (other hosts fetching
    the same version read it from here: a swarm) and each object once verified. ``report`` (the
    checkout's) gets the objects delivered intact (``from_peers``), bytes per peer and rejections;
    an object no peer delivered intact is simply not in the local tier afterwards. ``excluded``:
    ids of peers not to ask (caught serving bad bytes earlier in the same checkout); a peer caught
    now is added, so neither the other objects of this fetch nor the caller's later sources for
    the same version ask it again.

    ``spans`` and ``pieces`` (a version's :meth:`~paramstore.manifest.Manifest.spans` and
    :meth:`~paramstore.manifest.Manifest.piece_spans`): an object whose tensors they cover, end to
    end, is *relayed* (:class:`_Relay`: blocks verified one by one against them, read from the
    nearest fetcher ahead in a chain, and served on once verified); any other (patch objects, an
    object the version references only part of) is fetched as a whole (:class:`_Fetch`).
    """
    concurrency = FETCH_CONCURRENCY if concurrency is None else concurrency
    todo = sorted((d for d in objects if not root.tier.exists(d)), key=lambda d: -objects[d])
    lock = threading.Lock()
    excluded = set() if excluded is None else excluded
    random.shuffle(todo)  # hosts fetching at once start on different objects
    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="paramstore-fetch") as readers, \
            ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="paramstore-hash") as hashers:
        def one(digest: str) -> None:
            plan = _Relay.plan(digest, objects[digest], spans, pieces)
            if plan is not None:
                relay = _Relay(root, transport, pool, digest, objects[digest], server, report, lock, excluded, *plan)
                if relay.run():
                    with lock:
                        report.from_peers.append(digest)
                return
            job = _Fetch(root, transport, pool, digest, objects[digest], server, report, lock, hashers, excluded)
            ok = (extents is not None and extents.get(digest) == objects[digest] or job.sized()) and job.run()
            if ok:
                with lock:
                    report.from_peers.append(digest)

        list(readers.map(one, todo))


class _Fetch:
    """One object: slices from whoever holds them (whole object, or just the slice), verified.

    Slices are read in rounds, from the next :data:`BURST_SLICES` missing ones. Those another
    fetching host already holds are read from it. While other hosts fetch the same object too
    (they announce its fetch key), a round reads one slice from a host holding the whole object
    (its origin) only when no fetching host holds any of them, so the origin serves each slice
    about once; alone, a round reads twice as many as the last one, up to :data:`BURST_SLICES`.
    Each slice that arrives is hashed at once (:class:`ObjectHasher`), so little hashing is left
    after the last one. Who served each slice is kept (:attr:`served`): the object's digest says
    only that some byte is wrong, so blame needs to know whose it was (:meth:`recover`).
    """

    def __init__(self, root: StoreRoot, transport: Transport, pool: SlabPool, digest: str, size: int,
                 server: PeerServer | None, report: FetchReport, lock: threading.Lock,
                 hashers: ThreadPoolExecutor, excluded: set[str]) -> None:
        self.root, self.transport, self.pool, self.digest, self.size = root, transport, pool, digest, size
        self.server, self.report, self.lock, self.hashers = server, report, lock, hashers
        self.me = server.peer.id if server is not None else None
        n = -(-size // SLICE_BYTES)
        self.keys = [_slice_key(digest, i) for i in range(n)]
        self.fetch_key = _slice_key(digest, -1)  # announced while this host fetches the object
        start = random.randrange(n)  # hosts fetching at once start on different slices
        self.order = [(start + i) % n for i in range(n)]
        self.bad: set[str] = set()  # peers that failed this object
        self.excluded = excluded  # peers caught serving bad bytes: asked nothing more in this fetch (shared)
        # slice -> (peer whose bytes are in the slab there, whether it holds the whole object)
        self.served: dict[int, tuple[Peer, bool]] = {}
        self.prints: dict[tuple[int, str], tuple[Peer, bytes]] = {}  # (slice, peer id) -> its bytes' hash
        self.culprits: set[str] = set()  # peers blamed for this object (each counted once)
        self.hashing: list[Future[None]] = []
        # A read that timed out may leave slices in flight that write later: the file is then
        # never verified nor published (the object is left to another source).
        self.tainted = False

    def run(self) -> bool:
        slab = self.pool.take(self.size)
        placed = False
        announced: list[str] = []
        try:
            try:
                self.addr = self.transport.register(slab.map)
            except BaseException:
                slab.close()
                raise
            buf = memoryview(slab.map)
            try:
                self.hasher = ObjectHasher(buf)
                if self._swarm(announced) and not self.tainted:
                    placed = self._hashed() == self.digest
                if announced:
                    self.root.registry.withdraw_objects(self.me, announced)  # type: ignore[arg-type]
                if not placed:
                    placed = self.recover(buf)
            finally:
                wait(self.hashing)
                buf.release()
                _retire(self.transport, self.addr, slab.close)  # its slices were announced: readers may be mid-read
        finally:
            if placed:
                self.root.tier.put(self.digest, slab.path, move=True)
                if self.server is not None:
                    self.server.serve([self.digest])
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(slab.path)
        return placed

    def sized(self) -> bool:
        """Whether a holder's own safetensors header says the object is ``self.size`` bytes long.

        Reads the header (at most :data:`PROBE_BYTES` first, then the rest its length field names,
        never more than the size claimed nor the format's 100 MB header cap) from a host holding
        the object or its first slice, into a small buffer: nothing of the claimed size is
        allocated before this. A mismatch (a registry record that lies, or is stale) is warned
        about and the object is left to other sources.
        """
        found = self._holders([self.digest, self.keys[0]])
        for peer, addr in found.get(self.digest, []) + found.get(self.keys[0], []):
            try:
                if self.size < 8:
                    raise ValueError("shorter than a safetensors header")
                head = self._head(peer, addr, min(self.size, PROBE_BYTES))
                (length,) = struct.unpack_from("<Q", head)
                if len(head) < 8 + length <= min(self.size, _HEADER_CAP):
                    head = self._head(peer, addr, 8 + length)
                tensor_spans(memoryview(head), self.size)
                return True
            except TransferError:
                with self.lock:
                    self.bad.add(peer.id)
            except ValueError as e:
                warnings.warn(f"paramstore: object {self.digest[:16]}… is recorded as {self.size} bytes, but the header "
                              f"its holder {peer.session} serves says otherwise ({e}): not fetched from peers",
                              RuntimeWarning, stacklevel=2)
                with self.lock:
                    self.report.rejected["size"] += 1
                return False
        return False

    def _head(self, peer: Peer, addr: int, nbytes: int) -> bytes:
        """The first ``nbytes`` of the object a peer serves at ``addr``, read into a fresh buffer
        (counted in the report's ``bytes_from``: they crossed the wire too)."""
        view = memoryview(bytearray(nbytes))
        local = self.transport.register(view)
        try:
            self.transport.read(peer.session, [(local, addr, nbytes)])
        finally:
            _retire(self.transport, local, lambda: None)  # a late write still lands in live memory
        with self.lock:
            self.report.bytes_from[peer.session] += nbytes
        return bytes(view)

    def _hashed(self) -> str:
        wait(self.hashing)
        try:
            return self.hasher.digest()
        except ValueError as e:
            return str(e)

    def recover(self, buf: memoryview) -> bool:
        """The mixed read did not verify (or stopped short): find a good copy, and who served bad bytes.

        When every slice arrived, some peer served wrong bytes, but the object's digest does not say
        whose: each slice is fingerprinted with who served it, then each peer's slices are read again
        from another holder, one peer at a time, until the object verifies (:meth:`_substitute`);
        failing that, it is read whole from one holder at a time. Once a copy verifies, a peer is
        blamed only for a slice whose bytes differ from it (:meth:`_blame_differing`), or for a
        read it served alone that failed: never an honest one. Before, the object was read again
        whole from whichever holder the registry named first; a good one first verified it, and the
        corrupt peer went unblamed and was asked again for the next object.
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
        """Read each contributing peer's slices again from another whole-object holder (a peer
        already caught in this fetch first: the likeliest culprit), one peer at a time, until the
        object verifies; True once it does.

        A replacement that does not verify the object is undone (the slices it overwrote were kept
        aside: at most one uncaught peer's share of the object, in memory, only on this path), so each slice
        is read again once at most: the extra bytes are at most the object's size. Reading it again
        whole from one holder at a time cost 1 to 2 times its size, and blamed nobody when the
        holder the registry named first was a good one.
        """
        peers = list({p.id: p for p, _ in self.served.values()}.values())
        random.shuffle(peers)
        peers.sort(key=lambda p: p.id not in self.excluded)
        for peer in peers:
            mine = [i for i, (p, _) in self.served.items() if p.id == peer.id]
            others = [h for h in self._holders([self.digest]).get(self.digest, []) if h[0].id != peer.id]
            if not mine or not others:
                continue
            # a peer already caught: its slices are not worth putting back if the replacement fails
            kept = {} if peer.id in self.excluded else {i: (bytes(buf[self._span(i)]), self.served[i]) for i in mine}
            other, addr = random.choice(others)
            got = self._read({(other, True): [(i, addr + i * SLICE_BYTES) for i in mine]})
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
        for peer, addr in self._holders([self.digest]).get(self.digest, []):
            if self.tainted:
                return False
            if len(self._read({(peer, True): [(i, addr + i * SLICE_BYTES) for i in self.order]})) < len(self.order):
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
        """Keep a hash of these slices as served, with who served them, for :meth:`_blame_differing`.
        A host fetching the object too (it serves slices it has not verified yet) is never blamed:
        it may only pass on what a bad peer served it."""
        for i in slices:
            peer, whole = self.served[i]
            if whole:
                self.prints[i, peer.id] = (peer, self._slice(buf, i))

    def _convict_sole_server(self) -> None:
        """If one whole-object holder served every slice now in the slab (which failed), blame it."""
        servers = {p.id: (p, whole) for p, whole in self.served.values()}
        if len(self.served) == len(self.order) and len(servers) == 1:
            peer, whole = next(iter(servers.values()))
            if whole:
                self._blame(peer)

    def _blame_differing(self, buf: memoryview) -> None:
        """The slab verified: blame each peer that served some slice with other bytes than these."""
        truth: dict[int, bytes] = {}
        for (i, _), (peer, fingerprint) in self.prints.items():
            if peer.id not in self.culprits:
                truth[i] = truth[i] if i in truth else self._slice(buf, i)
                if fingerprint != truth[i]:
                    self._blame(peer)

    def _blame(self, peer: Peer) -> None:
        _blame(self, peer, "bytes")

    def _holders(self, keys: list[str]) -> dict[str, list[tuple[Peer, int]]]:
        found = self.root.registry.holders(keys)
        skip = self.bad | self.excluded
        return {k: [(p, a) for p, a in v if p.id != self.me and p.id not in skip] for k, v in found.items()}

    def _swarm(self, announced: list[str]) -> bool:
        """Read every slice, each from a peer holding it; True once all arrived.

        A plan maps ``(peer, whether it holds the whole object)`` to the slices read from it."""
        if self.server is not None and ANNOUNCE_SLICES:
            self._announce({self.fetch_key: 0}, announced)
        pending = list(self.order)
        burst = 1
        while pending:
            window = pending[:BURST_SLICES]
            found = self._holders([self.digest, self.fetch_key] + [self.keys[i] for i in window])
            crowd = bool(found.get(self.fetch_key))  # other hosts fetch it too
            whole = found.get(self.digest, [])
            plan: dict[tuple[Peer, bool], list[tuple[int, int]]] = {}
            rest = []
            for i in window:
                partial = found.get(self.keys[i], [])
                if partial:
                    peer = random.choice(partial)
                    plan.setdefault((peer[0], False), []).append((i, peer[1]))
                else:
                    rest.append(i)
            # from whole-object holders: alone, a growing burst; in a crowd, one slice, and only
            # when no other fetching host holds one we lack (so the origin serves each about once)
            for i in rest[:burst if not crowd else 0 if plan else 1] if whole else []:
                peer = random.choice(whole)
                plan.setdefault((peer[0], True), []).append((i, peer[1] + i * SLICE_BYTES))
            if not plan:
                return False  # nobody (left) holds what is missing
            done = self._read(plan)
            if done:
                self.hashing.append(self.hashers.submit(self._arrived, done))
                if self.server is not None and ANNOUNCE_SLICES:
                    self._announce({self.keys[i]: self.addr + i * SLICE_BYTES for i in done}, announced)
            arrived = set(done)
            pending = [i for i in pending if i not in arrived]
            burst = 1 if crowd else min(2 * burst, BURST_SLICES)
        return True

    def _announce(self, new: dict[str, int], announced: list[str]) -> None:
        self.root.registry.announce_objects(self.me, new)  # type: ignore[arg-type]
        announced.extend(new)

    def _arrived(self, done: list[int]) -> None:
        for i in sorted(done):
            span = self._span(i)
            self.hasher.arrived(span.start, span.stop)

    def _read(self, plan: Mapping[tuple[Peer, bool], list[tuple[int, int]]]) -> list[int]:
        """Read each peer's slices (in parallel across peers); returns the slices that arrived
        (and records who served them in :attr:`served`)."""
        done: list[int] = []

        def read(item: tuple[tuple[Peer, bool], list[tuple[int, int]]]) -> None:
            (peer, whole), mine = item
            ranges = [(self.addr + i * SLICE_BYTES, remote, min(SLICE_BYTES, self.size - i * SLICE_BYTES))
                      for i, remote in mine]
            try:
                self.transport.read(peer.session, _contiguous(ranges))
            except TransferError as e:
                with self.lock:
                    self.bad.add(peer.id)
                    self.tainted = self.tainted or e.code == -2
                    for i, _ in mine:  # part of it may have landed: nobody's bytes for sure
                        self.served.pop(i, None)
                return
            with self.lock:
                self.report.bytes_from[peer.session] += sum(n for _, _, n in ranges)
                done.extend(i for i, _ in mine)
                self.served.update((i, (peer, whole)) for i, _ in mine)

        if len(plan) == 1:
            read(next(iter(plan.items())))
        else:
            with ThreadPoolExecutor(len(plan)) as pool:
                list(pool.map(read, plan.items()))
        return done


#: Slices a round reads at most when no other host is fetching the object (64 MiB).
BURST_SLICES = 16


#: Bytes of one relay block at most: a piece (the unit a receiver verifies alone), or small tensors
#: grouped (the header is the first unit of the first block).
BLOCK_BYTES = PIECE_SIZE
#: Blocks of one object read at once (each its own transport read, verified as soon as it lands).
RELAY_INFLIGHT = 4
#: Missing blocks looked up per registry round.
RELAY_WINDOW = 16
#: Seconds (plus one block's time per host ahead, and 4 more) a relaying host waits on an upstream
#: whose mark does not move and which still answers, before passing over it for this object; one
#: that does not answer (its progress word cannot be read) is passed over at once.
STALL_S = 10.0
#: Seconds between two registry lookups of who fetches an object while a fetch waits on its
#: upstream (whose progress it reads from that host itself, not from the registry).
RELOOK_S = 1.0
#: Seconds a fetcher that finished keeps its fetch key and verified blocks announced (its slab is
#: then the object itself): a host that joins late, or whose upstream just finished, chains from it.
LINGER_S = 10.0
#: Fetchers of one object up to which they relay it along one chain (fan-out 1: each reads from the
#: nearest fetcher ahead); with more, along a tree of fan-out :data:`TREE_FANOUT` (:func:`relay_fanout`).
#: 8 hosts: the chain, whose fill (hosts x one block's time) is small there and every host uploads
#: each block at most once.
CHAIN_HOSTS = 16
#: Fan-out of the relay tree beyond :data:`CHAIN_HOSTS` fetchers. A fetcher ``d`` hops below the
#: first gets the first block after ``d`` hops, and an interior node sends each block to ``f``
#: children over one uplink, so a hop takes ``f`` blocks' time: the fill is about
#: ``f * log_f(n)`` blocks' time, against ``n`` for the chain. 256 hosts (8 MiB blocks, 1 Gbit/s,
#: 67 ms a block): chain 256 x 67 ms = 17 s; f=2 depth 8, 16 x 67 ms = 1.1 s; f=3 depth 5,
#: 15 x 67 ms = 1.0 s (the same at 64: 12 blocks' time either way). 2, not 3: the fill is within a
#: block's time or two of 3's, and where one object's tree is all that moves, an interior node's
#: uplink gives each child half of it, not a third (and half the hosts are interior, not a third,
#: so the upload is spread more evenly). Each host fetches a version's objects in random order,
#: so its order of arrival, hence its place (interior or leaf), differs per object: the uploads spread
#: over every host's link when many objects move at once.
TREE_FANOUT = 2
#: Environment variable that fixes the fan-out whatever the number of fetchers (an int >= 1;
#: benchmarks: ``tools/bench_cluster.py --fanout``); read each time a relay chooses its upstream.
FANOUT_ENV = "PARAMSTORE_RELAY_FANOUT"
#: Peer ids seen fetching (rollout hosts, not the origin): preferred to other holders of a whole
#: object, so the origin serves each block about once even after the chain is gone.
_RELAYERS: dict[str, None] = {}
_T = TypeVar("_T")
_TEST_DELAY_S = 0.0  # tests: seconds each block read is held back (a slow host)


def relay_fanout(fetchers: int) -> int:
    """The relay tree's fan-out for an object ``fetchers`` hosts fetch (this one included): 1 (a
    chain) up to :data:`CHAIN_HOSTS`, then :data:`TREE_FANOUT`; :data:`FANOUT_ENV`, where set to
    an int >= 1, whatever the number (another value is ignored)."""
    env = os.environ.get(FANOUT_ENV, "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env)
    return 1 if fetchers <= CHAIN_HOSTS else TREE_FANOUT


def relay_depth(index: int, fanout: int) -> int:
    """Hops from the first fetcher (index 0) down to the ``index``-th in a tree of ``fanout``
    (the parent of ``i`` is ``(i - 1) // fanout``; fan-out 1: a chain, ``index`` hops)."""
    if fanout <= 1:
        return index
    hops = 0
    while index > 0:
        index = (index - 1) // fanout
        hops += 1
    return hops


def relay_order(ahead: Sequence[_T], fanout: int) -> list[_T]:
    """The upstreams a fetcher prefers, given the fetchers ahead of it in ascending ``(order number,
    peer id)`` order (its index in the tree: ``len(ahead)``): its parent in a tree of ``fanout``
    (``(i - 1) // fanout``), then the parent's ancestors up to the first fetcher, then the others
    ahead, nearest first. Fan-out 1: the nearest first, all of them (the chain)."""
    ancestors = []
    k = len(ahead)
    while k > 0:
        k = (k - 1) // max(1, fanout)
        ancestors.append(k)
    seen = set(ancestors)
    return [ahead[j] for j in ancestors] + [ahead[j] for j in range(len(ahead) - 1, -1, -1) if j not in seen]


class _Relay:
    """One object, relayed: read block by block from the nearest fetcher ahead, each block verified
    before it is announced, so others read it from here while the rest still arrives.

    The object is cut into *blocks* (:meth:`plan`): the header, then the pieces the manifest lists
    (8 MiB ranges of large tensors, small tensors whole), grouped up to :data:`BLOCK_BYTES`. A
    block is checked alone as it lands: each piece against the manifest's piece digest, the header
    against the object's name (``object_digest(header, tensor digests the manifest lists)``, which
    also proves the layout). Once every block verified, the object did: no byte is hashed twice,
    and a block that fails names exactly the peer that served it.

    *Plan: a chain, or a tree, in order of arrival.* Each fetcher announces the object's fetch key
    with the registry's next order number as the "address" (:meth:`Registry.announce_in_order`: the
    order of arrival every host sees alike), and its *progress word* (16 registered bytes: its
    slab's address and how many blocks, from the first on, it verified); fetchers in ``(order number,
    peer id)`` order form a tree of fan-out :func:`relay_fanout` (1, a chain, up to
    :data:`CHAIN_HOSTS` fetchers): the ``i``-th reads from the ``(i - 1) // f``-th
    (:func:`relay_order`; its ancestors, then the others ahead nearest first, where that one is put
    aside). A fetcher reads its upstream's progress word straight from that host (no registry
    round trip) and the blocks below its mark from its slab; the mark moves only past verified
    blocks. When the upstream has not got further it waits for it (every host sends each block
    about once to each child, the first fetcher alone reads the origin) unless its word cannot be
    read (passed over at once) or its mark does not move for :data:`STALL_S` (plus a block's time
    per hop). With no fetcher ahead, it reads from a holder of the whole object,
    preferring hosts seen fetching (:data:`_RELAYERS`) to the others (the origin). A finished
    fetcher keeps its announcements for :data:`LINGER_S`, so late
    joiners and the tail of the chain read from it, not from the origin.
    """

    @staticmethod
    def plan(digest: str, size: int, spans: Mapping[str, Mapping[tuple[int, int], str]] | None,
             pieces: Mapping[str, Mapping[tuple[int, int], str]] | None
             ) -> tuple[int, list[tuple[int, int, list[tuple[int, int, str | None]]]], Mapping[tuple[int, int], str]] | None:
        """``(data start, blocks, tensor spans)`` if the manifest's tensors of ``digest`` tile the
        object's data up to ``size`` (every byte but the header has a piece digest), else None.
        A block: ``(begin, end, units)``, a unit ``(begin, end, piece digest)`` (None: the header)."""
        sp = spans.get(digest) if spans is not None else None
        pc = pieces.get(digest) if pieces is not None else None
        if not sp or not pc:
            return None
        start = min(b for b, _ in sp)
        units: list[tuple[int, int, str | None]] = [(0, start, None)]
        pos = start
        for b, e in sorted(sp):
            if b != pos:
                return None
            pos = e
        if start < 8 or pos != size:
            return None
        pos = start
        for (b, e), d in sorted(pc.items()):
            if e == b:
                continue
            if b != pos:
                return None
            units.append((b, e, d))
            pos = e
        if pos != size:
            return None
        blocks: list[tuple[int, int, list[tuple[int, int, str | None]]]] = []
        for u in units:
            if blocks and blocks[-1][1] - blocks[-1][0] + u[1] - u[0] <= BLOCK_BYTES:
                blocks[-1] = (blocks[-1][0], u[1], blocks[-1][2] + [u])
            else:
                blocks.append((u[0], u[1], [u]))
        return start, blocks, sp

    def __init__(self, root: StoreRoot, transport: Transport, pool: SlabPool, digest: str, size: int,
                 server: PeerServer | None, report: FetchReport, lock: threading.Lock, excluded: set[str],
                 start: int, blocks: list[tuple[int, int, list[tuple[int, int, str | None]]]],
                 spans: Mapping[tuple[int, int], str]) -> None:
        self.root, self.transport, self.pool, self.digest, self.size = root, transport, pool, digest, size
        self.server, self.report, self.lock, self.excluded = server, report, lock, excluded
        self.start, self.blocks, self.spans = start, blocks, spans
        self.me = server.peer.id if server is not None else None
        self.fetch_key = _block_key(digest, -1)
        self.progress_key = _block_key(digest, -2)
        # its place among the fetchers (the registry's order number); a host that does not serve
        # relays nothing: it goes last (reads from the chain's tail)
        self.stamp = (1 << 64) - 1
        self.cond = threading.Condition()
        self.done: set[int] = set()  # blocks verified (and announced)
        self.landed = 0  # of them, whole blocks (not the header alone): alone, that many more reads at once
        self.busy: set[int] = set()  # blocks being read or verified
        self.reading: set[int] = set()  # blocks being read
        self.bad: set[str] = set()  # peers that failed to serve or stalled: not asked again for this object
        self.culprits: set[str] = set()  # peers blamed for this object
        self.waiting: tuple[tuple[str, int], float] | None = None  # ((upstream, its progress), since)
        self.bad_at = 0.0  # when a peer was last put aside (the registry is asked again)
        self.block_s = 0.05  # seconds one block takes to arrive (running estimate)
        self.announced: list[str] = []
        self.found: dict[str, list[tuple[Peer, int]]] = {}  # the last registry answer
        self.found_at = -1.0
        self.tainted = False  # a read timed out: a late write may still land; nothing here is trusted

    def run(self) -> bool:
        # None ready: a slab made now is reserved and faulted on a thread of its own, just ahead of
        # the blocks that arrive, not before the first read (256 MiB: 0.13 s on the hot path).
        slab = self.pool.take(self.size, reserve=False)
        self.space = _Space(slab)
        try:
            self.addr = self.transport.register(slab.map)
        except BaseException:
            self.space.close()
            slab.discard()
            raise
        self.buf = memoryview(slab.map)
        # progress: (slab address, blocks verified from the first on), read by the hosts behind
        # this one straight through the transport; scratch: where this host reads others' into
        self.progress = memoryview(bytearray(16))
        self.scratch = memoryview(bytearray(16))
        self.paddr = self.transport.register(self.progress)
        self.saddr = self.transport.register(self.scratch)
        struct.pack_into("<QQ", self.progress, 0, self.addr, 0)
        placed = False
        try:
            with ThreadPoolExecutor(RELAY_INFLIGHT, thread_name_prefix="paramstore-relay") as readers:
                placed = self._relay(readers)
            placed = placed and not self.tainted and len(self.done) == len(self.blocks)
            if self.space.error is not None and not placed:
                raise self.space.error  # the local tier is full: the checkout says so
        finally:
            self.space.close()
            self.buf.release()
            if placed:
                self.root.tier.put(self.digest, slab.path, move=True)  # the mapping stays: same pages
                if self.server is not None:
                    self.server.serve([self.digest])
                self._linger(slab.close)
            else:
                if self.announced:
                    with contextlib.suppress(ParamStoreError, OSError):
                        self.root.registry.withdraw_objects(self.me, self.announced)  # type: ignore[arg-type]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(slab.path)
                _retire(self.transport, self.addr, slab.close)
                _retire(self.transport, self.paddr, lambda: None)
            _retire(self.transport, self.saddr, lambda: None)
        return placed

    def _linger(self, close: Callable[[], None]) -> None:
        """Keep this fetch's announcements for :data:`LINGER_S`, then withdraw them and retire the slab."""
        registry, me, keys, transport, addr = self.root.registry, self.me, list(self.announced), self.transport, self.addr

        def withdraw() -> None:
            if keys:
                with contextlib.suppress(ParamStoreError, OSError, RuntimeError):
                    registry.withdraw_objects(me, keys)  # type: ignore[arg-type]
            _retire(transport, addr, close)
            _retire(transport, paddr, lambda: None)

        paddr = self.paddr
        _retirements.add(time.monotonic() + (LINGER_S if keys else 0.0), withdraw)

    # -- the loop ----------------------------------------------------------------------------
    def _relay(self, readers: ThreadPoolExecutor) -> bool:
        """Read every block; True once all verified. In a chain blocks are read one at a time, in
        order (a block that arrives whole sooner is served on sooner; two at once would both land
        late), the next one's read starting while the last one is verified; alone, from a whole
        holder, one more block at once per block landed (up to :data:`RELAY_INFLIGHT`)."""
        if self.me is not None:  # its place, given by the registry with the announcement, once the slab is ready
            self.stamp = self.root.registry.announce_in_order(self.me, self.fetch_key, {self.progress_key: self.paddr})
            self.announced.extend([self.fetch_key, self.progress_key])
        futures: list[Future[None]] = []
        lanes = 1
        misses = 0  # looks at the upstream's mark in a row that found no new block
        n = len(self.blocks)
        while True:
            with self.cond:
                if self.tainted or self.space.error is not None:
                    break
                missing = [i for i in range(n) if i not in self.done and i not in self.busy]
                if not missing and not self.busy:
                    return len(self.done) == n
                room = min(lanes - len(self.reading), 2 * RELAY_INFLIGHT - len(self.busy))
                if not missing or room <= 0:
                    self.cond.wait(0.05)
                    continue
            picks, crowd = self._choose(missing[:RELAY_WINDOW], room)
            if picks is None:  # the upstream has not verified the next block yet: look again soon,
                # at once first (in a chain it is about as far as this host: its mark moves within a
                # few ms), then less often (measured: one wait of block_s / 8, 8.75 ms at 1 Gbit/s,
                # after each block was most of the ~10 ms a hop lost per block)
                with self.cond:
                    self.cond.wait(min(0.01, max(0.001, self.block_s / 8), 0.0005 * (1 << min(misses, 8))))
                misses += 1
                continue
            misses = 0
            if not picks:  # nobody (left) holds what is missing
                with self.cond:
                    if not self.busy:
                        return False
                    self.cond.wait(0.05)
                continue
            for peer, i, remote in picks:
                with self.cond:
                    self.busy.add(i)
                    self.reading.add(i)
                futures.append(readers.submit(self._one, peer, i, remote, True))
            # alone, one more block in flight per block landed (up to RELAY_INFLIGHT): grown as
            # reads land, not as they are issued, so the first fetcher of an all-at-once checkout
            # has read one block, not four sharing its link, by the time the others are seen
            # (measured: 4 at once delayed the second host by ~2 blocks' time, for good)
            lanes = 1 if crowd else min(1 + self.landed, RELAY_INFLIGHT)
        for f in futures:
            f.result()
        return False

    def _lookup(self, fresh: bool = False) -> dict[str, list[tuple[Peer, int]]]:
        """Who holds the object and who fetches it (with their progress words): from the registry
        at most every :data:`RELOOK_S` while an upstream is followed (at once after a peer was put
        aside, and each time when ``fresh``: reading from a whole holder, so that a fetcher that
        joined just before this one is followed as soon as it is seen)."""
        now = time.monotonic()
        if fresh or now - self.found_at >= RELOOK_S or self.found_at < self.bad_at:
            self.found = self._holders([self.digest, self.fetch_key, self.progress_key])
            self.found_at = now
        return self.found

    def _choose(self, window: list[int], room: int) -> tuple[list[tuple[Peer, int, int]] | None, bool]:
        """What to read next: ``(peer, block, address of the object's first byte there)``; None to
        wait for the upstream; empty if nobody can serve the window. And whether others fetch it."""
        found = self._lookup()
        if not any((a, p.id) < (self.stamp, self.me or "") for p, a in found.get(self.fetch_key, [])):
            found = self._lookup(fresh=True)  # nobody ahead, as last seen: ask again before the origin
        skip = self.bad | self.excluded
        mine = (self.stamp, self.me or "")
        words = {p.id: a for p, a in found.get(self.progress_key, [])}
        ahead = []  # every fetcher ahead, also those put aside here: the tree is the same on every host
        for peer, stamp in found.get(self.fetch_key, []):
            _RELAYERS[peer.id] = None
            if (stamp, peer.id) < mine and peer.id in words:
                ahead.append(((stamp, peer.id), peer))
        crowd = bool(found.get(self.fetch_key))
        if len(_RELAYERS) > 4096:
            for k in list(_RELAYERS)[:2048]:
                del _RELAYERS[k]
        fetchers = {p.id for p, _ in found.get(self.fetch_key, [])} | {self.me or ""}  # this one announced itself
        fanout = relay_fanout(len(fetchers))
        ups = [up for up in relay_order([p for _, p in sorted(ahead, key=lambda x: x[0])], fanout) if up.id not in skip]
        hops = relay_depth(len(ups), fanout)  # fan-out 1: one hop per fetcher ahead (the chain)
        for up in ups:  # the parent, its ancestors, then the others nearest first
            try:  # its progress word, straight from it: (slab address, blocks verified from the first)
                self.transport.read(up.session, [(self.saddr, words[up.id], 16)])
                base, mark = struct.unpack_from("<QQ", self.scratch, 0)
            except TransferError:
                log.debug("relay %s: upstream %s does not answer: passed over", self.digest[:12], up.session)
                self._put_aside(up)  # dead or leaving: the next one up
                continue
            have = [i for i in window if i < mark]
            if have:
                self.waiting = None
                return [(up, i, base) for i in have[:room]], crowd
            now = time.monotonic()
            if self.waiting is None or self.waiting[0] != (up.id, mark):
                self.waiting = ((up.id, mark), now)  # (upstream, its progress) waited on, since
            # the fill: a host k hops down sees its upstream's mark move only every block, once the
            # first block came down k hops: never a stall (measured: 2 s passed over hosts at 100 Mbit/s)
            if now - self.waiting[1] < STALL_S + (hops + 4) * self.block_s:
                return None, crowd
            log.debug("relay %s: upstream %s stalled at block %d for %.2f s: passed over",
                      self.digest[:12], up.session, mark, now - self.waiting[1])
            self._put_aside(up)  # it answers but makes no progress: the next one up
        whole = [(p, a) for p, a in found.get(self.digest, []) if p.id not in skip]
        if not whole:
            return [], crowd
        known = [w for w in whole if w[0].id in _RELAYERS]
        out = []
        for i in window[:room]:
            peer, addr = random.choice(known or whole)  # each block: spread over the holders alike
            out.append((peer, i, addr))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("relay %s: blocks %s from whole holder(s) %s: %d fetcher(s) seen, %d ahead, %d put aside",
                      self.digest[:12], [i for _, i, _ in out], sorted({p.session for p, _, _ in out}),
                      len(fetchers), len(ahead), len(skip))
        return out, crowd

    def _put_aside(self, peer: Peer) -> None:
        with self.cond:
            self.bad.add(peer.id)
        self.bad_at = time.monotonic()
        self.waiting = None

    def _one(self, peer: Peer, i: int, remote: int, whole: bool) -> None:
        """Read block ``i`` from ``peer``, verify it, announce it (this host then serves it)."""
        b, e, _ = self.blocks[i]
        remote = remote + b if whole else remote
        ok = False
        try:
            try:
                if not self.space.wait(e):
                    return  # the space could not be reserved: nothing is written there
                t0 = time.monotonic()
                self.transport.read(peer.session, [(self.addr + b, remote, e - b)])
                if _TEST_DELAY_S:
                    time.sleep(_TEST_DELAY_S)  # a slow link
            except TransferError as err:
                with self.cond:
                    self.bad.add(peer.id)
                    self.tainted = self.tainted or err.code == -2
                self.bad_at = time.monotonic()
                return
            finally:
                with self.cond:
                    self.reading.discard(i)  # the next read may start while this block is verified
                    self.cond.notify_all()
            with self.lock:
                self.report.bytes_from[peer.session] += e - b
            if log.isEnabledFor(logging.DEBUG):
                log.debug("relay %s: block %d (%d bytes) from %s in %.3f s", self.digest[:12], i, e - b,
                          peer.session, time.monotonic() - t0)
            if e - b >= BLOCK_BYTES // 2:
                self.block_s = 0.7 * self.block_s + 0.3 * (time.monotonic() - t0)
            why = self._verify(i)
            if why is not None:
                self._blame(peer, why)
                return
            ok = True
        finally:
            with self.cond:
                if ok:
                    self.done.add(i)
                    self.landed += e - b >= BLOCK_BYTES // 2
                    mark = struct.unpack_from("<Q", self.progress, 8)[0]
                    while mark in self.done:
                        mark += 1
                    if not self.tainted:  # blocks [0, mark) verified: the hosts behind may read them
                        struct.pack_into("<Q", self.progress, 8, mark)
                self.busy.discard(i)
                self.cond.notify_all()

    def _verify(self, i: int) -> str | None:
        """Why block ``i`` (all of it in the slab) fails verification, or None."""
        for b, e, d in self.blocks[i][2]:
            if d is not None:
                if piece_digest(self.buf[b:e]) != d:
                    return f"bytes {b}-{e} do not match their piece digest"
                continue
            try:  # the header: its layout and the manifest's tensor digests must make the object's name
                start, spans = tensor_spans(self.buf, self.size)
                if start != self.start:
                    return "its header has another length"
                if object_digest(self.buf[:start], [self.spans[s] for s in spans]) != self.digest:
                    return "its header does not make the object's digest"
            except (ValueError, KeyError) as err:
                return f"its header does not match the manifest ({err!r})"
        return None

    def _blame(self, peer: Peer, why: str) -> None:
        _blame(self, peer, f"a block ({why})")

    def _holders(self, keys: list[str]) -> dict[str, list[tuple[Peer, int]]]:
        found = self.root.registry.holders(keys)
        return {k: [(p, a) for p, a in v if p.id != self.me] for k, v in found.items()}

    def _announce(self, new: dict[str, int]) -> None:
        self.root.registry.announce_objects(self.me, new)  # type: ignore[arg-type]
        self.announced.extend(new)


#: Bytes a fresh relay slab is reserved (and faulted) ahead of the furthest block asked for.
SPACE_AHEAD = 4 * BLOCK_BYTES


class _Space:
    """The space of a relay's slab, reserved and faulted (:meth:`Slab.reserve`) in offset order on
    a thread of its own, at most :data:`SPACE_AHEAD` bytes beyond the furthest block a read has
    asked for (:meth:`wait`): the first read starts at once and the fault work overlaps the
    transfer, paced by it. Before, :meth:`SlabPool.take` reserved and faulted the whole slab first:
    0.13 s for 256 MiB on the hot path (one host, 1 Gbit/s: the fetch took 1.06× a raw read of the
    same bytes, now 1.01×), and with 8 hosts on 2 cores all faulting at once, more for the first
    host of the chain. A slab that came ready (prepared by the pool) needs none of it; one that
    cannot be reserved (a full tmpfs) fails the fetch with StorageFullError, never SIGBUS."""

    def __init__(self, slab: "Slab") -> None:
        self.slab, self.size = slab, slab.size
        self.cond = threading.Condition()
        self.upto = slab.size if slab.reserved else 0  # bytes [0, upto) reserved
        self.want = 0  # the furthest end a read asked for
        self.error: Exception | None = None
        self.stop = False
        self.thread: threading.Thread | None = None
        if self.upto < self.size:
            self.thread = threading.Thread(target=self._run, name="paramstore-space", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        step = BLOCK_BYTES  # a multiple of the page size: every reservation starts on a page
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.stop or self.upto < self.want + SPACE_AHEAD)
                if self.stop:
                    return
                begin = self.upto
            end = min(self.size, begin + step)
            try:
                self.slab.reserve(begin, end)
            except Exception as e:  # noqa: BLE001 - StorageFullError mostly; the fetch raises it
                with self.cond:
                    self.error = e
                    self.cond.notify_all()
                return
            with self.cond:
                self.upto = end
                self.cond.notify_all()
                if end == self.size:
                    return

    def wait(self, end: int) -> bool:
        """Wait until bytes ``[0, end)`` are reserved; False if they cannot be (:attr:`error`).
        Each call moves the reservation on (:data:`SPACE_AHEAD` past ``end``), reserved or not:
        else it would stop until a read found its range unreserved, and wait for it then."""
        with self.cond:
            if end > self.want:
                self.want = end
                self.cond.notify_all()
            self.cond.wait_for(lambda: self.upto >= end or self.error is not None or self.stop)
            return self.upto >= end

    def close(self) -> None:
        """Stop reserving (before the slab is unmapped)."""
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()


def _blame(fetch: "_Fetch | _Relay", peer: Peer, what: str) -> None:
    """``peer`` served ``what`` of ``fetch``'s object that fails verification: counted in the
    report's ``rejected`` (once per object), said in a warning, and asked nothing more in this fetch."""
    with fetch.lock:
        if peer.id in fetch.culprits:
            return
        fetch.culprits.add(peer.id)
        fetch.excluded.add(peer.id)
        fetch.report.rejected[peer.session] += 1
    warnings.warn(f"paramstore: peer {peer.session} served {what} of object {fetch.digest[:16]}… that fails "
                  "verification: it is asked nothing more in this fetch", RuntimeWarning, stacklevel=3)


def _block_key(digest: str, index: int) -> str:
    """The name verified block ``index`` of object ``digest`` is announced under by a host fetching
    it (index -1: the host fetches the object; its "address" there is its order number among the
    object's fetchers, :meth:`Registry.announce_in_order`)."""
    return blake3.blake3(b"paramstore/block/v1\0" + bytes.fromhex(digest)
                         + index.to_bytes(8, "big", signed=True)).hexdigest()


def _contiguous(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Reads ``(local, remote, n)`` with each run contiguous on both sides merged into one."""
    out: list[tuple[int, int, int]] = []
    for local, remote, n in ranges:
        if out and out[-1][0] + out[-1][2] == local and out[-1][1] + out[-1][2] == remote:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((local, remote, n))
    return out


def _slice_key(digest: str, index: int) -> str:
    """The name slice ``index`` of object ``digest`` is announced under while a host fetches it
    (index -1: the object itself is being fetched by the announcing host)."""
    return blake3.blake3(b"paramstore/slice/v1\0" + bytes.fromhex(digest)
                         + index.to_bytes(8, "big", signed=True)).hexdigest()


#: How long memory stays registered after its announcement is withdrawn: a host that looked the
#: holders up just before may still be reading it.
RETIRE_AFTER_S = 2.0


def _retire(transport: Transport, addr: int, close: Callable[[], None]) -> None:
    """Unregister the memory at ``addr``, then ``close`` it, after :data:`RETIRE_AFTER_S` (on the
    process's retirement thread)."""
    def done() -> None:
        with contextlib.suppress(ParamStoreError):
            transport.unregister(addr)
        with contextlib.suppress(BufferError):
            close()

    _retirements.add(time.monotonic() + RETIRE_AFTER_S, done)


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


def _fresh_retirements() -> None:
    """In a forked child: the parent's thread and due retirements stay the parent's (its lock
    may even have been held at the fork); the child starts its own on its first retirement."""
    global _retirements
    _retirements = _Retirements()


_retirements = _Retirements()
os.register_at_fork(after_in_child=_fresh_retirements)
