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
"""

from __future__ import annotations

import ctypes
import mmap
import struct
import weakref
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, NamedTuple

import torch

from .errors import CorruptObjectError, LoadError, StoreClosedError
from .liveness import libc
from .manifest import Manifest, Version
from .tensors import ST_TO_TORCH

from paramstore.backends.tiers.base import Tier

if TYPE_CHECKING:
    from .checkout import FetchReport

__all__ = ["Snapshot", "LoadResult"]

_MADV_POPULATE_READ = 22


class LoadResult(NamedTuple):
    """What :meth:`Snapshot.load_into` did not match, as ``Module.load_state_dict`` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class Snapshot(Mapping[str, torch.Tensor]):
    """A checked-out version: a mapping of names to tensors (the mapping itself is immutable).

    Tensors are views of the store's shared memory (CPU). Names tied at commit time return the very
    same tensor. The snapshot holds a lease on its version: the version is not pruned until the
    snapshot is closed (or garbage collected, or its process dies). Close it, or use it as a context
    manager, when done; tensors already taken stay valid after close.

    Attributes:
        version: the :class:`~paramstore.Version` checked out.
        manifest: where each tensor lies.
        fetch: how the bytes were obtained (:class:`~paramstore.checkout.FetchReport`: objects
            already here, from peers, from the remote; bytes per source), or None.

    ``sizes`` (object -> bytes, the registry's records): each object's file must have that size
    when it is mapped; objects left out are checked against the manifest's byte ranges only.

    Example:
        >>> with store.checkout("latest") as snap:
        ...     print(snap)
        ...     print(sorted(snap), snap["2.bias"].dtype, len(snap))
        Snapshot(step=1, tensors=4, digest=...)
        ['0.bias', '0.weight', '2.bias', '2.weight'] torch.float32 4
    """

    def __init__(self, version: Version, manifest: Manifest, tier: Tier,
                 on_close: Callable[[], None] | None = None, *, fetch: "FetchReport | None" = None,
                 sizes: Mapping[str, int] | None = None) -> None:
        self.version = version
        self.manifest = manifest
        self.fetch = fetch
        # Releases the lease on close, or when the snapshot is garbage collected unclosed.
        self._finalizer = weakref.finalize(self, on_close) if on_close is not None else None
        self._maps: dict[str, mmap.mmap] = {}
        try:
            for o, extent in sorted(_extents(manifest).items()):
                self._maps[o] = _map_checked(tier, o, version.step, extent, (sizes or {}).get(o))
        except BaseException:
            self.close()  # releases the lease too
            raise
        self._bufs: dict[str, torch.Tensor] | None = {
            o: torch.frombuffer(m, dtype=torch.uint8) for o, m in self._maps.items()
        }
        self._views: dict[str, torch.Tensor] = {}

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

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._bufs is None:
            raise StoreClosedError(f"snapshot of step {self.version.step} is closed")
        target = self.manifest.aliases.get(name, name)
        view = self._views.get(target)
        if view is None:
            try:
                e = self.manifest.tensors[target]
            except KeyError:
                raise KeyError(f"no tensor {name!r} in version {self.version.step}") from None
            buf = self._bufs[e.object]
            view = buf[e.offset : e.offset + e.nbytes].view(ST_TO_TORCH[e.dtype]).view(e.shape)
            self._views[target] = view
        return view

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
        for buf in list(self._bufs.values()):
            libc().madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(buf.numel()), _MADV_POPULATE_READ)

    def load_into(self, module: torch.nn.Module, *, strict: bool = True) -> LoadResult:
        """Copy this version into ``module``'s parameters and buffers, in place.

        Tied parameters are handled (the shared storage is written once per name, same bytes).
        Tensors are copied to each parameter's own device and dtype.

        Args:
            module: the module to load into.
            strict: raise if names differ, as ``load_state_dict`` does.

        Returns:
            The missing and unexpected keys.

        Raises:
            LoadError (a ``RuntimeError``): names differ (with ``strict``) or shapes differ.

        Example:
            >>> with store.checkout("latest") as snap:
            ...     snap.load_into(policy)
            LoadResult(missing_keys=[], unexpected_keys=[])
            >>> torch.equal(policy[0].weight, model[0].weight)
            True
            >>> with store.checkout("latest") as snap:
            ...     snap.load_into(torch.nn.Linear(4, 8), strict=False)
            LoadResult(missing_keys=['weight', 'bias'], unexpected_keys=['0.bias', '0.weight', '2.bias', '2.weight'])
        """
        try:
            res = module.load_state_dict(dict(self.items()), strict=strict)
        except RuntimeError as e:  # torch reports name and shape mismatches this way
            raise LoadError(f"cannot load version {self.version.step} into {type(module).__name__}: {e}") from e
        return LoadResult(list(res.missing_keys), list(res.unexpected_keys))

    def close(self) -> None:
        """Release the snapshot. Tensors already taken from it stay valid (they keep their mapping).

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
        self._bufs = None
        self._views = {}
        self._maps = {}
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Snapshot(step={self.version.step}, tensors={len(self)}, digest={self.version.digest[:12]})"

    def verify(self) -> dict[str, str]:
        """Re-hash every byte this snapshot maps; returns ``{object: why}`` for each damaged one.

        One blake3 pass over the version's objects (both levels of each object digest, and each
        tensor digest against the manifest), reading the very pages the tensor views use. Empty
        when every object is intact. ``store.checkout(v, verify=True)`` calls it and raises.

        Example:
            >>> with store.checkout("latest") as snap:
            ...     snap.verify()
            {}
        """
        from .ops import check_buffer

        if self._bufs is None:
            raise StoreClosedError(f"snapshot of step {self.version.step} is closed")
        spans: dict[str, dict[tuple[int, int], str]] = {}
        for e in self.manifest.tensors.values():
            spans.setdefault(e.object, {})[(e.offset, e.offset + e.nbytes)] = e.digest
        bad: dict[str, str] = {}
        for o, m in self._maps.items():
            with memoryview(m) as mv:
                why = check_buffer(o, mv, spans.get(o, {}))
            if why is not None:
                bad[o] = why
        return bad


def _extents(manifest: Manifest) -> dict[str, tuple[int, int, str]]:
    """Per object: the lowest offset and the highest end of the byte ranges the manifest points
    into, and the name of the tensor that ends highest (one pass over the manifest)."""
    out: dict[str, tuple[int, int, str]] = {}
    for name, e in manifest.tensors.items():
        lo, hi, last = out.get(e.object, (e.offset, -1, name))
        end = e.offset + e.nbytes
        out[e.object] = (min(lo, e.offset), end, name) if end > hi else (min(lo, e.offset), hi, last)
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
