"""Patches between versions: an object of a new version rebuilt from the objects of an older one.

Content addressing moves only the tensors that changed; but in RL post-training nearly every
tensor changes a little at every step (a few percent of its bf16 elements), so a version would
still move almost whole. A *patch object* rebuilds one object of version ``target`` from the
objects of version ``base`` a host already holds: for each of the target's tensors, the sparse
changes against the same tensor (same name, same block) in ``base`` (:func:`paramstore.patch.encode`:
positions delta-coded, new bit patterns, zstd).

**Made** after each commit, on a thread of its own in the committing process (:class:`Patcher`,
never on the training thread), for the new objects of the version against the version before it,
and kept only when at most ``max_ratio`` of the object's size. It is recorded in the registry
(:meth:`~paramstore.backends.registries.base.Registry.add_patches`), which keeps the record, and
so the patch object, exactly as long as both versions exist: GC never keeps a base for a patch,
it drops the patch with its base.

**Used** by a checkout that lacks objects of a version (:func:`fetch_by_patches`, before peers and
the remote are asked for whole objects): it looks for a chain of recorded patches from a version
whose objects are all on this host (``base → target``, or ``v-2 → v-1 → v``, rebuilding the
intermediate version here), fetches the patch objects (from peers, like any object), rebuilds
each target object into a slab or a new file (never into an object someone may read;
:func:`rebuild`: one pass, each piece read from its base, patched and hashed while in cache, pieces
on a thread per core) and places it only if its object digest (every piece, the tensor digests
over them, and the header) is the one the manifest names. A patch that is damaged, for the wrong base,
or missing, leaves its object to be fetched whole. A chain is used only when its patch objects are
smaller than the objects they rebuild.

**Format.** A patch object is an ordinary object of the store (a safetensors file named by its
object digest), so tiers, peers, push/pull and ``verify`` treat it like any other:

* tensor ``head`` (``U8``): the target object's header bytes;
* tensor ``t<i>`` (``U8``) for the i-th tensor of the target in file order: its sparse changes
  against its base tensor, or its bytes whole when it has no base here (a new name, another
  dtype or length, a block stored on another host) or its changes would not be smaller;
* ``__metadata__``: ``paramstore_patch`` (this format), ``target`` (object digest), ``base``
  (step), ``size`` (the target's bytes) and ``spans``: a JSON list, per target tensor, of
  ``[begin, end, dtype, base object or "", base offset, changed elements, gap width]``; and
  ``paramstore_digests`` (:data:`paramstore.format.DIGESTS_KEY`): the piece digests of its own
  tensors, so that hosts fetching it at once relay it block by block, each block verified alone
  (:func:`paramstore.format.listed_digests`), as they do the objects a manifest lists. Patch
  objects written before it are fetched as a whole.

Example:
    >>> import torch
    >>> from paramstore import ParamStore
    >>> from paramstore.delta import make_patches, patch_summary
    >>> w = torch.zeros(4096)
    >>> s = ParamStore(root, patches=True)
    >>> s.commit(1, {"w": w}).result().step
    1
    >>> w[7] = 1.0
    >>> s.commit(2, {"w": w}).result().step
    2
    >>> s.flush().step  # waits for the patches too
    2
    >>> [(base, target, info["changed"]) for (base, target), info in sorted(patch_summary(s._root).items())]
    [(1, 2, 1)]
    >>> s.close()
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import CorruptObjectError, VersionNotFoundError
from .format import (DIGESTS_KEY, TensorSpec, header_layout, layout, loads, object_digest, parse_header,
                     piece_hasher, pieces, pieces_root, read_header, tensor_pieces, tensor_spans)
from .patch import Frame, encode, open_frame, run_all
from .objects import read_manifest
from .reports import FetchReport, PatchReport
from .staging import storage_error, tmp_name
from .writer import Writer

if TYPE_CHECKING:
    from .manifest import Manifest
    from .root import StoreRoot
    from .staging import SlabPool

__all__ = ["Patcher", "make_patches", "encode_patches", "write_patches", "rebuild", "rebuild_all", "fetch_by_patches", "plan_chain", "patch_summary",
           "PATCH_OBJECT_FORMAT", "DEFAULT_MAX_RATIO", "MAX_CHAIN"]

#: The patch-object format this paramstore writes and reads.
PATCH_OBJECT_FORMAT = "1"
#: A patch object is kept only when it is at most this fraction of the object it rebuilds.
DEFAULT_MAX_RATIO = 0.5
#: The longest chain of patches a checkout follows (versions rebuilt on the way, the last included).
MAX_CHAIN = 8
#: How long a checkout waits for the patches of a version whose writer makes patches (the version
#: before it has them) before it moves whole objects.
WAIT_FOR_PATCHES_S = 10.0

_Key = tuple[str, tuple[int, ...]]  # (tensor name, block offsets): a tensor's identity across versions


# -- making ------------------------------------------------------------------------------------
def make_patches(root: "StoreRoot", base: int, target: int, *, max_ratio: float = DEFAULT_MAX_RATIO,
                 lock: bool = True, announce: Callable[[list[str]], None] | None = None) -> dict[str, tuple[str, int]]:
    """Make, store and record the patch objects rebuilding ``target``'s new objects from ``base``.

    "New" objects are those of ``target`` that ``base`` does not reference and this host holds.
    Returns ``{target object: (patch object, size)}`` as recorded (empty when nothing was worth a
    patch, or when either version went meanwhile). Raises VersionNotFoundError if a version is gone
    before its manifest was read. ``lock``: hold the host's GC lock (shared) from the first patch
    object placed until the record is written, so GC cannot sweep them in between. ``announce``:
    called with the patch objects before the record is written (a peer server serves them: readers
    the record wakes find them announced).
    """
    reg = root.registry
    made = encode_patches(root, reg.get_manifest(base), reg.get_manifest(target), base, max_ratio)
    if not made:
        reg.add_patches(base, target, {})  # made, none worth keeping: readers waiting for them go on
        return {}
    with (root.gc_lock() if lock else contextlib.nullcontext()):
        out = write_patches(root, made)
        if announce is not None:
            announce(sorted({p for p, _ in out.values()}))
        return out if reg.add_patches(base, target, out) else {}


class _Encoded(NamedTuple):
    """A patch object made, not yet written (:func:`write_patches`)."""

    header: bytes
    blobs: list[bytes]  # its tensors' bytes, in file order
    meta: dict[str, str]  # its header's ``__metadata__``
    digests: list[str]  # its tensors' digests, in file order


def encode_patches(root: "StoreRoot", base_m: "Manifest", target_m: "Manifest", base: int,
                   max_ratio: float = DEFAULT_MAX_RATIO) -> dict[str, _Encoded]:
    """The patch objects (not yet written: :func:`write_patches`) rebuilding the objects of
    ``target_m`` that ``base_m`` does not reference and this host holds, each from the objects of
    ``base_m`` (version ``base``) holding the same tensor (name, block) in the same dtype and
    length; only those at most ``max_ratio`` of their object. Works on any two manifests: a
    version's, or its derived form's (:func:`paramstore.derived.make_patches`)."""
    tier = root.tier
    bases = {(name, c.offsets): (e.dtype, c) for name, e in base_m.stored() for c in e.pieces()}
    where = {(c.object, c.offset): (name, c.offsets) for name, e in target_m.stored() for c in e.pieces()}
    todo = sorted(o for o in target_m.objects() - base_m.objects() if tier.exists(o))
    made: dict[str, _Encoded] = {}
    with _Maps(tier) as maps:
        for obj in todo:
            try:
                patch = _make_one(maps, obj, base, where, bases, max_ratio)
            except FileNotFoundError:  # collected meanwhile (its version was pruned)
                continue
            if patch is not None:
                made[obj] = patch
    return made


def write_patches(root: "StoreRoot", made: Mapping[str, _Encoded]) -> dict[str, tuple[str, int]]:
    """Place the patch objects of :func:`encode_patches` in the tier: ``{object: (patch, size)}``.
    The caller holds the GC lock (shared) until a record names them."""
    return {obj: _write(root, patch) for obj, patch in made.items()}


def _make_one(maps: "_Maps", obj: str, base: int, where: Mapping[tuple[str, int], _Key],
              bases: Mapping[_Key, tuple[str, Any]], max_ratio: float
              ) -> _Encoded | None:
    """The header, blobs and tensor digests of the patch object for ``obj``, or None if not worth it."""
    buf = maps.get(obj)
    size = len(buf)
    start, entries = parse_header(buf)
    dtypes = {start + int(e["data_offsets"][0]): e["dtype"] for e in entries.values()}
    budget = int(max_ratio * size)
    blobs: list[bytes] = [bytes(buf[:start])]
    spans: list[list[Any]] = []
    total = start
    for begin, end in tensor_spans(buf)[1]:
        dtype, n = dtypes[begin], end - begin
        key = where.get((obj, begin))
        ref = bases.get(key) if key is not None else None
        enc = None
        if ref is not None and ref[0] == dtype and ref[1].nbytes == n and n and maps.has(ref[1].object):
            base_buf = maps.get(ref[1].object)[ref[1].offset : ref[1].offset + n]
            enc = encode(base_buf, buf[begin:end], dtype, max_bytes=n // 2)
        if enc is None:
            blobs.append(bytes(buf[begin:end]))
            spans.append([begin, end, dtype, "", 0, 0, 0])
        else:
            blobs.append(enc.frame)
            spans.append([begin, end, dtype, ref[1].object, ref[1].offset, enc.changed, enc.gap_width])  # type: ignore[index]
        total += len(blobs[-1])
        if total > budget:
            return None
    hashed = [tensor_pieces(b) for b in blobs]  # in file order: tensors of one item size keep theirs
    meta = {"paramstore_patch": PATCH_OBJECT_FORMAT, "target": obj, "base": str(base), "size": str(size),
            "spans": json.dumps(spans, separators=(",", ":")),
            DIGESTS_KEY: json.dumps([list(p) or [d] for d, p in hashed], separators=(",", ":"))}
    plan = layout([TensorSpec("head", "U8", (len(blobs[0]),)),
                   *(TensorSpec(f"t{i}", "U8", (len(b),)) for i, b in enumerate(blobs[1:]))], meta)
    return _Encoded(plan.header, blobs, meta, [d for d, _ in hashed])


def _write(root: "StoreRoot", patch: _Encoded) -> tuple[str, int]:
    """Place a patch object in the tier (written, fsynced, renamed); returns (digest, size)."""
    header, blobs = patch.header, patch.blobs
    digest = object_digest(header, patch.digests)
    path = os.path.join(root.tier.tmp_dir, tmp_name())
    try:
        with open(path, "xb") as f:
            f.write(header)
            for b in blobs:
                f.write(b)
        root.tier.put(digest, path, move=True)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return digest, len(header) + sum(len(b) for b in blobs)


# -- reading -----------------------------------------------------------------------------------
class _Patch(NamedTuple):
    """A patch object as read, every field checked (:func:`_read_patch`)."""

    target: str  # the digest of the object it rebuilds
    size: int  # that object's size
    spans: list[tuple[int, int, str, str, int, int, int]]  # begin, end, dtype, base object, base offset, changed, width
    views: dict[str, memoryview]  # "head" and "t<i>": views of the patch object's bytes


def _read_patch(buf: memoryview) -> _Patch:
    """A patch object's fields and tensors (as views of ``buf``); CorruptObjectError for anything that
    is not a well-formed patch object (it may come from a hostile bucket or peer: every field is
    checked here, before anything is allocated from it)."""
    try:
        start, entries, meta = read_header(buf)
        if meta.get("paramstore_patch") != PATCH_OBJECT_FORMAT:
            raise ValueError(f"not a patch object of format {PATCH_OBJECT_FORMAT}")
        views = {}
        for name, e in entries.items():
            begin, end = e["data_offsets"]
            if not (type(begin) is int and type(end) is int and 0 <= begin <= end <= len(buf) - start):
                raise ValueError(f"{name!r} lies outside the patch object")
            views[name] = buf[start + begin : start + end]
        spans = [_span(s) for s in loads(meta["spans"], list)]
        target, size = meta["target"], int(meta["size"])
        int(meta["base"])
        if not isinstance(target, str) or size < 0:
            raise ValueError("bad target or size")
        if "head" not in views or any(f"t{i}" not in views for i in range(len(spans))):
            raise ValueError("a tensor of the patch object is missing")
        tensor_spans(views["head"], size)  # the header it carries must end its tensors at ``size``
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptObjectError(f"malformed patch object: {e}") from None
    return _Patch(target, size, spans, views)


def _span(s: Any) -> tuple[int, int, str, str, int, int, int]:
    """One ``spans`` entry of a patch object, type-checked (ValueError if it is not one)."""
    if not isinstance(s, list) or len(s) != 7 or not all(type(s[i]) is int for i in (0, 1, 4, 5, 6)) \
            or not isinstance(s[2], str) or not isinstance(s[3], str):
        raise ValueError(f"bad span {str(s)[:80]}")
    return tuple(s)  # type: ignore[return-value]


def rebuild(root: "StoreRoot", pool: "SlabPool | None", patch: str, target: str, size: int) -> int:
    """Rebuild object ``target`` of ``size`` bytes (as the version's record says) from the patch
    object ``patch`` (both named by digest; the patch and its base objects are on this host), check
    its digest, and place it.

    One pass over the object (:func:`_apply`): each block is read from its base (``pread``: the
    base is not mapped), patched, hashed and written while it is in cache, pieces side by side on a
    thread per core this process may run on; the digest of what was written (every piece, the
    tensor digests over them, the header) must be ``target``. Where it is written:

    * ``pool`` given: into one of its slabs (a pre-faulted one when the pool has one ready: the
      fastest rebuild, its pages faulted beforehand in the background), unmapped once placed;
    * ``pool`` None: into a new file of the tier's ``tmp/``, with ``pwrite`` (no page tables set up
      or torn down, no slab faulted: the least CPU in all, but the fresh pages are allocated on this
      path, and one write at a time).

    Returns the target's size. Raises CorruptObjectError (nothing placed, nothing allocated) for a
    malformed patch, a patch for another object or of another size, or a result whose digest is not
    ``target`` (a damaged patch or base); FileNotFoundError if the patch or a base object is not here;
    StorageFullError if the tier's filesystem is full (nothing placed either way, nothing left).
    """
    tier = root.tier
    with _Maps(tier) as maps, _Bases(tier) as bases:
        got = _read_patch(maps.get(patch))
        if got.target != target or got.size != size:
            raise CorruptObjectError(f"patch {patch[:12]}… rebuilds {got.target[:12]}… of {got.size} bytes, not "
                                     f"{target[:12]}… of {size}")
        slab, fd, buf = None, -1, None
        if pool is not None:
            slab = pool.take(size)
            path, buf = slab.path, memoryview(slab.map)
        else:
            path = os.path.join(tier.tmp_dir, tmp_name())
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise storage_error(e, tier.tmp_dir, size, "an object rebuilt from a patch") from e
        error, placed = None, False
        try:
            try:
                digest = _apply(bases, got, buf if buf is not None else fd)
                if digest != target:
                    error = (f"rebuilt an object hashing to {digest[:12]}…, not {target[:12]}…: a damaged patch "
                             "or base")
            except CorruptObjectError as e:  # (the exception's frames, which may view the slab, go here)
                error = str(e)
            except FileNotFoundError:
                raise
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):  # writing the file: a full filesystem
                    raise storage_error(e, tier.tmp_dir, size, "an object rebuilt from a patch") from e
                raise
            except (ValueError, KeyError, TypeError, IndexError) as e:
                error = f"does not apply: {e}"
            if error is not None:
                raise CorruptObjectError(f"patch {patch[:12]}… {error}")
            if fd >= 0:
                os.close(fd)
                fd = -1
            tier.put(target, path, move=True)  # (a slab is unmapped after: the object is visible sooner)
            placed = True
        finally:
            if fd >= 0:
                os.close(fd)
            if slab is not None and placed:
                buf.release()  # type: ignore[union-attr]
                pool.retire(slab)  # type: ignore[union-attr]
            elif slab is not None:
                _drop(slab, buf)  # type: ignore[arg-type]
            elif not placed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    return size


def _drop(slab: Any, buf: memoryview) -> None:
    """Delete a slab that did not become an object (its map is closed once nothing views it)."""
    try:
        buf.release()
        slab.close()
    except BufferError:
        pass
    with contextlib.suppress(FileNotFoundError):
        os.unlink(slab.path)


#: Bytes of a tensor stored whole in a patch that a rebuild hashes and writes at a time (a patched
#: tensor goes a chunk of its frame at a time, at most as much): hashed while in cache.
_BLOCK = 1 << 21
#: Pieces are handed to the threads in jobs of at least this many bytes (consecutive pieces, so a
#: shard of many small tensors is not handed over tensor by tensor).
_JOB_BYTES = 8 << 20


class _Piece(NamedTuple):
    """One piece of one tensor of the object a patch rebuilds: what writes and hashes it."""

    at: int  # the tensor's offset in the object
    begin: int  # the piece, relative to the tensor
    end: int
    blob: memoryview | None  # the tensor's bytes, when the patch carries it whole
    frame: Frame | None  # else its changes against its base:
    base: int  # the base object (a descriptor)
    base_at: int  # and the tensor's offset there


def _apply(bases: "_Bases", patch: _Patch, out: memoryview | int) -> str:
    """Write the object ``patch`` rebuilds into ``out`` — a writable buffer of its size (a slab's
    map), or a file descriptor (an empty file, written with ``pwrite``) — and return the object
    digest of what was written, in one pass over its bytes: each piece of each tensor (the rule its
    header names: :func:`paramstore.format.header_layout`) goes a block at a time (a frame chunk read
    from its base into its place in ``out``, or into this thread's buffer for a file, and patched in
    place; or a block of a tensor the patch carries whole), each block hashed while it is in cache;
    pieces side by side on the threads that decode patches (:func:`paramstore.patch.run_all`).

    Raises ValueError (CorruptObjectError for a frame or a count of changes that is not right) for a
    patch that does not apply: a header that is not the object's, spans that are not its tensors, a
    base range outside its object; FileNotFoundError when a base object is not here; OSError when
    writing a file fails. ``out`` then holds no particular bytes, and no thread writes into it any more.
    """
    head = patch.views["head"]
    start, spans, piece_size = header_layout(head, patch.size)
    if start != len(head) or [(s[0], s[1]) for s in patch.spans] != spans:
        raise ValueError("its spans are not the tensors of the header it carries")
    units: list[_Piece] = []
    frames: list[tuple[Frame, int, int]] = []  # each patched tensor's frame and its units [first, last)
    for i, (begin, end, dtype, bobj, boff, changed, width) in enumerate(patch.spans):
        blob, n = patch.views[f"t{i}"], end - begin
        ranges = pieces(n, piece_size)
        if bobj:
            base, base_size = bases.open(bobj)
            if not 0 <= boff <= boff + n <= base_size:
                raise ValueError(f"base range {boff}..{boff + n} outside object {bobj[:12]}…")
            frame = open_frame(blob, n, dtype, changed, width)
            frames.append((frame, len(units), len(units) + len(ranges)))
            units += [_Piece(begin, pb, pe, None, frame, base, boff) for pb, pe in ranges]
        elif len(blob) != n:
            raise ValueError(f"tensor {i} is {len(blob)} bytes, its span {n}")
        else:
            units += [_Piece(begin, pb, pe, blob, None, -1, 0) for pb, pe in ranges]
    jobs: list[list[_Piece]] = [[]]
    size = 0
    for u in units:  # consecutive pieces, at least _JOB_BYTES a job
        if size >= _JOB_BYTES:
            jobs.append([])
            size = 0
        jobs[-1].append(u)
        size += u.end - u.begin
    if isinstance(out, int):
        into: _Slab | _File = _File(out)
    elif len(out) != patch.size:
        raise ValueError(f"a buffer of {len(out)} bytes for an object of {patch.size}")
    else:
        into = _Slab(out)
    into.write(head, 0)
    done = [r for rs in run_all(_write_pieces, [(into, job) for job in jobs]) for r in rs]
    for frame, first, last in frames:
        frame.check(sum(count for _, count in done[first:last]))
    digests, k = [], 0
    for begin, end in spans:
        ds = [d for d, _ in done[k : k + len(pieces(end - begin, piece_size))]]
        k += len(ds)
        digests.append(ds[0] if len(ds) == 1 else pieces_root(ds, end - begin))
    return object_digest(head, digests)


_SCRATCH = threading.local()


def _write_pieces(into: "_Slab | _File", job: list[_Piece]) -> list[tuple[str, int]]:
    """Write and hash the pieces of ``job`` (one thread): each ``(piece digest, changes decoded)``."""
    done = []
    for u in job:
        h, count = piece_hasher(), 0
        if u.frame is None:
            assert u.blob is not None
            for lo in range(u.begin, u.end, _BLOCK):
                block = u.blob[lo : min(lo + _BLOCK, u.end)]
                h.update(block)
                into.write(block, u.at + lo)
        else:
            step = u.frame.chunk_bytes
            for lo in range(u.begin, u.end, step):
                n = min(lo + step, u.end) - lo
                block = into.block(u.at + lo, n)
                if os.preadv(u.base, [block], u.base_at + lo) != n:
                    raise ValueError(f"its base object ends before byte {u.base_at + lo + n}")
                count += u.frame.decode_chunk(lo // step, block)
                h.update(block)
                into.finish(block, u.at + lo)
        done.append((h.hexdigest(), count))
    return done


class _Slab:
    """A rebuild's destination in memory (a slab's map): blocks are built in place."""

    def __init__(self, buf: memoryview) -> None:
        self._buf = buf

    def block(self, at: int, n: int) -> memoryview:
        """Where to build bytes ``[at, at + n)``: in place."""
        return self._buf[at : at + n]

    def finish(self, block: memoryview, at: int) -> None:
        """``block`` (from :meth:`block`) holds its final bytes: nothing to do, they are in place."""

    def write(self, data: memoryview | bytes, offset: int) -> None:
        """Copy ``data`` to ``offset``."""
        self._buf[offset : offset + len(data)] = data


def _scratch(size: int) -> memoryview:
    """This thread's buffer of at least ``size`` bytes (kept: its pages are faulted once per thread)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < size:
        buf = _SCRATCH.buf = memoryview(bytearray(max(size, _BLOCK)))
    return buf


