"""Lazy reads: a checkout that moves only the pieces its reads touch (``checkout(v, fetch="lazy")``).

A lazy checkout leases the version and maps the objects this host already holds, as an eager one
does, but fetches nothing. Each object it lacks is mapped instead as a *sparse* file of the
object's extent, made in the tier's ``tmp/`` and unlinked at once (its pages belong to this
snapshot alone: nothing else can see it, and nothing is left behind if the process dies; it is
never published as the object). :class:`LazyReads` keeps which pieces of it have arrived.

A read (``snap.read``, ``snap[name]``, ``load_into``, ``snap.assets``) first calls :meth:`LazyReads.ensure`
with the byte ranges it touches. The pieces those ranges meet (a piece is the unit of verification:
:meth:`~paramstore.manifest.Chunk.hash_pieces`, a 2 MiB piece of a larger tensor, 8 MiB in objects
written before, else the whole tensor) that have not arrived are read

1. from a peer that announced the whole object (through the transport, into a fresh registered
   buffer: a read that times out and writes late never lands in the snapshot's pages), then
2. from the remote tier (a ranged read of the object),

and each piece is hashed and compared with the digest the manifest lists for it *before* it is
copied into the snapshot's pages: no unverified byte is ever handed out. A peer that serves a bad
piece is named in ``snap.fetch.rejected`` and asked nothing more for this snapshot; the piece is
read from the next source. Pieces that arrived stay for later reads of the snapshot; two threads
that need the same piece at once fetch it once (the second waits for the first). A piece no source
delivers raises :class:`~paramstore.errors.ObjectUnavailableError` naming the tensor.

Not done: the object header is never fetched (reads do not need it, and only a manifest that covers
every tensor of an object could verify it); a complete object is not published into the tier;
pieces are not shared between two lazy snapshots of one version; hosts reading lazily do not
serve what they read to others.
"""

from __future__ import annotations

import bisect
import mmap
import os
import random
import threading
import time
import warnings
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from .errors import CorruptObjectError, ObjectUnavailableError, RemoteError, TransferError
from .format import ITEMSIZE, PIECE_SIZE, piece_digest
from .manifest import Chunk, Manifest
from .peer import _contiguous
from .relay import PEER_RETRIES, RETRY_S, holders_of
from .reports import FetchReport
from .retire import retire
from .staging import tmp_name

if TYPE_CHECKING:
    from .root import StoreRoot
    from paramstore.backends.transports.base import Transport

    from .peer import PeerServer
    from .remote import Remote

__all__ = ["LazyReads", "touched", "BATCH_BYTES"]

#: Bytes one read from one source moves at most (several pieces that lie side by side go together).
BATCH_BYTES = 64 << 20
#: A box made of more contiguous runs than this is treated as the span from its first to its last byte.
_MAX_RUNS = 1 << 20

Piece = tuple[int, int, str]  # absolute (begin, end) in the object, and the digest to check it against


class _Partial:
    """One object this host lacks: its sparse mapping, its pieces and which of them arrived."""

    def __init__(self, digest: str, m: mmap.mmap, pieces: list[Piece]) -> None:
        self.digest, self.map = digest, m
        self.pieces = pieces  # sorted, non-overlapping (tensors tile an object)
        self.begins = [p[0] for p in pieces]
        self.ends = [p[1] for p in pieces]
        self.arrived: set[tuple[int, int]] = set()
        self.inflight: dict[tuple[int, int], threading.Event] = {}
        self.lock = threading.Lock()

    def meeting(self, begin: int, end: int) -> list[Piece]:
        """The non-empty pieces that meet ``[begin, end)``."""
        lo = bisect.bisect_right(self.ends, begin)
        hi = bisect.bisect_left(self.begins, end)
        return [p for p in self.pieces[lo:hi] if p[1] > p[0]]


