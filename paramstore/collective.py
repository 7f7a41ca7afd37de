"""Collective checkout: one member of a process group sends a version, every member ends up with it.

Every member of a group (NCCL on GPUs, HCCL on Ascend, gloo on CPUs) calls
``store.checkout(version, group=pg, src=r)``; the store calls :func:`broadcast_version` with a
:class:`~paramstore.backends.transports.collective.Collective` over ``pg``. Each member has its own
store root (its host's shared memory); member ``src`` holds the version.

The protocol (every message is JSON as bytes, buffers are ``uint8``; nothing is pickled):

1. **Agree** (``all_gather_bytes``): each member says which rank it takes for the source and the
   protocol it speaks; members that disagree all fail (no mismatched collective is started).
2. **Offer** (``broadcast_bytes`` from ``src``): ``src`` resolves the version, leases it for the
   whole broadcast, and sends the version record, the manifest, the objects' sizes and the bucket
   size, or why it cannot (an unknown version, objects it lacks): then every member raises.
3. **Status** (``all_gather_bytes``): each receiver checks the manifest against the version digest
   and its objects' sizes (:func:`~paramstore.manifest.check_manifest`), checks that its own
   registry does not hold another version at that step, and says which objects its tier lacks, or
   its error. The union of what is lacking, sorted by digest, is what moves.
4. **Buckets** (``broadcast``): those objects' bytes, one after the other, cut into buckets of
   ``bucket_bytes``; an object larger than a bucket spans several, a bucket may hold the tail of
   one and the head of the next. A member that lacks an object copies its part of each bucket into
   a slab of the store's pool (on a CPU group, a bucket inside one object is received straight into
   the slab, and sent straight from the source's mapping); the others receive into a bounce
   buffer. Two buckets are in flight at once; the first bucket's worth goes in pieces that double,
   the last bucket's worth in pieces that halve (:func:`_bounds`). Each bucket that landed is
   hashed (its pieces, :class:`~paramstore.format.ObjectHasher`) on a helper thread while the next
   one is in flight; an object whose last byte arrived is then checked (its digest, and each tensor
   where the manifest places it); good ones are renamed into the local tier (their slabs unmapped
   afterwards, on another helper thread), bad ones are discarded, never placed.
5. **Outcome** (``all_gather_bytes``): if any member met a bad object or an error, every member
   raises :class:`~paramstore.errors.BroadcastError` naming the ranks and objects (objects that were
   verified and placed stay: they are content-addressed).
6. **Register**: each receiver whose registry lacks the version registers it (as a pull does: the
   objects and the tensor index, ``require_newest=False``), then a last ``all_gather_bytes`` makes a
   registration failure on any member fail every member.

Receivers hold their host's GC lock (shared) from the status round until the version is
registered, so GC cannot sweep objects placed but not yet referenced. A member that dies makes the
others' collectives fail (:class:`TorchCollective` spreads the failure to every member):
each raises BroadcastError, and its slabs are discarded.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Mapping


from .errors import BroadcastError, InvalidArgumentError, ParamStoreError, StepOrderError, VersionNotFoundError
from .format import ObjectHasher, loads
from .liveness import libc
from .manifest import MAX_MANIFEST_BYTES, Manifest, Version, check_manifest
from .objects import check_buffer, check_held, index_entries, read_manifest
from .reports import FetchReport
from .root import StoreRoot, VersionSpec
from .snapshot import MADV_POPULATE_READ  # Linux 5.14+ (elsewhere madvise fails and the send faults the pages itself)

from paramstore.backends.registries.base import check_digests
from paramstore.backends.transports.collective import MAX_MESSAGE_BYTES, Collective

if TYPE_CHECKING:
    import torch

    from .staging import Slab, SlabPool

__all__ = ["broadcast_version", "PROTOCOL", "DEFAULT_BUCKET_BYTES"]

#: The protocol version members compare in the first round (2: the first and last buckets are
#: cut by halvings, :func:`_bounds`).
PROTOCOL = 2

#: Bytes per bucket unless the caller says otherwise.
DEFAULT_BUCKET_BYTES = 64 << 20

#: The largest bucket a source may ask for: every receiver allocates two bounce buffers of
#: ``min(bucket, stream)`` bytes (on its device), so the source cannot choose more than this.
MAX_BUCKET_BYTES = 1 << 30

#: The longest message of the rounds that carry a few fields (hello; and, plus
#: :data:`REPLY_BYTES_PER_OBJECT` per object of the offer, status, outcome and registration): a
#: member that announces more fails the round before any member allocates it (world x its length).
SHORT_MESSAGE_BYTES = 1 << 20
#: Room per object of the offer in a reply (its digest in ``lack``, or its digest and reason in ``bad``).
REPLY_BYTES_PER_OBJECT = 512
#: The longest offer (version, manifest, sizes): twice the largest manifest a remote accepts.
MAX_OFFER_BYTES = 2 * MAX_MANIFEST_BYTES

_PAGE = os.sysconf("SC_PAGE_SIZE")


def broadcast_version(root: StoreRoot, pool: "SlabPool", coll: Collective, src: int, version: VersionSpec, *,
                      resolve: Callable[[VersionSpec], int], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> FetchReport:
    """Make version ``version`` of member ``src`` present and registered in every member's store.

    Called by every member of the group, with the same ``src`` (see the module docstring for the
    protocol). Only ``src``'s ``version``, ``resolve`` and ``bucket_bytes`` count.

    Args:
        root: this member's store.
        pool: this member's slab pool (destinations of received objects).
        coll: the group.
        src: the rank (in the group) of the member that holds the version.
        version: a step, ``"latest"`` or a tag, resolved on ``src``.
        resolve: ``src``'s resolver (the store's: it knows its remote).
        bucket_bytes: bytes per broadcast (``src``'s value is used by every member).

    Returns:
        A :class:`~paramstore.reports.FetchReport`: ``step``, ``local`` (objects this member already
        held), ``from_group`` (those it received, verified and placed), ``bytes_from["group:<src>"]``
        (their bytes) and ``seconds``. The caller leases ``report.step`` and maps it.

    Raises:
        InvalidArgumentError: ``src`` is not a rank of the group, or ``bucket_bytes`` is not a
            positive int (on every member that passes it: check arguments alike everywhere).
        BroadcastError: on every member, naming the rank(s) that failed and why: ``src`` could not
            resolve or does not hold the version, a member received bytes that do not match the
            manifest, a member died or left, members disagree on ``src``, a member could not
            register the version. Nothing that failed verification is placed anywhere.

    Example:
        >>> import torch.distributed as dist
        >>> from paramstore.backends.transports.collective import TorchCollective
        >>> from paramstore.collective import broadcast_version
        >>> dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
        >>> report = broadcast_version(store._root, store._pool, TorchCollective(), 0, "latest",
        ...                            resolve=store._read.resolve)
        >>> report.step, report.local, report.from_group, dict(report.bytes_from)
        (1, 1, [], {})
        >>> dist.destroy_process_group()
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or not 1 <= bucket_bytes <= MAX_BUCKET_BYTES:
        raise InvalidArgumentError(f"bucket_bytes must be an int in [1, {MAX_BUCKET_BYTES}], got {bucket_bytes!r}")
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < coll.size:
        raise InvalidArgumentError(f"src must be a rank of the group (0..{coll.size - 1}), got {src!r}")
    t0 = time.monotonic()
    try:
        return _Broadcast(root, pool, coll, src, bucket_bytes).run(version, resolve, t0)
    except BroadcastError:  # raised on every member alike (or the group is broken already)
        raise
    except BaseException as e:  # a bug or an interrupt mid-protocol: the others must not wait for us
        coll.abort(f"{type(e).__name__}: {e}")
        raise


class _Broadcast:
    """One collective checkout on one member."""

    def __init__(self, root: StoreRoot, pool: "SlabPool", coll: Collective, src: int, bucket_bytes: int) -> None:
        self.root, self.pool, self.coll, self.src, self.bucket_bytes = root, pool, coll, src, bucket_bytes
        self.rank = coll.rank
        self.is_src = self.rank == src
        self.objects = 0  # objects in the offer (the same on every member): bounds the replies

    # -- the rounds --------------------------------------------------------------------------
    def run(self, version: VersionSpec, resolve: Callable[[VersionSpec], int], t0: float) -> FetchReport:
        self._agree()
        lease: str | None = None
        try:
            if self.is_src:
                offer, lease = self._offer(version, resolve)
            got = _decode(self.coll.broadcast_bytes(_encode(offer) if self.is_src else None, self.src,
                                                    limit=MAX_OFFER_BYTES), f"rank {self.src}'s offer")
            if "error" in got:
                raise BroadcastError(f"collective checkout of {version!r}: the source, rank {self.src}, cannot "
                                     f"send it: {got['error']}", rank=self.src)
            return self._transfer(got, t0)
        finally:
            if lease is not None:
                with contextlib.suppress(ParamStoreError, OSError):
                    self.root.registry.release_lease(lease)

    def _agree(self) -> None:
        mine = {"src": self.src, "protocol": PROTOCOL}
        hello = self.coll.all_gather_bytes(_encode(mine), limit=SHORT_MESSAGE_BYTES)
        views = [_decode(b, f"rank {r}'s hello") for r, b in enumerate(hello)]
        odd = [r for r, v in enumerate(views) if v != mine]
        if odd:
            said = "; ".join(f"rank {r}: src {views[r].get('src')!r}, protocol {views[r].get('protocol')!r}"
                             for r in odd[:8])
            raise BroadcastError(f"members of the group disagree on the collective checkout: rank {self.rank} "
                                 f"takes src {self.src} (protocol {PROTOCOL}), but {said}", rank=odd[0])

    def _offer(self, version: VersionSpec, resolve: Callable[[VersionSpec], int]) -> tuple[dict[str, Any], str | None]:
        """What ``src`` sends: the version, manifest, sizes and bucket size, or its error."""
        try:
            step = resolve(version)
            reg = self.root.registry
            lease = reg.acquire_lease(step, f"collective checkout (pid {os.getpid()})").id
        except ParamStoreError as e:
            return {"error": f"{type(e).__name__}: {e}"}, None
        try:
            v = reg.get_version(step)
            manifest = read_manifest(self.root, step)
            objects = sorted(manifest.objects())
            sizes = reg.object_sizes(objects)
            lacking = [o for o in objects if o not in sizes or not self.root.tier.exists(o)]
            if lacking:
                raise ParamStoreError(f"its store lacks {len(lacking)} object(s) of version {step} "
                                      f"({lacking[0][:12]}…): check the version out there first")
            wrong = [o for o in objects if self.root.tier.size(o) != sizes[o]]
            if wrong:
                raise ParamStoreError(f"object {wrong[0]} of version {step} is {self.root.tier.size(wrong[0])} bytes "
                                      f"in its store, its registry says {sizes[wrong[0]]}: run `paramstore verify`")
        except ParamStoreError as e:
            with contextlib.suppress(ParamStoreError, OSError):
                reg.release_lease(lease)
            return {"error": f"{type(e).__name__}: {e}"}, None
        return {"version": v.to_json(), "manifest": manifest.to_json(), "sizes": sizes,
                "bucket_bytes": self.bucket_bytes}, lease

    def _transfer(self, offer: Mapping[str, Any], t0: float) -> FetchReport:
        offered = offer.get("sizes")
        self.objects = len(offered) if isinstance(offered, dict) else 0
        # -- status: check the offer, say what is lacking -----------------------------------------
        status: dict[str, Any]
        manifest: Manifest | None = None
        version: Version | None = None
        sizes: dict[str, int] = {}
        registered = self.is_src
        try:
            version, manifest, sizes, bucket = _parse_offer(offer, self.src)
            if not self.is_src:
                registered = self._registered(version)
            lack = [] if self.is_src else [o for o in sorted(sizes) if not self.root.tier.exists(o)]
            status = {"lack": lack}
        except ParamStoreError as e:
            status = {"error": f"{type(e).__name__}: {e}"}
        with self.root.gc_lock() if not self.is_src else contextlib.nullcontext():
            statuses = self._exchange(status, "status")
            self._raise_errors(statuses, _offer_step(offer), "could not take part")
            assert version is not None and manifest is not None
            wanted = set(sizes)
            plan = sorted({o for s in statuses for o in s.get("lack", []) if o in wanted})
            mine = set(status["lack"])
            report = FetchReport(version.step, local=len(sizes) - len(mine))
            outcome = _Buckets(self, manifest, sizes, plan, mine, bucket).run()
            report.from_group = sorted(outcome["placed"])
            if report.from_group:
                report.bytes_from[f"group:{self.src}"] = sum(sizes[o] for o in report.from_group)
            # -- outcome: every member verified what it received? --------------------------------
            results = self._exchange({k: outcome[k] for k in ("bad", "error") if outcome.get(k)}, "outcome")
            self._raise_errors(results, version.step, "failed")
            # -- register ------------------------------------------------------------------------
            done: dict[str, Any] = {}
            if not registered:
                try:
                    self._register(version, manifest, sizes, skip=set(report.from_group))
                except ParamStoreError as e:
                    done = {"error": f"registering the version failed: {type(e).__name__}: {e}"}
            self._raise_errors(self._exchange(done, "registration"), version.step, "failed")
        if plan and not self.is_src:
            with contextlib.suppress(ParamStoreError, OSError):  # destinations for the next version (same layout)
                self.pool.prepare([sizes[o] for o in sorted(sizes)], purpose="fetch")
        report.seconds = time.monotonic() - t0
        return report

    def _exchange(self, mine: Mapping[str, Any], what: str) -> list[dict[str, Any]]:
        """Every member's reply of round ``what``, each at most :func:`_reply_limit` bytes."""
        limit = _reply_limit(self.objects)
        return [_reply(_decode(b, f"rank {r}'s {what}"), r, what)
                for r, b in enumerate(self.coll.all_gather_bytes(_encode(mine), limit=limit))]

    def _raise_errors(self, statuses: list[dict[str, Any]], step: Any, verb: str) -> None:
        failed = [(r, s) for r, s in enumerate(statuses) if s.get("error") or s.get("bad")]
        if not failed:
            return
        parts = []
        for r, s in failed[:8]:
            why = []
            if s.get("bad"):
                bad = s["bad"]
                first = sorted(bad)[0]
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                why.append(f"object {first} received from rank {self.src} does not match the manifest "
                           f"({bad[first]}){more}; not placed")
            if s.get("error"):
                why.append(str(s["error"]))
            parts.append(f"rank {r}: {'; '.join(why)}")
        more = f" (and {len(failed) - 8} more ranks)" if len(failed) > 8 else ""
        raise BroadcastError(f"collective checkout of version {step} from rank {self.src} {verb} on "
                             f"{len(failed)} rank(s): {' | '.join(parts)}{more}", rank=failed[0][0])

    # -- this member's registry ---------------------------------------------------------------
    def _registered(self, version: Version) -> bool:
        """Whether the local registry holds ``version`` already (ParamStoreError: another version
        at that step)."""
        try:
            here = self.root.registry.get_version(version.step)
        except VersionNotFoundError:
            return False
        if here.digest != version.digest:
            raise ParamStoreError(f"this store holds another version at step {version.step} (digest "
                                  f"{here.digest[:16]}…, the source's {version.digest[:16]}…): a different run?")
        return True

    def _register(self, version: Version, manifest: Manifest, sizes: Mapping[str, int], skip: set[str]) -> None:
        """Register ``version`` here, as a pull does (objects, tensor index; not necessarily the
        newest). The manifest's pieces in objects this host held before are checked first."""
        check_held(self.root, manifest, sizes, skip, f"version {version.step} from rank {self.src}")
        objects, tensors = index_entries(manifest, sizes)
        try:
            self.root.registry.publish(version, manifest, objects, tensors, require_newest=False)
        except StepOrderError:
            self._registered(version)  # registered meanwhile by another process of this host: the same one?
            # (raises ParamStoreError if a different version took the step)


def _offer_step(offer: Mapping[str, Any]) -> Any:
    """The step an offer names, for messages ("?" if it is malformed)."""
    v = offer.get("version")
    return v.get("step", "?") if isinstance(v, Mapping) else "?"


class _Buckets:
    """Phase 4 on one member: the bucket loop, verification and placement."""

    def __init__(self, b: _Broadcast, manifest: Manifest, sizes: Mapping[str, int], plan: list[str],
                 mine: set[str], bucket_bytes: int) -> None:
        self.b, self.coll, self.sizes, self.plan, self.mine = b, b.coll, sizes, plan, mine
        self.bucket = bucket_bytes
        self.starts: list[int] = []
        pos = 0
        for o in plan:
            self.starts.append(pos)
            pos += sizes[o]
        self.total = pos
        self.spans = manifest.spans()
        self.error: str | None = None  # this member's first local error (it keeps taking part)
        self.slabs: dict[str, "Slab"] = {}
        self.views: dict[str, "torch.Tensor"] = {}  # object -> its bytes (slab or source mapping)
        self.maps: list[Any] = []
        self.lent = contextlib.ExitStack()  # source: the pool's own mappings of objects it committed
        self.faulted: set[str] = set()  # source: objects sent from such a mapping (nothing to populate)
        self.checks: dict[str, Future[str | None]] = {}
        self.hashing: dict[str, _InOrder] = {}

    def run(self) -> dict[str, Any]:
        import torch

        if not self.plan:
            return {"placed": []}
        placed: list[str] = []
        bad: dict[str, str] = {}
        hashers = ThreadPoolExecutor(1, thread_name_prefix="paramstore-bcast-verify")
        streamed = False  # every bucket went by: from then on a local error is reported, not raised
        try:
            self._open()
            bounds = _bounds(self.total, self.bucket)
            n = len(bounds)
            size = min(self.bucket, self.total)
            bounce = [torch.empty(size, dtype=torch.uint8, device=self.coll.device) for _ in range(min(2, n))]
            direct_ok = self.coll.device.type == "cpu"
            pending: list[Any] = [None] * len(bounce)
            landing: list[Any] = [None] * len(bounce)

            def start(i: int) -> None:
                k = i % len(bounce)
                lo, hi = bounds[i]
                pieces = self._pieces(lo, hi)
                target = None
                if direct_ok and len(pieces) == 1 and pieces[0][0] in self.views:
                    o, a, b, _ = pieces[0]
                    target = self.views[o][a:b]  # straight from the source's mapping / into the slab
                if target is None:
                    target = bounce[k][: hi - lo]
                    if self.b.is_src:
                        self._pack(pieces, target, lo)
                landing[k] = (pieces, target, lo, target.data_ptr() == bounce[k].data_ptr())
                pending[k] = self.coll.broadcast(target, self.b.src, async_op=True)

            if self.b.is_src:
                self._populate(*bounds[0])
                for i in range(n):
                    k = i % len(bounce)
                    if pending[k] is not None:
                        pending[k].wait()
                    start(i)
                    if i + 1 < n:  # map the next bucket's pages while this one goes out
                        self._populate(*bounds[i + 1])
                for p in pending:
                    if p is not None:
                        p.wait()
                streamed = True
                return {"placed": []}
            start(0)
            for i in range(n):
                k = i % len(bounce)
                if i + 1 < n:
                    start(i + 1)
                pending[k].wait()
                pending[k] = None
                pieces, target, lo, bounced = landing[k]
                landing[k] = None
                self._unpack(pieces, target, lo, bounced, hashers)
                del target  # (a view of a slab: placing unmaps it)
            streamed = True
            for o in sorted(self.mine):
                if o not in self.checks and o in self.slabs:  # (a local error kept it from completing)
                    bad.setdefault(o, "not every byte was received")
            for o, f in sorted(self.checks.items()):
                why = f.result()
                if why is None:
                    placed.append(o)
                else:
                    bad[o] = why
            for h in self.hashing.values():
                h.release()
            self._release_views()
            for o in placed:  # verified: placed while still mapped; unmapped afterwards, off this path
                slab = self.slabs.pop(o)
                try:
                    self.b.root.tier.put(o, slab.path, move=True)
                finally:
                    self.b.pool.retire_later(slab)
        except (ParamStoreError, OSError) as e:
            if isinstance(e, BroadcastError) or not streamed:
                raise  # mid-stream: the others are still in buckets (broadcast_version aborts the group)
            self.error = self.error or f"{type(e).__name__}: {e}"  # placing: reported in the outcome round
        finally:
            hashers.shutdown(wait=True)
            for h in self.hashing.values():
                h.release()
            self._release_views()
            for slab in self.slabs.values():  # anything not placed: never published
                with contextlib.suppress(BufferError):
                    slab.close()  # (a broadcast abandoned after a failure may still hold it: left mapped)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(slab.path)
            self.slabs.clear()
            for m in self.maps:
                with contextlib.suppress(BufferError):
                    m.close()
            with contextlib.suppress(BufferError):
                self.lent.close()
        out: dict[str, Any] = {"placed": placed}
        if bad:
            out["bad"] = bad
        if self.error:
            out["error"] = self.error
        return out

    def _open(self) -> None:
        """Source: map the objects it sends. Receiver: a slab for each object it lacks."""
        import torch

        if self.b.is_src:
            for o in self.plan:
                # an object this process committed: the pool still maps its slab, pages faulted
                m = self.lent.enter_context(self.b.pool.lent(self.b.root.tier.object_path(o)))
                if m is not None:
                    self.faulted.add(o)
                else:
                    m = self.b.root.tier.map(o, private=True)  # copy-on-write: writable for torch, never written
                    self.maps.append(m)
                self.views[o] = torch.frombuffer(m, dtype=torch.uint8)[: self.sizes[o]]
            return
        try:
            for o in self.plan:
                if o in self.mine:
                    slab = self.b.pool.take(self.sizes[o])
                    self.slabs[o] = slab
                    self.views[o] = torch.frombuffer(slab.map, dtype=torch.uint8)[: self.sizes[o]]
                    self.hashing[o] = _InOrder(o, slab.map, self.sizes[o], self.spans.get(o, {}))
        except ParamStoreError as e:  # e.g. the tmpfs is full: keep taking part, report it at the end
            self.error = f"{type(e).__name__}: {e}"
            self._release_views()

    def _release_views(self) -> None:
        self.views.clear()

    def _populate(self, lo: int, hi: int) -> None:
        """Source: fault in the pages of stream bytes ``[lo, hi)`` of its mappings now
        (``madvise(MADV_POPULATE_READ)``, GIL released), instead of inside the send."""
        madvise = libc().madvise
        for o, a, b, _ in self._pieces(lo, hi):
            view = self.views.get(o)
            if view is None or o in self.faulted:
                continue
            start = view.data_ptr() + a
            aligned = start - start % _PAGE
            madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(start + (b - a) - aligned), MADV_POPULATE_READ)

    def _pieces(self, lo: int, hi: int) -> list[tuple[str, int, int, int]]:
        """The parts of objects in stream bytes ``[lo, hi)``: ``(object, begin, end, stream start)``."""
        import bisect

        out = []
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while i < len(self.plan) and self.starts[i] < hi:
            o, s = self.plan[i], self.starts[i]
            a, b = max(lo, s) - s, min(hi, s + self.sizes[o]) - s
            if b > a:
                out.append((o, a, b, s + a))
            i += 1
        return out

    def _pack(self, pieces: list[tuple[str, int, int, int]], target: "torch.Tensor", lo: int) -> None:
        for o, a, b, at in pieces:
            target[at - lo: at - lo + b - a].copy_(self.views[o][a:b])

    def _unpack(self, pieces: list[tuple[str, int, int, int]], target: "torch.Tensor", lo: int, bounced: bool,
                hashers: ThreadPoolExecutor) -> None:
        for o, a, b, at in pieces:
            view = self.views.get(o)
            if view is None:
                continue  # not lacking here (or no slab: a local error)
            if bounced:
                view[a:b].copy_(target[at - lo: at - lo + b - a])
            # hash what arrived while the next buckets arrive (one helper thread: in order)
            hashers.submit(self.hashing[o].upto, b)
            if b == self.sizes[o]:  # its last byte
                self.checks[o] = hashers.submit(self._check, o)

    def _check(self, o: str) -> str | None:
        """Why object ``o`` as received is not the one the manifest names, or None."""
        if self.hashing[o].result() is None:
            return None
        with memoryview(self.slabs[o].map) as buf:  # say why the way verify does (one more pass)
            return check_buffer(o, buf[: self.sizes[o]], self.spans.get(o, {})) or self.hashing[o].result()


