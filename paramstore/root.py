"""Opening a store's directory: the marker file, the registry and the tier. No torch.

A store root holds::

    paramstore.json   marker: {"format": 1, "store_id": ...}, written last when a store is created
    meta/             the LMDB registry (versions, manifests, tags, tensor index) and its events file
    objects/          content-addressed safetensors objects (the shared-memory tier)
    tmp/              slabs being written; leftovers here after a crash are unreferenced
    device/           CUDA IPC descriptors of a trainer's ``device_latest`` (made by its first export;
                      with the root in a group store)
    quarantine/       damaged objects moved aside (made when needed; with the root in a group store)

Put the root on a tmpfs (``/dev/shm/...``) so objects live in shared memory.

Identity: the marker's ``store_id`` is also written into the registry when the store is created,
and every open compares the two, so metadata that was deleted (a /dev/shm cleaner) or replaced is
refused with :class:`~paramstore.errors.MetadataLostError`, never silently re-created. With a
shared (Redis) registry the marker remembers the registry's own id the first time it is joined.

Safety: a root is created private (``0700``: the objects and metadata are the owner's alone), and
a root owned by another user or writable by others is refused
(:class:`~paramstore.errors.UnsafeStoreError`): whoever owns the directory could swap its
``objects/`` under the trainer.

Group stores (``shared_group=True``, for a group whose processes run with umask ``007``): the
root's owner is the trainer; the group's other members read, lease, check out and open its CUDA
IPC descriptors. The root is ``3770`` (setgid: what is made in it gets the group; sticky: a member
may create names in it but never rename or delete the owner's ``meta/``, ``objects/``...); its
folders ``meta/``, ``objects/`` (and ``objects/<d[:2]>/``), ``tmp/``, ``device/`` and
``quarantine/`` are ``2750``: members list and read them but add nothing, so no member can plant
an object under a digest the trainer would deduplicate against, nor a descriptor. Members write
only the LMDB files in ``meta/`` (``0660``: leases are LMDB writes). Every file the trainer replaces
atomically (the marker, descriptors) goes through :func:`paramstore.safefs.write_atomic`, so a
``*.partial`` link a member plants in the root is never followed. A group root without the sticky
bit (made before it was set) is fixed by its owner's next open and refused to members until then
(:class:`~paramstore.errors.UnsafeStoreError`): a member cannot fix what it does not own, and until
its owner does, any member could have swapped its folders.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from paramstore.backends.registries import Registry, find_registry, open_registry
from paramstore.backends.tiers.local import QUARANTINE_DIR, LocalTier

from . import safefs
from .errors import (
    CorruptStoreError, InvalidArgumentError, MetadataLostError, NotAStoreError, StorageError,
    TagNotFoundError, UnsafeStoreError, VersionNotFoundError,
)
from .format import loads
from .text import restore_advice

__all__ = ["StoreRoot", "VersionSpec", "open_root", "check_creatable", "check_safe",
           "check_group_root", "MARKER", "STORE_FORMAT"]

#: How a version is named: a step, ``"latest"``, or a tag.
VersionSpec = int | str

MARKER = "paramstore.json"
_STEP = re.compile(r"-?[0-9]+\Z")
STORE_FORMAT = 1
#: A group store's root: setgid (what is made in it gets its group) and sticky (a member may create
#: names in it, never rename or delete the owner's), group ``rwx``.
GROUP_ROOT_MODE = 0o3770
#: A group store's folders: the group lists and reads them, only the owner writes into them.
GROUP_DIR_MODE = 0o2750
#: The LMDB files the group writes (leases, and the events file a lease change touches).
GROUP_META_MODE = 0o660
_GROUP_DIRS = ("meta", "objects", "tmp", "device", QUARANTINE_DIR)
_GROUP_META_FILES = ("data.mdb", "lock.mdb", "events", "lease-events")


@dataclass
class StoreRoot:
    """The parts of an open store directory."""

    path: str
    info: dict[str, Any]
    registry: Registry
    tier: LocalTier
    #: manifests read lately, by (step, version digest, created_at): a manifest never changes, and
    #: parsing one of 10,000 tensors costs ~100 ms at every checkout otherwise (see objects.read_manifest)
    manifests: "OrderedDict[tuple[int, str, float], Any]" = field(default_factory=OrderedDict)
    manifests_lock: threading.Lock = field(default_factory=threading.Lock)

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
        try:
            fd = os.open(os.path.join(self.path, "meta", "gc.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError as e:
            raise MetadataLostError(f"the metadata of the store at {self.path} was deleted (meta/ is gone): "
                                    f"{restore_advice(self.path)}") from e
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
              name: str = "default", shared_group: bool = False) -> StoreRoot:
    """Open the store at ``path``; with ``create``, make one if ``path`` is missing or empty.

    ``registry``: None for the root's own registry (LMDB, in ``<path>/meta``), or a URL whose scheme
    names an installed registry (``redis://`` shared by several hosts, or a third party's: see
    :mod:`paramstore.backends.registries`); then ``name`` tells the stores sharing it apart.
    ``shared_group``: a new root is made a group store (``3770``; group members may read and lease,
    see the module's doc) instead of ``0700``. A group root this user owns gets its modes fixed at
    every open.

    Raises:
        NotAStoreError: ``path`` holds no store (and ``create`` is false, or it holds other files),
            or a store of an unsupported format.
        MetadataLostError: the store's metadata is missing or belongs to another store.
        InvalidArgumentError: no installed registry serves the URL's scheme (nothing is created).
        UnsafeStoreError: ``path`` is owned by another user or writable by others; a group store
            whose root lacks the sticky bit or whose folders the group may write (opened by a
            member), or that holds a folder that is a link or not its owner's.
    """
    path = os.path.abspath(os.fspath(path))
    marker = os.path.join(path, MARKER)
    find_registry(registry)  # a URL no installed registry serves: refused before anything is made
    if not os.path.exists(marker):
        if not create:
            raise NotAStoreError(_not_a_store(path, create=False))
        if os.path.exists(path) and (not os.path.isdir(path) or not _creatable(os.listdir(path))) \
                and not os.path.exists(marker):  # another process may have finished creating it since
            raise NotAStoreError(_not_a_store(path, create=True))
        if os.path.isdir(path):
            check_safe(path)  # an empty directory someone else made must not become our store
        try:
            _create(path, marker, mode=GROUP_ROOT_MODE if shared_group else 0o700)
        except OSError as e:  # a parent that does not exist or cannot be written, a full disk...
            raise StorageError(e.errno, f"cannot create a store at {path}: {e.strerror}; choose a directory "
                                        "you can write to (on /dev/shm for shared memory)", path) from e
    check_safe(path)
    check_group_root(path)
    info = _read_marker(path, marker)
    if registry is None and "registry_id" in info:
        raise InvalidArgumentError(_needs_registry(path, info))
    meta = os.path.join(path, "meta")
    if registry is not None and "registry_id" not in info and _has_local_versions(meta):
        raise InvalidArgumentError(
            f"the store at {path} is a single-host store (its versions are in {meta}); it cannot join a shared "
            f"registry, which would hide them: open it without --registry (registry=), or give the shared store "
            "a root of its own")
    if registry is None and not os.path.exists(os.path.join(meta, "data.mdb")):
        raise MetadataLostError(
            f"the metadata of the store at {path} is missing ({meta}/data.mdb was deleted, by a /dev/shm cleaner?): "
            f"its versions are lost here and nothing was re-created. {restore_advice(path)}")
    # no URL: the root's own registry (the ``lmdb`` entry point), made with the root
    reg = open_registry(registry, meta, name, create=registry is not None, mode=0o660 if shared_group else 0o600)
    try:
        info = _check_identity(path, marker, info, reg, shared=registry is not None, name=name)
        tier = LocalTier(path, create=True)
    except BaseException:
        reg.close()
        raise
    return StoreRoot(path, info, reg, tier)


def check_creatable(path: str) -> None:
    """Raise NotAStoreError if ``path`` holds something that is not a store and could not become one
    (a file, a directory of other files); a missing or empty directory, or a store, passes."""
    if os.path.exists(os.path.join(path, MARKER)) or not os.path.exists(path):
        return
    if not os.path.isdir(path) or not _creatable(os.listdir(path)):
        raise NotAStoreError(_not_a_store(path, create=True))


def check_safe(path: str) -> None:
    """Refuse a root owned by another user or writable by others (UnsafeStoreError).

    A root another user owns is accepted only as a group store (``shared_group=True``: setgid,
    group ``rwx``) of a group this process belongs to."""
    st = os.stat(path)
    group_store = (st.st_mode & (stat.S_ISGID | stat.S_IRWXG) == stat.S_ISGID | stat.S_IRWXG
                   and (st.st_gid == os.getegid() or st.st_gid in os.getgroups()))
    if st.st_uid != os.geteuid() and not group_store:
        raise UnsafeStoreError(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): whoever "
                               "owns it could replace the store's objects. Use a directory of your own")
    if st.st_mode & stat.S_IWOTH:
        raise UnsafeStoreError(f"{path} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}): anyone could "
                               f"replace the store's objects. Run: chmod o-w {path}")


def check_group_root(path: str) -> None:
    """A group store's modes (see the module's doc): its owner fixes them; a member refuses a root
    without the sticky bit or a folder the group may write (UnsafeStoreError). A private root passes."""
    st = os.stat(path)
    if not _is_group_root(st):
        return
    if st.st_uid == os.geteuid():
        _secure_group_root(path)
        return
    loose = [d for d in _GROUP_DIRS if _group_writable(os.path.join(path, d))]
    if st.st_mode & stat.S_ISVTX and not loose:
        return
    why = "its root lacks the sticky bit" if not st.st_mode & stat.S_ISVTX else ""
    why += (" and " if why and loose else "") + (f"the group may write {', '.join(loose)}" if loose else "")
    raise UnsafeStoreError(
        f"the group store at {path} is not locked against its members: {why}, so any member could have "
        f"renamed or replaced what its trainer wrote. Its owner (uid {st.st_uid}) fixes it by opening it once "
        f"(`paramstore --root {path} ls`), or by hand: chmod {GROUP_ROOT_MODE:o} {path}, chmod {GROUP_DIR_MODE:o} "
        f"on its folders")


def _is_group_root(st: os.stat_result) -> bool:
    return st.st_mode & (stat.S_ISGID | stat.S_IRWXG) == stat.S_ISGID | stat.S_IRWXG


def _group_writable(path: str) -> bool:
    try:
        return bool(os.lstat(path).st_mode & stat.S_IWGRP)
    except FileNotFoundError:
        return False


def _secure_group_root(path: str) -> None:
    """Give a group root of this user's its modes (whatever the umask it was made with): the root
    ``3770``, its folders and ``objects/<d[:2]>/`` ``2750`` (made if missing), the group's LMDB files
    ``0660``. Raises UnsafeStoreError for a folder that is a link or that another user made."""
    _chmod(path, GROUP_ROOT_MODE)
    for d in _GROUP_DIRS:
        safefs.own_directory(os.path.join(path, d), GROUP_DIR_MODE)
        _chmod(os.path.join(path, d), GROUP_DIR_MODE)
    objects = os.path.join(path, "objects")
    for sub in os.listdir(objects):
        if stat.S_ISDIR(os.lstat(os.path.join(objects, sub)).st_mode):
            safefs.own_directory(os.path.join(objects, sub), GROUP_DIR_MODE)
            _chmod(os.path.join(objects, sub), GROUP_DIR_MODE)
    for name in _GROUP_META_FILES:  # meta/ is no longer group-writable: nobody swaps these now
        f = os.path.join(path, "meta", name)
        try:
            st = os.lstat(f)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):  # swapped by a member while meta/ was group-writable
            raise UnsafeStoreError(f"{f} is not a regular file (a link?): a member of the store's group replaced "
                                   "it while meta/ was group-writable, so that the trainer's writes go elsewhere. "
                                   "Remove the link (the events files are made again at the next open; "
                                   f"data.mdb or lock.mdb: restore meta/), then run paramstore --root {path} verify")
        if st.st_uid == os.geteuid():
            _chmod(f, GROUP_META_MODE)


def _chmod(path: str, mode: int) -> None:
    if stat.S_IMODE(os.lstat(path).st_mode) != mode:
        os.chmod(path, mode)


def _read_marker(path: str, marker: str) -> dict[str, Any]:
    try:
        with open(marker, "rb") as f:
            info = loads(f.read(), object, marker)
    except OSError as e:
        raise NotAStoreError(f"{marker} is unreadable: {e}") from e
    except ValueError as e:  # bad JSON or bad UTF-8, or nested too deeply
        raise CorruptStoreError(f"{marker} is damaged ({e}); the store's metadata cannot be trusted: "
                                f"{restore_advice(path)}") from e
    if not isinstance(info, dict) or info.get("format") != STORE_FORMAT:
        fmt = info.get('format') if isinstance(info, dict) else '?'
        newer = isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > STORE_FORMAT
        raise NotAStoreError(f"{path} holds a store of format {fmt}; this paramstore reads format {STORE_FORMAT}"
                             + ("; it was written by a newer paramstore: upgrade paramstore" if newer else ""))
    if not isinstance(info.get("store_id"), str):
        raise CorruptStoreError(f"{marker} has no store_id: the store's identity cannot be checked")
    return info


def _check_identity(path: str, marker: str, info: dict[str, Any], reg: Registry, *, shared: bool,
                    name: str) -> dict[str, Any]:
    """Compare the registry's identity with the marker's; returns the marker's info (updated if joined).

    A root that joins a shared registry records its id, URL (password masked) and the store's name
    in the marker, so that a later open without them can say which registry and name to pass."""
    if not shared:
        held = reg.swap_meta("store_id", None, info["store_id"])  # a store made before 0.2 is adopted
        if held != info["store_id"]:
            raise MetadataLostError(
                f"the metadata in {path}/meta belongs to another store (id {held}, this root's is {info['store_id']}): "
                "it was replaced. Nothing was changed; restore the right meta/ or remove the directory")
        return info
    known = info.get("registry_id")
    held = reg.get_meta("store_id")
    if held is None and known is None:
        held = reg.swap_meta("store_id", None, uuid.uuid4().hex)  # the first host to join names it
    if held is None:
        _not_in_registry(path, info, reg, name)
    if known is not None and held != known:
        raise MetadataLostError(f"the shared registry holds another store under this name (id {held}; {path} "
                                f"belongs to id {known}): check the registry URL and name=")
    joined = {**info, "registry_id": held, "registry": getattr(reg, "url", None), "name": name}
    if joined != info:
        _write_json(marker, joined)
    return joined


def _has_local_versions(meta: str) -> bool:
    """Whether the LMDB registry in ``meta`` (every root has one) records versions: a single-host store."""
    if not os.path.exists(os.path.join(meta, "data.mdb")):
        return False
    reg = open_registry(None, meta, "default", create=False)
    try:
        return reg.latest_step() is not None
    finally:
        reg.close()


def _needs_registry(path: str, info: dict[str, Any]) -> str:
    """Why a root that caches a shared-registry store cannot be read without that registry, and the
    command that reads it (the URL as the marker recorded it: password masked)."""
    url, name = info.get("registry") or "redis://HOST:PORT/DB", info.get("name") or "NAME"
    return (f"the store at {path} is this host's cache of the store {name!r} in the shared registry {url}: its "
            f"versions are listed there, not in {path}/meta. Pass the registry and the store's name: "
            f"`paramstore --root {path} --registry {url} --name {name} ls` (or $PARAMSTORE_REGISTRY and "
            f"$PARAMSTORE_NAME; in Python ParamStore({path!r}, registry=URL, name={name!r}))"
            + ("; put the password where *** stands" if ":***@" in url else ""))


def _not_in_registry(path: str, info: dict[str, Any], reg: Registry, name: str) -> None:
    """Raise the error for a shared registry that holds no store under ``name`` although this root
    joined one: a mistyped name (InvalidArgumentError naming the stores there), or lost metadata
    (MetadataLostError: the server was flushed or restarted without persistence)."""
    url, known = getattr(reg, "url", "the registry"), info.get("registry_id")
    stores = reg.stores()
    if stores is None:  # cannot list: say both
        raise MetadataLostError(
            f"no store named {name!r} in {url}, which held this root's store (id {known}): check the name; if it "
            "is right, the server lost the store's metadata (flushed?): nothing was re-created")
    mine = [n for n, sid in stores.items() if sid == known]
    there = f"stores there: {', '.join(stores)}" if stores else "the server holds no store at all"
    if mine:
        raise InvalidArgumentError(f"no store named {name!r} on {url}; {there}. This root ({path}) caches the store "
                                   f"named {mine[0]!r}: pass --name {mine[0]} (name={mine[0]!r})")
    if stores:
        raise InvalidArgumentError(
            f"no store named {name!r} on {url}; {there}. None of them is the store this root ({path}) caches "
            f"(id {known}{', named ' + repr(info['name']) if info.get('name') else ''}): check --name and "
            "--registry (the server or database may be another); nothing was created")
    raise MetadataLostError(
        f"no store named {name!r} on {url}: {there}, yet this root ({path}) caches a store there (id {known}"
        f"{', named ' + repr(info['name']) if info.get('name') else ''}): check --registry (another server or "
        "database?); if it is right, the server lost its data (flushed, or restarted without persistence): "
        "nothing was re-created. Restore the versions from the store's remote, or use a new store name")


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
    return (f"no store exists at {path} (no {MARKER}); a reader never creates one: check the path. If the "
            "trainer has not committed yet, wait for it (wait_for, subscribe or checkout(min_step=, timeout=)); "
            f"a trainer's first commit creates it (ParamStore({path!r}).commit(...))")


def _creatable(entries: list[str]) -> bool:
    # Empty, or what another process creating the same store at this moment has made so far.
    return all(e in ("meta", "objects", "tmp", "device", QUARANTINE_DIR) or e.startswith(MARKER + ".")
               for e in entries)


def _create(path: str, marker: str, *, mode: int) -> None:
    os.makedirs(path, mode=mode, exist_ok=True)
    os.chmod(path, mode)  # makedirs' mode is filtered by the umask
    group = _is_group_root(os.stat(path))
    if group:  # its folders first, locked, before anything is written into them
        _secure_group_root(path)
    store_id = uuid.uuid4().hex
    reg = open_registry(None, os.path.join(path, "meta"), "default", create=True,
                        mode=GROUP_META_MODE if group else 0o600)
    try:
        store_id = reg.swap_meta("store_id", None, store_id) or store_id  # two creators: the first id wins
    finally:
        reg.close()
    LocalTier(path, create=True)
    if group:
        _secure_group_root(path)  # the LMDB files, whatever the umask
    _write_json(marker, {"format": STORE_FORMAT, "store_id": store_id})


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``path`` atomically (see :func:`paramstore.safefs.write_atomic`: a ``*.partial`` link
    planted in a group root is never followed)."""
    safefs.write_atomic(path, json.dumps(data).encode(), mode=0o644)
