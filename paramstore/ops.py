"""Whole-store operations: verify (and repair), remove a version, du, diff
(``ParamStore.verify/remove/du/diff`` delegate here). Only ``diff`` imports torch.

Each returns a plain dict (what the CLI's ``--json`` prints), but :func:`remove_version`.

Damage and what is done about it:

* :func:`verify` re-hashes objects and reports what is ``corrupt`` or ``missing``, which versions
  are damaged, and (``advice``) what to run next.
* :func:`~paramstore.objects.quarantine` moves damaged objects to ``<root>/quarantine/`` (renamed,
  kept for forensics) and drops their tensor-index entries, so that no later commit deduplicates
  against them: the next commit of the same weights writes fresh bytes.
* :func:`repair` (``verify(repair=True)``) quarantines, then fetches good copies from peers or the
  remote (each re-hashed before it is placed) and reports the versions that stay damaged.
* :func:`remove_version` removes such a version (``paramstore rm``); GC reclaims its objects.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterable

from .errors import (
    CorruptObjectError,
    CorruptStoreError,
    InvalidArgumentError,
    ObjectUnavailableError,
    RemoteError,
    TransferError,
    VersionNotFoundError,
)
from .adapters import base_of
from . import derived
from .manifest import Manifest, TensorEntry, Version
from .objects import hash_object, piece_name, quarantine, read_manifest
from .progress import progress
from .root import StoreRoot

if TYPE_CHECKING:
    import torch

    from .checkout import Fetcher
    from .snapshot import Snapshot

__all__ = ["verify", "repair", "remove_version", "du", "diff"]


def verify(root: StoreRoot, steps: Iterable[int] | None = None, *, show_progress: bool | None = None) -> dict[str, Any]:
    """Rehash the objects of the given versions (all when None) and check every manifest entry.

    Reports ``corrupt`` objects (bytes do not match the name, or a tensor's digest differs from its
    manifest; for a chunked tensor, each chunk's against its own digest; in a whole-store check, live
    patch objects too), ``missing`` objects, and, for a whole-store check, ``patch_objects`` (how many
    live ones), ``orphans`` (objects no version or patch record references) and ``leftovers`` (files in
    ``tmp/``: an in-flight commit's, or a crash's).
    ``ok`` is False when anything is corrupt or missing. ``unreadable_manifests`` (step -> why)
    lists versions whose manifest cannot be parsed (damaged registry). ``advice`` says what to run
    next (empty when all is well): ``paramstore verify --repair`` (see :func:`repair`). Each
    version is leased while its objects
    are hashed, one version at a time (a trainer's ``wait_for_readers`` is held up by one version,
    never by the whole run); a version pruned before its turn is skipped in a whole-store check.
    ``show_progress``: None shows a bar when stderr is a terminal.
    """
    whole = steps is None
    reg = root.registry
    wanted = [v.step for v in reg.versions()] if whole else list(steps)
    # object -> [(step, name, span, digest)] (per chunk of a chunked tensor), and each object's hash
    # result, computed once
    refs: dict[str, list[tuple[int, str, tuple[int, int], str]]] = {}
    results: dict[str, tuple[str, dict[tuple[int, int], str]] | str | None] = {}  # None: missing
    selected: list[int] = []
    unreadable: dict[int, str] = {}
    sizes = root.tier.sizes({o for s in wanted for o in _objects_of(root, s)})  # for the bar and the report
    with progress(sum(sizes.values()), "verify", enabled=show_progress) as bar:
        for s in wanted:
            with root.leased([s], skip_missing=whole) as held:
                if not held:
                    continue
                selected.append(s)
                try:
                    manifest = read_manifest(root, s, cached=False)
                except CorruptStoreError as e:
                    unreadable[s] = str(e)
                    continue
                for name, e in manifest.stored():
                    for c in e.pieces():
                        refs.setdefault(c.object, []).append(
                            (s, piece_name(name, e, c), (c.offset, c.offset + c.nbytes), c.digest))
                        if c.object not in results:
                            results[c.object] = _hash_or_why(root, c.object)
                            bar.update(sizes.get(c.object, 0))
    patches: set[str] = set()
    if whole:  # patch objects are read by checkouts too: a damaged one is reported (and repair quarantines it)
        patches = {p for pairs in reg.patches().values() for p in pairs.values()} & set(root.tier.list())
        for p in sorted(patches - set(results)):
            results[p] = _hash_or_why(root, p)
            if results[p] is None:  # collected meanwhile with its record: not damage
                del results[p]
    corrupt: dict[str, str] = {}
    missing = sorted(o for o, r in results.items() if r is None)
    for obj, r in sorted(results.items()):
        if isinstance(r, str):
            corrupt[obj] = r
        elif r is not None:
            got, tensor_digests = r
            if got != obj:
                corrupt[obj] = ("patch object: " if obj in patches else "") + f"bytes hash to {got}"
            else:
                bad = [f"step {s} {n!r}" for s, n, span, d in refs.get(obj, ()) if tensor_digests.get(span) != d]
                if bad:
                    corrupt[obj] = "tensor digests differ for " + ", ".join(bad[:5])
    checked = [o for o, r in results.items() if r is not None]
    damaged = sorted({s for o in [*corrupt, *missing] for s, *_ in refs.get(o, ())} | set(unreadable))
    # objects an earlier repair set aside: repairing again without a new source of good copies loops
    set_aside = {q.split(".", 1)[0] for q in root.tier.quarantined()}
    quarantined = [o for o in missing if o in set_aside]
    stuck = sorted({s for o in quarantined for s, *_ in refs.get(o, ())}
                   - {s for o in [*corrupt, *missing] if o not in quarantined for s, *_ in refs.get(o, ())}
                   - set(unreadable))
    report: dict[str, Any] = {
        "ok": not corrupt and not missing and not unreadable,
        "versions_checked": len(selected),
        "objects_checked": len(checked),
        "bytes_checked": sum(sizes.get(o, 0) for o in checked),
        "corrupt": corrupt,
        "missing": missing,
        "unreadable_manifests": unreadable,
        "damaged_versions": damaged,
        "quarantined_missing": quarantined,
        "advice": " ".join(filter(None, [
            "" if not set(damaged) - set(stuck) and not set(corrupt) & patches else (
                "run `paramstore verify --repair` (store.verify(repair=True)): it moves damaged objects to "
                f"{os.path.join(root.path, 'quarantine')} so that no commit reuses them, and fetches good copies "
                "from peers or the remote (--remote URL); checking out a damaged version meanwhile serves wrong "
                "weights unless checkout(verify=True)."),
            _stuck_advice(root, stuck)])),
    }
    if whole:
        present = set(root.tier.list())
        report["patch_objects"] = len(patches)  # live (gc keeps them), not unreferenced
        live = derived.mark(root, set(refs) | patches, dry_run=True) & present  # what recipes made: kept by gc
        report["derived_objects"] = len(live)
        report["orphans"] = sorted(present - set(refs) - patches - live)
        report["leftovers"] = root.tier.leftovers()
        # More objects that no version explains than objects in use: not what crashes leave (at most a
        # commit's worth), but what a lost or replaced database looks like. GC would delete them all.
        report["metadata_suspect"] = len(report["orphans"]) > max(len(refs), 1)
        if report["metadata_suspect"]:
            report["advice"] = " ".join(filter(None, [report["advice"], (
                f"{len(report['orphans'])} objects are referenced by no version (against {len(refs)} in use): if "
                "versions you expect are missing, the store's metadata may have been lost or replaced; do not run "
                "gc (it would delete them) before restoring the versions from the store's remote "
                f"(`paramstore --root {root.path} --remote URL pull VERSION`)")]))
    return report


def _stuck_advice(root: StoreRoot, steps: list[int]) -> str:
    """What can still help versions whose damaged objects an earlier repair quarantined without
    finding a good copy: a source of good copies, or removing them (repairing alone would loop)."""
    if not steps:
        return ""
    listed = ", ".join(map(str, steps))
    them = "them" if len(steps) > 1 else "it"
    return (f"version{'s' if len(steps) > 1 else ''} {listed}: damaged objects were quarantined by an earlier "
            f"check or repair (in {root.tier.quarantine_dir}) and no good copy has been placed since; repairing again "
            f"helps only with "
            f"a source that has {them}: a remote (`paramstore --root {root.path} --remote URL verify --repair`) or "
            "a peer serving the version (`paramstore serve` on a host that holds it, all hosts on one --registry). "
            "Otherwise remove " + them + ": " + " and ".join(f"`paramstore rm {s}`" for s in steps)
            + " (the latest version can be removed once a newer one is committed).")


def _objects_of(root: StoreRoot, step: int) -> set[str]:
    try:
        return set(read_manifest(root, step).objects())
    except (VersionNotFoundError, CorruptStoreError):
        return set()


def _hash_or_why(root: StoreRoot, digest: str) -> tuple[str, dict[tuple[int, int], str]] | str | None:
    """``hash_object``'s result, the reason the object is malformed, or None if it is missing."""
    try:
        return hash_object(root, digest)
    except FileNotFoundError:
        return None
    except CorruptObjectError as e:
        return str(e)