#: The first and the last bucket of the stream are each cut into up to this many halvings: the
#: first in pieces growing from 1/32 of a bucket (the source maps, and a receiver starts hashing,
#: after a small one), the last in pieces shrinking to 1/32 (what a receiver hashes after the last
#: one lands is a small piece). No piece is cut below :data:`MIN_PIECE`.
SPLITS = 5
#: The smallest piece :func:`_bounds` cuts a first or last bucket into.
MIN_PIECE = 1 << 20


def _halvings(length: int) -> list[int]:
    """``length`` bytes as pieces each half the rest (at most :data:`SPLITS` cuts, none below
    :data:`MIN_PIECE`), largest first; they add up to ``length``."""
    out, rest = [], length
    while len(out) < SPLITS and rest >= 2 * MIN_PIECE:
        half = rest // 2
        out.append(rest - half)
        rest = half
    return out + [rest]


def _bounds(total: int, bucket: int) -> list[tuple[int, int]]:
    """The broadcasts of a stream of ``total`` bytes, ``[lo, hi)`` each: ``bucket`` bytes each, but
    the first bucket cut into pieces that grow and the last into pieces that shrink
    (:func:`_halvings`; a stream of less than two buckets: its first half and the rest). The same
    on every member (a function of the offer).

    Example:
        >>> [(hi - lo) >> 20 for lo, hi in _bounds(256 << 20, 64 << 20)]
        [2, 2, 4, 8, 16, 32, 64, 64, 32, 16, 8, 4, 2, 2]
        >>> [(hi - lo) >> 20 for lo, hi in _bounds(10 << 20, 4 << 20)]
        [1, 1, 2, 2, 2, 1, 1]
        >>> _bounds(100, 64)
        [(0, 50), (50, 100)]
        >>> _bounds(1, 64)
        [(0, 1)]
    """
    head = min(bucket, total // 2)
    tail = min(bucket, total - head)
    sizes = _halvings(head)[::-1] if head else []
    middle = total - head - tail
    sizes += [min(bucket, middle - m) for m in range(0, middle, bucket)]
    sizes += _halvings(tail)
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    assert lo == total
    return out


class _InOrder:
    """An object's digest and tensor digests, hashed as its bytes arrive front to back.

    :meth:`upto` (called in order, on one thread) hashes each tensor as far as the arrived bytes
    reach, so when the last bucket lands only its bytes are left. :meth:`result` then checks what
    :func:`~paramstore.objects.check_buffer` checks: the object digest (header and every tensor) and
    each tensor the manifest places in the object (``spans``: ``(begin, end) -> digest``).
    """

    def __init__(self, digest: str, buf: Any, size: int, spans: Mapping[tuple[int, int], str]) -> None:
        self.base = memoryview(buf)
        self.digest, self.mv, self.size, self.want = digest, self.base[:size], size, dict(spans)
        # pieces (format.ObjectHasher) hashed side by side, a thread per core, as buckets land
        self.hasher = ObjectHasher(self.mv, parallel=True)
        self.reached = 0

    def upto(self, end: int) -> None:
        """Bytes ``[0, end)`` are final."""
        end = min(end, self.size)
        if end > self.reached:
            self.hasher.arrived(self.reached, end)
        self.reached = max(self.reached, end)

    def result(self) -> str | None:
        """None if every byte arrived and matches; else why not."""
        try:
            got = self.hasher.tensor_digests()
        except ValueError as e:
            return str(e) if str(e).startswith("malformed") else "not every byte was received"
        digest = self.hasher.digest()
        if digest != self.digest:
            return f"bytes hash to {digest}"
        bad = [f"{b}..{e}" for (b, e), d in sorted(self.want.items()) if got.get((b, e)) != d]
        return f"tensor digests differ from the manifest at bytes {', '.join(bad[:5])}" if bad else None

    def release(self) -> None:
        """Let go of the buffer (before it is unmapped)."""
        self.mv.release()
        self.base.release()


def _parse_offer(offer: Mapping[str, Any], src: int) -> tuple[Version, Manifest, dict[str, int], int]:
    """The offer's version, manifest, sizes and bucket size, checked (ParamStoreError otherwise)."""
    where = f"received from rank {src}"
    try:
        version = Version.from_json(offer["version"])
        manifest = Manifest.from_json(offer["manifest"])
        sizes = offer["sizes"]
        bucket = offer["bucket_bytes"]
    except (KeyError, TypeError) as e:
        raise ParamStoreError(f"the offer {where} is malformed ({e!r})") from None
    if not isinstance(sizes, dict) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                              for n in sizes.values()):
        raise ParamStoreError(f"the offer {where} has bad object sizes")
    if isinstance(bucket, bool) or not isinstance(bucket, int) or not 1 <= bucket <= MAX_BUCKET_BYTES:
        raise ParamStoreError(f"the offer {where} has a bad bucket size {bucket!r} (1 to {MAX_BUCKET_BYTES})")
    check_digests(sizes)
    check_manifest(manifest, version, sizes, where=where)
    return version, manifest, dict(sizes), bucket


def _reply_limit(objects: int) -> int:
    """The longest reply of the status, outcome and registration rounds, for an offer of ``objects``
    objects (the same on every member: the offer is)."""
    return min(MAX_MESSAGE_BYTES, SHORT_MESSAGE_BYTES + REPLY_BYTES_PER_OBJECT * objects)


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _reply(msg: dict[str, Any], rank: int, what: str) -> dict[str, Any]:
    """A member's reply if the fields a round reads have their types (``lack``: digests, ``bad``:
    digest -> why, ``error``: text); else an error naming the member, which fails the round."""
    lack, bad, error = msg.get("lack", []), msg.get("bad", {}), msg.get("error", "")
    if isinstance(lack, list) and all(isinstance(o, str) for o in lack) and isinstance(bad, dict) \
            and all(isinstance(v, str) for v in bad.values()) and isinstance(error, str):
        return msg
    return {"error": f"rank {rank} sent a malformed {what}"}


def _decode(data: bytes, what: str) -> dict[str, Any]:
    try:
        return loads(data, dict, what)
    except ValueError as e:  # not JSON, nested too deeply, or not an object
        raise BroadcastError(str(e)) from None
