"""Derived objects: a version in the form an engine runs (issue 29, item 2), made once and shared by content.

``store.checkout(v, recipe="fp8-block128")``, ``store.prefetch(v, recipe=...)`` and
``store.export(v, dir, recipe=...)`` give version ``v`` as :mod:`paramstore.recipes` derives it:
each tensor the recipe's predicate accepts replaced by what its ``convert`` makes of it (an FP8
weight and its scale), every other tensor as committed. The result is exactly
``recipes.derive(recipe, dict(snapshot))`` of the version's own snapshot, names tied at commit
included (a tied name the recipe does not convert keeps the committed bytes).

**Made once, shared by content.** What a recipe makes of an object is a pure function of the
object's digest and the recipe's name and version: the *unit* of derivation is one source object
(every tensor its safetensors header names, under that name), and its result one *derived
object*: an ordinary content-addressed safetensors object of the local tier (written to ``tmp/``,
hashed, renamed into ``objects/`` by :meth:`LocalTier.put <paramstore.backends.tiers.local.LocalTier.put>`,
as a commit places its objects). Two derivers of the same unit, in any processes, write the same
bytes (the recipes are exact: see :mod:`paramstore.recipes`) under the same name; the rename is
atomic, so they end with one valid object. The mapping from a unit to its result is a small JSON
*record* in the store's registry, under ``<recipe>@<version>/<source object digest>``
(:meth:`Registry.swap_derived <paramstore.backends.registries.base.Registry.swap_derived>`): the
derived objects and their sizes, and for each converted tensor its byte range in the source and
the entries of its outputs. A record is created once (the first writer wins, the others adopt it)
and read by every later checkout, in any process; so a version that shares unchanged objects with
an earlier one derives only its changed objects.

**Shared between hosts.** With a shared registry (redis), every host reads the records any host
wrote. A host that needs a unit whose record names derived objects it lacks asks for them as for
any object (``elsewhere``: the checkout's fetcher, from the peers that serve them, then the
remote, each verified against its digest as it arrives), and derives the unit itself only if
nobody can deliver them; a record the registry lacks is looked for in the remote too (where
:meth:`Remote.push <paramstore.remote.Remote.push>` puts the records of the versions it pushes);
derived objects are ordinary objects of the tier, so every peer server serves them. So a recipe's
work is done once per changed object in the whole cluster, by the first host that asks. With
patches (a trainer with ``derive=`` and ``patches=``: :func:`make_patches`), a record also names a
patch for each of its derived objects against the previous version's derived objects; a host that
holds those moves the patch and rebuilds the object (verified) instead of moving it whole.

A tensor that the version names otherwise than its object does (its bytes deduplicated against
another tensor's, a chunked tensor of a sharded commit, a tied name) is a unit of its own, keyed
by the blake3 of its name, dtype, shape and pieces (``t-<key>``): its derivation then reads
the tensor as the version names it.

**Lifetimes.** A derived object is referenced by no version: GC's mark phase (:func:`mark`, called
by :func:`paramstore.maintenance.gc` under the exclusive GC lock) keeps every derived object whose
record's source objects are still referenced, and drops the records whose sources are not, so
their derived objects are swept with their source. A leased version's objects are referenced, so
a checked-out derived snapshot keeps its derived objects too. A deriver holds the GC lock shared
from the rename of its objects until its record is written, as a commit does until it publishes.

No pickle anywhere: records are JSON read through :func:`paramstore.format.loads`, every digest
and entry checked before it names a file. A record that does not parse, or whose objects are
missing or of another size, is derived again and replaced.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol

import blake3

from . import delta
from .errors import CorruptObjectError, InvalidArgumentError, ParamStoreError, UnsafeStoreError
from .format import DATA_ALIGN, PIECE_SIZES, TensorSpec, layout, loads, object_digest, read_header, tensor_pieces
from .manifest import ASSET_PREFIX, Manifest, TensorEntry
from .objects import quarantine
from .root import StoreRoot
from .staging import tmp_name
from .validate import check_digest

if TYPE_CHECKING:
    import torch

    from .staging import Slab, SlabPool

    from .recipes import Recipe
    from .snapshot import Snapshot

__all__ = ["RECORD_FORMAT", "Elsewhere", "record_objects", "DeriveReport", "recipe_key", "derive_manifest", "checkout", "mark",
           "records", "make_patches"]

class Elsewhere(Protocol):
    """Where a derivation looks for what another host made: the checkout's fetcher
    (:meth:`paramstore.checkout.Fetcher.elsewhere`)."""

    def record(self, key: str) -> bytes | None:
        """The derived record ``key`` as another store keeps it (the remote), or None."""

    def objects(self, sizes: dict[str, int], entries: Iterable[TensorEntry] = ()) -> None:
        """Bring these derived objects here (peers, the remote), each verified against its digest;
        what nobody delivers stays absent (then it is derived here). ``entries``: their tensors
        (their records' outputs, with piece digests): an object whose tensors they list end to
        end is relayed between the hosts that want it block by block, its size and layout taken
        from them as from a manifest (:func:`paramstore.peer.fetch`)."""

    def patches(self, todo: dict[str, tuple[str, int]], wanted: dict[str, int]) -> None:
        """Rebuild derived objects from patches (``object: (patch, object size)``), after bringing
        the patch objects this host lacks (``wanted``: their sizes) from peers
        (:func:`paramstore.delta.rebuild_all`); what is not rebuilt stays absent."""
#: An output's digest and its piece digests (:func:`paramstore.format.tensor_pieces`), by its key in the object.
_Hashed = tuple[str, tuple[str, ...]]
#: The records' format (a record of another format is derived again).
RECORD_FORMAT = 1
_UNIT_DOMAIN = b"paramstore/derived-unit/v1\0"


@dataclass
class DeriveReport:
    """What deriving one version did: ``units`` looked up, of which ``derived`` were derived now
    (the others found made already), ``tensors`` converted now, ``objects`` and ``bytes`` written
    now, and the seconds it took. A checkout with a recipe carries it as ``snap.derived``."""

    recipe: str
    units: int = 0
    derived: int = 0
    tensors: int = 0
    objects: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Record:
    """A unit's result: its sources, its derived objects (digest -> size), and the outputs of each
    converted tensor, by (source byte range, or None for a tensor unit) and name."""

    sources: tuple[str, ...]
    objects: dict[str, int]
    outputs: dict[tuple[tuple[int, int] | None, str], dict[str, TensorEntry]] = field(default_factory=dict)
    #: derived object -> a patch rebuilding it: (patch object, its size, the objects it reads)
    patches: dict[str, tuple[str, int, tuple[str, ...]]] = field(default_factory=dict)


def recipe_key(recipe: "Recipe") -> str:
    """The name of a recipe's record folder: ``<name>@<version>``.

    Example:
        >>> from paramstore import recipes
        >>> recipe_key(recipes.get("fp8-block128"))
        'fp8-block128@1'
    """
    return f"{recipe.name}@{recipe.version}"


def resolve_recipe(recipe: "str | Recipe") -> "Recipe":
    """The :class:`~paramstore.recipes.Recipe` ``recipe`` names (InvalidArgumentError listing the
    known ones for an unknown name or another type)."""
    from . import recipes

    if not isinstance(recipe, (str, recipes.Recipe)):
        raise InvalidArgumentError(f"recipe must be a recipe's name or a Recipe, not {type(recipe).__name__}; "
                                   f"the known recipes are {', '.join(repr(n) for n in recipes.names())}")
    return recipes.get(recipe)


# -- records -------------------------------------------------------------------------------------
def _key(recipe: "Recipe", unit: str) -> str:
    """The registry key of ``unit``'s record: ``<recipe>@<version>/<unit>``."""
    return f"{recipe_key(recipe)}/{unit}"


def _encode(recipe: "Recipe", record: _Record) -> bytes:
    tensors = [{"span": None if span is None else list(span), "name": name,
                "outputs": {n: e.to_json() for n, e in sorted(outs.items())}}
               for (span, name), outs in sorted(record.outputs.items(), key=lambda kv: (kv[0][0] or (-1, -1), kv[0][1]))]
    d = {"format": RECORD_FORMAT, "recipe": recipe.name, "recipe_version": recipe.version,
         "sources": list(record.sources), "objects": dict(sorted(record.objects.items())), "tensors": tensors}
    if record.patches:
        d["patches"] = {o: [p, n, list(b)] for o, (p, n, b) in sorted(record.patches.items())}
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def _decode(raw: bytes, recipe: "Recipe | None" = None) -> _Record:
    """Parse and check a record (ValueError, CorruptObjectError or ParamStoreError when it is not one)."""
    d = loads(raw, dict, "derived record")
    if d.get("format") != RECORD_FORMAT or set(d) - {"patches"} != {"format", "recipe", "recipe_version", "sources",
                                                                     "objects", "tensors"}:
        raise ValueError("not a derived record of format 1")
    if recipe is not None and (d["recipe"], d["recipe_version"]) != (recipe.name, recipe.version):
        raise ValueError("a record of another recipe")
    if not isinstance(d["sources"], list) or not isinstance(d["objects"], dict) or not isinstance(d["tensors"], list):
        raise ValueError("malformed derived record")
    sources = tuple(check_digest(s) for s in d["sources"])
    objects = {}
    for o, n in d["objects"].items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"bad object size {n!r}")
        objects[check_digest(o)] = n
    outputs: dict[tuple[tuple[int, int] | None, str], dict[str, TensorEntry]] = {}
    for t in d["tensors"]:
        if not isinstance(t, dict) or set(t) != {"span", "name", "outputs"} or not isinstance(t["name"], str) \
                or not isinstance(t["outputs"], dict):
            raise ValueError("malformed derived tensor")
        span = t["span"]
        if span is not None and (not isinstance(span, list) or len(span) != 2
                                 or not all(isinstance(x, int) and not isinstance(x, bool) for x in span)):
            raise ValueError(f"bad span {span!r}")
        outs = {}
        for name, e in t["outputs"].items():
            entry = TensorEntry.from_json(e)
            if entry.chunks or entry.object not in objects:
                raise ValueError(f"output {name!r} lies in no object of the record")
            outs[name] = entry
        outputs[(None if span is None else (span[0], span[1]), t["name"])] = outs
    patches = {}
    for o, entry in d.get("patches", {}).items():
        if o not in objects or not isinstance(entry, list) or len(entry) != 3 or type(entry[1]) is not int \
                or entry[1] < 0 or not isinstance(entry[2], list):
            raise ValueError(f"bad patch entry for {str(o)[:12]}")
        patches[o] = (check_digest(entry[0]), entry[1], tuple(check_digest(b) for b in entry[2]))
    return _Record(sources, objects, outputs, patches)