def repair(root: StoreRoot, fetcher: "Fetcher", report: dict[str, Any]) -> dict[str, Any]:
    """Act on a :func:`verify` report: quarantine, re-fetch, and say what stays damaged.

    Objects whose bytes do not match their digest (re-hashed once more here) are quarantined
    (:func:`~paramstore.objects.quarantine`). Then each damaged version is leased and its missing objects are fetched
    from peers, then the remote (``fetcher``: the checkout path's, which re-hashes every object
    before placing it). Adds to ``report`` (and returns it): ``quarantined`` (digest -> path),
    ``restored`` (digests fetched), ``unrepaired`` (step -> why) and ``ok``/``advice`` for the
    state *after* the repair. A version whose manifest disagrees with an intact object, or that
    no peer or remote holds, stays damaged: remove it with :func:`remove_version`.
    """
    tier = root.tier
    bad_bytes = []
    for o in report["corrupt"]:
        r = _hash_or_why(root, o)
        if isinstance(r, str) or (r is not None and r[0] != o):
            bad_bytes.append(o)
    quarantined = quarantine(root, bad_bytes)
    restored: set[str] = set()
    unrepaired: dict[int, str] = dict(report.get("unreadable_manifests", {}))
    unfetched: dict[int, set[str]] = {}  # a version another version's fetch may still have completed
    for s in report["damaged_versions"]:
        if s in unrepaired:
            continue
        with root.leased([s], skip_missing=True) as held:
            if not held:
                continue  # removed meanwhile: nothing left to repair
            try:
                manifest = read_manifest(root, s, cached=False)
            except (CorruptObjectError, CorruptStoreError) as e:
                unrepaired[s] = str(e)
                continue
            try:
                restored.update(fetcher.fetch(s, manifest).fetched)
            except (CorruptObjectError, ObjectUnavailableError, RemoteError, TransferError) as e:  # a bad copy, or unavailable
                unrepaired[s] = str(e)
                unfetched[s] = manifest.objects()
                continue
            intact = [o for o in report["corrupt"] if o not in bad_bytes and o in manifest.objects()]
            if intact:
                unrepaired[s] = (f"its manifest disagrees with intact object {intact[0]} "
                                 f"({report['corrupt'][intact[0]]}): the registry's record is damaged")
            elif any(not tier.exists(o) for o in manifest.objects()):
                unrepaired[s] = "some of its objects are still missing"
    for s, objects in unfetched.items():  # an object shared with a version fetched later is here now
        if all(tier.exists(o) for o in objects):
            del unrepaired[s]
    report.update(
        quarantined=quarantined, restored=sorted(restored), unrepaired=dict(sorted(unrepaired.items())),
        ok=not unrepaired,
        advice="" if not unrepaired else (
            f"no peer or remote holds a good copy of version{'s' if len(unrepaired) > 1 else ''} "
            f"{', '.join(map(str, sorted(unrepaired)))}: remove "
            + ("them" if len(unrepaired) > 1 else "it") + " with "
            + " and ".join(f"`paramstore rm {s}`" for s in sorted(unrepaired))
            + " (store.remove(step); objects go at the next `paramstore gc`; the latest "
            "version can be removed once a newer one is committed), or open the store with --remote URL of a "
            "remote that has " + ("them" if len(unrepaired) > 1 else "it") + " and repair again"),
    )
    return report


