"""The checkout path: where a byte comes from between ``store.checkout`` and a zero-copy snapshot.

1. **Resolve and lease.** The version named by a step, ``"latest"``, a tag or ``min_step`` is
   resolved and leased in one registry transaction (:meth:`Registry.acquire_lease`): from then on
   no prune removes it. A version pruned between resolving and leasing is resolved again; one found
   only in the remote tier is pulled first (verified).
2. **Obtain the bytes** (:class:`Fetcher`): objects the host's shared-memory tier already holds
   are used as they are. Objects it lacks (a version committed on another host of a shared
   registry) come from the peers that announced them (:func:`paramstore.peer.fetch`: slices read
   through the transfer engine straight into pre-faulted slabs, hashed as they arrive, renamed into
   place only if the digest matches), then from the remote tier (downloaded, re-hashed, placed).
   What moved is described by a :class:`~paramstore.reports.FetchReport`, which the snapshot carries (``snap.fetch``).
3. **Map.** :class:`~paramstore.snapshot.Snapshot` maps each object copy-on-write and views every
   tensor in place: no copy. Each object's header and size are checked against the manifest as it
   is mapped (an object truncated beforehand raises CorruptObjectError, not a short view or a SIGBUS), but
   objects already on this host are **not re-hashed**: that would read every byte, which is what
   zero-copy checkout avoids. Bytes that came from peers or the remote were hashed on arrival.
4. **Verify** (only with ``checkout(v, verify=True)``): one blake3 pass over the mapped objects.
   A damaged object is quarantined (moved to ``<root>/quarantine/``, dropped from the dedup index)
   and CorruptObjectError names it and the version; ``paramstore verify --repair`` then fetches a
   good copy.

An object nobody can deliver raises :class:`~paramstore.errors.ObjectUnavailableError`, which
names the object and says what to start.
"""

from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING, Callable, Iterable, Mapping


from .errors import (
    CorruptObjectError,
    InvalidArgumentError,
    ObjectUnavailableError,
    ParamStoreError,
    TransferError,
    VersionNotFoundError,
)
from .delta import fetch_by_patches, rebuild_all
from .lazy import LazyReads
from .manifest import Manifest, TensorEntry, object_piece_spans, object_spans
from .objects import quarantine, read_manifest
from .peer import fetch as peer_fetch
from .reports import FetchReport, TransferReport
from .root import StoreRoot, VersionSpec
from .validate import check_bound, check_timeout

if TYPE_CHECKING:
    from paramstore.backends.registries.base import Registry
    from paramstore.backends.transports.base import Transport

    from .peer import PeerServer
    from .remote import Remote
    from .snapshot import Snapshot
    from .staging import SlabPool

__all__ = ["Fetcher", "map_version", "release_lease", "check_checkout_args"]