class _File:
    """A rebuild's destination file, written one ``pwrite`` at a time: blocks are built in this
    thread's buffer. (tmpfs takes a file's lock for every write, and threads writing one file at
    once spun on it: a 256 MiB rebuild on 2 threads took 0.8 CPU-s and 1.8 s instead of ~0.15 and
    ~0.15; they wait here instead, asleep, while the others read, patch and hash.)"""

    def __init__(self, fd: int) -> None:
        self._fd, self._lock = fd, threading.Lock()

    def block(self, at: int, n: int) -> memoryview:
        """Where to build bytes ``[at, at + n)``: this thread's buffer."""
        return _scratch(n)[:n]

    def finish(self, block: memoryview, at: int) -> None:
        """``block`` (from :meth:`block`) holds its final bytes: write them at ``at``."""
        self.write(block, at)

    def write(self, data: memoryview | bytes, offset: int) -> None:
        """All of ``data`` at ``offset`` (OSError if the file cannot take it: a full filesystem)."""
        view = memoryview(data)
        with self._lock:
            while view.nbytes:
                n = os.pwritev(self._fd, [view], offset)
                view, offset = view[n:], offset + n


# -- using -------------------------------------------------------------------------------------
def plan_chain(root: "StoreRoot", step: int, missing: set[str], *, depth: int = MAX_CHAIN
               ) -> list[tuple[int, int, dict[str, str]]]:
    """The patch records to apply, in order, to rebuild ``missing`` objects of ``step`` from a
    version whose objects are all on this host: ``[(base, target, {object: patch})]``, the last
    one's target being ``step``; empty when no chain exists or its patches are not smaller than
    what they rebuild. Intermediate versions must be rebuilt whole by their record."""
    reg, tier = root.registry, root.tier
    records: dict[int, list[tuple[int, dict[str, str]]]] = {}
    for (b, t), pairs in reg.patches().items():
        if b < t <= step:
            records.setdefault(t, []).append((b, pairs))
    if step not in records:
        return []
    objects: dict[int, set[str] | None] = {}

    def objects_of(s: int) -> set[str] | None:
        if s not in objects:
            try:
                objects[s] = read_manifest(root, s).objects()  # the base's: read at its checkout, cached
            except VersionNotFoundError:
                objects[s] = None
        return objects[s]

    def search(t: int, need: set[str], left: int) -> list[tuple[int, int, dict[str, str]]] | None:
        for b, pairs in sorted(records.get(t, []), key=lambda r: -r[0]):  # the newest base first
            if not need & pairs.keys():
                continue
            have = objects_of(b)
            if have is None:
                continue
            lacking = {o for o in have if not tier.exists(o)}
            if not lacking:
                return [(b, t, pairs)]
            if left > 1:
                sub = search(b, lacking, left - 1)
                if sub and lacking <= sub[-1][2].keys():
                    return [*sub, (b, t, pairs)]
        return None

    chain = search(step, missing, depth) or []
    if chain:
        patches = {p for _, t, pairs in chain for o, p in pairs.items() if t != step or o in missing}
        full = sum(reg.object_sizes(missing & chain[-1][2].keys()).values())
        if sum(reg.object_sizes(patches).values()) >= full:
            return []
    return chain


