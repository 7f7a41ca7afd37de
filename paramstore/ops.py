"""Whole-store operations: verify, du, diff (``ParamStore.verify/du/diff`` delegate here). Only
``diff`` imports torch.

Each returns a plain dict (what the CLI's ``--json`` prints).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable, Iterator

from .errors import CorruptObjectError, VersionNotFoundError
from .format import rehash
from .progress import progress
from .root import StoreRoot

__all__ = ["verify", "du", "diff", "hash_object"]


def hash_object(root: StoreRoot, digest: str) -> tuple[str, dict[tuple[int, int], str]]:
    """Rehash object ``digest`` from its bytes.

    Returns the recomputed object digest and each tensor's digest keyed by its absolute
    ``(begin, end)``.
    Raises CorruptObjectError if the file is not a well-formed paramstore object.
    """
    m = root.tier.map(digest, private=False)
    try:
        with memoryview(m) as mv:
            try:
                return rehash(mv)
            except ValueError as e:
                raise CorruptObjectError(f"object {digest}: {e}") from e
    finally:
        m.close()


def verify(root: StoreRoot, steps: Iterable[int] | None = None, *, show_progress: bool = True) -> dict[str, Any]:
    """Rehash the objects of the given versions (all when None) and check every manifest entry.

    Reports ``corrupt`` objects (bytes do not match the name, or a tensor's digest differs from its
    manifest), ``missing`` objects, and, for a whole-store check, ``orphans`` (objects no version
    references) and ``leftovers`` (files in ``tmp/``: an in-flight commit's, or a crash's).
    ``ok`` is False when anything is corrupt or missing.
    """
    whole = steps is None
    wanted = [v.step for v in root.registry.versions()] if whole else list(steps)
    with root.leased(wanted, skip_missing=whole) as selected:
        return _verify(root, selected, whole, show_progress)


def _verify(root: StoreRoot, selected: list[int], whole: bool, show_progress: bool) -> dict[str, Any]:
    reg = root.registry
    refs: dict[str, list[tuple[int, str, tuple[int, int], str]]] = {}  # object -> (step, name, span, digest)
    for s in selected:
        man = reg.get_manifest(s)
        for name, e in man.tensors.items():
            refs.setdefault(e.object, []).append((s, name, (e.offset, e.offset + e.nbytes), e.digest))
    corrupt: dict[str, str] = {}
    missing: list[str] = []
    sizes = {o: root.tier.size(o) for o in refs if root.tier.exists(o)}
    with progress(sum(sizes.values()), "verify", enabled=None if show_progress else False) as bar:
        for obj in sorted(refs):
            if obj not in sizes:
                missing.append(obj)
                continue
            try:
                got, tensor_digests = hash_object(root, obj)
            except CorruptObjectError as e:
                corrupt[obj] = str(e)
            else:
                if got != obj:
                    corrupt[obj] = f"bytes hash to {got}"
                else:
                    bad = [f"step {s} {n!r}" for s, n, span, d in refs[obj] if tensor_digests.get(span) != d]
                    if bad:
                        corrupt[obj] = "tensor digests differ for " + ", ".join(bad[:5])
            bar.update(sizes[obj])
    bad_steps = sorted({s for o in [*corrupt, *missing] for s, *_ in refs[o]})
    report: dict[str, Any] = {
        "ok": not corrupt and not missing,
        "versions_checked": len(selected),
        "objects_checked": len(sizes),
        "bytes_checked": sum(sizes.values()),
        "corrupt": corrupt,
        "missing": missing,
        "damaged_versions": bad_steps,
    }
    if whole:
        report["orphans"] = sorted(set(root.tier.list()) - set(refs))
        report["leftovers"] = root.tier.leftovers()
    return report


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
    with Snapshot(va, ma, root.tier) as sa, Snapshot(vb, mb, root.tier) as sb:
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