class Fetcher:
    """Obtains the objects of a version this host lacks from an ordered list of sources.

    :attr:`sources`: rebuilt from patches against a version this host holds (with ``patches``),
    read from peers, downloaded from the remote (when there is one). Each source is given what is
    still missing and places what it can, verified; the next one gets the rest. A peer caught
    serving bad bytes (named in the report's ``rejected``) is asked nothing more in that fetch, by
    any source: they share one set of excluded peers, made for each :meth:`fetch`.

    Args:
        root: the host's store.
        pool: the store's slab pool (fetch destinations are pre-faulted slabs).
        remote: the remote tier, if any.
        transport: called to get this process's transport when a peer fetch is needed (started
            lazily: a store that never fetches from peers never starts a transfer engine).
        server: called to get this process's peer server, if it runs one (fetched objects are
            then served to other hosts at once).
        prepare_buffers: after objects arrived from peers or patches, prepare slabs for the next
            version of the same layout; without it, rebuilds from patches take no slab (they write
            new files: the least CPU, see :func:`paramstore.delta.rebuild`).
        patches: first rebuild what patches can (:func:`paramstore.delta.fetch_by_patches`; the
            derived objects of a recipe too, :meth:`elsewhere`).
    """

    def __init__(self, root: StoreRoot, pool: "SlabPool", *, remote: "Remote | None",
                 transport: Callable[[], "Transport"], server: Callable[[], "PeerServer | None"],
                 prepare_buffers: bool = True, patches: bool = False) -> None:
        self._root, self._pool, self._remote = root, pool, remote
        self._transport, self._server, self._prepare = transport, server, prepare_buffers
        self._patches = patches
        #: Where objects come from, in order: ``source(step, manifest, missing, report, excluded)``
        #: places what it can (asking no peer whose id is in ``excluded``, and adding those it
        #: catches serving bad bytes) and returns an error worth naming if nothing more comes, else None.
        self.sources: list[Callable[[int, Manifest, list[str], FetchReport, set[str]], Exception | None]] = [
            *([self._from_patches] if patches else []), self._from_peers,
            *([self._from_remote] if remote is not None else [])]

    def fetch(self, step: int, manifest: Manifest) -> FetchReport:
        """Make every object of ``manifest`` present in the local tier (the caller holds a lease).

        Raises:
            ObjectUnavailableError: some object is on no live peer and not in the remote.
            CorruptObjectError: the remote holds a damaged copy (nothing damaged is placed).
        """
        t0 = time.monotonic()
        tier = self._root.tier
        objects = sorted(manifest.objects())
        missing = [o for o in objects if not tier.exists(o)]
        report = FetchReport(step, local=len(objects) - len(missing))
        errors: list[Exception] = []
        excluded: set[str] = set()  # peers caught serving bad bytes: not asked again for this version
        for source in self.sources:
            if not missing:
                break
            error = source(step, manifest, missing, report, excluded)
            errors += [error] if error is not None else []
            missing = [o for o in missing if not tier.exists(o)]
        if self._prepare and (report.from_peers or report.from_patches):
            # destinations for the next version (same layout), faulted in the background
            self._pool.prepare(list(tier.sizes(objects).values()), purpose="fetch")
        report.seconds = time.monotonic() - t0
        if missing:
            message = _unavailable(self._root, step, missing, self._remote is not None)
            message += "".join(f" ({e})" for e in errors)
            raise ObjectUnavailableError(message) from (errors[0] if errors else None)
        return report

    def lazy(self, step: int, manifest: Manifest, report: FetchReport) -> "LazyReads":
        """What a lazy checkout of leased version ``step`` reads the pieces of the objects this host
        lacks with (:mod:`paramstore.lazy`): from the peers that hold them, then the remote; nothing is
        fetched now. ``report`` (the snapshot's) gets what those reads move."""
        return LazyReads(self._root, step, manifest, report, transport=self._transport, server=self._server,
                         remote=self._remote)

    @property
    def write_pool(self) -> "SlabPool | None":
        """Where objects made on this host (rebuilt from patches, derived) are written: the store's
        slab pool when it prepares buffers (its slabs faulted in the background: the fastest), else
        None (new files: the least CPU, no slab faulted, no page tables set up and torn down; see
        :func:`paramstore.delta.rebuild`, :func:`paramstore.derived.derive_manifest`)."""
        return self._pool if self._prepare else None

    def elsewhere(self, report: FetchReport | None) -> "_Elsewhere":
        """Where a derivation (:mod:`paramstore.derived`) finds what another host made: derived
        records in the remote, derived objects on peers, then in the remote (bytes counted in
        ``report``)."""
        return _Elsewhere(self, report if report is not None else FetchReport(0))

    def _from_patches(self, step: int, manifest: Manifest, missing: list[str], report: FetchReport,
                      excluded: set[str]) -> None:
        fetch_by_patches(self._root, self.write_pool, step, manifest, report,
                         functools.partial(self._get, report, excluded))

    def _from_peers(self, step: int, manifest: Manifest, missing: list[str], report: FetchReport,
                    excluded: set[str]) -> Exception | None:
        reg = self._root.registry
        if not reg.holders(missing, limit=1):  # nobody holds any of it whole: no relay has a source either
            return None
        spans = manifest.spans()
        extents = {o: max(end for _, end in spans[o]) for o in missing if spans[o]}
        try:
            peer_fetch(self._root, self._transport(), reg.object_sizes(missing), pool=self._pool, report=report,
                       server=self._server(), extents=extents, excluded=excluded, spans=spans,
                       pieces=manifest.piece_spans())
        except TransferError as e:  # e.g. no transfer engine on this host: the remote may still serve it
            error = TransferError(f"the peer fetch failed: {e}")
            error.__cause__ = e
            return error
        return None

    def _from_remote(self, step: int, manifest: Manifest, missing: list[str], report: FetchReport,
                     excluded: set[str]) -> None:
        assert self._remote is not None
        try:
            got = self._remote.fetch(self._root, step)
        except VersionNotFoundError:
            return None
        if got is not None:
            report.from_remote = list(got.moved)
            report.from_patches += got.from_patches
            report.patch_bytes += got.patch_bytes
            if got.bytes:
                report.bytes_from[self._remote.url] += got.bytes
        return None

    def _get(self, report: FetchReport, excluded: set[str], sizes: "dict[str, int]",
             spans: "Mapping[str, Mapping[tuple[int, int], str]] | None" = None,
             pieces: "Mapping[str, Mapping[tuple[int, int], str]] | None" = None) -> int:
        """Move these objects (patches, derived objects) here from peers, none from a peer in
        ``excluded``; returns the bytes moved (counted per peer in ``report.bytes_from``). What no
        peer delivers is simply not here afterwards. ``spans``, ``pieces``: the digests of their
        tensors and pieces where known (:func:`paramstore.peer.fetch`)."""
        if not self._root.registry.holders(sizes, limit=1):
            return 0
        sub = FetchReport(report.step)
        try:
            peer_fetch(self._root, self._transport(), sizes, pool=self._pool, report=sub, server=self._server(),
                       excluded=excluded, spans=spans, pieces=pieces)
        except TransferError:
            pass  # no transfer engine here: the objects move whole from the remote, if any
        report.bytes_from.update(sub.bytes_from)
        report.rejected.update(sub.rejected)
        report.failed.update(sub.failed)
        return sub.bytes