def fetch_by_patches(root: "StoreRoot", pool: "SlabPool | None", step: int, manifest: "Manifest",
                     report: "FetchReport", get: Callable[[Mapping[str, int]], int]) -> None:
    """Rebuild the objects of ``step`` this host lacks from patches where a chain exists
    (:func:`plan_chain`); ``get(sizes)`` moves patch objects here (from peers) and returns the
    bytes it moved. ``pool``: where the rebuilds write (:func:`rebuild`: its slabs, or new files
    when None). What was rebuilt goes into ``report`` (``from_patches``, ``patch_bytes``,
    ``rejected["patch"]``); what was not is left for whole-object fetches."""
    tier, reg = root.tier, root.registry
    missing = {o for o in manifest.objects() if not tier.exists(o)}
    try:
        await_patches(root, step, WAIT_FOR_PATCHES_S)
        chain = plan_chain(root, step, missing)
    except VersionNotFoundError:
        return
    for base, target, pairs in chain:
        try:
            objects = manifest.objects() if target == step else reg.get_manifest(target).objects()
        except VersionNotFoundError:
            return  # pruned meanwhile: the rest moves whole
        todo = sorted(o for o in objects if o in pairs and not tier.exists(o))
        sizes = reg.object_sizes(todo)
        wanted = reg.object_sizes({pairs[o] for o in todo if not tier.exists(pairs[o])})
        rebuild_all(root, pool, {o: (pairs[o], sizes[o]) for o in todo}, wanted, report, get)
        if target != step and not all(tier.exists(o) for o in objects):
            return  # an intermediate version is incomplete: the rest moves whole


