"""A checked-out version: its tensors as zero-copy views of the shared-memory objects.

:mod:`paramstore.checkout` leases the version and makes its objects present; a :class:`Snapshot` then
reads the manifest (one registry read), maps each object the version references
copy-on-write (one ``mmap`` per object, a few per GiB), and builds tensor views on first access.
No tensor byte is read or copied by checkout itself; the first touch of a page maps the store's page
into this process (``Snapshot.prefault`` does it ahead of time). The views are writable, copy-on-write:
writing through one copies that page privately (later reads of that name in this process see the
change), and the store never changes.

Mapping checks each object's shape, not its bytes: its size must be the one the registry recorded,
its safetensors header length must fit in it, and every byte range the manifest points into must
lie in it; otherwise CorruptObjectError names the file. So an object truncated before checkout never
yields a short tensor view (a bare torch RuntimeError) or a SIGBUS on first touch. (A file truncated
*while* mapped still raises SIGBUS in its readers: published objects are never written, so only
something outside paramstore can do that.) The bytes themselves are not re-hashed — that would cost a
read of every byte — unless asked for: :meth:`Snapshot.verify`, or ``store.checkout(v, verify=True)``.

A *chunked* tensor (committed by several ranks, each storing its own block: see
:mod:`paramstore.manifest`) has no single view. ``snap[name]`` assembles it once into a fresh CPU
tensor (cached like a view); :meth:`Snapshot.read` copies any box of a tensor, of either form,
touching only the chunks that intersect it; and :meth:`Snapshot.load_into` loads a module whose
parameters are DTensors block by block, each rank reading only its own block, whatever layout the
version was committed in (a resharded checkout).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import struct
import sys
import threading
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from .adapters import base_of
from .errors import CorruptObjectError, InvalidArgumentError, InvalidTensorError, LoadError, StoreClosedError
from .liveness import libc
from .lazy import LazyReads
from .manifest import Chunk, Manifest, TensorEntry, Version
from .objects import check_buffer
from .reports import FetchReport, LoadResult
from .sharded import is_dtensor, local_block
from .staging import unmap
from .tensors import ST_TO_TORCH

from paramstore.backends.tiers.base import Tier

__all__ = ["Snapshot", "release_mappings"]

#: madvise advice that maps every page of a range readable now (Linux 5.14+).
MADV_POPULATE_READ = 22


class _Unmapper:
    """Drops the mappings of closed snapshots on a thread of its own.

    Unmapping a GiB of faulted-in pages tears down a quarter of a million page-table entries
    (~0.1 s here), which a rollout's pause need not wait for: :meth:`Snapshot.close` releases the
    lease at once and hands its references here. :func:`release_mappings` waits for them (a store's
    ``close`` does, so memory is returned by the time it returns). A mapping nothing else
    references is dropped a few MiB at a time (:func:`paramstore.staging.unmap`), so that a
    checkout's ``mmap`` on another thread never waits for a whole GiB's teardown.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending = 0
        self._pid: int | None = None
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()

    def drop(self, refs: Any) -> None:
        with self._cond:
            if self._pid != os.getpid():  # first use, or a forked child: the parent's thread is not here
                self._pid, self._pending, self._queue = os.getpid(), 0, queue.SimpleQueue()
                threading.Thread(target=self._run, args=(self._queue,), name="paramstore-unmap", daemon=True).start()
            self._pending += 1
            self._queue.put(refs)

    def _run(self, q: "queue.SimpleQueue[Any]") -> None:
        while True:
            refs = q.get()
            maps = list(refs[0].values())
            refs[0].clear()
            del refs  # the snapshot's tensors: those nobody else took go now
            while maps:
                m = maps.pop()
                if sys.getrefcount(m) <= 2:  # this name and the call's argument: nobody maps it
                    unmap(m)  # (a tensor taken from the snapshot keeps its mapping: left to it)
                del m
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            if self._pid != os.getpid():
                return True
            return self._cond.wait_for(lambda: self._pending == 0, timeout)


_unmapper = _Unmapper()


def release_mappings(timeout: float | None = None) -> bool:
    """Wait until the mappings of every snapshot this process closed are dropped; False on timeout."""
    return _unmapper.wait(timeout)


