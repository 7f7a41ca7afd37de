"""The objects of a store root as the fetch paths handle them: read a version's manifest (cached),
check received bytes against their digests, quarantine damaged objects, and index the objects of a
version received from elsewhere.

Shared by checkout (:mod:`paramstore.checkout`), peers, patches, the remote, the group broadcast,
the device cache and the scrubber; the whole-store commands built on them (verify and repair,
remove, du, diff) are in :mod:`paramstore.ops`.

* :func:`read_manifest`: a version's manifest, parsed once per open store (a small LRU).
* :func:`hash_object`, :func:`check_buffer`, :func:`entries_by_object`, :func:`check_entries`,
  :func:`check_held`: re-hash an object, or check bytes against the digests a manifest gives.
* :func:`quarantine` moves damaged objects to ``<root>/quarantine/`` (renamed, kept for forensics)
  and drops their tensor-index entries, so that no later commit deduplicates against them: the next
  commit of the same weights writes fresh bytes.
* :func:`index_entries`: registry entries for a version pulled or broadcast here.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping

from paramstore.backends.registries.base import ObjectInfo, TensorLocation

from .errors import CorruptObjectError, CorruptStoreError, ParamStoreError
from .format import bad_pieces, pieces, rehash, tensor_digest
from .manifest import Chunk, Manifest, TensorEntry, Version
from .root import StoreRoot

__all__ = ["read_manifest", "MANIFEST_CACHE", "hash_object", "check_buffer", "piece_name", "entries_by_object",
           "check_entries", "check_held", "index_entries", "quarantine"]


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


def piece_name(name: str, entry: TensorEntry, chunk: Chunk) -> str:
    """How reports name a piece of tensor ``name``: the name itself for a tensor stored whole, the
    name and the chunk's box for a chunk (``w[2:4, 0:3]``).

    Example:
        >>> from paramstore.manifest import Chunk, TensorEntry
        >>> e = TensorEntry("F32", (4, 3), "", "", 0, 48, (Chunk((2, 0), (2, 3), "", "", 0, 24),))
        >>> piece_name("w", e, e.chunks[0])
        'w[2:4, 0:3]'
    """
    if not entry.chunks:
        return name
    return f"{name}[{', '.join(f'{o}:{o + n}' for o, n in zip(chunk.offsets, chunk.sizes))}]"


#: Manifests :func:`read_manifest` keeps parsed per open store (a rollout checks out the same few
#: versions again and again).
MANIFEST_CACHE = 8


def read_manifest(root: StoreRoot, step: int, *, cached: bool = True, version: Version | None = None) -> Manifest:
    """The manifest of ``step``; CorruptStoreError (naming the registry's file) if it cannot be parsed.

    Raises VersionNotFoundError if the version does not exist. ``cached=False``: parse the stored
    record even if this store read it before (what ``verify`` checks). ``version``: the version
    record of ``step`` if the caller has read it already (not read again).

    Example:
        >>> from paramstore.objects import read_manifest
        >>> sorted(read_manifest(store._root, 1).names())
        ['0.bias', '0.weight', '2.bias', '2.weight']
    """
    try:
        if not cached:
            return root.registry.get_manifest(step)
        if version is None:
            version = root.registry.get_version(step)
        key = (step, version.digest, version.created_at)  # another version at this step (removed, re-committed) has another key
        with root.manifests_lock:
            hit = root.manifests.get(key)
            if hit is not None:
                root.manifests.move_to_end(key)
                return hit
        manifest = root.registry.get_manifest(step)
        with root.manifests_lock:
            root.manifests[key] = manifest
            while len(root.manifests) > MANIFEST_CACHE:
                root.manifests.popitem(last=False)
        return manifest
    except CorruptObjectError as e:  # JSON, but not a valid manifest (Manifest.from_json)
        if root.registry.shared:
            raise  # received from a shared registry: as the registry reports it
        raise CorruptStoreError(f"the manifest of version {step} in {_registry_file(root)} is damaged ({e}): "
                                f"remove the version (`paramstore rm {step}`), then pull it again from the "
                                f"store's remote (`paramstore --root {root.path} --remote URL pull {step}`)") from None
    except ParamStoreError:
        raise
    except (ValueError, KeyError, TypeError) as e:  # not JSON, or not a manifest's JSON
        raise CorruptStoreError(f"the manifest of version {step} in {_registry_file(root)} is damaged "
                                f"({type(e).__name__}: {e}): remove the version (`paramstore rm {step}`), then "
                                f"pull it again from the store's remote (`paramstore --root {root.path} --remote URL "
                                f"pull {step}`)") from None


def _registry_file(root: StoreRoot) -> str:
    """Where the registry keeps its records: a file of this host, or a server's URL."""
    if not root.registry.shared:
        return os.path.join(root.path, "meta", "data.mdb")
    return f"the registry at {getattr(root.registry, 'url', type(root.registry).__name__)}"


def check_buffer(digest: str, buf: memoryview, tensors: Mapping[tuple[int, int], str]) -> str | None:
    """Why the bytes ``buf`` are not object ``digest`` holding ``tensors`` (span -> tensor digest),
    or None if they are. One blake3 pass over ``buf``.

    Example:
        >>> from paramstore.format import layout, TensorSpec, tensor_digest, object_digest
        >>> plan = layout([TensorSpec("w", "U8", (4,))])
        >>> data = plan.header + bytes([1, 2, 3, 4])
        >>> span = (len(plan.header), len(data))
        >>> good = object_digest(plan.header, [tensor_digest(bytes([1, 2, 3, 4]))])
        >>> check_buffer(good, memoryview(data), {span: tensor_digest(bytes([1, 2, 3, 4]))}) is None
        True
        >>> check_buffer(good, memoryview(data[:-1] + b"\\xff"), {}).startswith("bytes hash to ")
        True
        >>> check_buffer(good, memoryview(data[:-1]), {})
        'malformed (truncated: its tensors end at byte 68, the file at byte 67)'
    """
    try:
        got, digests = rehash(buf)
    except ValueError as e:
        return f"malformed ({e})"
    if got != digest:
        return f"bytes hash to {got}"
    bad = [f"{b}..{e}" for (b, e), d in sorted(tensors.items()) if digests.get((b, e)) != d]
    return f"tensor digests differ from the manifest at bytes {', '.join(bad[:5])}" if bad else None


def quarantine(root: StoreRoot, digests: Iterable[str]) -> dict[str, str]:
    """Move damaged objects to ``<root>/quarantine/`` and keep commits from deduplicating against them.

    Each file is renamed, never deleted (:meth:`LocalTier.quarantine`); readers mapping it keep
    their pages. With the host's own (LMDB) registry their records and tensor-index entries are
    dropped (:meth:`Registry.forget_objects`), so the next commit of the same weights writes
    fresh bytes. With a registry shared by hosts the records stay (other hosts may hold good
    copies, and peers fetch by them): a commit deduplicates only against objects present on its
    own host, and the file is gone from here. Runs under the GC lock (exclusive), so no commit is
    between its dedup lookup and its publish. Returns ``{digest: new path}`` for the files moved.

    Example:
        >>> from paramstore.objects import quarantine
        >>> digest = sorted(store.manifest(1).objects())[0]
        >>> moved = quarantine(store._root, [digest])
        >>> os.path.basename(os.path.dirname(moved[digest])), store.verify()["missing"] == [digest]
        ('quarantine', True)
    """
    digests = sorted(set(digests))
    moved: dict[str, str] = {}
    with root.gc_lock(exclusive=True):
        for d in digests:
            path = root.tier.quarantine(d)
            if path is not None:
                moved[d] = path
        if digests and not root.registry.shared:  # a shared registry keeps them: other hosts may hold good copies
            root.registry.forget_objects(set(digests))
    return moved


def entries_by_object(manifest: Manifest | None) -> dict[str, list[tuple[str, Chunk]]]:
    """The manifest's pieces (a tensor stored whole, or each chunk of a chunked one) grouped by the
    object that holds them, each with its name for messages (:func:`~paramstore.objects.piece_name`)."""
    out: dict[str, list[tuple[str, Chunk]]] = {}
    for name, e in manifest.stored() if manifest is not None else ():
        for c in e.pieces():
            out.setdefault(c.object, []).append((piece_name(name, e, c), c))
    return out


def check_entries(buf: memoryview, entries: list[tuple[str, Chunk]],
                   spans: Mapping[tuple[int, int], str] | None, where: str) -> None:
    """CorruptObjectError unless the bytes each piece (see :func:`entries_by_object`) names in the
    object ``buf`` hash to its digest. ``spans``: the object's tensor digests by (begin, end) when
    already computed (a rehash); other ranges are hashed here."""
    for name, c in entries:
        begin, end = c.offset, c.offset + c.nbytes
        got = spans.get((begin, end)) if spans is not None else None
        if got is None:
            if end > len(buf):
                raise CorruptObjectError(f"{where}: tensor {name!r} at [{begin}, {end}) lies past the object's end")
            # with the digest rule of the manifest that lists it: pieces when it lists piece digests,
            # else blake3 of all its bytes (a manifest written before pieces, or bytes of one piece)
            got = tensor_digest(buf[begin:end], piece_size=c.piece_size)
        if got != c.digest:
            where_bad = ""
            if c.piece_digests and end <= len(buf):
                bad = bad_pieces(buf[begin:end], c.piece_digests)
                ranges = pieces(c.nbytes, c.piece_size)
                where_bad = f" (piece{'s' if len(bad) > 1 else ''} " + ", ".join(
                    f"{i} at [{begin + ranges[i][0]}, {begin + ranges[i][1]})" for i in bad[:5]) + ")"
            raise CorruptObjectError(f"{where}: the bytes of tensor {name!r} at [{begin}, {end}) hash to "
                                     f"{got[:16]}…, its manifest says {c.digest[:16]}…{where_bad}: a tampered manifest")


def index_entries(manifest: Manifest, sizes: Mapping[str, int]) -> tuple[dict[str, ObjectInfo], dict[str, TensorLocation]]:
    """Registry entries for a version received from elsewhere (pulled, broadcast): each object's tensors in file order, and the index.

    Each piece is one tensor of its object (a tensor stored whole, or a chunk: the index locates a
    chunk by its own digest, never a chunked tensor's, which is no digest of bytes). Spans are keyed
    by (start, end): an empty tensor starts where the next one does, and sorts before it (as the
    commit laid them out); pieces naming the same span are one tensor.
    """
    spans: dict[str, dict[tuple[int, int], str]] = {o: {} for o in sizes}
    tensors: dict[str, TensorLocation] = {}
    for c in (c for _, e in manifest.stored() for c in e.pieces()):
        spans[c.object][(c.offset, c.offset + c.nbytes)] = c.digest
        tensors[c.digest] = TensorLocation(c.object, c.offset, c.nbytes)
    objects = {o: ObjectInfo(sizes[o], tuple(d for _, d in sorted(spans[o].items()))) for o in sizes}
    return objects, tensors


def check_held(root: StoreRoot, manifest: Manifest, sizes: Mapping[str, int], skip: set[str], where: str) -> None:
    """CorruptObjectError unless each tensor (each chunk of a chunked tensor) that ``manifest``, a
    version received from elsewhere, places in an object this host already held (those not in
    ``skip``, which were just received and checked) lies there: the object has the size ``sizes``
    says and the bytes hash to the piece's digest. Pieces the local index already locates at the
    very same place are not hashed again. ``where`` (the manifest's source) starts the messages."""
    entries = {o: es for o, es in entries_by_object(manifest).items() if o not in skip}
    if not entries:
        return
    known = root.registry.locate_tensors(list(dict.fromkeys(c.digest for es in entries.values() for _, c in es)))
    for o, es in entries.items():
        if root.tier.size(o) != sizes[o]:
            raise CorruptObjectError(f"{where}: object {o} is {root.tier.size(o)} bytes here; the source says {sizes[o]}")
        todo = [(n, c) for n, c in es if known.get(c.digest) != (o, c.offset, c.nbytes)]
        if todo:
            with root.tier.map(o) as m, memoryview(m) as buf:
                check_entries(buf, todo, None, f"{where}, object {o}")
