"""Whole-store operations: verify, du, diff (``ParamStore.verify/du/diff`` delegate here). Only
``diff`` imports torch.

Each returns a plain dict (what the CLI's ``--json`` prints).
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from .errors import CorruptObjectError, ObjectUnavailableError, VersionNotFoundError
from .format import rehash
from .progress import progress
from .root import StoreRoot

__all__ = ["verify", "du", "diff", "hash_object"]


def hash_object(root: StoreRoot, digest: str) -> tuple[str, dict[tuple[int, int], str]]:
    """Rehash object ``digest`` from its bytes.

    Returns the recomputed object digest and each tensor's digest keyed by its absolute
    ``(begin, end)``.
    Raises FileNotFoundError if it is missing, CorruptObjectError if the file is not a well-formed
    paramstore object (empty or truncated included).
    """
    try:
        m = root.tier.map(digest)
    except ValueError as e:  # mmap of an empty file
        raise CorruptObjectError(f"object {digest}: {e}") from e
    try:
        with memoryview(m) as mv:
            try:
                return rehash(mv)
            except ValueError as e:
                raise CorruptObjectError(f"object {digest}: {e}") from e
    finally:
        m.close()


def verify(root: StoreRoot, steps: Iterable[int] | None = None, *, show_progress: bool | None = None) -> dict[str, Any]:
    """Rehash the objects of the given versions (all when None) and check every manifest entry.

    Reports ``corrupt`` objects (bytes do not match the name, or a tensor's digest differs from its
    manifest), ``missing`` objects, and, for a whole-store check, ``orphans`` (objects no version
    references) and ``leftovers`` (files in ``tmp/``: an in-flight commit's, or a crash's).
    ``ok`` is False when anything is corrupt or missing. Each version is leased while its objects
    are hashed, one version at a time (a trainer's ``wait_for_readers`` is held up by one version,
    never by the whole run); a version pruned before its turn is skipped in a whole-store check.
    ``show_progress``: None shows a bar when stderr is a terminal.
    """
    whole = steps is None
    reg = root.registry
    wanted = [v.step for v in reg.versions()] if whole else list(steps)
    # object -> [(step, name, span, digest)], and each object's hash result, computed once
    refs: dict[str, list[tuple[int, str, tuple[int, int], str]]] = {}
    results: dict[str, tuple[str, dict[tuple[int, int], str]] | str | None] = {}  # None: missing
    selected: list[int] = []
    sizes = root.tier.sizes({o for s in wanted for o in _objects_of(root, s)})  # for the bar and the report
    with progress(sum(sizes.values()), "verify", enabled=show_progress) as bar:
        for s in wanted:
            with root.leased([s], skip_missing=whole) as held:
                if not held:
                    continue
                selected.append(s)
                for name, e in reg.get_manifest(s).tensors.items():
                    refs.setdefault(e.object, []).append((s, name, (e.offset, e.offset + e.nbytes), e.digest))
                    if e.object not in results:
                        results[e.object] = _hash_or_why(root, e.object)
                        bar.update(sizes.get(e.object, 0))
    corrupt: dict[str, str] = {}
    missing = sorted(o for o, r in results.items() if r is None)
    for obj, r in sorted(results.items()):
        if isinstance(r, str):
            corrupt[obj] = r
        elif r is not None:
            got, tensor_digests = r
            if got != obj:
                corrupt[obj] = f"bytes hash to {got}"
            else:
                bad = [f"step {s} {n!r}" for s, n, span, d in refs[obj] if tensor_digests.get(span) != d]
                if bad:
                    corrupt[obj] = "tensor digests differ for " + ", ".join(bad[:5])
    checked = [o for o, r in results.items() if r is not None]
    report: dict[str, Any] = {
        "ok": not corrupt and not missing,
        "versions_checked": len(selected),
        "objects_checked": len(checked),
        "bytes_checked": sum(sizes.get(o, 0) for o in checked),
        "corrupt": corrupt,
        "missing": missing,
        "damaged_versions": sorted({s for o in [*corrupt, *missing] for s, *_ in refs[o]}),
    }
    if whole:
        report["orphans"] = sorted(set(root.tier.list()) - set(refs))
        report["leftovers"] = root.tier.leftovers()
    return report


def _objects_of(root: StoreRoot, step: int) -> set[str]:
    try:
        return set(root.registry.get_manifest(step).objects())
    except VersionNotFoundError:
        return set()


def _hash_or_why(root: StoreRoot, digest: str) -> tuple[str, dict[tuple[int, int], str]] | str | None:
    """``hash_object``'s result, the reason the object is malformed, or None if it is missing."""
    try:
        return hash_object(root, digest)
    except FileNotFoundError:
        return None
    except CorruptObjectError as e:
        return str(e)


def du(root: StoreRoot) -> dict[str, Any]:
    """Logical bytes (every version's tensors) against bytes stored, and the dedup ratio."""
    versions = list(root.registry.versions())
    logical = sum(v.nbytes for v in versions)
    objects = list(root.tier.list())
    stored = sum(root.tier.size(o) for o in objects)
    tmp = sum(_size(os.path.join(root.tier.tmp_dir, f)) for f in root.tier.leftovers())
    return {
        "versions": len(versions),
        "objects": len(objects),
        "logical_bytes": logical,
        "stored_bytes": stored,
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
    try:
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
            elif eb.dtype != "BOOL" and eb.nbytes:
                ta, tb = sa[name], sb[name]
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
        "changed_bytes": sum(c["nbytes"] for c in changed),
        "added_bytes": sum(mb.entry(n).nbytes for n in nb - na),
        "digest_from": va.digest,
        "digest_to": vb.digest,
    }
