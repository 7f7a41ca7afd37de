"""The commit's hash threads: every tensor's digest, computed beside the copy that stages it.

A commit's bytes are hashed by :class:`HashQueue`'s threads (one per core, blake3 releasing the
GIL), in :class:`Unit` s: consecutive pieces of a large tensor (:func:`piece_spans`), or a batch
of small tensors of one slab. While a commit is being copied (:meth:`HashQueue.staging`)
only :func:`staging_hashers` of them run, so the copy keeps its core; :class:`EarlyHash` hands each
tensor to them as soon as its copy is done, so that on a host with a spare core the version is
hashed when its last byte is staged. :class:`Hashed` is a tensor's length and the futures of its
pieces' digests.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .format import piece_digest, pieces
from .format import Placement
from .staging import Slab

if TYPE_CHECKING:
    from .commit import _Job

__all__ = ["INLINE_HASH_BYTES", "UNIT_BYTES", "OVERLAP_HASH_MIN_CPUS", "Item", "Unit", "HashQueue", "EarlyHash",
           "Hashed", "staging_hashers", "hash_bytes", "piece_spans"]

#: Tensors under this many bytes are hashed in batches (one unit per ~1 MiB), or inline by the
#: publisher: handing each to a thread would cost more than hashing it.
INLINE_HASH_BYTES = 1 << 20
#: Bytes of a large tensor's consecutive pieces one unit hashes (each piece its own digest): 8 MiB,
#: four 2 MiB pieces. A unit per piece cost 4x the hand-offs (queue, future, wake-up) for the same
#: bytes; a unit takes a thread ~1.5 ms (blake3 of 8 MiB on one thread, measured on this 2-core host).
UNIT_BYTES = 8 << 20
#: Hosts with fewer cores than this copy CPU tensors into staging on the stager thread alone
#: (``memmove``, not torch's intra-op threads) and hash on all the other cores meanwhile; hosts
#: with at least this many keep torch's parallel copy and hash on half the cores while it runs.
#: Measured on 2 cores (1 GiB, bf16): the copy is memory-bound (one thread 56-59 ms, torch's two
#: 55 ms), blake3 is ~150 ms per GiB per thread; torch's two copy threads next to a hash thread made
#: commit -> staged ~108 ms (its threads wait for each other at every tensor), one copy thread next
#: to one hash thread ~65 ms, for commit -> visible ~120 ms against ~150 ms hashing after the copy.
OVERLAP_HASH_MIN_CPUS = 4


class Item:
    """The ``k``-th result of a future that returns a list (a batch of small tensors' digests)."""

    def __init__(self, future: Future, k: int) -> None:
        self.future, self.k = future, k

    def result(self) -> str:
        return self.future.result()[self.k]


class Unit:
    """Bytes of a slab to hash on one thread: a piece (or a tensor of one piece), or a batch of
    small tensors (``spans``: ``(offset, nbytes)`` each). ``future`` gets their digests."""

    __slots__ = ("slab", "spans", "future", "state")

    def __init__(self, slab: Slab, spans: list[tuple[int, int]]) -> None:
        self.slab, self.spans = slab, spans
        self.future: Future[list[str]] = Future()
        self.state = 0  # 0 queued, 1 taken by a hash thread, 2 cancelled (changed under the queue's lock)

    def run(self) -> None:
        try:
            self.future.set_result([hash_bytes(self.slab, o, n) for o, n in self.spans])
        except BaseException as e:  # noqa: BLE001 - delivered to whoever waits for the digests
            self.future.set_exception(e)


class HashQueue:
    """``threads`` hash threads taking :class:`Unit` s in order; while a commit is being copied
    (:meth:`staging`) at most ``while_staging`` of them hash at once (the stager holds a core),
    then all of them. ``while_staging`` 0 (one core): nothing is hashed while a copy runs.

    ``started_while_staging`` counts the units a thread took while a copy ran (for tests)."""

    def __init__(self, threads: int, while_staging: int) -> None:
        self.threads, self.while_staging = threads, while_staging
        self.started_while_staging = 0
        self._cv = threading.Condition()
        self._todo: collections.deque[Unit] = collections.deque()
        self._active = 0
        self._staging = 0
        self._closed = False
        self._workers = [threading.Thread(target=self._work, name=f"paramstore-hash-{k}", daemon=True)
                         for k in range(threads)]
        for w in self._workers:
            w.start()

    def put(self, units: list[Unit]) -> None:
        with self._cv:
            self._todo.extend(units)
            self._cv.notify(len(units))

    @contextlib.contextmanager
    def staging(self) -> Any:
        """While this is entered, hash on ``while_staging`` threads only."""
        with self._cv:
            self._staging += 1
        try:
            yield
        finally:
            with self._cv:
                self._staging -= 1
                self._cv.notify_all()

    def cancel(self, units: list[Unit]) -> list[Unit]:
        """Drop the units of ``units`` no thread has taken; returns those taken (wait for their futures)."""
        taken = []
        with self._cv:
            for u in units:
                if u.state == 0:
                    u.state = 2
                    u.future.cancel()
                elif u.state == 1:
                    taken.append(u)
        return taken

    def close(self) -> None:
        """Hash what is queued, then stop the threads."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for w in self._workers:
            w.join()

    def _work(self) -> None:
        while True:
            with self._cv:
                while True:
                    while self._todo and self._todo[0].state == 2:
                        self._todo.popleft()
                    limit = self.while_staging if self._staging else self.threads
                    if self._todo and self._active < limit:
                        break
                    if self._closed and not self._todo:
                        return
                    self._cv.wait()
                unit = self._todo.popleft()
                unit.state = 1
                self._active += 1
                if self._staging:
                    self.started_while_staging += 1
            try:
                unit.run()
            finally:
                with self._cv:
                    self._active -= 1
                    self._cv.notify()


class EarlyHash:
    """Hands each tensor of ``job`` to the hash threads as soon as its copy is done: each piece of
    a tensor of 1 MiB or more on its own, smaller tensors in batches of about 1 MiB (within a
    slab). Fills ``into`` (a tensor's key -> its :class:`Hashed`: ``job.early`` itself, keyed by
    (shard, placement), or by name until a streaming commit's shards are final) and ``job.units``."""

    def __init__(self, job: "_Job", hashers: HashQueue, into: dict) -> None:
        self._job, self._hashers, self._into = job, hashers, into
        self._batch: list[tuple[Any, Placement]] = []
        self._batch_bytes = 0
        self._slab: Slab | None = None

    def copied(self, key: Any, p: Placement, slab: Slab) -> None:
        if p.nbytes >= INLINE_HASH_BYTES:
            units = [Unit(slab, spans) for spans in piece_spans(p.offset, p.nbytes)]
            self._into[key] = Hashed(p.nbytes, [Item(u.future, k) for u in units for k in range(len(u.spans))])
            self._give(units)
            return
        if self._slab is not slab:
            self.flush()  # a batch reads one slab
        self._slab = slab
        self._batch.append((key, p))
        self._batch_bytes += p.nbytes
        if self._batch_bytes >= INLINE_HASH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Hand the batch of small tensors on (at the end of each shard, and when it reaches 1 MiB)."""
        if not self._batch:
            return
        unit = Unit(self._slab, [(p.offset, p.nbytes) for _, p in self._batch])  # type: ignore[arg-type]
        for k, (key, p) in enumerate(self._batch):
            self._into[key] = Hashed(p.nbytes, [Item(unit.future, k)])
        self._batch, self._batch_bytes = [], 0
        self._give([unit])

    def _give(self, units: list[Unit]) -> None:
        self._job.units += units
        self._hashers.put(units)


class Hashed:
    """A tensor being hashed during staging: its length and a future per piece."""

    def __init__(self, nbytes: int, parts: list[Any]) -> None:
        self.nbytes, self.parts = nbytes, parts

    def result(self) -> tuple[int, list[str]]:
        return self.nbytes, [f.result() for f in self.parts]


def piece_spans(offset: int, nbytes: int) -> list[list[tuple[int, int]]]:
    """The pieces of a tensor of ``nbytes`` bytes at ``offset`` (:func:`paramstore.format.pieces`),
    as ``(offset, nbytes)`` spans grouped into units of up to :data:`UNIT_BYTES` (at least one
    piece each), in order.

    Example:
        >>> [len(u) for u in piece_spans(64, 21 << 20)]  # 11 pieces of 2 MiB: 4 + 4 + 3
        [4, 4, 3]
    """
    spans = [(offset + b, e - b) for b, e in pieces(nbytes)]
    units: list[list[tuple[int, int]]] = []
    for s in spans:
        if units and sum(n for _, n in units[-1]) + s[1] <= UNIT_BYTES:
            units[-1].append(s)
        else:
            units.append([s])
    return units


def staging_hashers(cores: int) -> int:
    """Hash threads that run while a commit is copied: every core but the stager's on hosts with
    fewer than :data:`OVERLAP_HASH_MIN_CPUS` cores (none on one core: nothing to overlap), half
    of them on larger hosts (where torch's copy runs on several threads)."""
    return cores - 1 if cores < OVERLAP_HASH_MIN_CPUS else cores // 2


def hash_bytes(slab: Slab, offset: int, nbytes: int) -> str:
    """blake3 of ``nbytes`` bytes of ``slab`` at ``offset`` (a piece, or a tensor of one piece), on this thread."""
    with memoryview(slab.map) as mv:
        return piece_digest(mv[offset : offset + nbytes])