def remove_version(root: StoreRoot, step: int) -> Version:
    """Remove version ``step`` from this store (its manifest, tags and persisted mark), for good.

    For a version that cannot be repaired. Refused (InvalidArgumentError) while a reader holds a
    lease on it (the message names the holders: close their snapshots or stop them first) and for
    the latest version (the registry always keeps it: commit a newer one first). Objects are not
    touched: the next GC deletes those no other version references. A remote keeps its copy
    (``prune --tier remote`` removes remote versions). Refused too for the base of an adapter
    version that is still there (:mod:`paramstore.adapters`). Raises VersionNotFoundError if there
    is none.
    Returns the removed version's record.

    Example:
        >>> from paramstore.ops import remove_version
        >>> _ = store.commit(2, model).result()
        >>> remove_version(store._root, 1).step, [v.step for v in store.versions()]
        (1, [2])
    """
    reg = root.registry
    version = reg.get_version(step)
    for _ in range(2):  # the checks, then the transaction re-checks them; one retry for a race
        holders = [lease for lease in reg.leases() if lease.step == step]
        if holders:
            who = "; ".join(f"{lease.holder!r} (pid {lease.pid} on {lease.host})" for lease in holders)
            raise InvalidArgumentError(f"version {step} is in use: leased by {who}; close those snapshots (or stop "
                                       "those processes) and remove it again")
        if reg.latest_step() == step:
            raise InvalidArgumentError(f"version {step} is the latest, which the store always keeps: commit a newer "
                                       f"version (the correct weights, say), then remove {step}")
        adapters = [v.step for v in reg.versions() if base_of(v.metadata) == step]
        if adapters:
            raise InvalidArgumentError(f"version {step} is the base of adapter version(s) {adapters}: remove those "
                                       f"first (an adapter needs its base)")
        if step in reg.remove_versions([step]):
            return version
        try:
            reg.get_version(step)
        except VersionNotFoundError:
            return version  # removed by someone else meanwhile
    raise InvalidArgumentError(f"version {step} could not be removed: it was leased again meanwhile")


