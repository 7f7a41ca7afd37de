"""What an operation reports: plain data, no behaviour beyond formatting.

Each report type is returned by one operation (and exported where users meet it):

* :class:`FetchReport`: how a checkout obtained the bytes of a version (``snap.fetch``,
  :mod:`paramstore.checkout`, :mod:`paramstore.peer`, :mod:`paramstore.collective`);
* :class:`TransferReport`: what a push or pull moved (:mod:`paramstore.remote`);
* :class:`PatchReport`: what the patcher made for one version (:mod:`paramstore.delta`);
* :class:`PruneReport`, :class:`GcReport`: what a prune or a GC did (:mod:`paramstore.maintenance`);
* :class:`LoadResult`: what :meth:`Snapshot.load_into <paramstore.snapshot.Snapshot.load_into>` did not match.

A leaf module: it imports nothing of paramstore (and no torch), so any layer can name these types.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

__all__ = ["FetchReport", "TransferReport", "PatchReport", "PruneReport", "GcReport", "LoadResult"]


@dataclass
class FetchReport:
    """How a checkout obtained the bytes of a version.

    Attributes:
        step: the version.
        local: objects this host already held (nothing moved for them).
        from_peers: objects read from peer hosts (verified).
        from_remote: objects downloaded from the remote tier (verified).
        from_patches: objects rebuilt here from patches against a version this host holds
            (verified; see :mod:`paramstore.delta`).
        patch_bytes: bytes of patch objects moved to this host (also counted in ``bytes_from``).
        from_group: objects received over a collective group (``checkout(group=pg, src=r)``;
            verified), counted in ``bytes_from`` under ``"group:<src rank>"``.
        bytes_from: bytes read per source: a peer's session (``host:port``) or the remote's URL.
        rejected: per peer session, objects whose bytes from that peer failed verification: a copy
            it served alone failed, or bytes it served differ from a copy that verified (so it is
            named even when another holder's bytes made the object whole); a peer named here is
            asked nothing more in that fetch (``"patch"``: patches that did not rebuild their
            object, which then moved whole; ``"size"``: objects whose size in the registry the
            header their holder serves contradicts, which were then not read from peers).
        failed: per peer session, its reads that failed (a transport error: the peer is dead,
            refused, or moved no byte for the transfer engine's progress timeout): once per stall
            and object in a fetch (the reads in flight to it fail together), once per failed batch
            in a lazy read. Not a fault of its bytes: a holder nobody else can replace is asked
            again after a back-off (:data:`paramstore.relay.PEER_RETRIES`); a fetcher ahead whose
            progress cannot be read is passed over.
        seconds: time spent obtaining bytes.
        lazy: whether the checkout was lazy (``checkout(v, fetch="lazy")``: objects this host lacked
            were not fetched at checkout; reads fetch the pieces they touch, see :mod:`paramstore.lazy`).
        lazy_bytes: bytes moved by those reads so far (also counted per source in ``bytes_from``).

    Example:
        >>> with store.checkout("latest") as snap:
        ...     report = snap.fetch
        >>> report.step, report.local, report.moved, report.bytes  # everything was already on this host
        (1, 1, False, 0)
        >>> report.as_dict()
        {'step': 1, 'local': 1, 'from_peers': 0, 'from_remote': 0, 'from_patches': 0, 'patch_bytes': 0,
         'from_group': 0, 'bytes': 0, 'bytes_from': {}, 'rejected': {}, 'failed': {}, 'seconds': ...,
         'lazy': False, 'lazy_bytes': 0}
    """

    step: int
    local: int = 0
    from_peers: list[str] = field(default_factory=list)
    from_remote: list[str] = field(default_factory=list)
    from_patches: list[str] = field(default_factory=list)
    patch_bytes: int = 0
    from_group: list[str] = field(default_factory=list)
    bytes_from: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    lazy: bool = False
    lazy_bytes: int = 0

    @property
    def bytes(self) -> int:
        """Bytes moved to this host, from every source."""
        return sum(self.bytes_from.values())

    @property
    def fetched(self) -> list[str]:
        """Objects obtained by this host from any source (peers, the remote, rebuilt from patches)."""
        return [*self.from_peers, *self.from_remote, *self.from_patches, *self.from_group]

    @property
    def moved(self) -> bool:
        """Whether any byte had to move."""
        return bool(self.from_peers or self.from_remote or self.from_patches or self.from_group or self.lazy_bytes)

    def absorb(self, pulled: "TransferReport | None") -> None:
        """Count what a pull from the remote placed before this fetch as part of it (those
        objects were not local: they came from the remote, whole or rebuilt from patches); a pull
        of another version, or none, changes nothing."""
        if pulled is None or pulled.step != self.step:
            return
        self.from_remote[:0] = pulled.moved
        self.from_patches[:0] = pulled.from_patches
        self.patch_bytes += pulled.patch_bytes
        self.local -= len(pulled.moved) + len(pulled.from_patches)
        self.bytes_from[pulled.url] += pulled.bytes
        self.seconds += pulled.seconds

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "local": self.local, "from_peers": len(self.from_peers),
                "from_remote": len(self.from_remote), "from_patches": len(self.from_patches),
                "patch_bytes": self.patch_bytes, "from_group": len(self.from_group), "bytes": self.bytes, "bytes_from": dict(self.bytes_from),
                "rejected": dict(self.rejected), "failed": dict(self.failed), "seconds": self.seconds, "lazy": self.lazy,
                "lazy_bytes": self.lazy_bytes}


@dataclass(frozen=True)
class TransferReport:
    """What a push or pull moved."""

    step: int
    objects: int  # objects moved
    bytes: int  # bytes moved
    skipped: int  # objects the other side already had
    seconds: float
    moved: tuple[str, ...] = ()  # digests of the objects moved whole (pull only)
    url: str = ""  # the remote's URL
    from_patches: tuple[str, ...] = ()  # objects that moved as patches (pushed as / rebuilt from)
    patch_bytes: int = 0  # bytes of patch objects moved (counted in ``bytes`` too)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "objects": self.objects, "bytes": self.bytes, "skipped": self.skipped,
                "seconds": self.seconds, "from_patches": len(self.from_patches), "patch_bytes": self.patch_bytes}


@dataclass
class PatchReport:
    """What the patcher made for one version: ``{target object: (patch object, size)}``, the base,
    and how long it took (``error``: why it made nothing, if it failed)."""

    base: int | None
    target: int
    patches: dict[str, tuple[str, int]] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.patches.values())


@dataclass(frozen=True)
class PruneReport:
    """What a prune kept (with reasons) and removed."""

    kept: Mapping[int, list[str]]
    removed: list[int]
    dry_run: bool
    policy: str
    #: versions the policy dropped but a lease taken meanwhile (or a newer latest) saved, or (remote)
    #: that a kept version stored as patches is rebuilt from
    spared: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "dry_run": self.dry_run, "kept": {str(k): v for k, v in self.kept.items()},
                "removed": self.removed, "spared": self.spared}


@dataclass(frozen=True)
class GcReport:
    """What a GC deleted (or would delete, in a dry run)."""

    objects: list[str]
    bytes_freed: int
    temporary_files: list[str]
    dry_run: bool

    def as_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "objects_deleted": len(self.objects), "bytes_freed": self.bytes_freed,
                "temporary_files_deleted": self.temporary_files, "objects": self.objects}


class LoadResult(NamedTuple):
    """What :meth:`Snapshot.load_into <paramstore.snapshot.Snapshot.load_into>` did not match, as ``Module.load_state_dict`` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]