class Snapshot(Mapping[str, torch.Tensor]):
    """A checked-out version: a mapping of names to tensors (the mapping itself is immutable).

    Tensors are views of the store's shared memory (CPU) or, for ``checkout(v, device=...)``, of
    the version's objects in that device's memory (:attr:`device`); a chunked tensor is assembled
    once into a fresh tensor on the same device (:meth:`read` copies part of one). Names tied at commit time return the very
    same tensor. The snapshot holds a lease on its version: the version is not pruned until the
    snapshot is closed (or garbage collected, or its process dies). Close it, or use it as a context
    manager, when done; tensors already taken stay valid after close.

    Attributes:
        version: the :class:`~paramstore.Version` checked out.
        manifest: where each tensor lies.
        fetch: how the bytes were obtained (:class:`~paramstore.reports.FetchReport`: objects
            already here, from peers, from the remote; bytes per source), or None.

    ``sizes`` (object -> bytes, the registry's records): each object's file must have that size
    when it is mapped; objects left out are checked against the manifest's byte ranges only.

    ``lazy`` (a lazy checkout, ``checkout(v, fetch="lazy")``: see :mod:`paramstore.lazy`): the
    objects this host lacks are mapped as sparse files of their own, and each read first makes
    the pieces it touches present, verified (:attr:`lazy` is then True).

    Example:
        >>> with store.checkout("latest") as snap:
        ...     print(snap)
        ...     print(sorted(snap), snap["2.bias"].dtype, len(snap))
        Snapshot(step=1, tensors=4, digest=...)
        ['0.bias', '0.weight', '2.bias', '2.weight'] torch.float32 4
    """

    def __init__(self, version: Version, manifest: Manifest, tier: Tier,
                 on_close: Callable[[], None] | None = None, *, fetch: "FetchReport | None" = None,
                 sizes: Mapping[str, int] | None = None, lazy: LazyReads | None = None) -> None:
        self.version = version
        self.manifest = manifest
        self.fetch = fetch
        # Releases the lease on close, or when the snapshot is garbage collected unclosed.
        self._finalizer = weakref.finalize(self, on_close) if on_close is not None else None
        self._maps: dict[str, mmap.mmap] = {}
        self._host: dict[str, torch.Tensor] = {}
        self._bufs: dict[str, torch.Tensor] | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._lazy = lazy
        #: where the tensors live: the CPU (views of shared memory), or the device of a device checkout
        self.device = torch.device("cpu")
        try:
            for o, extent in sorted(manifest.memo("extents", lambda: _extents(manifest)).items()):
                if lazy is not None and not tier.exists(o):  # read piece by piece, as reads need them
                    self._maps[o] = lazy.map(o, extent[1], (sizes or {}).get(o))
                else:
                    self._maps[o] = _map_checked(tier, o, version.step, extent, (sizes or {}).get(o))
        except BaseException:
            self.close()  # releases the lease too
            raise
        self._host = {o: torch.frombuffer(m, dtype=torch.uint8) for o, m in self._maps.items()}
        # what tensor views are made of: the shared-memory pages, or (a device checkout) the
        # objects' buffers on a device (see :meth:`_on_device`)
        self._bufs = dict(self._host)
        #: how a device checkout got its buffers: ``"ipc"`` (the owner's device memory, mapped),
        #: ``"copy"`` (copied from shared memory), or None (a CPU checkout)
        self.device_source: str | None = None
        #: bytes copied to the device by this checkout (0 for objects already there, or mapped)
        self.device_bytes = 0
        #: the recipe this snapshot is derived by (``checkout(v, recipe=...)``: see
        #: :mod:`paramstore.derived`), or None: the version as committed
        self.recipe: str | None = None
        #: with a recipe, what deriving it did (:class:`paramstore.derived.DeriveReport`)
        self.derived: Any = None

    def _handover(self) -> Callable[[], None] | None:
        """Detach what this snapshot would call on close (its lease's release) and return it: a
        derived snapshot of the same version takes the lease over (:func:`paramstore.derived.checkout`)."""
        if self._finalizer is None:
            return None
        detached = self._finalizer.detach()
        self._finalizer = None
        if detached is None:
            return None
        _, func, args, kwargs = detached
        return lambda: func(*args, **kwargs)

    def _on_device(self, buffers: Mapping[str, torch.Tensor], source: str, nbytes: int) -> "Snapshot":
        """Make the tensor views views of ``buffers`` (object -> its bytes on one device) instead
        of the shared-memory pages (which stay mapped, for :attr:`assets` and :meth:`verify`)."""
        devices = {b.device for b in buffers.values()}
        if len(devices) > 1 or set(buffers) != set(self._host):
            raise ValueError(f"device buffers must cover the snapshot's objects on one device, got {devices}")
        self._bufs = dict(buffers)
        self._views = {}
        self.device = devices.pop() if devices else self.device
        self.device_source, self.device_bytes = source, nbytes
        return self

    @property
    def lazy(self) -> bool:
        """Whether this is a lazy checkout (``checkout(v, fetch="lazy")``): reads move the pieces they
        touch (see :mod:`paramstore.lazy`)."""
        return self._lazy is not None

    @property
    def step(self) -> int:
        """The version's step (what a rollout sample should record).

        Example:
            >>> with store.checkout("latest") as snap:
            ...     snap.step
            1
        """
        return self.version.step

    @property
    def digest(self) -> str:
        """The version's content digest (lineage for a rollout sample).

        The same weights have the same digest, whatever step or store they were committed at.

        Example:
            >>> _ = store.commit(2, model).result()  # the same weights again
            >>> with store.checkout(1) as a, store.checkout(2) as b:
            ...     a.digest == b.digest == store.get(1).digest, len(a.digest)
            (True, 64)
        """
        return self.version.digest

    @property
    def base_step(self) -> int | None:
        """For an adapter version (:mod:`paramstore.adapters`), the step of the version it applies
        to, kept as long as the adapter version is (check it out for the base weights); else None.

        Example:
            >>> config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["0"]}
            >>> lora = {"base_model.model.0.lora_A.weight": torch.ones(2, 4),
            ...         "base_model.model.0.lora_B.weight": torch.zeros(8, 2)}
            >>> _ = store.commit(2, lora, base=1, adapter_config=config).result()
            >>> with store.checkout(2) as adapter, store.checkout(adapter.base_step) as base:
            ...     sorted(adapter)[0], base.step
            ('base_model.model.0.lora_A.weight', 1)
        """
        return base_of(self.version.metadata)

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._bufs is None:
            raise StoreClosedError(f"snapshot of step {self.version.step} is closed")
        target = self.manifest.aliases.get(name, name)
        view = self._views.get(target)
        if view is None:
            e = self._entry(name)
            if e.chunks:  # no single view: assemble the whole tensor, once
                view = self.read(target, (0,) * len(e.shape), e.shape)
            else:
                c = e.pieces()[0]
                if self._lazy is not None:  # every piece of it here, verified, before the view
                    self._lazy.ensure(c.object, [(c.offset, c.offset + c.nbytes)], target)
                view = self._piece(e, c)
            self._views[target] = view
        return view

    def read(self, name: str, offsets: Sequence[int], sizes: Sequence[int],
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the box ``[offsets, offsets + sizes)`` of tensor ``name`` into ``out``, and return it.

        Only the box is copied, whether the tensor is stored whole or in chunks (a sharded
        commit): each chunk that intersects the box gives its intersection, straight from the
        store's pages; the whole tensor is never materialized. This is how a rank loads just its
        own block of a version committed in another layout (:meth:`load_into` uses it).

        Args:
            name: a tensor name (or an alias).
            offsets: where the box starts, one int per dimension.
            sizes: the box's extent, one int per dimension (0 gives an empty box).
            out: the destination, of shape ``sizes``; a new tensor of the stored dtype on the
                snapshot's :attr:`device` if
                None. Copied into with ``copy_`` semantics: another dtype is cast to, another
                device is copied to.

        Returns:
            ``out``.

        Raises:
            KeyError: no such tensor.
            InvalidArgumentError: ``offsets`` or ``sizes`` do not have one int >= 0 per
                dimension, the box does not lie in the tensor, or ``out`` is not of shape ``sizes``.

        Example:
            >>> with store.checkout("latest") as snap:
            ...     rows = snap.read("0.weight", (2, 0), (3, 4))  # rows 2..4 of the (8, 4) weight
            ...     out = torch.zeros(3, 2, dtype=torch.float64)
            ...     cols = snap.read("0.weight", (0, 1), (3, 2), out=out)  # cast into out
            >>> torch.equal(rows, model[0].weight[2:5]), cols is out
            (True, True)
            >>> torch.equal(cols, model[0].weight[:3, 1:3].double())
            True
        """
        e = self._entry(name)
        lo, n = _check_box(name, e.shape, offsets, sizes)
        if out is None:
            out = torch.empty(n, dtype=ST_TO_TORCH[e.dtype], device=self.device)
        elif not isinstance(out, torch.Tensor) or tuple(out.shape) != n:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise InvalidArgumentError(f"read({name!r}): out is {got}, the box is of shape {n}")
        lazy = self._lazy
        if lazy is None:
            copy_box(e, lambda c: self._piece(e, c), lo, n, out)
            return out
        target = self.manifest.aliases.get(name, name)

        def piece(c: Chunk) -> torch.Tensor:  # the pieces of c the box touches, here and verified first
            start = [max(a, b) - b for a, b in zip(lo, c.offsets)]
            stop = [min(a + s, b + t) - b for a, s, b, t in zip(lo, n, c.offsets, c.sizes)]
            lazy.ensure_box(target, e.dtype, c, start, stop)
            return self._piece(e, c)

        copy_box(e, piece, lo, n, out)
        return out

    @property
    def assets(self) -> dict[str, bytes]:
        """The version's assets (``config.json``, tokenizer files...; see :mod:`paramstore.assets`):
        file name -> bytes, read from the store. They are not among the snapshot's tensors.

        Example:
            >>> _ = store.commit(2, model, assets={"notes.txt": b"lr=1e-6"}).result()
            >>> with store.checkout(2) as snap:
            ...     snap.assets, "notes.txt" in snap
            ({'notes.txt': b'lr=1e-6'}, False)
        """
        if self._bufs is None:
            raise StoreClosedError(f"snapshot of step {self.version.step} is closed")
        if self._lazy is not None:
            for n, e in self.manifest.assets.items():
                self._lazy.ensure(e.object, [(e.offset, e.offset + e.nbytes)], f"asset {n}")
        return {n: bytes(self._maps[e.object][e.offset : e.offset + e.nbytes]) for n, e in self.manifest.assets.items()}

    def _entry(self, name: str) -> TensorEntry:
        """The manifest entry of ``name`` (following an alias); StoreClosedError, KeyError."""
        if self._bufs is None:
            raise StoreClosedError(f"snapshot of step {self.version.step} is closed")
        try:
            return self.manifest.entry(name)
        except KeyError:
            raise KeyError(f"no tensor {name!r} in version {self.version.step}") from None

    def _piece(self, e: TensorEntry, c: Chunk) -> torch.Tensor:
        """A zero-copy view of piece ``c`` of entry ``e`` (shape ``c.sizes``)."""
        assert self._bufs is not None
        return self._bufs[c.object][c.offset : c.offset + c.nbytes].view(ST_TO_TORCH[e.dtype]).view(c.sizes)

    def __iter__(self) -> Iterator[str]:
        return iter(self.manifest.names())

    def __len__(self) -> int:
        return len(self.manifest.tensors) + len(self.manifest.aliases)

    def __contains__(self, name: object) -> bool:
        return name in self.manifest.tensors or name in self.manifest.aliases

    def prefault(self) -> None:
        """Map every page of this version into the process now (``madvise(MADV_POPULATE_READ)``).

        A first read of a store page costs a page fault (~60 ms per GiB with 4 KiB pages). A
        rollout worker that learns of a version before it needs it can call this on a background
        thread (it does not hold the GIL), so that the later ``load_into`` runs at memory speed.
        No-op where the kernel lacks the call (Linux < 5.14).

        Example:
            >>> import threading
            >>> snap = store.checkout("latest")
            >>> warm = threading.Thread(target=snap.prefault)  # while the rollout still works on the last one
            >>> warm.start(); warm.join()
            >>> _ = snap.load_into(policy)  # reads pages already mapped
            >>> snap.close()
        """
        if self._bufs is None:
            raise StoreClosedError(f"snapshot of step {self.version.step} is closed")
        lazy = self._lazy
        for o, buf in list(self._host.items()):
            if lazy is not None and lazy.lacks(o):
                continue  # (a lazy object's holes: faulting them would fill the snapshot's own file with zeros)
            libc().madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(buf.numel()), MADV_POPULATE_READ)

    def load_into(self, module: torch.nn.Module | Mapping[str, torch.Tensor], *, strict: bool = True) -> LoadResult:
        """Copy this version into ``module``'s parameters and buffers, in place.

        ``module`` may also be a mapping of names to tensors (an engine's own buffers): each is
        written in place, with the same checks.

        The names are those of ``module.state_dict()``, with ``load_state_dict``'s rules: names
        missing from the version, and names of the version the module lacks, are reported (and
        raise with ``strict``); a shape that differs always raises. Everything is checked before
        any byte is copied. Each tensor is copied straight from the store's pages into the
        module's own tensor (:meth:`read`), cast to its dtype and moved to its device. Tied
        parameters stay tied (their storage is written once).

        A parameter or buffer that is a DTensor is loaded block by block: each rank copies only its
        own block (from its mesh and placements, ``Shard`` and ``Replicate`` on any mesh), from
        whichever chunks of the version hold it, into the DTensor's local tensor. No collective
        runs and no rank reads a whole tensor, so a version committed by 8 ranks loads into 2, or
        into a plain module, and the other way round. Each rank calls ``load_into`` on its own
        snapshot of the same version, on its own time (no rank waits for another).

        Args:
            module: the module (or mapping of names to tensors) to load into.
            strict: raise if names differ, as ``load_state_dict`` does.

        Returns:
            The missing and unexpected keys.

        Raises:
            LoadError (a ``RuntimeError``): names differ (with ``strict``), shapes differ (the
            global shape, for a DTensor), or a DTensor's placement is ``Partial`` (or
            ``_StridedShard``: its block is not one box of the tensor).
            InvalidArgumentError: ``module`` is neither a module nor a mapping.

        Example:
            >>> with store.checkout("latest") as snap:
            ...     snap.load_into(policy)
            LoadResult(missing_keys=[], unexpected_keys=[])
            >>> torch.equal(policy[0].weight, model[0].weight)
            True
            >>> with store.checkout("latest") as snap:
            ...     snap.load_into(torch.nn.Linear(4, 8), strict=False)
            LoadResult(missing_keys=['weight', 'bias'], unexpected_keys=['0.bias', '0.weight', '2.bias', '2.weight'])
            >>> weights = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
            >>> with store.checkout("latest") as snap:  # a plain dict of tensors, written in place
            ...     snap.load_into(weights)
            LoadResult(missing_keys=[], unexpected_keys=[])
        """
        if self._bufs is None:
            raise StoreClosedError(f"snapshot of step {self.version.step} is closed")
        if not isinstance(module, (torch.nn.Module, Mapping)):
            raise InvalidArgumentError(f"load_into takes a torch.nn.Module or a mapping of names to tensors, "
                                       f"got {type(module).__name__}")
        with torch.no_grad():  # to_local() then aliases the DTensor's local tensor
            own = module.state_dict(keep_vars=True) if isinstance(module, torch.nn.Module) else dict(module)
            missing = [k for k in own if k not in self]
            unexpected = [k for k in self if k not in own]
            problems = []
            if strict and missing:
                problems.append(f"missing keys {missing}")
            if strict and unexpected:
                problems.append(f"unexpected keys {unexpected}")
            plan: list[tuple[str, torch.Tensor, tuple[int, ...]]] = []
            written: dict[int, str] = {}  # id of a module tensor -> the stored tensor copied into it
            for key, value in own.items():
                target = self.manifest.aliases.get(key, key)
                if key not in self or written.get(id(value)) == target:
                    continue  # missing, or a tied parameter already planned from the same bytes
                written[id(value)] = target
                try:
                    dest = _destination(key, value, self.manifest.entry(key).shape)
                except LoadError as e:
                    problems.append(str(e))
                    continue
                if dest is not None:
                    plan.append((key, *dest))
            if problems:
                raise LoadError(f"cannot load version {self.version.step} into {type(module).__name__}: "
                                + "; ".join(problems))
            for key, local, offsets in plan:
                self.read(key, offsets, tuple(local.shape), out=local)
        return LoadResult(missing, unexpected)

    def close(self) -> None:
        """Release the snapshot. Tensors already taken from it stay valid (they keep their mapping).

        The lease is released at once; the snapshot's own mappings are dropped on a background
        thread (unmapping a GiB takes ~0.1 s, which the caller need not wait for).

        Example:
            >>> snap = store.checkout("latest")
            >>> weight = snap["0.weight"]
            >>> snap.close()  # releases the lease: the version may now be pruned
            >>> store.leases(), weight.shape
            ([], torch.Size([8, 4]))
            >>> snap["0.weight"]
            Traceback (most recent call last):
            ...
            paramstore.errors.StoreClosedError: snapshot of step 1 is closed
        """
        refs = (self._maps, self._host, self._bufs, self._views)
        if self._lazy is not None:
            self._lazy.close()
        self._bufs = None
        self._views = {}
        self._host = {}
        self._maps = {}
        if any(refs):
            _unmapper.drop(refs)
        del refs
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "" if self.device.type == "cpu" else f", device={self.device}"
        where += "" if self.recipe is None else f", recipe={self.recipe!r}"
        return f"Snapshot(step={self.version.step}, tensors={len(self)}, digest={self.version.digest[:12]}{where})"

    def verify(self) -> dict[str, str]:
        """Re-hash every byte this snapshot maps; returns ``{object: why}`` for each damaged one.

        One blake3 pass over the version's objects (both levels of each object digest, and each
        tensor digest against the manifest), reading the very pages the tensor views use. Empty
        when every object is intact. For an object a lazy snapshot reads piece by piece, the
        pieces that arrived are re-hashed against their digests. ``store.checkout(v, verify=True)`` calls it and raises.

        Example:
            >>> with store.checkout("latest") as snap:
            ...     snap.verify()
            {}
        """
        if self._bufs is None:
            raise StoreClosedError(f"snapshot of step {self.version.step} is closed")
        spans = self.manifest.spans()
        bad: dict[str, str] = {}
        for o, m in self._maps.items():
            if self._lazy is not None and self._lazy.lacks(o):  # only the pieces that arrived
                why = self._lazy.verify(o)
                if why is not None:
                    bad[o] = why
                continue
            with memoryview(m) as mv:
                why = check_buffer(o, mv, spans.get(o, {}))
            if why is not None:
                bad[o] = why
        return bad


def copy_box(entry: TensorEntry, piece: Callable[[Chunk], torch.Tensor], offsets: tuple[int, ...],
             sizes: tuple[int, ...], out: torch.Tensor) -> None:
    """Copy the box ``[offsets, offsets + sizes)`` of tensor ``entry`` into ``out`` (of shape
    ``sizes``): from each of its pieces (``piece(chunk)``: a view of that chunk's bytes, of shape
    ``chunk.sizes``) that meets the box, its intersection. Nothing else is read or copied.
    (:meth:`Snapshot.read`, and the export of a chunked tensor into its file.)"""
    for c in entry.pieces():
        start = [max(a, b) for a, b in zip(offsets, c.offsets)]
        stop = [min(a + s, b + t) for a, s, b, t in zip(offsets, sizes, c.offsets, c.sizes)]
        if any(a >= b for a, b in zip(start, stop)):
            continue  # this piece lies outside the box
        src = tuple(slice(a - o, b - o) for a, b, o in zip(start, stop, c.offsets))
        dst = tuple(slice(a - o, b - o) for a, b, o in zip(start, stop, offsets))
        out[dst].copy_(piece(c)[src])


def _check_box(name: str, shape: tuple[int, ...], offsets: Sequence[int],
               sizes: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` as tuples, once checked: one int >= 0 per dimension of ``shape`` each,
    and the box inside it. Raises InvalidArgumentError."""
    box = []
    for what, v in (("offsets", offsets), ("sizes", sizes)):
        try:
            t = tuple(v)
        except TypeError:
            t = None
        if t is None or len(t) != len(shape) or not all(_is_count(n) for n in t):
            raise InvalidArgumentError(f"read({name!r}): {what} {v!r} must be {len(shape)} ints >= 0, one per "
                                       f"dimension of its shape {list(shape)}")
        box.append(tuple(int(n) for n in t))
    lo, n = box
    if any(o + k > s for o, k, s in zip(lo, n, shape)):
        raise InvalidArgumentError(f"read({name!r}): the box at {list(lo)} of sizes {list(n)} exceeds its shape "
                                   f"{list(shape)}")
    return lo, n


