"""The verified relay: one object moved to every host that fetches it, block by block, each block
verified before it is passed on. No torch.

:func:`paramstore.peer.fetch` relays every object a version's manifest covers end to end
(:meth:`Relay.plan`), and the others whose piece digests something lists (a patch object's own
header, read first and relayed as a block of its own; a derived object's record). The object is cut
into *blocks* (its header, then its pieces, grouped up to :data:`BLOCK_BYTES`); each is checked
alone the moment it lands (pieces against their piece digests, the header against the object's
name) and only then counted in this host's *progress word*, which the hosts behind it read
straight from here. Fetchers of one object are ordered by the
registry (:meth:`~paramstore.backends.registries.base.Registry.announce_in_order`) into a chain or
a tree (:func:`relay_fanout`: whichever reaches the last one first); each reads from its parent, the first from a
holder of the whole object. A dead or stalled upstream is passed over and the fetch goes on from
its own verified blocks; a block that fails blames exactly the peer that served it (:func:`blame`,
shared with peer.py's whole-object fetch). See docs/architecture.md, *Several hosts*.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import struct
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Collection, Container, Mapping

import blake3

from .errors import ParamStoreError, TransferError
from .format import PIECE_SIZE, header_layout, listed_digests, object_digest, piece_digest, rehash, tensor_spans
from .reports import FetchReport
from .retire import RETIRE_AFTER_S, later, retire
from .root import StoreRoot
from .staging import Slab, SlabPool

from paramstore.backends.registries.base import Peer, Registry
from paramstore.backends.transports.base import Transport

if TYPE_CHECKING:
    from .peer import PeerServer, _Fetch

__all__ = ["Relay", "Retries", "PEER_RETRIES", "RETRY_S", "blame", "holders_of", "relay_block_bytes", "relay_depth", "relay_fanout", "relay_order"]

#: Logger of the relay's decisions at DEBUG (who served each block, why an upstream was passed
#: over, why a block was read from a whole holder): ``logging.getLogger("paramstore.relay")``.
log = logging.getLogger(__name__)


#: Bytes of one relay block at most: a piece (the unit a receiver verifies alone), or small tensors
#: grouped (the header is the first unit of the first block). A piece of an object written with
#: larger pieces (8 MiB, before) is a block of its own: a unit is never cut.
BLOCK_BYTES = PIECE_SIZE
#: Bytes at most of an object relayed as one block checked whole against its name, when nothing
#: lists its piece digests (:meth:`Relay.whole`: patch objects written before they listed them).
WHOLE_BLOCK_BYTES = 8 << 20
#: Bytes at most of what a manifest's plan takes for an object's header (:meth:`Relay.plan`).
PLAN_HEADER_BYTES = 8 << 20
#: A small object's units are grouped into blocks of fewer bytes (:func:`relay_block_bytes`), so that
#: it makes about this many blocks, down to :data:`MIN_BLOCK_BYTES`.
RELAY_BLOCKS = 16
MIN_BLOCK_BYTES = 1 << 20
#: The "piece digest" of a block that is a whole object (:meth:`Relay.whole`), checked by its
#: name: not hex, so no digest a manifest holds (each checked as 64 hex digits) is ever taken for it.
WHOLE = "<the whole object>"
#: A progress word's mark once its relay ended without the object (:meth:`Relay.run`): the hosts
#: behind it pass over it at once instead of waiting for a registry lookup to miss it.
GONE = (1 << 64) - 1
#: Bytes of an object's header at most: the format's cap (:func:`paramstore.format.read_header`)
#: and its length field.
HEADER_CAP = 8 + 100_000_000
#: Seconds a fetcher ahead's progress word, as read, stands for blocks it covers: the next block
#: below it is read from there without reading the word again (one small read, ~0.2 ms of CPU on
#: the two hosts here, saved per block a follower was behind). A mark only grows, and a fetcher's
#: slab stays registered :data:`RELAY_RETIRE_S` after it ended, far longer than this.
MARK_TTL_S = 1.0
#: Blocks of one object read at once (each its own transport read, verified as soon as it lands).
RELAY_INFLIGHT = 4
#: Missing blocks looked up per registry round.
RELAY_WINDOW = 16
#: Fetchers ahead one registry lookup asks for by position (:func:`relay_order`: the parent, its
#: ancestors, then the nearest), so that a reply stays this small whatever the number of hosts.
#: Before, each lookup listed every fetcher of the object: with 512 fetchers, ~131 KiB sent per
#: lookup against 2.4 KiB by position, and ~10x the CPU of redis-server's one thread
#: (``tools/bench_registry.py``; docs/benchmarks.md, its block).
RELAY_ASK = 12
#: Holders of one key a lookup asks for at most (:func:`holders_of`), besides those it skips.
HOLDERS_SAMPLE = 16
#: Seconds (plus one block's time per host ahead, and 4 more) a relaying host waits on an upstream
#: whose mark does not move and which still answers, before passing over it for this object; one
#: that does not answer (its progress word cannot be read) is passed over at once.
STALL_S = 10.0
#: Times a peer whose reads failed (a transport error, not bad bytes) is asked again for an object
#: when nobody else can serve it: after its ``n``-th failure (the reads in flight to it when it
#: failed count once), :data:`RETRY_S` × 2^(n-1) seconds later (a relay; a lazy read,
#: :mod:`paramstore.lazy`, alike where no remote is open). The transfer engine fails a read that
#: made no progress for 1 s (``MC_TCP_PROGRESS_TIMEOUT_SEC``), so a holder that is only stalled
#: for a moment (a loss burst, a busy host) is not given up for good.
PEER_RETRIES = 3
RETRY_S = 1.0


class Retries:
    """Which peers put aside for one object after failed reads may be asked again, and when
    (:data:`PEER_RETRIES`, :data:`RETRY_S`); shared by a relay and a whole-object fetch
    (:class:`paramstore.peer._Fetch`). The caller holds its own lock around every call.

    Example:
        >>> r = Retries()
        >>> r.failed_read("a", now=10.0)
        >>> r.due({"a"}, set(), now=10.5)  # nobody due yet; the next one in half a second
        ([], 0.5)
        >>> r.due({"a"}, set(), now=11.0)
        (['a'], None)
        >>> r.due({"a"}, {"a"}, now=11.0)  # one caught serving bad bytes is never asked again
        ([], None)
    """

    def __init__(self) -> None:
        #: peer id -> (failures, when the last one was counted)
        self.failed: dict[str, tuple[int, float]] = {}

    def failed_read(self, peer: str, *, now: float | None = None) -> None:
        """Count a failure of ``peer`` (once per stall: call it only for a peer not already put
        aside, since the reads in flight to a stalled peer fail together)."""
        now = time.monotonic() if now is None else now
        self.failed[peer] = (self.failed.get(peer, (0, 0.0))[0] + 1, now)

    def forget(self, peer: str) -> None:
        """``peer`` is never to be asked again for this object (it is not merely stalled)."""
        self.failed.pop(peer, None)

    def due(self, bad: set[str], excluded: set[str], *, now: float | None = None) -> tuple[list[str], float | None]:
        """Of the peers in ``bad`` (put aside) that failed reads at most :data:`PEER_RETRIES`
        times and are not ``excluded`` (caught serving bad bytes): those whose back-off is over,
        and the seconds until the next of the others is due (None when no other is left)."""
        now = time.monotonic() if now is None else now
        left = {p: RETRY_S * 2 ** (n - 1) - (now - at) for p, (n, at) in self.failed.items()
                if n <= PEER_RETRIES and p in bad and p not in excluded}
        later = [wait for wait in left.values() if wait > 0]
        return sorted(p for p, wait in left.items() if wait <= 0), (min(later) if later else None)
#: Seconds between two registry lookups of who fetches an object while a fetch follows its
#: upstream (whose progress it reads from that host itself, not from the registry), doubling after
#: each such lookup up to :data:`RELOOK_MAX_S`, and back to this when an upstream is put aside. What
#: a lookup then finds (fetchers that joined since: with more of them the fan-out may change,
#: :func:`relay_fanout`) is nothing the fetch needs at once: a dead or stalled upstream shows in
#: its progress word. Each reply lists every fetcher, so with a fixed interval the registry's traffic grew as
#: hosts² (16 hosts x 4 objects at 100 Mbit/s: 2.4-2.6 MiB per 14 s version).
RELOOK_S = 1.0
RELOOK_MAX_S = 8.0
#: Seconds a relay's registered memory (its slab, its progress word) stays registered after its
#: announcements are withdrawn: a follower acts on a registry answer up to :data:`RELOOK_MAX_S`
#: old, and memory unregistered sooner could be registered again at the same address by then
#: (another relay's progress word, a new slab), so the follower would read someone else's bytes
#: and blame an honest peer.
RELAY_RETIRE_S = RELOOK_MAX_S + RETIRE_AFTER_S
#: Seconds a fetcher that finished keeps its fetch key and verified blocks announced (its slab is
#: then the object itself): a host that joins late, or whose upstream just finished, chains from it.
LINGER_S = 10.0
#: Largest fan-out :func:`relay_fanout` considers.
MAX_FANOUT = 3
#: Environment variable that fixes the fan-out whatever the number of fetchers (an int >= 1;
#: benchmarks: ``tools/bench_cluster.py --fanout``); read each time a relay chooses its upstream.
FANOUT_ENV = "PARAMSTORE_RELAY_FANOUT"
#: Peer ids seen fetching (rollout hosts, not the origin): preferred to other holders of a whole
#: object, so the origin serves each block about once even after the chain is gone.
_RELAYERS: dict[str, None] = {}
_TEST_DELAY_S = 0.0  # tests: seconds each block read (or whole fetch's slice read) is held back (a slow host)
#: Why block 0 of a plan a version's manifest gave fails when the object's header ends before the
#: first byte the version references: the version references the object only in part (tensors it
#: shares with an older version, deduplicated into that version's object), and the plan took the
#: tensors it does not reference for part of the header. The object is then read whole.
IN_PART = "its header ends before the first byte the version references"
#: A relay's plan (:meth:`Relay.plan`): the data's start; the blocks, each ``(begin, end, units)``
#: with a unit ``(begin, end, piece digest)`` (None: the header; :data:`WHOLE`: the whole object);
#: the manifest's tensor spans of the object (digest by ``(begin, end)``).
_Block = tuple[int, int, list[tuple[int, int, str | None]]]
_Plan = tuple[int, list[_Block], Mapping[tuple[int, int], str]]


def relay_block_bytes(size: int) -> int:
    """The bytes a relay block of an object of ``size`` bytes groups its units up to: a piece
    (:data:`BLOCK_BYTES`), or, for a small object, about ``size / RELAY_BLOCKS`` and at least
    :data:`MIN_BLOCK_BYTES`. Each hop holds a block back until it verified it, so an object of few
    large blocks crosses n hosts one large block per hop (a 10.9 MiB patch in two blocks: ~0.7 s
    per hop at 100 Mbit/s, ~6 s to 8 hosts), and in small ones one small block per hop. A unit (a
    piece, a tensor) is never cut: blocks only group them.

    Example:
        >>> [relay_block_bytes(n) >> 20 for n in (256 << 20, 32 << 20, 11 << 20, 1 << 20)]
        [2, 2, 1, 1]
    """
    return max(MIN_BLOCK_BYTES, min(BLOCK_BYTES, size // RELAY_BLOCKS))


def relay_fanout(fetchers: int, blocks: int = 1) -> int:
    """The relay tree's fan-out for an object of ``blocks`` blocks that ``fetchers`` hosts fetch
    (this one included): the ``f`` in 1..:data:`MAX_FANOUT` (1: a chain) with the least estimated
    time to the last fetcher, ``f * (blocks + depth)`` blocks' time, where ``depth`` is the last
    fetcher's hops below the first (:func:`relay_depth`; a chain: ``fetchers - 1``). An interior node
    sends each block to ``f`` children over one uplink, so blocks flow down at ``1/f`` of a link,
    and the fill takes ``depth`` hops of up to ``f`` blocks' time each; ties go to the smaller
    ``f``. :data:`FANOUT_ENV`, where set to an int >= 1, fixes it (another value is ignored).

    ``blocks``: the object's relay blocks (:meth:`Relay.plan`: its header, then its pieces grouped). A chain wherever
    the object has many blocks next to its fetchers (8 hosts, an object of 32 blocks: 39
    blocks' time, against 70 for f = 2), a tree where it has few (16 hosts, a
    one-block object: the chain's 16 against 10 for f = 2; 256 hosts, 32 blocks: the chain's 287
    against 80) — measured on the simulated cluster, 16 hosts and 4 one-block objects at 100 Mbit/s,
    one after the other: the chain 14.3 and 15.1 s, f = 2 8.8 and 10.9 s (docs/benchmarks.md).

        >>> relay_fanout(8, 32), relay_fanout(16, 1), relay_fanout(17, 32), relay_fanout(256, 32)
        (1, 2, 1, 2)
    """
    env = os.environ.get(FANOUT_ENV, "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env)
    n, b = max(1, fetchers), max(1, blocks)
    return min(range(1, MAX_FANOUT + 1), key=lambda f: (f * (b + relay_depth(n - 1, f)), f))


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


def relay_order(position: int, fanout: int, skip: Container[int] = (), limit: int = RELAY_ASK) -> list[int]:
    """The positions of the fetchers ahead that the fetcher at ``position`` prefers, at most
    ``limit`` of them and none in ``skip``: its parent in a tree of ``fanout`` (``(position - 1) //
    fanout``), then the parent's ancestors up to the first fetcher (position 0), then the others
    ahead, nearest first. Fan-out 1: the nearest first (the chain).

        >>> relay_order(4, 2), relay_order(10, 3), relay_order(10, 3, skip={3}, limit=4), relay_order(9, 1, limit=3)
        ([1, 0, 3, 2], [3, 0, 9, 8, 7, 6, 5, 4, 2, 1], [0, 9, 8, 7], [8, 7, 6])
    """
    out: list[int] = []
    k = position
    while k > 0 and len(out) < limit:
        k = (k - 1) // max(1, fanout)
        if k not in skip:
            out.append(k)
    taken = set(out)
    for k in range(position - 1, -1, -1):
        if len(out) >= limit:
            break
        if k not in skip and k not in taken:
            out.append(k)
    return out


class Relay:
    """One object, relayed: read block by block from the nearest fetcher ahead, each block verified
    before it is announced, so others read it from here while the rest still arrives.

    The object is cut into *blocks* (:meth:`plan`): the header, then the pieces the manifest lists
    (2 MiB ranges of large tensors, small tensors whole), grouped up to :func:`relay_block_bytes`
    (:data:`BLOCK_BYTES`; less for an object under 32 MiB). A
    block is checked alone as it lands: each piece against the manifest's piece digest, the header
    against the object's name (``object_digest(header, tensor digests the manifest lists)``, which
    also proves the layout). Once every block verified, the object did: no byte is hashed twice,
    and a block that fails names exactly the peer that served it.

    *Plan: a chain, or a tree, in order of arrival.* Each fetcher announces the object's fetch key
    at the address of its *progress word* (16 registered bytes: its slab's address, 0 until it has
    one, and how many blocks, from the first on, it verified; :data:`GONE` once it ended without
    the object) and gets its *position* with it
    (:meth:`Registry.announce_in_order`: the order of arrival every host sees alike); by position
    the fetchers form a tree of fan-out :func:`relay_fanout` (1: a chain, where the object has
    many blocks next to its fetchers): the ``i``-th reads from the ``(i - 1) // f``-th
    (:func:`relay_order`; its ancestors, then the others ahead nearest first, where that one is put
    aside). A lookup (:meth:`Registry.in_order`) asks for those positions alone, at most
    :data:`RELAY_ASK`: its reply does not grow with the number of hosts. A fetcher reads its
    upstream's progress word straight from that host (no registry
    round trip) and the blocks below its mark from its slab; the mark moves only past verified
    blocks. When the upstream has not got further it waits for it (every host sends each block
    about once to each child, the first fetcher alone reads the origin) unless its word cannot be
    read (passed over at once) or its mark does not move for :data:`STALL_S` (plus a block's time
    per hop). With no fetcher ahead, it reads from a holder of the whole object,
    preferring hosts its lookups saw fetching (:data:`_RELAYERS`) to the others (the origin). A finished
    fetcher keeps its announcements for :data:`LINGER_S`, so late
    joiners and the tail of the chain read from it, not from the origin.
    """

    @staticmethod
    def plan(digest: str, size: int, spans: Mapping[str, Mapping[tuple[int, int], str]] | None,
             pieces: Mapping[str, Mapping[tuple[int, int], str]] | None, header_alone: bool = False) -> _Plan | None:
        """``(data start, blocks, tensor spans)`` if the tensors ``spans`` lists for ``digest`` (a
        manifest's, a derived record's, or the object's own header's: :func:`~paramstore.format.listed_digests`)
        tile the object's data up to ``size`` (every byte but the header has a piece digest), else None.
        A block: ``(begin, end, units)``, a unit ``(begin, end, piece digest)`` (None: the header);
        units are grouped up to :func:`relay_block_bytes` of the object; ``header_alone``: the
        header is a block of its own (a plan its header gave: :meth:`run`).

        A manifest's spans that tile only the object's end look like a longer header: a version
        that references only an older object's last tensors. None where that "header" would be
        over :data:`PLAN_HEADER_BYTES` (~80,000 tensors' entries at ~107 bytes each: far likelier such a
        version; either way the object is then read whole); a shorter one is found out at block 0
        (:data:`IN_PART`)."""
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
        if start < 8 or pos != size or (start > PLAN_HEADER_BYTES and not header_alone):
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
        most = relay_block_bytes(size)
        blocks: list[_Block] = []
        for k, u in enumerate(units):
            if blocks and (k > 1 or not header_alone) and blocks[-1][1] - blocks[-1][0] + u[1] - u[0] <= most:
                blocks[-1] = (blocks[-1][0], u[1], blocks[-1][2] + [u])
            else:
                blocks.append((u[0], u[1], [u]))
        return start, blocks, sp

    @staticmethod
    def whole(size: int) -> _Plan:
        """The plan of an object of at most :data:`WHOLE_BLOCK_BYTES` whose piece digests nothing lists
        (a patch object written before they did): one block, the whole object, checked against
        the object's name (:data:`WHOLE`)."""
        return 0, [(0, size, [(0, size, WHOLE)])], {}

    def __init__(self, root: StoreRoot, transport: Transport, pool: SlabPool, digest: str, size: int,
                 server: PeerServer | None, report: FetchReport, lock: threading.Lock, excluded: set[str],
                 plan: _Plan | None) -> None:
        self.root, self.transport, self.pool, self.digest, self.size = root, transport, pool, digest, size
        self.server, self.report, self.lock, self.excluded = server, report, lock, excluded
        self.start, self.blocks, self.spans = plan if plan is not None else (0, [], {})
        # the plan's largest block (before a header gives it: what it will be about)
        self.block_bytes = self._usual_block(size)
        self.me = server.peer.id if server is not None else None
        # fetchers of one key follow each other: every block boundary must agree along a chain
        self.fetch_key = _fetch_key(digest, self.blocks if plan is not None else None)
        #: True once the object's header (read by :meth:`run`, for want of a plan) agrees with its
        #: size and name but lists no piece digests and the object is over a block, or once the
        #: header (block 0 of a manifest's plan) ends before the first byte the version references
        #: (:data:`IN_PART`): it is not relayed; the caller reads it whole (:class:`paramstore.peer._Fetch`).
        self.unlisted = False
        # its place among the fetchers (the registry's position); a host that does not serve
        # relays nothing: it has none, and goes last (reads from the chain's tail)
        self.position: int | None = None
        self.cond = threading.Condition()
        self.done: set[int] = set()  # blocks verified (and announced)
        self.landed = 0  # of them, whole blocks (not the header alone): alone, that many more reads at once
        self.busy: set[int] = set()  # blocks being read or verified
        self.reading: set[int] = set()  # blocks being read
        self.bad: set[str] = set()  # peers that failed to serve or stalled: not asked again for this object
        # of them, those that only failed reads: asked again (:meth:`_retry`) when nobody else
        # can serve, after a back-off
        self.retries = Retries()
        self.retry_at = 0.0  # no holder is looked up before then (a back-off)
        self.culprits: set[str] = set()  # peers blamed for this object
        self.waiting: tuple[tuple[str, int], float] | None = None  # ((upstream, its progress), since)
        self.bad_at = 0.0  # when a peer was last put aside (the registry is asked again)
        self.block_s = 0.05  # seconds one block takes to arrive (running estimate)
        self.announced: list[str] = []
        self.ahead: dict[int, tuple[Peer, int]] = {}  # the last registry answer: position -> (fetcher, progress word)
        self.marks: dict[str, tuple[int, int, float]] = {}  # fetcher ahead -> its progress word as last read, when
        self.end = 1  # positions given out, as last seen (the fetchers of the object, about)
        self.gone: set[int] = set()  # positions ahead put aside or found empty (never given again while this one holds its own)
        self.found_at = -1.0
        self.whole: list[tuple[Peer, int]] = []  # holders of the whole object, as last seen
        self.whole_at = -1.0
        self.relook_s = RELOOK_S  # seconds to the next lookup while an upstream is followed
        self.tainted = False  # a read timed out: a late write may still land; nothing here is trusted

    def _usual_block(self, size: int) -> int:
        """The bytes of a usual block of the plan (what a block that counts as landed, and the
        block-time estimate, are measured against): its largest, but at most
        :func:`relay_block_bytes` (a long header, or an 8 MiB piece of an object written before
        pieces were 2 MiB, is not the measure of the plan's 2 MiB blocks)."""
        return min(max((e - b for b, e, _ in self.blocks), default=relay_block_bytes(size)), relay_block_bytes(size))

    def run(self) -> bool:
        """Fetch the object; True once every block is verified and the object is in the local tier.

        Without a plan the object's own header gives it (a patch object lists its piece digests:
        :func:`~paramstore.format.listed_digests`), read first (:meth:`_header`) from the fetcher
        ahead that verified it, else from a holder of the whole object: so that of hosts
        fetching it at once only the first reads it from the origin, and nothing of the size the
        registry claims is allocated before a header agrees with it."""
        # progress: (slab address, blocks verified from the first on), read by the hosts behind
        # this one straight through the transport, (0, 0) until its slab is ready; scratch: where
        # this host reads others' into
        self.progress = memoryview(bytearray(16))
        self.scratch = memoryview(bytearray(16))
        self.paddr = self.transport.register(self.progress)
        self.saddr = self.transport.register(self.scratch)
        slab: Slab | None = None
        placed = False
        try:
            if self.me is not None:  # its place among the fetchers, given by the registry with the announcement
                self.position = self.root.registry.announce_in_order(self.me, self.fetch_key, self.paddr)
                self.announced.append(self.fetch_key)
            head = b"" if self.blocks else self._header()
            if not self.blocks:
                return False  # no header agreed, or it lists no digests (:attr:`unlisted`)
            # None ready: a slab made now is reserved and faulted on a thread of its own, just ahead
            # of the blocks that arrive, not before the first read (256 MiB: 0.13 s on the hot path).
            slab = self.pool.take(self.size, reserve=False)
            self.space = _Space(slab)
            try:
                self.addr = self.transport.register(slab.map)
            except BaseException:
                self.space.close()
                slab.discard()
                slab = None
                raise
            self.buf = memoryview(slab.map)
            if head and self.blocks[0][2][0][2] is None:  # the header, verified, is block 0
                if not self.space.wait(self.start):
                    raise self.space.error  # type: ignore[misc]
                self.buf[:self.start] = head[:self.start]
                self.done.add(0)
            struct.pack_into("<Q", self.progress, 0, self.addr)  # the address first: never (0, mark > 0)
            struct.pack_into("<Q", self.progress, 8, len(self.done))
            with ThreadPoolExecutor(RELAY_INFLIGHT, thread_name_prefix="paramstore-relay") as readers:
                placed = self._relay(readers)
            placed = placed and not self.tainted and len(self.done) == len(self.blocks)
            if self.space.error is not None and not placed:
                raise self.space.error  # the local tier is full: the checkout says so
        finally:
            if slab is not None:
                self.space.close()
                self.buf.release()
            if placed:
                assert slab is not None
                self.root.tier.put(self.digest, slab.path, move=True)  # the mapping stays: same pages
                if self.server is not None:
                    self.server.serve([self.digest])
                self._linger(slab.close)
            else:
                struct.pack_into("<Q", self.progress, 8, GONE)  # the hosts behind pass over it at once
                if self.announced:
                    with contextlib.suppress(ParamStoreError, OSError):
                        self.root.registry.withdraw_objects(self.me, self.announced)  # type: ignore[arg-type]
                if slab is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(slab.path)
                    retire(self.transport, self.addr, slab.close, RELAY_RETIRE_S)
                retire(self.transport, self.paddr, lambda: None, RELAY_RETIRE_S)
            retire(self.transport, self.saddr, lambda: None)
        return placed

    def _header(self) -> bytes:
        """The object's header, from the nearest fetcher ahead that verified it (its progress
        word's mark: block 0, the header alone) or a holder of the whole object, checked against
        the object's size and name; sets the plan it gives (its piece digests; one block checked
        whole for an object of at most a block that lists none; none, and :attr:`unlisted`, for a
        larger one). A peer whose header lists digests that do not make the name is blamed; one
        whose header disagrees with the size (or is malformed) is not asked again, and when no
        peer's agrees that is warned about and counted (``rejected["size"]``): the registry's
        record is wrong, or stale. b"" when none agrees."""
        denied: tuple[Peer, ValueError] | None = None
        misses = 0
        while True:
            picks, _ = self._choose([0], 1)
            if picks is None:  # the fetcher ahead has not verified the header yet
                time.sleep(min(0.01, 0.0005 * (1 << min(misses, 8))))
                misses += 1
                continue
            if not picks:
                break
            peer, _, base = picks[0]
            try:
                head = self._read_header(peer, base)
                header_layout(memoryview(head), self.size)
            except TransferError as err:
                self._read_failed(peer, err)
                if self.tainted:
                    break
                continue
            except ValueError as e:  # not this object's size, or no header at all
                with self.cond:
                    self.bad.add(peer.id)
                self.bad_at = time.monotonic()
                denied = denied or (peer, e)
                continue
            try:
                listed = listed_digests(head, self.size, self.digest)
            except ValueError as e:
                self._blame(peer, f"its header ({e})")
                continue
            plan = None if listed is None else Relay.plan(self.digest, self.size, {self.digest: listed[0]},
                                                          {self.digest: listed[1]}, header_alone=True)
            if plan is None:  # no digests listed (or none that tile it): one block checked whole, or read whole
                plan = Relay.whole(self.size) if self.size <= WHOLE_BLOCK_BYTES else None
                self.unlisted = plan is None
            if plan is not None:
                self.start, self.blocks, self.spans = plan
                self.block_bytes = self._usual_block(self.size)
            return head
        if denied is not None:
            warnings.warn(f"paramstore: object {self.digest[:16]}… is recorded as {self.size} bytes, but the header "
                          f"its holder {denied[0].session} serves does not agree with that size ({denied[1]}), and "
                          "no peer asked serves one that does: not fetched from peers", RuntimeWarning, stacklevel=3)
            with self.lock:
                self.report.rejected["size"] += 1
        return b""

    def _read_header(self, peer: Peer, base: int) -> bytes:
        """The header of the object ``peer`` serves at ``base``: its length field, then the rest
        (never more than the size claimed nor the format's cap)."""
        (length,) = struct.unpack("<Q", self._read_small(peer, base, 8))
        if not 8 < 8 + length <= min(self.size, HEADER_CAP):
            raise ValueError(f"its header's length field says {length} bytes")
        return self._read_small(peer, base, 8 + length)

    def _read_small(self, peer: Peer, remote: int, nbytes: int) -> bytes:
        """``nbytes`` from ``remote`` at ``peer``, read into memory of their own (a read that timed
        out may still write there later), counted in the report (they crossed the wire too)."""
        view = memoryview(bytearray(nbytes))
        local = self.transport.register(view)
        try:
            self.transport.read(peer.session, [(local, remote, nbytes)])
        finally:
            retire(self.transport, local, lambda: None)  # a late write still lands in live memory
        with self.lock:
            self.report.bytes_from[peer.session] += nbytes
        return bytes(view)

    def _linger(self, close: Callable[[], None]) -> None:
        """Keep this fetch's announcements for :data:`LINGER_S`, then withdraw them and retire the slab."""
        registry, me, keys, transport, addr = self.root.registry, self.me, list(self.announced), self.transport, self.addr

        def withdraw() -> None:
            if keys:
                with contextlib.suppress(ParamStoreError, OSError, RuntimeError):
                    registry.withdraw_objects(me, keys)  # type: ignore[arg-type]
            retire(transport, addr, close, RELAY_RETIRE_S)
            retire(transport, paddr, lambda: None, RELAY_RETIRE_S)

        paddr = self.paddr
        later(time.monotonic() + (LINGER_S if keys else 0.0), withdraw)

    # -- the loop ----------------------------------------------------------------------------
    def _relay(self, readers: ThreadPoolExecutor) -> bool:
        """Read every block; True once all verified. In a chain blocks are read one at a time, in
        order (a block that arrives whole sooner is served on sooner; two at once would both land
        late), the next one's read starting while the last one is verified; alone, from a whole
        holder, one more block at once per block landed (up to :data:`RELAY_INFLIGHT`)."""
        futures: list[Future[None]] = []
        crowd = True  # until the registry says otherwise: one read at a time
        misses = 0  # looks at the upstream's mark in a row that found no new block
        n = len(self.blocks)
        while True:
            with self.cond:
                if self.tainted or self.unlisted or self.space.error is not None:
                    break
                missing = [i for i in range(n) if i not in self.done and i not in self.busy]
                if not missing and not self.busy:
                    return len(self.done) == n
                # alone, one more block in flight per block landed (up to RELAY_INFLIGHT): grown as
                # reads land, not as they are issued, so the first fetcher of an all-at-once checkout
                # has read one block, not four sharing its link, by the time the others are seen
                # (measured: 4 at once delayed the second host by ~2 blocks' time, for good)
                lanes = 1 if crowd else min(1 + self.landed, RELAY_INFLIGHT)
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
        for f in futures:
            f.result()
        return False

    def _lookup(self, fresh: bool = False) -> dict[int, tuple[Peer, int]]:
        """The fetchers ahead this one would read from (:func:`relay_order`, by position: at most
        :data:`RELAY_ASK`), with their progress words: from the registry after :data:`RELOOK_S`,
        then 2, 4... up to :data:`RELOOK_MAX_S` while an upstream is followed (at once after a peer
        was put aside, and each time when ``fresh``: reading from a whole holder, so that a fetcher
        that joined just before this one is followed as soon as it is seen)."""
        now = time.monotonic()
        aside = self.found_at < self.bad_at
        periodic = now - self.found_at >= self.relook_s
        if fresh or periodic or aside:
            if aside:
                self.relook_s = RELOOK_S
            elif periodic and not fresh and self.found_at >= 0:
                self.relook_s = min(2 * self.relook_s, RELOOK_MAX_S)
            for _ in range(2):  # again if the answer moves the tree (another fan-out; a host that
                # does not serve: another place, behind the fetchers seen now)
                place, fanout = self._place(), self._fanout()
                asked = relay_order(place, fanout, self.gone)
                self.end, self.ahead = self.root.registry.in_order(self.fetch_key, asked)
                self.ahead = {q: (p, a) for q, (p, a) in self.ahead.items() if p.id != self.me}
                if self.position is not None:  # below its own position, empty stays empty
                    self.gone.update(q for q in asked if q not in self.ahead)
                if (self._place(), self._fanout()) == (place, fanout):
                    break
            self.found_at = now
            for p, _ in self.ahead.values():
                _RELAYERS[p.id] = None
            if len(_RELAYERS) > 4096:
                for k in list(_RELAYERS)[:2048]:
                    del _RELAYERS[k]
        return self.ahead

    def _place(self) -> int:
        """This fetcher's position (one that does not serve: behind every fetcher seen)."""
        return self.position if self.position is not None else self.end

    def _fetchers(self) -> int:
        """The fetchers of the object as last seen, this one included."""
        return max(self.end, self._place() + 1)

    def _fanout(self) -> int:
        """The tree's fan-out for the fetchers seen (:func:`relay_fanout`; before a header gives
        the plan, for the blocks it will have about)."""
        return relay_fanout(self._fetchers(), len(self.blocks) or 1 + -(-self.size // self.block_bytes))

    def _choose(self, window: list[int], room: int) -> tuple[list[tuple[Peer, int, int]] | None, bool]:
        """What to read next: ``(peer, block, address of the object's first byte there)``; None to
        wait for the upstream; empty if nobody can serve the window. And whether others fetch it."""
        ahead = self._lookup()
        skip = self.bad | self.excluded
        backoff = time.monotonic() < self.retry_at  # nobody to ask but peers that failed reads, not yet
        if not backoff and not any(p.id not in skip for p, _ in ahead.values()):
            ahead = self._lookup(fresh=True)  # nobody (usable) ahead, as last seen: ask again before the origin
        crowd = self._fetchers() > 1  # others fetch it
        fanout = self._fanout()
        ups = [(q, *ahead[q]) for q in relay_order(self._place(), fanout, self.gone) if q in ahead]
        hops = relay_depth(self._place(), fanout)  # fan-out 1: one hop per fetcher ahead (the chain)
        for q, up, word in ups:  # the parent, its ancestors, then the others nearest first
            if up.id in skip:
                continue
            seen = self.marks.get(up.id)
            if seen is not None and time.monotonic() - seen[2] < MARK_TTL_S and window[0] < seen[1]:
                base, mark = seen[0], seen[1]  # it had verified the next block already (a mark only grows)
            else:
                try:  # its progress word, straight from it: (slab address, blocks verified from the first)
                    self.transport.read(up.session, [(self.saddr, word, 16)])
                except TransferError:
                    log.debug("relay %s: upstream %s does not answer: passed over", self.digest[:12], up.session)
                    self._put_aside(up, q, failed=True)  # dead or leaving: the next one up
                    continue
                base, mark = struct.unpack_from("<QQ", self.scratch, 0)
                if mark == GONE:
                    log.debug("relay %s: upstream %s ended without the object: passed over", self.digest[:12], up.session)
                    self._put_aside(up, q)
                    continue
                mark = mark if base else 0  # no slab yet
                self.marks[up.id] = (base, mark, time.monotonic())
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
            self._put_aside(up, q)  # it answers but makes no progress: the next one up
        whole = [(p, a) for p, a in self.whole if p.id not in skip]
        if not whole and backoff:
            return None, crowd  # a back-off (:meth:`_retry`) is not over
        if not whole or time.monotonic() - self.whole_at > RETIRE_AFTER_S / 2:  # whole holders from a fresh answer
            whole = self._find_whole(skip)
        self.relook_s = RELOOK_S  # nobody to follow: once one is, it is looked up again after 1 s
        if not whole:
            if not self._retry():
                return [], crowd  # nobody left to ask
            whole = self._find_whole(self.bad | self.excluded)
            if not whole:
                return None, crowd  # those asked again hold nothing; others' back-off is not over
        known = [w for w in whole if w[0].id in _RELAYERS]
        out = []
        for i in window[:room]:
            peer, addr = random.choice(known or whole)  # each block: spread over the holders alike
            out.append((peer, i, addr))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("relay %s: blocks %s from whole holder(s) %s: position %d of %d, %d put aside",
                      self.digest[:12], [i for _, i, _ in out], sorted({p.session for p, _, _ in out}),
                      self._place(), self.end, len(skip))
        return out, crowd

    def _find_whole(self, skip: set[str]) -> list[tuple[Peer, int]]:
        """Holders of the whole object but those in ``skip``, from a fresh registry answer (kept
        in :attr:`whole`)."""
        self.whole = holders_of(self.root.registry, [self.digest], self.me, skip).get(self.digest, [])
        self.whole_at = time.monotonic()
        return self.whole

    def _retry(self) -> bool:
        """Nobody usable holds the object: the peers put aside that failed reads (not those caught
        serving bad bytes, nor fetchers ahead passed over: :meth:`_put_aside`) are asked again, each at most :data:`PEER_RETRIES` times, once its
        back-off is over (those due are taken out of :attr:`bad`; :attr:`retry_at`: when the next
        one is due). False once none is left to ask, now or later."""
        now = time.monotonic()
        with self.cond:
            due, later = self.retries.due(self.bad, self.excluded, now=now)
            self.bad.difference_update(due)
            self.retry_at = now + later if later is not None else 0.0
        if due:
            log.debug("relay %s: nobody else holds it: asking %d peer(s) that failed a read again",
                      self.digest[:12], len(due))
        return bool(due) or later is not None

    def _read_failed(self, peer: Peer, err: TransferError) -> None:
        """A read from ``peer`` failed: it is put aside for this object, a failure counted (once
        for the reads in flight to it then: they fail together) for :meth:`_retry`. A read that
        timed out may still write later: nothing here is trusted then (:attr:`tainted`)."""
        with self.cond:
            first = peer.id not in self.bad
            if first:
                self.retries.failed_read(peer.id)
            self.bad.add(peer.id)
            self.marks.pop(peer.id, None)
            self.tainted = self.tainted or err.code == -2
        if first:
            with self.lock:
                self.report.failed[peer.session] += 1
        self.bad_at = time.monotonic()

    def _put_aside(self, peer: Peer, position: int, *, failed: bool = False) -> None:
        """Pass over the fetcher ahead at ``position`` for this object (dead, stalled or ended): not
        asked again, not even by :meth:`_retry`. ``failed``: a read from it failed (counted in the
        report once, unless it was put aside already)."""
        with self.cond:
            first = peer.id not in self.bad
            self.bad.add(peer.id)
            self.retries.forget(peer.id)
            self.gone.add(position)
            self.marks.pop(peer.id, None)
        if failed and first:
            with self.lock:
                self.report.failed[peer.session] += 1
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
                self._read_failed(peer, err)
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
            if e - b >= self.block_bytes // 2:
                self.block_s = 0.7 * self.block_s + 0.3 * (time.monotonic() - t0)
            why = self._verify(i)
            if why == IN_PART:  # not the peer's fault: the plan's "header" holds tensors too
                log.debug("relay %s: %s: read whole instead", self.digest[:12], why)
                with self.cond:
                    self.unlisted = True
                    self.cond.notify_all()
                return
            if why is not None:
                self._blame(peer, why)
                return
            ok = True
        finally:
            with self.cond:
                if ok:
                    self.done.add(i)
                    self.landed += e - b >= self.block_bytes // 2
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
            if d == WHOLE:  # the whole object (:meth:`whole`): its bytes must make its name
                try:
                    if rehash(self.buf[:self.size])[0] != self.digest:
                        return "the object's bytes do not make its name"
                except ValueError as err:
                    return f"it is not a well-formed object ({err})"
                continue
            if d is not None:
                if piece_digest(self.buf[b:e]) != d:
                    return f"bytes {b}-{e} do not match their piece digest"
                continue
            try:  # the header: its layout and the manifest's tensor digests must make the object's name
                start, spans = tensor_spans(self.buf, self.size)
                if start < self.start and set(self.spans) <= set(spans):  # it places every tensor the version
                    return IN_PART  # references where the manifest does: those tensors are the object's tail
                if start != self.start:
                    return "its header has another length"
                if object_digest(self.buf[:start], [self.spans[s] for s in spans]) != self.digest:
                    return "its header does not make the object's digest"
            except (ValueError, KeyError) as err:
                return f"its header does not match the manifest ({err!r})"
        return None

    def _blame(self, peer: Peer, why: str) -> None:
        blame(self, peer, f"a block ({why})")

    def _announce(self, new: dict[str, int]) -> None:
        self.root.registry.announce_objects(self.me, new)  # type: ignore[arg-type]
        self.announced.extend(new)


#: Bytes a fresh relay slab is reserved (and faulted) ahead of the furthest block asked for.
SPACE_AHEAD = 32 << 20


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


def holders_of(registry: Registry, keys: list[str], me: str | None, skip: Collection[str] = ()
               ) -> dict[str, list[tuple[Peer, int]]]:
    """The holders of ``keys`` a fetch may read from: neither ``me`` nor any in ``skip``, a random
    sample of each key where more hold it (``HOLDERS_SAMPLE + 1`` at most, ``me`` and ``skip`` left
    out of a sample that makes room for them): a reply does not grow with the hosts that hold it."""
    found = registry.holders(keys, limit=HOLDERS_SAMPLE + len(skip) + 1)
    return {k: [(p, a) for p, a in v if p.id != me and p.id not in skip] for k, v in found.items()}


def blame(fetch: "_Fetch | Relay", peer: Peer, what: str) -> None:
    """``peer`` served ``what`` of ``fetch``'s object (a relay, or peer.py's whole-object fetch) that
    fails verification: counted in the
    report's ``rejected`` (once per object), said in a warning, and asked nothing more in this fetch."""
    with fetch.lock:
        if peer.id in fetch.culprits:
            return
        fetch.culprits.add(peer.id)
        fetch.excluded.add(peer.id)
        fetch.report.rejected[peer.session] += 1
    warnings.warn(f"paramstore: peer {peer.session} served {what} of object {fetch.digest[:16]}… that fails "
                  "verification: it is asked nothing more in this fetch", RuntimeWarning, stacklevel=3)


def _fetch_key(digest: str, blocks: list[_Block] | None) -> str:
    """The key a host fetching object ``digest`` announces at its progress word's address, with its
    position among the object's fetchers (:meth:`Registry.announce_in_order`): it names the plan's
    block boundaries too, so only fetchers that cut the object alike follow each other (a block
    count read from one means the same bytes to the other). ``blocks`` None: a relay whose plan
    the object's header gives (:meth:`Relay.run`), announced before it has read it; such plans
    all cut the header alone, then the pieces the header lists, grouped up to
    :func:`relay_block_bytes` (v3: since blocks are 2 MiB, so that a host of an older paramstore,
    which grouped them up to 8 MiB, never follows one of this one or leads it)."""
    h = blake3.blake3(b"paramstore/fetch/v3\0" + bytes.fromhex(digest))
    h.update(b"header" if blocks is None else struct.pack(f"<{2 * len(blocks)}Q", *(x for b, e, _ in blocks for x in (b, e))))
    return h.hexdigest()