def _parse(raw: bytes | None, recipe: "Recipe") -> _Record | None:
    """``raw`` as a record of ``recipe``, or None if absent or damaged (then derived again, and replaced)."""
    if not raw:
        return None
    try:
        return _decode(raw, recipe)
    except (ValueError, ParamStoreError):
        return None


def _here(root: StoreRoot, record: _Record, elsewhere: Elsewhere | None) -> bool:
    """Whether every object of ``record`` is in the local tier at its size, after asking
    ``elsewhere`` (peers, the remote: verified as any fetched object) for those that are not."""
    def absent() -> dict[str, int]:
        out = {}
        for o, n in record.objects.items():
            try:
                size = root.tier.size(o)
            except FileNotFoundError:
                out[o] = n
                continue
            if size != n:
                raise CorruptObjectError(f"derived object {o[:12]}… has {size} bytes, its record says {n}")
        return out

    try:
        missing = absent()
        if missing and elsewhere is not None:
            tier = root.tier
            todo = {o: record.patches[o] for o in missing if o in record.patches
                    and all(tier.exists(b) for b in record.patches[o][2])}  # its bases here: worth moving
            if todo:
                elsewhere.patches({o: (p, missing[o]) for o, (p, _, _) in todo.items()},
                                  {p: n for p, n, _ in todo.values() if not tier.exists(p)})
                missing = absent()
        if missing and elsewhere is not None:
            elsewhere.objects(missing, _pieced(record))
            missing = absent()
    except CorruptObjectError:
        return False
    return not missing