def rebuild_all(root: "StoreRoot", pool: "SlabPool | None", todo: Mapping[str, tuple[str, int]],
                wanted: Mapping[str, int], report: "FetchReport", get: Callable[[Mapping[str, int]], int]) -> None:
    """Rebuild each ``object: (patch, object size)`` of ``todo`` (:func:`rebuild`), after moving
    the patch objects this host lacks (``wanted``: their sizes) with ``get``. Rebuilt objects go
    to ``report.from_patches``, the patch bytes moved to ``patch_bytes``, a patch that does not
    rebuild its object to ``rejected["patch"]`` (with a warning); every object not rebuilt is left
    to be fetched whole."""
    if wanted:
        report.patch_bytes += get(wanted)
    for obj, (patch, size) in todo.items():
        try:
            rebuild(root, pool, patch, obj, size)
        except FileNotFoundError:
            continue  # the patch did not come, or a base was collected: moved whole instead
        except CorruptObjectError as e:
            report.rejected["patch"] += 1
            warnings.warn(f"paramstore: {e}; the object is fetched whole", RuntimeWarning, stacklevel=3)
            continue
        report.from_patches.append(obj)


#: (store root, writer run id) of the writers a wait for patches ran out on: not waited for again
#: until a version of theirs is found with its patches (a writer on another host cannot be checked).
_STALLED: set[tuple[str, str]] = set()