class _Elsewhere:
    """:class:`paramstore.derived.Elsewhere` for one checkout: its fetcher's peers and remote."""

    def __init__(self, fetcher: Fetcher, report: FetchReport) -> None:
        self._fetcher, self._report = fetcher, report

    def record(self, key: str) -> bytes | None:
        remote = self._fetcher._remote
        return None if remote is None else remote.derived_record(key)

    def patches(self, todo: "dict[str, tuple[str, int]]", wanted: "dict[str, int]") -> None:
        f = self._fetcher
        if not f._patches:
            return  # this store moves whole objects
        rebuild_all(f._root, f.write_pool, todo, wanted, self._report,
                    functools.partial(f._get, self._report, set()))

    def objects(self, sizes: "dict[str, int]", entries: "Iterable[TensorEntry]" = ()) -> None:
        f, tier = self._fetcher, self._fetcher._root.tier
        entries = list(entries)
        f._get(self._report, set(), sizes, object_spans(entries), object_piece_spans(entries))
        left = {o: n for o, n in sizes.items() if not tier.exists(o)}
        if left and f._remote is not None:
            moved = f._remote.fetch_objects(f._root, left)
            if moved:
                self._report.bytes_from[f._remote.url] += moved


def _unavailable(root: StoreRoot, step: int, missing: list[str], has_remote: bool) -> str:
    shared = root.registry.shared  # one host's registry: no peers to ask
    what = f"{len(missing)} object{'s' if len(missing) > 1 else ''} of version {step} ({missing[0][:12]}…)"
    if shared:
        where = "no live host serves " + ("them" if len(missing) > 1 else "it")
        todo = ("run `paramstore serve` (or store.serve()) on a host that holds the version, "
                + ("and check that the remote holds it" if has_remote else "or open the store with remote=URL"))
    elif any(q.startswith(missing[0] + ".") for q in root.tier.quarantined()):
        where = (f"quarantined as damaged (in {root.tier.quarantine_dir}) and "
                 + ("the remote has no good copy" if has_remote else "no remote is open"))
        todo = ("restore it from a remote that has it (`paramstore verify --repair --remote URL`), or remove the "
                f"version (`paramstore rm {step}`)")
    else:
        where = "missing from this store (deleted outside paramstore?)"
        todo = (f"run `paramstore --root {root.path} verify` to see what else is damaged, and "
                f"`paramstore --root {root.path} --remote URL pull {step}` from a remote that has it")
    return f"{what}: {where}; {todo}"