def _pieced(record: _Record) -> list[TensorEntry]:
    """The record's outputs, if each one larger than a piece lists its piece digests (records
    written since they do), so its objects can be relayed block by block; else none (an older
    record: its objects are fetched as a whole, checked against their names)."""
    entries = [e for outs in record.outputs.values() for e in outs.values()]
    if any(c.nbytes > max(PIECE_SIZES) and not c.piece_digests for e in entries for c in e.pieces()):
        return []
    return entries


def records(root: StoreRoot) -> Iterable[tuple[str, _Record | None]]:
    """Every derived record of the store's registry: (key, record, or None if it does not parse). No torch."""
    keys = root.registry.derived_keys()
    for i in range(0, len(keys), 1024):
        got = root.registry.derived(keys[i:i + 1024])
        for key in keys[i:i + 1024]:
            if key not in got:
                continue  # dropped meanwhile
            try:
                yield key, _decode(got[key])
            except (ValueError, ParamStoreError):
                yield key, None


def record_objects(raw: bytes) -> tuple[tuple[str, ...], dict[str, int]] | None:
    """A derived record's source objects and derived objects (digest -> size), or None if it is
    not one (for stores that keep records without deriving: the remote's GC). No torch."""
    try:
        record = _decode(raw)
    except (ValueError, ParamStoreError):
        return None
    return record.sources, dict(record.objects)


def mark(root: StoreRoot, referenced: set[str], *, dry_run: bool = False) -> set[str]:
    """GC's mark phase for derived objects (the caller holds the GC lock exclusive): the derived
    objects of every record whose source objects are all still ``referenced``. Unless ``dry_run``,
    the other records (and those that do not parse) are dropped from the registry, so their
    objects are swept as objects nobody references."""
    live: set[str] = set()
    dead: list[str] = []
    for key, record in records(root):
        if record is not None and record.sources and all(s in referenced for s in record.sources):
            live.update(record.objects)
            live.update(p for p, _, _ in record.patches.values())
        else:
            dead.append(key)
    if dead and not dry_run:
        root.registry.drop_derived(dead)
    return live