def await_patches(root: "StoreRoot", step: int, timeout: float) -> bool:
    """Wait (up to ``timeout`` seconds) for the patches of ``step`` when its writer makes patches
    (the registry's ``"patches"`` value names the writer's run id: :class:`Patcher` sets it), is
    still the store's writer and alive (:func:`_patcher_gone`), and an older version exists. The
    writer records even an empty set, so this returns as soon as they are made. A wait that runs
    out is remembered for the store and writer: the next checkouts do not wait for it (until one
    finds its patches made). True if ``step`` has a patch record now."""
    reg = root.registry
    writer = reg.get_version(step).writer
    key = (root.path, writer)
    if reg.patches(step):
        _STALLED.discard(key)
        return True
    if (not writer or key in _STALLED or reg.get_meta("patches") != writer or _patcher_gone(reg, writer)
            or not any(v.step < step for v in reg.versions())):
        return False
    deadline = time.monotonic() + timeout
    with reg.watch() as watch:
        while not reg.patches(step):
            left = deadline - time.monotonic()
            if left <= 0:
                _STALLED.add(key)
                return False
            watch.wait(min(left, 1.0))
    return True


def _patcher_gone(reg: Any, writer: str) -> bool:
    """Whether the writer ``writer`` (a run id) makes no more patches: the store's writer record
    names another run, or none (released at a clean close), or its process on this host is dead
    (checked as :mod:`paramstore.writer` does; one on another host is assumed alive)."""
    raw = reg.get_meta("writer")
    current = Writer.from_text(raw) if raw else None
    return current is None or current.run_id != writer or not current.alive()