def map_version(root: StoreRoot, fetcher: Fetcher, step: int, lease_id: str, *, given: FetchReport | None = None,
                pulled: TransferReport | None = None, verify: bool = False, lazy: bool = False) -> "Snapshot":
    """Obtain the bytes of leased version ``step`` and map it; the lease is released if anything fails.

    ``lazy``: obtain nothing now; objects this host lacks are mapped sparse and read piece by piece
    as the snapshot's reads touch them (:mod:`paramstore.lazy`).

    ``given``: the report of a collective checkout that already placed the objects (nothing is
    fetched); ``pulled``: a pull from the remote that placed some (merged into the report).
    ``verify``: re-hash what was mapped; damaged objects are quarantined
    (:func:`paramstore.objects.quarantine`) and CorruptObjectError names them and the version.
    """
    from .snapshot import Snapshot

    reg = root.registry
    release = functools.partial(release_lease, reg, lease_id, os.getpid())
    try:
        record = reg.get_version(step)
        manifest = read_manifest(root, step, version=record)
        reads = None
        if lazy:
            objects = manifest.objects()
            report = FetchReport(step, local=sum(root.tier.exists(o) for o in objects), lazy=True)
            reads = fetcher.lazy(step, manifest, report)
        else:
            report = given if given is not None else fetcher.fetch(step, manifest)
        report.absorb(pulled)  # what a pull of this version placed already
        snap = Snapshot(record, manifest, root.tier, on_close=release, fetch=report,
                        sizes=reg.object_sizes(manifest.objects()), lazy=reads)
        if verify:
            _verify_or_quarantine(root, snap)
        return snap
    except ObjectUnavailableError:  # (a FileNotFoundError too: not wrapped again)
        release()
        raise
    except FileNotFoundError as e:  # deleted behind the store's back after the fetch looked
        release()
        raise ObjectUnavailableError(f"version {step} references a missing object: {e.filename}; run "
                                     "`paramstore verify` to see what else is damaged") from e
    except BaseException:
        release()
        raise


def _verify_or_quarantine(root: StoreRoot, snap: "Snapshot") -> None:
    """Re-hash ``snap``'s objects; if any is damaged, close the snapshot, quarantine the damaged
    objects (so no commit reuses them) and raise CorruptObjectError naming them and the version."""
    bad = snap.verify()
    if not bad:
        return
    step = snap.step
    snap.close()
    moved = quarantine(root, bad)
    first = min(bad)
    where = f"; moved to {moved[first]}" if first in moved else ""
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise CorruptObjectError(f"version {step}: object {first} is damaged ({bad[first]}){where}{more}; run "
                             "`paramstore verify --repair` to fetch a good copy from peers or the remote")


def release_lease(registry: "Registry", lease_id: str, owner: int) -> None:
    """Release a snapshot's lease: on ``Snapshot.close()`` or when an unclosed snapshot is collected
    (maybe at exit). A forked child leaves its parent's lease alone."""
    if os.getpid() != owner:
        return
    try:
        registry.release_lease(lease_id)
    except (ParamStoreError, RuntimeError, OSError):
        pass  # store already closed: the lease dies with this process anyway


def check_checkout_args(version: VersionSpec, min_step: int | None, timeout: float | None) -> None:
    """InvalidArgumentError for a version and ``min_step`` given together, a bad ``min_step`` or timeout."""
    check_timeout(timeout)
    if min_step is not None:
        if version != "latest":
            raise InvalidArgumentError("pass either version or min_step, not both")
        check_bound(min_step, "min_step")