# -- deriving ------------------------------------------------------------------------------------
class _Sources:
    """One derivation's sources and destinations: the source objects' maps and headers (read
    once each), and where its derived objects are written (``scratch`` without a pool, else the
    pool's slabs, retired once the derivation ends)."""

    def __init__(self, root: StoreRoot, pool: "SlabPool | None" = None) -> None:
        self._root = root
        self._maps: dict[str, Any] = {}
        self._bufs: dict[str, "torch.Tensor"] = {}
        self._headers: dict[str, tuple[int, dict[str, dict]]] = {}
        self.scratch = _Scratch()  # what deferred conversions write into without a pool
        self.pool = pool  # where derived objects are written (their slabs prepared ahead), if given
        self.made: list[int] = []  # the sizes of the derived objects written
        self.placed: list["Slab"] = []  # slabs now objects, to retire (unmap) off the derivation's path

    def retire(self) -> None:
        """Hand the slabs placed as derived objects back to the pool, off the derivation's path
        (:meth:`SlabPool.retire_later`: unmapping a faulted slab tears down its page tables, ~0.06 s
        per 0.7 GB here)."""
        slabs, self.placed = self.placed, []
        for s in slabs:
            self.pool.retire_later(s)  # type: ignore[union-attr]  (slabs come from the pool)

    def buf(self, o: str) -> "torch.Tensor":
        import torch

        if o not in self._bufs:
            self._maps[o] = self._root.tier.map(o, private=True)  # copy-on-write: never written
            self._bufs[o] = torch.frombuffer(self._maps[o], dtype=torch.uint8)
        return self._bufs[o]

    def header(self, o: str) -> tuple[int, dict[str, dict]]:
        if o not in self._headers:
            self.buf(o)
            try:
                with memoryview(self._maps[o]) as mv:
                    start, entries, _ = read_header(mv)
            except ValueError as e:
                raise CorruptObjectError(f"object {o}: {e}; run `paramstore verify --repair`") from None
            self._headers[o] = (start, entries)
        return self._headers[o]

    def view(self, o: str, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> "torch.Tensor":
        from .tensors import ST_TO_TORCH

        return self.buf(o)[offset:offset + nbytes].view(ST_TO_TORCH[dtype]).view(shape)

    def tensor(self, e: TensorEntry) -> "torch.Tensor":
        """Tensor ``e`` of the version: a view of its object, or (chunked) assembled once."""
        import torch

        from .snapshot import copy_box
        from .tensors import ST_TO_TORCH

        if not e.chunks:
            return self.view(e.object, e.offset, e.nbytes, e.dtype, e.shape)
        out = torch.empty(e.shape, dtype=ST_TO_TORCH[e.dtype])
        copy_box(e, lambda c: self.view(c.object, c.offset, c.nbytes, e.dtype, c.sizes), (0,) * len(e.shape),
                 e.shape, out)
        return out

    def judged(self, e: TensorEntry) -> "torch.Tensor":
        """What the recipe's predicate is given for ``e``: a view of it, or, for a chunked tensor
        (not assembled just to be judged), an empty tensor of its dtype and shape on the meta device."""
        import torch

        from .tensors import ST_TO_TORCH

        if e.chunks:
            return torch.empty(e.shape, dtype=ST_TO_TORCH[e.dtype], device="meta")
        return self.tensor(e)

    def header_span(self, o: str, name: str) -> tuple[tuple[int, int], str, tuple[int, ...]] | None:
        start, entries = self.header(o)
        h = entries.get(name)
        try:
            b, e = h["data_offsets"]  # type: ignore[index]
            return (start + int(b), start + int(e)), str(h["dtype"]), tuple(int(n) for n in h["shape"])  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            return None


class _Deferred:
    """A tensor the recipe converts straight into the derived object's bytes (:attr:`Recipe.shapes
    <paramstore.recipes.Recipe.shapes>`, asked once: ``shapes``): nothing is converted until its
    place is known."""

    __slots__ = ("name", "tensor", "shapes")

    def __init__(self, recipe: "Recipe", name: str, tensor: "torch.Tensor") -> None:
        self.name, self.tensor = name, tensor
        self.shapes = recipe.shapes(name, tensor)  # type: ignore[misc]


class _Scratch:
    """Memory a derivation converts into, reused from one tensor to the next (faulted in once, not
    once per output): views carved from one buffer, grown when a tensor needs more."""

    def __init__(self) -> None:
        self._buf: "torch.Tensor | None" = None

    def views(self, shapes: Mapping[str, tuple["torch.dtype", tuple[int, ...]]]) -> dict[str, "torch.Tensor"]:
        import torch

        at, spans = 0, {}
        for name, (dtype, shape) in shapes.items():
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            spans[name] = (at, n, dtype, shape)
            at += -(-n // DATA_ALIGN) * DATA_ALIGN
        if self._buf is None or self._buf.numel() < at:
            self._buf = None
            self._buf = torch.empty(max(at, 1), dtype=torch.uint8)
        return {name: self._buf[b:b + n].view(dtype).view(shape) for name, (b, n, dtype, shape) in spans.items()}


def _store_outputs(root: StoreRoot, recipe: "Recipe", produced: list[tuple[tuple[tuple[int, int] | None, str],
                                                                           "Mapping[str, Any] | _Deferred"]],
                   sources: tuple[str, ...], report: DeriveReport, what: str, reading: "_Sources") -> _Record:
    """Write what the recipe produced as one derived object (the commit's format and digests:
    :func:`paramstore.format.layout`, :func:`~paramstore.format.object_digest`), placed with the
    tier's rename; returns the unit's record (not yet written). A :class:`_Deferred` tensor is
    converted now, once the object's layout is known: straight into the object's slab when the
    derivation has a pool (``reading.pool``: a slab prepared ahead, faulted in the background), else
    into ``reading.scratch``, written from there. The caller holds the GC lock shared."""
    import torch

    from .tensors import TORCH_TO_ST

    record = _Record(sources, {})
    if not produced:
        return record
    specs: list[TensorSpec] = []
    eager: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[tuple[tuple[int, int] | None, str], str]] = {}  # key in the object -> (source, name)

    def output(i: int, src: tuple[tuple[int, int] | None, str], n: str, dtype: Any, shape: tuple[int, ...]) -> str:
        if dtype not in TORCH_TO_ST:
            raise InvalidArgumentError(f"recipe {report.recipe!r}: {src[1]!r} gave {n!r} as {dtype}, which an "
                                       "object cannot hold")
        key = f"{i}:{n}"  # unique in the object even if two sources give the same name
        specs.append(TensorSpec(key, TORCH_TO_ST[dtype], tuple(int(d) for d in shape)))
        where[key] = (src, n)
        return key

    for i, (src, outs) in enumerate(produced):
        if isinstance(outs, _Deferred):
            for n, (dtype, shape) in outs.shapes.items():
                output(i, src, n, dtype, shape)
            continue
        for n, t in outs.items():
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(f"recipe {report.recipe!r}: {src[1]!r} gave {n!r} as "
                                           f"{type(t).__name__}, which an object cannot hold")
            eager[output(i, src, n, t.dtype, tuple(t.shape))] = t.detach().to("cpu").contiguous()
    plan = layout(specs)
    at = {p.spec.name: p for p in plan.placements}
    slab = None
    try:
        if reading.pool is not None:
            slab, digests = _into_slab(reading.pool, recipe, produced, plan, at, eager, report)
            path = slab.path
        else:
            path, digests = _into_file(root, recipe, produced, plan, at, eager, report, reading.scratch)
    except PermissionError as e:  # a slab or a file of tmp/ that this process may not create (a group store's member)
        raise UnsafeStoreError(f"cannot derive {what} with recipe {report.recipe!r} in {root.path}: this process "
                               f"may not write its objects ({e.strerror}); in a group store only its owner "
                               "derives: prefetch the version with the recipe in the trainer's process first") from None
    reading.made.append(plan.size)
    obj = object_digest(plan.header, [digests[p.spec.name][0] for p in plan.placements])
    try:
        placed = root.tier.put(obj, path, move=True)
    except BaseException:
        if slab is not None:
            slab.discard()
        raise
    if slab is not None:
        reading.placed.append(slab)  # (its file is the object now, or dropped): retired after the derivation
    if placed:
        report.objects += 1
        report.bytes += plan.size
    record.objects[obj] = plan.size
    for p in plan.placements:
        src, n = where[p.spec.name]
        digest, pieces = digests[p.spec.name]
        record.outputs.setdefault(src, {})[n] = TensorEntry(p.spec.dtype, p.spec.shape, digest, obj,
                                                            p.offset, p.nbytes, (), pieces)
    return record


def _into_file(root: StoreRoot, recipe: "Recipe", produced: list, plan: Any, at: dict, eager: dict,
               report: DeriveReport, scratch: _Scratch) -> tuple[str, dict[str, _Hashed]]:
    """The derived object written into a new file of ``tmp/`` (``pwrite``: no mapping set up),
    deferred conversions into ``scratch`` first; returns its path and each output's digest and
    piece digests."""
    import torch

    path = os.path.join(root.tier.tmp_dir, tmp_name())
    digests: dict[str, _Hashed] = {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        out = delta._File(fd)  # (all of each write, pwrite by pwrite)
        out.write(plan.header, 0)
        for key, t in _filled(recipe, produced, eager, lambda i, shapes: scratch.views(shapes), report):
            with memoryview(t.reshape(-1).view(torch.uint8).numpy()) as mv:
                digests[key] = tensor_pieces(mv)
                out.write(mv, at[key].offset)
        os.close(fd)
        fd = -1
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return path, digests


def _filled(recipe: "Recipe", produced: list, eager: "dict[str, torch.Tensor]",
            views_for: "Callable[[int, Mapping[str, Any]], dict[str, torch.Tensor]]",
            report: DeriveReport) -> "Iterable[tuple[str, torch.Tensor]]":
    """Each output of the object, ``(key, tensor)``, once its bytes are there: a deferred
    conversion's outputs after ``recipe.convert(..., out=views_for(i, its shapes))`` filled them
    (it must fill and return those very tensors), then the eager outputs as the recipe gave them."""
    for i, (_, outs) in enumerate(produced):
        if not isinstance(outs, _Deferred):
            continue
        views = views_for(i, outs.shapes)
        got = recipe.convert(outs.name, outs.tensor, out=views)  # type: ignore[call-arg]
        if set(got) != set(views) or any(got[n] is not v and got[n].data_ptr() != v.data_ptr()
                                         for n, v in views.items()):
            raise InvalidArgumentError(f"recipe {report.recipe!r}: convert({outs.name!r}, out=...) must fill and "
                                       f"return the outputs it was given ({sorted(views)}), not {sorted(got)}")
        yield from ((f"{i}:{n}", v) for n, v in views.items())
    yield from eager.items()


def _into_slab(pool: "SlabPool", recipe: "Recipe", produced: list, plan: Any, at: dict, eager: dict,
               report: DeriveReport) -> tuple["Slab", dict[str, _Hashed]]:
    """The derived object written into a slab of ``pool`` (one it prepared, faulted ahead, if there
    is one of this size): deferred conversions straight into its place, eager outputs copied there,
    each hashed from there. Returns the slab (its file renamed into the tier by the caller, then
    retired) and each output's digest and piece digests (:func:`~paramstore.format.tensor_pieces`)."""
    slab = pool.take(plan.size)
    try:
        digests = _fill(slab.map, recipe, produced, plan, at, eager, report)
    except BaseException:
        slab.discard()
        raise
    return slab, digests


def _fill(mapping: Any, recipe: "Recipe", produced: list, plan: Any, at: dict, eager: dict,
          report: DeriveReport) -> dict[str, _Hashed]:
    """Write the object into ``mapping`` (its header, deferred conversions into their places, eager
    outputs copied) and hash each output there. Nothing viewing ``mapping`` outlives the call."""
    import torch

    from .tensors import ST_TO_TORCH

    mapping[:len(plan.header)] = plan.header
    buf = torch.frombuffer(mapping, dtype=torch.uint8)
    places = {key: buf[p.offset:p.offset + p.nbytes].view(ST_TO_TORCH[p.spec.dtype]).view(p.spec.shape)
              for key, p in at.items()}
    for key, t in _filled(recipe, produced, eager, lambda i, shapes: {n: places[f"{i}:{n}"] for n in shapes}, report):
        if t is not places[key]:  # an eager output: copied into its place
            places[key].copy_(t)
    places.clear()  # no view of the mapping outlives the call
    del buf
    digests = {}
    with memoryview(mapping) as mv:
        for key, p in at.items():
            with mv[p.offset:p.offset + p.nbytes] as part:
                digests[key] = tensor_pieces(part)
    return digests


def _derive_object(root: StoreRoot, recipe: "Recipe", src: _Sources, o: str, report: DeriveReport) -> _Record:
    """Derive unit ``o``: every tensor of object ``o`` the recipe accepts, under its name there."""
    start, entries = src.header(o)
    produced = []
    for name, h in entries.items():
        if name.startswith(ASSET_PREFIX):
            continue
        span = src.header_span(o, name)
        if span is None:
            raise CorruptObjectError(f"object {o}: malformed header entry {name!r}")
        (b, e), dtype, shape = span
        from .tensors import ST_TO_TORCH

        if dtype not in ST_TO_TORCH:
            continue
        t = src.view(o, b, e - b, dtype, shape)
        if recipe.eligible(name, t):
            produced.append((((b, e), name), _converted(recipe, name, t)))
    report.tensors += len(produced)
    return _store_outputs(root, recipe, produced, (o,), report, f"object {o[:12]}…", src)


def _derive_tensor(root: StoreRoot, recipe: "Recipe", src: _Sources, name: str, e: TensorEntry,
                   report: DeriveReport) -> _Record:
    """Derive the unit of one tensor as the version names it."""
    t = src.tensor(e)
    produced = [((None, name), _converted(recipe, name, t))] if recipe.eligible(name, t) else []
    report.tensors += len(produced)
    return _store_outputs(root, recipe, produced, tuple(sorted({c.object for c in e.pieces()})), report,
                          f"tensor {name!r}", src)


def _converted(recipe: "Recipe", name: str, t: "torch.Tensor") -> "Mapping[str, Any] | _Deferred":
    """What ``recipe`` makes of ``t``: converted later, into the object's memory, when the recipe
    says its outputs' shapes; else now."""
    return _Deferred(recipe, name, t) if recipe.shapes is not None else recipe.convert(name, t)


def _tensor_unit(name: str, e: TensorEntry) -> str:
    canon = json.dumps([name, e.dtype, list(e.shape), [list(r) for r in e.ranges()]], separators=(",", ":"))
    return "t-" + blake3.blake3(_UNIT_DOMAIN + canon.encode()).hexdigest()


def _unit(root: StoreRoot, recipe: "Recipe", src: _Sources, unit: str, make: Callable[[], _Record],
          report: DeriveReport, cache: dict[str, _Record], elsewhere: Elsewhere | None) -> _Record:
    """The record of ``unit``: found (this call, or by a record whose objects are here or can be
    fetched), else made now and recorded."""
    if unit in cache:
        return cache[unit]
    report.units += 1
    key = _key(recipe, unit)
    raw = root.registry.derived([key]).get(key)
    if raw is None and elsewhere is not None:
        found = elsewhere.record(key)  # another store's (the remote's): shared here from now on
        if found is not None and _parse(found, recipe) is not None:
            raw = root.registry.swap_derived(key, None, found) or None
    record = _parse(raw, recipe)
    if record is None or not _here(root, record, elsewhere):
        with root.gc_lock():  # shared: no GC between the objects' rename and the record
            raw = root.registry.derived([key]).get(key)  # made meanwhile by another deriver?
            record = _parse(raw, recipe)
            if record is None or not _here(root, record, None):
                report.derived += 1
                made = make()
                mine = _encode(recipe, made)
                held = root.registry.swap_derived(key, raw, mine)  # first wins; a damaged or lost one replaced
                other = _parse(held, recipe) if held != mine else None
                record = other if other is not None and _here(root, other, None) else made
    cache[unit] = record
    return record


def derive_manifest(root: StoreRoot, manifest: Manifest, recipe: "str | Recipe",
                    report: DeriveReport | None = None, *, elsewhere: Elsewhere | None = None,
                    units: "dict[str, _Record] | None" = None,
                    pool: "SlabPool | None" = None) -> tuple[Manifest, DeriveReport]:
    """The manifest of a version (whose objects are all here, and leased by the caller) as
    ``recipe`` derives it: converted tensors point into derived objects (derived now unless a
    record says where they are and they are here, or ``elsewhere`` brings them), every other one as
    committed. Returns it and what was done.

    Raises:
        InvalidArgumentError: an unknown recipe; a recipe output whose name another tensor of the
            version has (derived already?), or that an object cannot hold.
        InvalidTensorError: a tensor the recipe cannot convert (an infinite element, say).
        UnsafeStoreError: derived objects are needed and this process may not write them (a member
            of a group store).

    ``units``: a dict filled with the record of each unit looked up (unit -> record). ``pool``: the
    store's slab pool: derived objects are written into its slabs (prepared ones when it has them),
    and slabs of the sizes derived now are prepared for the next version (in the background).
    """
    recipe = resolve_recipe(recipe)
    t0 = time.monotonic()
    report = report if report is not None else DeriveReport(recipe.name)
    src = _Sources(root, pool)
    cache: dict[str, _Record] = units if units is not None else {}  # unit -> its record
    tensors: dict[str, TensorEntry] = {}
    aliases: dict[str, str] = {}
    made_by: dict[str, str] = {}  # output name -> the input name it came from
    from .recipes import claim_output  # (loads torch: only when a version is derived)

    def put(new: str, entry: TensorEntry, name: str) -> None:
        claim_output(recipe, made_by, name, new, new in manifest.tensors or new in manifest.aliases, "the version")
        tensors[new] = entry

    def outputs(name: str, e: TensorEntry) -> dict[str, TensorEntry] | None:
        """The outputs of tensor ``name`` (entry ``e``), or None if the recipe leaves it as it is."""
        if not recipe.eligible(name, src.judged(e)):
            return None
        if not e.chunks:
            span = src.header_span(e.object, name)
            if span == ((e.offset, e.offset + e.nbytes), e.dtype, e.shape):  # named as in its object
                rec = _unit(root, recipe, src, e.object, lambda: _derive_object(root, recipe, src, e.object, report),
                            report, cache, elsewhere)
                found = rec.outputs.get(((e.offset, e.offset + e.nbytes), name))
                if found is not None:
                    return found
        unit = _tensor_unit(name, e)
        rec = _unit(root, recipe, src, unit, lambda: _derive_tensor(root, recipe, src, name, e, report), report, cache,
                    elsewhere)
        return rec.outputs.get((None, name), None)

    try:
        converted: set[str] = set()
        for name, e in manifest.tensors.items():
            outs = outputs(name, e)
            if outs is None:
                put(name, e, name)
            else:
                converted.add(name)
                for new, entry in outs.items():
                    put(new, entry, name)
        for alias, target in manifest.aliases.items():
            e = manifest.tensors[target]
            outs = outputs(alias, e)
            if outs is None and target not in converted:
                if alias in made_by:
                    put(alias, e, alias)  # raises: an output of another tensor took the name
                aliases[alias] = target
            elif outs is None:
                put(alias, e, alias)  # tied to a converted tensor: keeps the committed bytes
            else:
                for new, entry in outs.items():
                    put(new, entry, alias)
    finally:
        src.retire()  # (also when a unit failed: what was placed is unmapped)
    if pool is not None and src.made:
        pool.prepare(sorted(src.made), purpose="derive")  # the next version's, faulted meanwhile
    report.seconds += time.monotonic() - t0
    return Manifest(tensors, aliases, dict(manifest.assets)), report


def make_patches(root: StoreRoot, recipe: "str | Recipe", base: int, target: int, *,
                 max_ratio: float | None = None, announce: Callable[[list[str]], None] | None = None) -> dict[str, str]:
    """Patches for the derived objects of version ``target`` in ``recipe``'s form, against those of
    version ``base`` (both derived on this host, as a trainer with ``derive=`` and ``patches=``
    does): made like a version's patches (:func:`paramstore.delta.encode_patches`, on the two derived
    manifests), and named in the records of ``target``'s units (``patches``: each derived object's
    patch, its size and the objects it reads). A host that holds ``base``'s derived objects then
    moves a patch instead of a derived object (:func:`_here`). Returns ``{derived object: patch}``.
    Raises VersionNotFoundError if a version is gone."""
    recipe = resolve_recipe(recipe)
    reg = root.registry
    base_m, _ = derive_manifest(root, reg.get_manifest(base), recipe)
    units: dict[str, _Record] = {}
    target_m, _ = derive_manifest(root, reg.get_manifest(target), recipe, units=units)
    made = delta.encode_patches(root, base_m, target_m, base,
                                delta.DEFAULT_MAX_RATIO if max_ratio is None else max_ratio)
    made = {o: p for o, p in made.items() if any(o in r.objects for r in units.values())}  # derived ones only
    if not made:
        return {}
    out: dict[str, str] = {}
    with root.gc_lock():  # shared: no GC between the patches' rename and the records naming them
        written = delta.write_patches(root, made)
        if announce is not None:
            announce(sorted({p for p, _ in written.values()}))
        for unit, record in units.items():
            mine = {o: written[o] for o in record.objects if o in written}
            if not mine:
                continue
            key = _key(recipe, unit)
            raw = reg.derived([key]).get(key)
            now = _parse(raw, recipe)
            if now is None or now.objects != record.objects:
                continue  # replaced meanwhile: its objects are not these
            for o, (p, n) in mine.items():
                reads = sorted({sp[3] for sp in json.loads(made[o].meta["spans"]) if sp[3]})
                now.patches[o] = (p, n, tuple(reads))
            mine_raw = _encode(recipe, now)
            if reg.swap_derived(key, raw, mine_raw) == mine_raw:
                out.update({o: p for o, (p, _) in mine.items()})
    return out


def checkout(root: StoreRoot, snap: "Snapshot", recipe: "str | Recipe", *,
             elsewhere: Elsewhere | None = None, pool: "SlabPool | None" = None) -> "Snapshot":
    """``snap`` (a CPU checkout, holding its lease) in ``recipe``'s form: a new snapshot of the same
    version that maps the derived objects and the committed ones it keeps, and takes over the
    lease. ``snap`` is closed (its lease released on error). ``elsewhere``, ``pool``: see
    :func:`derive_manifest`."""
    from .snapshot import Snapshot

    try:
        recipe = resolve_recipe(recipe)
        manifest, report = derive_manifest(root, snap.manifest, recipe, elsewhere=elsewhere, pool=pool)
        sizes = dict(root.registry.object_sizes(manifest.objects()))
        sizes.update({o: root.tier.size(o) for o in manifest.objects() if o not in sizes})
    except BaseException:
        snap.close()
        raise
    on_close = snap._handover()
    try:
        out = Snapshot(snap.version, manifest, root.tier, on_close=on_close, fetch=snap.fetch, sizes=sizes)
    except BaseException:
        snap.close()
        if on_close is not None:
            on_close()
        raise
    snap.close()
    out.recipe, out.derived = recipe.name, report
    return out


def verify_or_forget(root: StoreRoot, snap: "Snapshot") -> None:
    """``checkout(..., verify=True)`` of a derived snapshot: re-hash what it maps; a damaged derived
    object is quarantined and the records pointing at it dropped (the next checkout derives it
    again). Raises CorruptObjectError naming it."""

    bad = snap.verify()
    if not bad:
        return
    step = snap.step
    snap.close()
    quarantine(root, bad)
    root.registry.drop_derived([key for key, record in records(root)
                                if record is not None and set(record.objects) & set(bad)])
    first = min(bad)
    raise CorruptObjectError(f"version {step} in recipe {snap.recipe!r}: object {first} is damaged ({bad[first]}); "
                             "it was quarantined: check out again (a derived object is derived again; a committed "
                             "one needs `paramstore verify --repair`)")