def patch_summary(root: "StoreRoot", target: int | None = None) -> dict[tuple[int, int], dict[str, int]]:
    """For each patch record (of ``target`` only, when given): ``(base, target) -> {"objects": n,
    "bytes": size of its patch objects, "changed": number of target objects it rebuilds}``
    (what ``du`` and ``show`` report)."""
    reg = root.registry
    records = reg.patches(target)
    sizes = reg.object_sizes({p for pairs in records.values() for p in pairs.values()})
    return {pair: {"objects": len(set(pairs.values())), "bytes": sum(sizes.get(p, 0) for p in set(pairs.values())),
                   "changed": len(pairs)} for pair, pairs in records.items()}


# -- the committing process's thread -------------------------------------------------------------
class Patcher:
    """Makes the patches of each committed version against the version before it, on a daemon
    thread of the committing process. At most one version waits: a newer commit replaces it (a
    patch nobody made costs a whole-object fetch, never correctness).

    Args:
        root: the store.
        writer: the committing process's run id. When it is the writer of a version it submits
            (a sharded commit's lead; every other committer), it is recorded in the registry as
            the writer that makes patches, so readers of its versions wait for them
            (:func:`await_patches`).
        max_ratio: see :data:`DEFAULT_MAX_RATIO`.
    """

    def __init__(self, root: "StoreRoot", writer: str, *, max_ratio: float = DEFAULT_MAX_RATIO,
                 announce: Callable[[list[str]], None] | None = None) -> None:
        self._root, self._max_ratio, self._writer, self._announce = root, max_ratio, writer, announce
        self._announced = False
        self._pending: int | None = None
        self._prev: int | None = None
        self._lock = threading.Condition()
        self._done = -1  # the newest step handled (an older one still waiting is skipped)
        self._asked = -1  # the newest step submitted
        self._submitted: list[int] = []  # steps submitted and not yet handled
        self.last: PatchReport | None = None
        self._thread = threading.Thread(target=self._loop, name="paramstore-patcher", daemon=True)
        self._thread.start()

    def submit(self, step: int, writer: str | None = None) -> None:
        """Make the patches of ``step`` (just committed, by ``writer``) when the thread gets to it."""
        if writer == self._writer and not self._announced:
            reg = self._root.registry
            current = reg.get_meta("patches")
            if current != writer:
                reg.swap_meta("patches", current, writer)
            self._announced = True
        with self._lock:
            self._pending = step
            self._submitted.append(step)
            self._asked = max(self._asked, step)
            self._lock.notify_all()

    def wait(self, step: int, timeout: float | None = None, *, submitted: bool = True) -> bool:
        """Block until the patches of ``step`` (or of a newer version) are made; False on timeout.
        ``submitted=False``: return at once unless ``step`` (or a newer one) was submitted already
        (a version committed before this process started, say)."""
        with self._lock:
            return self._lock.wait_for(lambda: self._done >= step or (not submitted and self._asked < step), timeout)

    def close(self) -> None:
        with self._lock:
            self._pending = -1
            self._lock.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending is not None)
                step, self._pending = self._pending, None
                if step == -1:
                    return
                skipped = [s for s in self._submitted if s < step]
                self._submitted = [s for s in self._submitted if s > step]
            self._skip(skipped)
            try:
                self.last = self._make(step)  # type: ignore[arg-type]
            finally:
                with self._lock:
                    self._done = max(self._done, step)  # type: ignore[type-var]
                    self._lock.notify_all()

    def _skip(self, steps: list[int]) -> None:
        """Record that no patches will come for versions a newer commit overtook (readers waiting
        for them go on with whole objects)."""
        for s in steps:
            try:
                base = self._base(s)
                if base is not None:
                    self._root.registry.add_patches(base, s, {})
            except Exception:  # noqa: BLE001 - readers then wait their bounded time, nothing worse
                pass

    def _base(self, step: int) -> int | None:
        """The newest version before ``step``."""
        reg = self._root.registry
        prev = self._prev
        if prev is not None and prev < step:
            try:
                reg.get_version(prev)
                newer = [v.step for v in reg.versions(after=prev) if v.step < step]
                return newer[-1] if newer else prev
            except VersionNotFoundError:
                pass
        older = [v.step for v in reg.versions() if v.step < step]
        return older[-1] if older else None

    def _make(self, step: int) -> PatchReport:
        t0 = time.monotonic()
        report = PatchReport(None, step)
        try:
            report.base = self._base(step)
            self._prev = step
            if report.base is not None:
                report.patches = make_patches(self._root, report.base, step, max_ratio=self._max_ratio,
                                              announce=self._announce)
        except VersionNotFoundError as e:
            report.error = str(e)  # pruned before its patches were made: nothing to do
        except Exception as e:  # noqa: BLE001 - the thread must live on: a patch is never needed
            report.error = f"{type(e).__name__}: {e}"
            warnings.warn(f"paramstore: the patches of step {step} were not made: {report.error}", RuntimeWarning,
                          stacklevel=1)
        report.seconds = time.monotonic() - t0
        return report