def du(root: StoreRoot) -> dict[str, Any]:
    """Logical bytes (every version's tensors) against bytes stored, and the dedup ratio; of the
    bytes stored, those of patch objects (:mod:`paramstore.delta`)."""
    versions = list(root.registry.versions())
    logical = sum(v.nbytes for v in versions)
    sizes = {o: _size(root.tier.object_path(o)) for o in root.tier.list()}
    stored = sum(sizes.values())
    patches = {p for pairs in root.registry.patches().values() for p in pairs.values() if p in sizes}
    tmp = sum(_size(os.path.join(root.tier.tmp_dir, f)) for f in root.tier.leftovers())
    return {
        "versions": len(versions),
        "objects": len(sizes),
        "logical_bytes": logical,
        "stored_bytes": stored,
        "patch_objects": len(patches),
        "patch_bytes": sum(sizes[p] for p in patches),
        "temporary_bytes": tmp,
        "dedup_ratio": (logical / stored) if stored else 0.0,
    }


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def diff(root: StoreRoot, a: int, b: int) -> dict[str, Any]:
    """Tensors added, removed and changed from version ``a`` to ``b``, with bytes and max |Δ|.

    ``max_abs_diff`` is given for changed tensors of the same dtype and shape (floating or integer).
    Every name is listed, tied names (aliases) included, but ``changed_bytes`` and ``added_bytes``
    count the bytes of each distinct tensor digest once: a tied embedding and output projection
    are one tensor, stored and moved once. ``nbytes`` is a whole tensor's, chunked or not.

    Tensors are compared by digest, and a chunked tensor's digest covers its layout (each chunk's
    box and digest). So a tensor whose layout changed (stored whole in one version and chunked in
    the other, or chunked another way) is listed as changed even when its values are equal; such an
    item (of the same dtype and shape) has ``relayout: True``, and then a ``max_abs_diff`` of 0 says
    the values are equal.

    When either version has assets (config, tokenizer files), ``assets`` lists the file names
    added, removed and changed.
    """
    with root.leased(sorted({a, b})):
        return _diff(root, a, b)