def _is_count(n: object) -> bool:
    """Whether ``n`` is an int >= 0 (a bool is not; a 0-dim integer tensor or numpy int is)."""
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        return False
    try:
        return n.__index__() >= 0  # type: ignore[attr-defined]
    except TypeError:
        return False


def _destination(key: str, value: Any, shape: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """Where tensor ``key`` of a version (of shape ``shape``) goes in a module whose state dict holds
    ``value`` under that name: the tensor to copy into and the offsets of its box in the whole
    tensor (zeros, unless ``value`` is a DTensor: then its local tensor and block). None for a
    DTensor whose mesh this rank is not part of (it holds nothing). Raises LoadError."""
    if not isinstance(value, torch.Tensor):
        raise LoadError(f"{key!r} is a {type(value).__name__} in the module, not a tensor")
    dtensor = is_dtensor(value)
    if tuple(value.shape) != tuple(shape):
        whose = " (the DTensor's global shape)" if dtensor else ""
        raise LoadError(f"size mismatch for {key!r}: the version has shape {list(shape)}, the module "
                        f"{list(value.shape)}{whose}")
    if not dtensor:
        return value, (0,) * len(shape)
    return _local_block(key, value)


def _local_block(key: str, value: Any) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """This rank's local tensor of DTensor ``value`` and the offsets of its block in the global
    tensor (:func:`paramstore.sharded.local_block`, as a commit finds them); None if this rank is
    not in its mesh. Raises LoadError for a placement whose local tensor is not one box."""
    try:
        block = local_block(key, value, verb="loaded")
    except InvalidTensorError as e:
        raise LoadError(str(e)) from None
    return None if block is None else (block.local, block.offsets)


def _extents(manifest: Manifest) -> dict[str, tuple[int, int, str]]:
    """Per object: the lowest offset and the highest end of the byte ranges the manifest points
    into, and the name of the tensor that ends highest (one pass over the manifest)."""
    out: dict[str, tuple[int, int, str]] = {}
    for name, e in manifest.stored():
        for obj, offset, nbytes, _ in e.ranges():
            lo, hi, last = out.get(obj, (offset, -1, name))
            end = offset + nbytes
            out[obj] = (min(lo, offset), end, name) if end > hi else (min(lo, offset), hi, last)
    return out


def _map_checked(tier: Tier, digest: str, step: int, extent: tuple[int, int, str],
                 expected: int | None) -> mmap.mmap:
    """Map object ``digest`` copy-on-write after checking its shape, not its bytes: its size is
    the registry's record of it (``expected``, when known), its safetensors header length fits in
    it, and every byte range the manifest points into (``extent``: lowest offset, highest end)
    lies in its data section. So no tensor view is ever short and no page past the end of the
    file is touched. A few header bytes are read; no JSON is parsed. Raises CorruptObjectError
    naming the file."""
    where = tier.object_path(digest) if hasattr(tier, "object_path") else digest
    try:
        m = tier.map(digest, private=True)
    except ValueError as e:  # mmap refuses an empty file
        raise CorruptObjectError(f"object {where} of version {step} is damaged ({e}: empty or truncated); "
                                 "run `paramstore verify --repair`") from None
    size, (lo, hi, last) = len(m), extent
    why = ""
    if expected is not None and size != expected:
        why = f"{size} bytes, the registry recorded {expected}: {'truncated' if size < expected else 'grown'}"
    elif size < 9:
        why = f"{size} bytes: too short for a safetensors header, truncated"
    else:
        (n,) = struct.unpack_from("<Q", m, 0)
        if 8 + n > size or m[8:9] != b"{":
            why = f"{size} bytes: its safetensors header (length {n}) is truncated or invalid"
        elif 8 + n > lo or hi > size:
            why = f"{size} bytes: tensor {last!r} ends at byte {hi}, past its end: truncated"
    if why:
        m.close()
        raise CorruptObjectError(f"object {where} of version {step} is damaged ({why}); "
                                 "run `paramstore verify --repair`")
    return m