class _Bases:
    """The base objects a rebuild reads, each opened once (read-only descriptors), closed together."""

    def __init__(self, tier: Any) -> None:
        self._tier = tier
        self._open: dict[str, tuple[int, int]] = {}

    def open(self, digest: str) -> tuple[int, int]:
        """``(descriptor, size)`` of object ``digest``; FileNotFoundError if it is not here."""
        if digest not in self._open:
            fd = os.open(self._tier.object_path(digest), os.O_RDONLY | os.O_CLOEXEC)
            self._open[digest] = (fd, os.fstat(fd).st_size)
        return self._open[digest]

    def __enter__(self) -> "_Bases":
        return self

    def __exit__(self, *exc: object) -> None:
        for fd, _ in self._open.values():
            os.close(fd)
        self._open.clear()


class _Maps:
    """Read-only maps of objects, opened once each and closed together."""

    def __init__(self, tier: Any) -> None:
        self._tier, self._maps = tier, {}  # type: ignore[var-annotated]
        self._views: dict[str, memoryview] = {}

    def has(self, digest: str) -> bool:
        if digest in self._views:
            return True
        try:
            self.get(digest)
        except FileNotFoundError:
            return False
        return True

    def get(self, digest: str) -> memoryview:
        if digest not in self._views:
            m = self._tier.map(digest)
            self._maps[digest] = m
            self._views[digest] = memoryview(m)
        return self._views[digest]

    def __enter__(self) -> "_Maps":
        return self

    def __exit__(self, *exc: object) -> None:
        for v in self._views.values():
            v.release()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a view of it is still referenced: unmapped when that goes
                pass
