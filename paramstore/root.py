"""Opening a store's directory: the marker file, the registry and the tier. No torch.

A store root holds::

    paramstore.json   marker: {"format": 1, "store_id": ...}, written last when a store is created
    meta/             the LMDB registry (versions, manifests, tags, tensor index) and its events file
    objects/          content-addressed safetensors objects (the shared-memory tier)
    tmp/              slabs being written; leftovers here after a crash are unreferenced

Put the root on a tmpfs (``/dev/shm/...``) so objects live in shared memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from paramstore.backends.registries import Registry, open_registry
from paramstore.backends.registries.lmdb import LmdbRegistry
from paramstore.backends.tiers.local import LocalTier

from .errors import InvalidArgumentError, NotAStoreError, StorageError, TagNotFoundError, VersionNotFoundError

__all__ = ["StoreRoot", "VersionSpec", "open_root", "MARKER", "STORE_FORMAT"]

#: How a version is named: a step, ``"latest"``, or a tag.
VersionSpec = int | str

MARKER = "paramstore.json"
_STEP = re.compile(r"-?[0-9]+\Z")
STORE_FORMAT = 1


@dataclass
class StoreRoot:
    """The parts of an open store directory."""

    path: str
    info: dict[str, Any]
    registry: Registry
    tier: LocalTier

    def resolve(self, version: VersionSpec) -> int:
        """The step named by a step, ``"latest"`` or a tag (a step is not checked to exist).

        Raises VersionNotFoundError (empty store), TagNotFoundError or InvalidArgumentError.
        """
        if isinstance(version, bool) or not isinstance(version, (int, str)):
            raise InvalidArgumentError(f"version must be a step, 'latest' or a tag, got {version!r}")
        if isinstance(version, int):
            return version
        if _STEP.match(version):  # "5" from a CLI or a config file: a step (tags cannot look like one)
            return int(version)
        if version[:1] == "-" and version.lstrip("-").isdigit():
            raise InvalidArgumentError(f"{version!r} is not a step: steps are written as non-negative integers")
        if version == "latest":
            step = self.registry.latest_step()
            if step is None:
                raise VersionNotFoundError(f"store {self.path} has no version yet")
            return step
        tags = self.registry.tags()
        if version not in tags:
            raise TagNotFoundError(f"no tag named {version!r} (tags: {', '.join(sorted(tags)) or 'none'})")
        return tags[version]

    @contextlib.contextmanager
    def leased(self, steps: Iterable[int], *, skip_missing: bool = False,
               holder: str = "paramstore") -> Iterator[list[int]]:
        """Hold a lease on each step while its objects are read (so retention cannot prune it).

        Yields the steps leased: all of them, or with ``skip_missing`` those still present.
        Raises VersionNotFoundError for a missing step otherwise.
        """
        held: list[tuple[int, str]] = []
        try:
            for s in steps:
                try:
                    held.append((s, self.registry.acquire_lease(s, f"{holder} (pid {os.getpid()})").id))
                except VersionNotFoundError:
                    if not skip_missing:
                        raise
            yield [s for s, _ in held]
        finally:
            for _, lease_id in held:
                self.registry.release_lease(lease_id)

    @contextlib.contextmanager
    def gc_lock(self, *, exclusive: bool = False) -> Iterator[None]:
        """The lock between commits (shared) and GC (exclusive) on this host.

        A commit holds it shared from its dedup lookup until its version is published, so GC never
        deletes an object that an in-flight commit is about to reference. ``flock`` is released by
        the kernel if the holder dies.
        """
        fd = os.open(os.path.join(self.path, "meta", "gc.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            _HELD.add(fd)
            yield
        finally:
            _HELD.discard(fd)
            os.close(fd)  # releases the lock

    def close(self) -> None:
        self.registry.close()


def open_root(path: str | os.PathLike[str], *, create: bool, registry: str | None = None,
              name: str = "default") -> StoreRoot:
    """Open the store at ``path``; with ``create``, make one if ``path`` is missing or empty.

    ``registry``: None for the LMDB registry in ``<path>/meta``, or a ``redis://`` URL shared by
    several hosts; then ``name`` tells the stores sharing that server apart.

    Raises:
        NotAStoreError: ``path`` holds no store (and ``create`` is false, or it holds other files),
            or a store of an unsupported format.
    """
    path = os.path.abspath(os.fspath(path))
    marker = os.path.join(path, MARKER)
    if not os.path.exists(marker):
        if not create:
            raise NotAStoreError(_not_a_store(path, create=False))
        if os.path.exists(path) and (not os.path.isdir(path) or not _creatable(os.listdir(path))):
            raise NotAStoreError(_not_a_store(path, create=True))
        try:
            _create(path, marker)
        except OSError as e:  # a parent that does not exist or cannot be written, a full disk...
            raise StorageError(e.errno, f"cannot create a store at {path}: {e.strerror}; choose a directory "
                                        "you can write to (on /dev/shm for shared memory)", path) from e
    try:
        with open(marker) as f:
            info = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise NotAStoreError(f"{marker} is unreadable: {e}") from e
    if not isinstance(info, dict) or info.get("format") != STORE_FORMAT:
        raise NotAStoreError(f"{path} holds a store of format {info.get('format') if isinstance(info, dict) else '?'}; "
                             f"this paramstore reads format {STORE_FORMAT}")
    reg = open_registry(registry, os.path.join(path, "meta"), name)
    tier = LocalTier(path, create=True)
    return StoreRoot(path, info, reg, tier)


# Descriptors of GC locks held right now. A flock belongs to the open file description, which a
# forked child shares: the child closes its copies at once, or the lock would last as long as it.
_HELD: set[int] = set()


def _close_inherited_locks() -> None:
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def _not_a_store(path: str, *, create: bool) -> str:
    """Why ``path`` cannot be opened (or created) as a store, and what to do instead."""
    instead = ("pass the store's own directory (--root on the command line), "
               "or choose an empty or new directory to create a store in")
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} is a file, not a paramstore root (a store is a directory); {instead}"
    try:
        other = os.path.isdir(path) and not _creatable(os.listdir(path))
    except OSError as e:
        return f"{path} is not a paramstore root (no {MARKER}) and cannot be listed: {e}; {instead}"
    if other or create:  # create: only a non-empty directory is refused
        return (f"{path} is not a paramstore root (no {MARKER}) and is not empty, so no store can be "
                f"created there either; {instead}")
    return f"{path} is not a paramstore root (no {MARKER}); create one with ParamStore({path!r})"


def _creatable(entries: list[str]) -> bool:
    # Empty, or what another process creating the same store at this moment has made so far.
    return all(e in ("meta", "objects", "tmp") or e.startswith(MARKER + ".") for e in entries)


def _create(path: str, marker: str) -> None:
    os.makedirs(path, exist_ok=True)
    LmdbRegistry(os.path.join(path, "meta"), create=True).close()
    LocalTier(path, create=True)
    tmp = f"{marker}.{os.getpid()}.partial"
    with open(tmp, "w") as f:
        json.dump({"format": STORE_FORMAT, "store_id": uuid.uuid4().hex}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, marker)  # two processes creating at once: the last marker wins, both valid
