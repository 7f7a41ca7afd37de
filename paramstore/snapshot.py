"""A checked-out version: its tensors as zero-copy views of the shared-memory objects.

:mod:`paramstore.checkout` leases the version and makes its objects present; a :class:`Snapshot` then
reads the manifest (one registry read), maps each object the version references
copy-on-write (one ``mmap`` per object, a few per GiB), and builds tensor views on first access.
No tensor byte is read or copied by checkout itself; the first touch of a page maps the store's page
into this process (``Snapshot.prefault`` does it ahead of time). The views are writable, copy-on-write:
writing through one copies that page privately (later reads of that name in this process see the
change), and the store never changes.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, NamedTuple

import torch

from .errors import LoadError, StoreClosedError
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

    Example:
        >>> with store.checkout("latest") as snap:
        ...     print(snap)
        ...     print(sorted(snap), snap["2.bias"].dtype, len(snap))
        Snapshot(step=1, tensors=4, digest=...)
        ['0.bias', '0.weight', '2.bias', '2.weight'] torch.float32 4
    """

    def __init__(self, version: Version, manifest: Manifest, tier: Tier,
                 on_close: Callable[[], None] | None = None, *, fetch: "FetchReport | None" = None) -> None:
        self.version = version
        self.manifest = manifest
        self.fetch = fetch
        # Releases the lease on close, or when the snapshot is garbage collected unclosed.
        self._finalizer = weakref.finalize(self, on_close) if on_close is not None else None
        self._maps: dict[str, mmap.mmap] = {o: tier.map(o, private=True) for o in sorted(manifest.objects())}
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