def _diff(root: StoreRoot, a: int, b: int) -> dict[str, Any]:
    import torch

    from .snapshot import Snapshot

    reg = root.registry
    va, vb = reg.get_version(a), reg.get_version(b)
    ma, mb = reg.get_manifest(a), reg.get_manifest(b)
    na, nb = set(ma.names()), set(mb.names())
    changed = []
    try:  # maps (and checks the size of) every object, those holding chunks included
        sa, sb = Snapshot(va, ma, root.tier), Snapshot(vb, mb, root.tier)
    except FileNotFoundError as e:
        raise ObjectUnavailableError(f"version {a} or {b} references an object missing from this host "
                                     f"({e.filename}): check it out first (it fetches from peers or the remote), "
                                     "or run `paramstore verify` to see what is damaged") from None
    with sa, sb:
        for name in sorted(na & nb):
            ea, eb = ma.entry(name), mb.entry(name)
            if (ea.digest, ea.dtype, ea.shape) == (eb.digest, eb.dtype, eb.shape):
                continue
            item: dict[str, Any] = {"name": name, "nbytes": eb.nbytes}
            if ea.dtype != eb.dtype or ea.shape != eb.shape:
                item["from"] = {"dtype": ea.dtype, "shape": list(ea.shape)}
                item["to"] = {"dtype": eb.dtype, "shape": list(eb.shape)}
                changed.append(item)
                continue
            if _boxes(ea) != _boxes(eb):  # the digests differ by layout: the values may be equal (docstring)
                item["relayout"] = True
            if eb.dtype != "BOOL" and eb.nbytes:
                ta, tb = _whole(sa, name, ea), _whole(sb, name, eb)
                work = torch.complex128 if ta.is_complex() else torch.float64
                item["max_abs_diff"] = float((tb.to(work) - ta.to(work)).abs().max())
            changed.append(item)
    return {
        "from": a,
        "to": b,
        "added": sorted(nb - na),
        "removed": sorted(na - nb),
        "changed": changed,
        "unchanged": len(na & nb) - len(changed),
        # once per distinct digest (tied names share one; so do equal tensors, stored once)
        "changed_bytes": sum({mb.entry(c["name"]).digest: c["nbytes"] for c in changed}.values()),
        "added_bytes": sum({mb.entry(n).digest: mb.entry(n).nbytes for n in nb - na}.values()),
        "digest_from": va.digest,
        "digest_to": vb.digest,
    } | _asset_diff(ma, mb)


def _asset_diff(ma: Manifest, mb: Manifest) -> dict[str, Any]:
    """``{"assets": {"added", "removed", "changed"}}`` (file names) when either version has assets."""
    if not ma.assets and not mb.assets:
        return {}
    a, b = set(ma.assets), set(mb.assets)
    return {"assets": {"added": sorted(b - a), "removed": sorted(a - b),
                       "changed": sorted(n for n in a & b if ma.assets[n].digest != mb.assets[n].digest)}}


def _boxes(entry: TensorEntry) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The layout of a tensor: the box (offsets, sizes) of each of its pieces."""
    return [(c.offsets, c.sizes) for c in entry.pieces()]


def _whole(snap: "Snapshot", name: str, entry: TensorEntry) -> "torch.Tensor":
    """Tensor ``name`` of ``snap``: a view of the store's bytes, or for a chunked tensor a copy
    assembled from its chunks and not cached (one tensor at a time)."""
    return snap.read(name, (0,) * len(entry.shape), entry.shape) if entry.chunks else snap[name]