class LazyReads:
    """The objects of one lazy snapshot that this host lacks, and how their pieces come here.

    Made by :meth:`paramstore.checkout.Fetcher.lazy` for a leased version; the snapshot calls
    :meth:`map` for each object it lacks, then :meth:`ensure` (or :meth:`ensure_box`) before it hands
    out any byte of one. ``report`` (the snapshot's ``fetch``) gets the bytes per source, the
    bytes moved lazily and the rejected peers.
    """

    def __init__(self, root: "StoreRoot", step: int, manifest: Manifest, report: FetchReport, *,
                 transport: Callable[[], "Transport"], server: Callable[[], "PeerServer | None"],
                 remote: "Remote | None") -> None:
        self._root, self._step, self._manifest, self.report = root, step, manifest, report
        self._transport, self._server, self._remote = transport, server, remote
        self._parts: dict[str, _Partial] = {}
        self._lock = threading.Lock()  # the report and the excluded peers
        #: peers caught serving a bad piece: asked nothing more by this snapshot
        self.excluded: set[str] = set()

    # -- mapping ---------------------------------------------------------------------------
    def map(self, digest: str, extent: int, expected: int | None) -> mmap.mmap:
        """A writable shared mapping of a fresh sparse file of ``extent`` bytes (the end of the last
        byte range the manifest points into the object), made in the tier's ``tmp/`` and unlinked
        at once. CorruptObjectError if the registry records a smaller object."""
        if expected is not None and expected < extent:
            raise CorruptObjectError(f"object {digest} of version {self._step} is recorded as {expected} bytes, "
                                     f"but the manifest points up to byte {extent}")
        path = os.path.join(self._root.tier.tmp_dir, f"lazy-{tmp_name()}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.unlink(path)  # only this mapping sees it; nothing is left if the process dies
            os.ftruncate(fd, extent)
            m = mmap.mmap(fd, extent, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        pieces = sorted((b, e, d) for (b, e), d in self._manifest.piece_spans().get(digest, {}).items())
        self._parts[digest] = _Partial(digest, m, pieces)
        return m

    def lacks(self, digest: str) -> bool:
        """Whether ``digest`` is one of the objects mapped sparse (read piece by piece)."""
        return digest in self._parts

    def close(self) -> None:
        """Drop the references to the mappings (the snapshot's unmapper then drops them)."""
        self._parts = {}

    # -- reads -----------------------------------------------------------------------------
    def ensure_box(self, name: str, dtype: str, chunk: Chunk, start: Sequence[int], stop: Sequence[int]) -> None:
        """Make the pieces of ``chunk`` (of tensor ``name``) that the box ``[start, stop)`` (in the
        chunk's own coordinates) touches present and verified."""
        if chunk.object not in self._parts:
            return
        ranges = touched(chunk.sizes, ITEMSIZE[dtype], start, stop)
        self.ensure(chunk.object, [(chunk.offset + b, chunk.offset + e) for b, e in ranges], name)

    def ensure(self, digest: str, ranges: Iterable[tuple[int, int]], what: str) -> None:
        """Make every piece of object ``digest`` that meets one of ``ranges`` (absolute byte ranges)
        present and verified; ``what`` (a tensor name) is named in errors. Thread-safe: a piece
        another thread is fetching is waited for, not fetched again."""
        part = self._parts.get(digest)
        if part is None:
            return
        need: dict[tuple[int, int], Piece] = {}
        for b, e in ranges:
            if e > b:
                need.update(((p[0], p[1]), p) for p in part.meeting(b, e))
        while True:
            with part.lock:
                missing = [p for k, p in need.items() if k not in part.arrived]
                mine = [p for p in missing if (p[0], p[1]) not in part.inflight]
                waits = [part.inflight[(p[0], p[1])] for p in missing if (p[0], p[1]) in part.inflight]
                for p in mine:
                    part.inflight[(p[0], p[1])] = threading.Event()
            if not missing:
                return
            try:
                if mine:
                    self._fetch(part, sorted(mine), what)
            finally:
                with part.lock:
                    for p in mine:
                        part.inflight.pop((p[0], p[1])).set()
            for event in waits:
                event.wait()
            # loop: what another thread failed to fetch is fetched (or fails) here

    def verify(self, digest: str) -> str | None:
        """Re-hash the pieces of ``digest`` that arrived; why one no longer matches, or None."""
        part = self._parts.get(digest)
        if part is None:
            return None
        with part.lock:
            arrived = sorted(p for p in part.pieces if (p[0], p[1]) in part.arrived)
        for b, e, d in arrived:
            if piece_digest(memoryview(part.map)[b:e]) != d:
                return f"piece [{b}, {e}) no longer hashes to its digest"
        return None

    # -- sources ---------------------------------------------------------------------------
    def _fetch(self, part: _Partial, pieces: list[Piece], what: str) -> None:
        """Move ``pieces`` of ``part`` here from its holders, else the remote. Without a remote,
        holders whose reads failed (not those caught serving bad pieces) are asked again after a
        back-off, up to :data:`~paramstore.relay.PEER_RETRIES` times: a stall longer than the
        transfer engine's progress timeout does not fail the caller's read."""
        pending = pieces
        why: list[str] = []
        for attempt in range(1 + (PEER_RETRIES if self._remote is None else 0)):
            if attempt:
                time.sleep(RETRY_S * 2 ** (attempt - 1))
            asked, pending = self._from_peers(part, pending, why)
            if not pending or not asked:
                break
        if pending and self._remote is not None:
            pending = self._from_remote(part, pending, why)
        if pending:
            b, e = pending[0][0], pending[-1][1]
            where = ("; ".join(dict.fromkeys(why)) if why else
                     "no live host serves it" + ("" if self._remote is not None else " and no remote is open"))
            raise ObjectUnavailableError(
                f"tensor {what!r} of version {self._step}: {len(pending)} piece(s) of object {part.digest[:12]}… "
                f"(bytes {b}-{e}) could not be read lazily: {where}; run `paramstore serve` (or store.serve()) on a "
                "host that holds the version, or open the store with remote=URL")

    def _from_peers(self, part: _Partial, pending: list[Piece], why: list[str]) -> tuple[int, list[Piece]]:
        """One round over the holders of ``part`` (none caught serving bad pieces): how many of
        those asked may be asked again (not caught in this round either), and what is still missing."""
        found = holders_of(self._root.registry, [part.digest], None).get(part.digest, [])
        if not found:
            return 0, pending
        try:
            transport = self._transport()
        except TransferError as e:
            why.append(f"no transfer engine here: {e}")
            return 0, pending
        server = self._server()
        holders = [h for h in found if server is None or h[0].id != server.peer.id]
        random.shuffle(holders)  # readers spread over the holders
        asked = []
        for peer, addr in holders:
            if not pending:
                break
            with self._lock:
                if peer.id in self.excluded:
                    continue
            asked.append(peer.id)
            pending = self._from_peer(part, transport, peer, addr, pending, why)
        with self._lock:
            return sum(p not in self.excluded for p in asked), pending

    def _from_peer(self, part: _Partial, transport: "Transport", peer: object, addr: int, pending: list[Piece],
                   why: list[str]) -> list[Piece]:
        """Read ``pending`` from one peer, a batch at a time; returns what is still missing (all of
        the rest once the peer fails or serves a bad piece: it is asked nothing more)."""
        session = peer.session  # type: ignore[attr-defined]
        left = list(pending)
        for batch in _batches(pending):
            size = sum(e - b for b, e, _ in batch)
            view = memoryview(bytearray(size))
            local = transport.register(view)
            try:
                reads, pos = [], 0
                for b, e, _ in batch:
                    reads.append((local + pos, addr + b, e - b))
                    pos += e - b
                try:
                    transport.read(session, _contiguous(reads))
                except TransferError as err:
                    why.append(f"peer {session} failed: {err}")
                    with self._lock:
                        self.report.failed[session] += 1
                    return left
                self._count(session, size)
                bad = self._place(part, batch, view)
            finally:
                retire(transport, local, lambda: None)  # a late write still lands in live memory
            done = {(b, e) for b, e, _ in batch} - {(b, e) for b, e, _ in bad}
            left = [p for p in left if (p[0], p[1]) not in done]
            if bad:
                self._blame(peer, part.digest, what=f"{len(bad)} piece(s)")
                why.append(f"peer {session} served {len(bad)} bad piece(s)")
                return left
        return left

    def _from_remote(self, part: _Partial, pending: list[Piece], why: list[str]) -> list[Piece]:
        assert self._remote is not None
        left = list(pending)
        for run in _runs(pending):
            for batch in _batches(run):
                b0, e0 = batch[0][0], batch[-1][1]
                try:
                    data = self._remote.tier.get(part.digest, b0, e0)
                except FileNotFoundError:
                    why.append(f"{self._remote.url} does not hold object {part.digest[:12]}… whole")
                    return left
                except (RemoteError, OSError) as err:
                    why.append(f"{self._remote.url} failed: {err}")
                    return left
                self._count(self._remote.url, len(data))
                if len(data) != e0 - b0:
                    why.append(f"{self._remote.url} returned {len(data)} bytes for {e0 - b0}")
                    return left
                view = memoryview(data)
                bad = self._place(part, [(b - b0, e - b0, d) for b, e, d in batch], view, shift=b0)
                done = {(b, e) for b, e, _ in batch} - {(b + b0, e + b0) for b, e, _ in bad}
                left = [p for p in left if (p[0], p[1]) not in done]
                if bad:
                    why.append(f"{self._remote.url} served {len(bad)} piece(s) that fail verification")
                    return left
        return left

    def _place(self, part: _Partial, batch: list[Piece], view: memoryview, shift: int = 0) -> list[Piece]:
        """Verify each piece of ``batch`` (laid end to end in ``view``; offsets relative to ``shift``)
        and copy those that match into the mapping; returns those that do not."""
        bad, pos = [], 0
        for b, e, d in batch:
            data = view[pos : pos + e - b]
            pos += e - b
            if piece_digest(data) != d:
                bad.append((b, e, d))
                continue
            part.map[b + shift : e + shift] = data
            with part.lock:
                part.arrived.add((b + shift, e + shift))
        return bad

    def _count(self, source: str, nbytes: int) -> None:
        with self._lock:
            self.report.bytes_from[source] += nbytes
            self.report.lazy_bytes += nbytes

    def _blame(self, peer: object, digest: str, what: str) -> None:
        session, pid = peer.session, peer.id  # type: ignore[attr-defined]
        with self._lock:
            if pid in self.excluded:
                return
            self.excluded.add(pid)
            self.report.rejected[session] += 1
        warnings.warn(f"paramstore: peer {session} served {what} of object {digest[:16]}… that fail verification: "
                      f"it is asked nothing more for version {self._step}", RuntimeWarning, stacklevel=3)


def _runs(pieces: list[Piece]) -> list[list[Piece]]:
    """``pieces`` (sorted) split where one does not start at the end of the one before."""
    out: list[list[Piece]] = []
    for p in pieces:
        if out and out[-1][-1][1] == p[0]:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def _batches(pieces: list[Piece]) -> list[list[Piece]]:
    """``pieces`` in groups of at most :data:`BATCH_BYTES` (a piece larger than that alone)."""
    out: list[list[Piece]] = []
    size = 0
    for p in pieces:
        n = p[1] - p[0]
        if not out or size + n > BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


def touched(sizes: Sequence[int], itemsize: int, start: Sequence[int], stop: Sequence[int]) -> list[tuple[int, int]]:
    """The byte ranges of a dense C-order tensor of shape ``sizes`` that the box ``[start, stop)``
    touches, at :data:`PIECE_SIZE` granularity (relative to the tensor's first byte; the larger
    pieces of objects written before are multiples of it): the box is a
    set of contiguous runs (along the dimensions it covers fully); where runs are shorter than a
    piece, each piece they touch gives one range inside it (which may cover more of the piece than
    the box does), so a box of a million rows makes a few ranges, not a million. The pieces these
    ranges meet are exactly the pieces the box touches.

    Example:
        >>> touched((4096, 4096), 4, (1024, 0), (2048, 4096)) == [(1024 * 16384, 2048 * 16384)]
        True
        >>> touched((4, 4), 4, (1, 1), (3, 2))  # two runs of one element, in one piece: one range
        [(20, 40)]
        >>> touched((4096, 4096), 4, (0, 0), (4096, 1)) == [(0, 4095 * 16384 + 4)]  # a column: every piece
        True
        >>> touched((2, 4 << 20), 4, (0, 0), (2, 1))  # the first element of each 16 MiB row: pieces 0 and 8
        [(0, 2097152), (16777216, 16777220)]
    """
    nd = len(sizes)
    if nd == 0:
        return [(0, itemsize)]
    if any(b >= e for b, e in zip(start, stop)):
        return []
    strides = [itemsize] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    k = nd - 1  # the box is full along every dimension after k
    while k > 0 and start[k] == 0 and stop[k] == sizes[k]:
        k -= 1
    run = (stop[k] - start[k]) * strides[k]
    count = 1
    for d in range(k):
        count *= stop[d] - start[d]
    first = sum(s * st for s, st in zip(start, strides))
    if count > _MAX_RUNS:
        last = sum((e - 1) * st for e, st in zip(stop, strides)) + itemsize
        return [(first, last)]
    import torch

    starts = torch.zeros(1, dtype=torch.int64)
    for d in range(k):
        starts = (starts[:, None] + torch.arange(start[d], stop[d], dtype=torch.int64) * strides[d]).reshape(-1)
    starts = starts + start[k] * strides[k] + sum(start[d] * strides[d] for d in range(k + 1, nd))
    if run >= PIECE_SIZE or count == 1:
        return _merge([(int(s), int(s) + run) for s in starts.tolist()])
    # many short runs: one range per (first piece, last piece) of each run, merged
    firsts = torch.div(starts, PIECE_SIZE, rounding_mode="floor")
    lasts = torch.div(starts + run - 1, PIECE_SIZE, rounding_mode="floor")
    ids = torch.unique(torch.cat([firsts, lasts])).tolist()
    lo, hi = int(starts[0]), int(starts[-1]) + run
    return _merge([(max(lo, i * PIECE_SIZE), min(hi, (i + 1) * PIECE_SIZE)) for i in ids])


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for b, e in sorted(ranges):
        if out and b <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((b, e))
    return out

