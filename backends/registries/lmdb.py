"""The single-host registry: one LMDB environment under the store root.

Databases (all values JSON unless said otherwise):

================  ==============================  ===========================================
name              key                             value
================  ==============================  ===========================================
``versions``      step, 8-byte big-endian         the version record (``Version.to_json``)
``manifests``     step, 8-byte big-endian         the manifest (``Manifest.to_json``)
``tags``          tag name, UTF-8                 step, 8-byte big-endian
``tensors``       tensor digest, 32 raw bytes     object digest (32 raw bytes), offset, length
``objects``       object digest, 32 raw bytes     size (8-byte big-endian) + its tensor digests (32 raw bytes each)
``refs``          step, 8-byte big-endian         the version's object digests (32 raw bytes each)
``leases``        lease id, UTF-8                 the lease (step, holder, pid, process start time, host, time)
``persisted``     step, 8-byte big-endian         URL of the remote the version is durable in
``peers``         peer id, UTF-8                  the peer (session, host, pid, process start time, node, time)
``holders``       object digest (32 raw bytes)    the address in the peer's registered memory, 8-byte big-endian
                  + peer id (UTF-8)               (then its position, for a key announced in order)
``peer-objects``  peer id (UTF-8) + NUL           empty: the reverse of ``holders``, so a peer's objects go with it
                  + object digest (32 raw bytes)
``ranks``         key (32 raw bytes) + position   the peer id holding ``key`` at that position
                  (8-byte big-endian)             (:meth:`Registry.announce_in_order`)
``meta``          ``store_id`` / ``writer``       the store's identity and its current writer (UTF-8)
``patches``       target step + base step          pairs of target object + patch object (32 raw bytes each)
                  (8-byte big-endian each)
``derived``       ``<recipe>@<version>/<unit>``    a derived record (JSON, :mod:`paramstore.derived`)
================  ==============================  ===========================================

``refs`` makes the mark phase of GC cheap (no manifest is parsed); ``objects`` lists each object's
tensors so GC can drop their index entries. A lease is live while its process (pid *and* start time,
see :mod:`paramstore.liveness`) runs; readers of ``leases`` release dead processes' leases. A peer is
live the same way (``node`` is the host that announced it, where its pid means something); whoever
reads ``peers()`` or ``holders()`` first after a peer's process died drops it with its holdings.
``holders`` keys sort by digest then peer id, so one cursor range gives an object's holders in order.

Damage is reported, never crashed on: an environment whose ``data.mdb`` is shorter than its last
page (a truncated file would make LMDB die with SIGBUS) is refused at open, undecodable records and
LMDB's own corruption errors become :class:`~paramstore.errors.CorruptStoreError`, and a
``data.mdb`` deleted or replaced while this process has it open (a /dev/shm cleaner) is noticed by
the next write, ``latest_step`` or ``versions`` call (:class:`~paramstore.errors.MetadataLostError`).
Free pages are reserved ahead in ``data.mdb`` (:data:`RESERVE_BYTES`), so that readers can still
take and release leases when the filesystem is full.

This is the only module that touches LMDB. The environment is opened per process and reopened
after ``fork`` (an LMDB environment must never be used across fork). Every publish and tag change
is one write transaction; afterwards the ``events`` file (``lease-events`` for lease changes) is
rewritten, which wakes the processes watching it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import json
import os
import random
import struct
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

import lmdb

from paramstore import liveness
from paramstore.errors import (
    CorruptStoreError, InvalidArgumentError, MetadataLostError, ParamStoreError, StepOrderError, StorageError,
    StorageFullError, TagNotFoundError, VersionNotFoundError,
)
from paramstore.manifest import Manifest, Version
from paramstore.text import restore_advice

from ._inotify import FileWatch
from .base import (
    Lease, ObjectInfo, Peer, Registry, TensorLocation, Watch, check_derived_key, check_derived_record, check_digests,
    check_holdings, check_limit, check_meta_key, check_patches, check_positions,
    check_peer, check_peer_id, unregistered,
)

__all__ = ["LmdbRegistry", "restore_advice", "from_url"]

_STEP = struct.Struct(">Q")
_LOC = struct.Struct(">32sQQ")
# Named databases missing from an older store are created when it is opened.
_DBS = ("versions", "manifests", "tags", "tensors", "objects", "refs", "leases", "persisted", "peers", "holders",
        "peer-objects", "ranks", "meta", "patches", "derived")
DEFAULT_MAP_SIZE = 1 << 36  # 64 GiB of address space; the file only grows as used
#: Bytes allocated ahead of LMDB's last page in ``data.mdb`` (topped up when half is used), so
#: that lease writes never need new space from a full filesystem.
RESERVE_BYTES = 8 << 20

_F = TypeVar("_F", bound=Callable[..., Any])


def _guarded(fn: _F) -> _F:
    """LMDB failures and undecodable records become the package's errors (never a bare one)."""
    @functools.wraps(fn)
    def call(self: "LmdbRegistry", *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except ParamStoreError:
            raise
        except (lmdb.DiskError, lmdb.MapFullError) as e:
            raise StorageFullError(errno.ENOSPC, f"the registry at {self._path} cannot grow: {e}; free space on "
                                                 "its filesystem (prune and gc)", self._path) from e
        except (*_DAMAGE, ValueError, KeyError, TypeError, RecursionError, struct.error) as e:  # JSON/UTF-8: ValueErrors
            raise CorruptStoreError(f"the registry at {self._path} is damaged ({type(e).__name__}: {e}); "
                                    f"{restore_advice(self._root)}") from e
        except lmdb.Error as e:  # not damage: too many readers, permissions, ...
            raise StorageError(errno.EIO, f"the registry at {self._path} failed: {type(e).__name__}: {e}",
                               self._path) from e
    return call  # type: ignore[return-value]


# LMDB's errors that mean the file is damaged (the others are limits or the environment's state).
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
           lmdb.BadValsizeError, lmdb.PanicError)


def _pairs(raw: bytes) -> dict[str, str]:
    """A patch record's value: target object -> patch object."""
    return {raw[i : i + 32].hex(): raw[i + 32 : i + 64].hex() for i in range(0, len(raw), 64)}


def _step_key(step: int) -> bytes:
    if not 0 <= step < 1 << 64:
        raise VersionNotFoundError(f"no version at step {step}")
    return _STEP.pack(step)


# py-lmdb refuses to open one environment twice in a process, so ParamStore objects on the same
# root share it: (real path, pid) -> [environment, reference count, databases].
_SHARED: dict[tuple[str, int], list] = {}
_SHARED_LOCK = threading.Lock()


# A child forked while a thread of the parent is inside a write transaction would wait forever
# when it closes the inherited environment (py-lmdb waits for the transaction's thread, which the
# child does not have). Write transactions hold this lock, and fork waits for it.
_FORK_LOCK = threading.RLock()


def _reinit_fork_lock() -> None:
    global _FORK_LOCK
    _FORK_LOCK = threading.RLock()


os.register_at_fork(before=lambda: _FORK_LOCK.acquire(), after_in_parent=lambda: _FORK_LOCK.release(),
                    after_in_child=_reinit_fork_lock)


def _drop_inherited() -> None:
    """In a forked child, close the environments inherited from the parent (lock held).

    The child never *uses* them (LMDB forbids that), but py-lmdb counts them as open and would
    refuse to open the same path again. Closing one in the child is safe: it unmaps the child's
    copy and closes the child's descriptors; the parent's file locks and reader slots, which
    belong to the parent's pid, are untouched.
    """
    pid = os.getpid()
    for key in [k for k in _SHARED if k[1] != pid]:
        _SHARED.pop(key)[0].close()


class _EventsWatch(Watch):
    def __init__(self, path: str) -> None:
        self._path = path
        self._w = FileWatch(path)

    def wait(self, timeout: float | None) -> bool:
        if not os.path.exists(self._path):  # deleted with the registry: no event will ever come, so
            time.sleep(0.1 if timeout is None else min(0.1, max(0.0, timeout)))  # let the caller look
            return True  # (and fail with MetadataLostError) every 0.1 s
        return self._w.wait(timeout)

    def close(self) -> None:
        self._w.close()


class LmdbRegistry(Registry):
    """Registry kept in an LMDB environment at ``path`` (a directory).

    Args:
        path: directory of the environment (created when ``create``).
        create: create the environment if missing.
        map_size: LMDB map size in bytes (address space reserved, not disk used).
        mode: permissions of the files LMDB creates (owner only by default).

    Raises:
        MetadataLostError: ``create`` is false and the environment does not exist.
        CorruptStoreError: the environment is damaged (e.g. ``data.mdb`` truncated).
    """

    #: One host's registry: its processes are the only readers and writers (no peers elsewhere).
    shared = False

    def __init__(self, path: str, *, create: bool = False, map_size: int = DEFAULT_MAP_SIZE,
                 mode: int = 0o600) -> None:
        self._path = path
        self._root = os.path.dirname(os.path.abspath(path))  # the store root (this is its meta/)
        self._mode = mode
        # Two event files: versions and tags change rarely and wake subscribers; lease changes are
        # frequent (every checkout's close) and only wake wait_for_readers().
        self._events = {"versions": os.path.join(path, "events"), "leases": os.path.join(path, "lease-events")}
        self._create = create
        self._map_size = map_size
        self._lock = threading.Lock()
        self._pid = -1
        self._env: lmdb.Environment | None = None
        self._announced: set[str] = set()  # peers announced through this object (withdrawn at close)
        self._inherited_peers: set[str] = set()  # a forked child's copy of its parent's
        self._open()

    # -- environment -------------------------------------------------------------------------
    def _open(self) -> None:
        if self._create:
            os.makedirs(self._path, mode=0o770 if self._mode & 0o060 else 0o700, exist_ok=True)
        elif not os.path.exists(self._data):
            raise MetadataLostError(f"the registry of this store is missing ({self._data} does not exist): its "
                                    f"metadata was deleted; nothing was re-created. {restore_advice(self._root)}")
        key = (os.path.realpath(self._path), os.getpid())
        with _SHARED_LOCK:
            _drop_inherited()
            entry = _SHARED.get(key)
            if entry is None:
                env = self._open_env()
                try:
                    entry = _SHARED[key] = [env, 0, {name: env.open_db(name.encode()) for name in _DBS},
                                            os.stat(self._data).st_ino]
                except (lmdb.DiskError, lmdb.MapFullError) as e:  # creating `meta` in an old store, disk full
                    env.close()
                    raise StorageFullError(errno.ENOSPC, f"cannot open the registry at {self._path}: {e}",
                                           self._path) from e
                except lmdb.Error as e:
                    env.close()
                    raise CorruptStoreError(f"the registry at {self._path} is damaged and cannot be opened ({e}); "
                                            f"{restore_advice(self._root)}") from e
            entry[1] += 1
        self._key = key
        env, self._dbs, self._ino = entry[0], entry[2], entry[3]
        self._reserve(env)
        for path in self._events.values():
            if not os.path.exists(path):
                with open(path, "ab"):
                    pass
        self._env = env
        self._pid = os.getpid()

    def _open_env(self) -> lmdb.Environment:
        """Open the environment, refusing a ``data.mdb`` shorter than its last page (SIGBUS otherwise)."""
        try:
            env = lmdb.open(self._path, map_size=self._map_size, max_dbs=len(_DBS), max_readers=1024,
                            subdir=True, create=self._create, readahead=False, mode=self._mode)
        except lmdb.DiskError as e:
            raise StorageFullError(errno.ENOSPC, f"cannot open the registry at {self._path}: {e}", self._path) from e
        except lmdb.Error as e:
            raise CorruptStoreError(f"the registry at {self._path} is damaged and cannot be opened ({e}); "
                                    f"{restore_advice(self._root)}") from e
        try:
            needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
            size = os.stat(self._data).st_size
            if size < needed:
                raise CorruptStoreError(f"the registry file {self._data} is truncated ({size} bytes, its pages need "
                                        f"{needed}): {restore_advice(self._root)}")
            env.reader_check()  # clear reader slots left by killed processes
        except lmdb.Error as e:
            env.close()
            raise CorruptStoreError(f"the registry at {self._path} is damaged: {e}") from e
        except BaseException:
            env.close()
            raise
        return env

    @property
    def _data(self) -> str:
        return os.path.join(self._path, "data.mdb")

    def _check_present(self) -> None:
        """Raise MetadataLostError if ``data.mdb`` was deleted or replaced since this process opened it."""
        try:
            ino = os.stat(self._data).st_ino
        except FileNotFoundError:
            ino = None
        if ino != self._ino:
            raise MetadataLostError(
                f"the registry of this store ({self._data}) was {'deleted' if ino is None else 'replaced'} while "
                "this process had it open (a /dev/shm cleaner?): versions written from now on would be lost. "
                f"Stop, then {restore_advice(self._root)}")

    def _reserve(self, env: lmdb.Environment) -> None:
        """Allocate :data:`RESERVE_BYTES` past LMDB's last page (best effort: skipped on a full disk)."""
        try:
            used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
            if os.stat(self._data).st_size - used >= RESERVE_BYTES // 2:
                return
            fd = os.open(self._data, os.O_RDWR | os.O_CLOEXEC)
        except (OSError, lmdb.Error):
            return  # read-only, or gone (reported by the next call)
        try:
            os.posix_fallocate(fd, 0, used + RESERVE_BYTES)
        except OSError:
            pass  # a full or non-allocating filesystem: writes extend the file as LMDB does by itself
        finally:
            os.close(fd)

    @property
    def env(self) -> lmdb.Environment:
        if self._env is None:
            raise RuntimeError("registry is closed")
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._inherited_peers |= self._announced  # the parent's: never withdrawn here
                    self._announced = set()
                    self._open()  # inherited across fork: open this process's own environment
        return self._env

    @contextlib.contextmanager
    def _write(self, db: object = None) -> Iterator[lmdb.Transaction]:
        """A write transaction, never open while the process forks (see ``_FORK_LOCK``)."""
        env = self.env
        self._check_present()
        with _FORK_LOCK:
            with env.begin(write=True, db=db) as txn:
                yield txn

    def close(self) -> None:
        if self._env is not None and self._pid == os.getpid():
            for peer_id in sorted(self._announced):
                self.withdraw_peer(peer_id)
            with _SHARED_LOCK:
                entry = _SHARED[self._key]
                entry[1] -= 1
                if entry[1] == 0:
                    del _SHARED[self._key]
                    self._env.close()
        self._env = None

    def _notify(self, what: str = "versions") -> None:
        fd = os.open(self._events[what], os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, struct.pack("<Qd", time.monotonic_ns(), time.time()), 0)
        finally:
            os.close(fd)

    # -- reads -------------------------------------------------------------------------------
    # latest_step, get_version, tags, object_sizes and referenced_objects override the contract's
    # defaults only to be faster: one cursor step or key lookup instead of reading every version.
    @_guarded
    def latest_step(self) -> int | None:
        env = self.env
        self._check_present()
        with env.begin(db=self._dbs["versions"]) as txn:
            cur = txn.cursor()
            return _STEP.unpack(cur.key())[0] if cur.last() else None

    def _tags_by_step(self, txn: lmdb.Transaction) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for k, v in txn.cursor(db=self._dbs["tags"]):
            out.setdefault(_STEP.unpack(v)[0], []).append(k.decode())
        return out

    @_guarded
    def get_version(self, step: int) -> Version:
        with self.env.begin() as txn:
            raw = txn.get(_step_key(step), db=self._dbs["versions"])
            if raw is None:
                raise VersionNotFoundError(f"no version at step {step}")
            tags = self._tags_by_step(txn).get(step, [])
            return Version.from_json(json.loads(raw), tuple(sorted(tags)))

    @_guarded
    def get_manifest(self, step: int) -> Manifest:
        with self.env.begin(db=self._dbs["manifests"]) as txn:
            raw = txn.get(_step_key(step))
        if raw is None:
            raise VersionNotFoundError(f"no version at step {step}")
        return Manifest.parse(raw)

    @_guarded
    def versions(self, after: int | None = None) -> Iterator[Version]:
        env = self.env
        self._check_present()
        with env.begin() as txn:
            tags = self._tags_by_step(txn)
            cur = txn.cursor(db=self._dbs["versions"])
            start = 0 if after is None else max(after + 1, 0)
            found = cur.set_range(_step_key(start))
            out = []
            while found:
                step = _STEP.unpack(cur.key())[0]
                out.append(Version.from_json(json.loads(cur.value()), tuple(sorted(tags.get(step, [])))))
                found = cur.next()
        return iter(out)

    @_guarded
    def tags(self) -> dict[str, int]:
        with self.env.begin(db=self._dbs["tags"]) as txn:
            return {k.decode(): _STEP.unpack(v)[0] for k, v in txn.cursor()}

    @_guarded
    def locate_tensors(self, digests: list[str]) -> dict[str, TensorLocation]:
        out: dict[str, TensorLocation] = {}
        with self.env.begin(db=self._dbs["tensors"]) as txn:
            for d in digests:
                raw = txn.get(bytes.fromhex(d))
                if raw is not None:
                    obj, off, n = _LOC.unpack(raw)
                    out[d] = TensorLocation(obj.hex(), off, n)
        return out

    @_guarded
    def objects(self) -> dict[str, int]:
        with self.env.begin(db=self._dbs["objects"]) as txn:
            return {k.hex(): _STEP.unpack_from(v)[0] for k, v in txn.cursor()}

    @_guarded
    def object_sizes(self, digests: Iterable[str]) -> dict[str, int]:
        out = {}
        with self.env.begin(db=self._dbs["objects"]) as txn:
            for d in check_digests(digests):
                raw = txn.get(bytes.fromhex(d))
                if raw is not None:
                    out[d] = _STEP.unpack_from(raw)[0]
        return out

    @_guarded
    def referenced_objects(self) -> set[str]:
        out: set[str] = set()
        with self.env.begin(db=self._dbs["refs"]) as txn:
            for _, v in txn.cursor():
                out.update(v[i : i + 32].hex() for i in range(0, len(v), 32))
            for _, v in txn.cursor(db=self._dbs["patches"]):
                out.update(v[i : i + 32].hex() for i in range(32, len(v), 64))
        return out

    # -- patches -----------------------------------------------------------------------------
    @_guarded
    def add_patches(self, base: int, target: int, patches: Mapping[str, tuple[str, int]]) -> bool:
        patches = check_patches(base, target, patches)
        key = _STEP.pack(target) + _STEP.pack(base)
        with self._write() as txn:
            versions = self._dbs["versions"]
            if txn.get(_STEP.pack(base), db=versions) is None or txn.get(_STEP.pack(target), db=versions) is None:
                return False
            pairs = _pairs(txn.get(key, b"", db=self._dbs["patches"]))
            pairs.update({obj: patch for obj, (patch, _) in patches.items()})
            txn.put(key, b"".join(bytes.fromhex(o) + bytes.fromhex(p) for o, p in sorted(pairs.items())),
                    db=self._dbs["patches"])
            for patch, size in patches.values():
                txn.put(bytes.fromhex(patch), _STEP.pack(size), db=self._dbs["objects"], overwrite=False)
        self._notify()
        return True

    @_guarded
    def patches(self, target: int | None = None) -> dict[tuple[int, int], dict[str, str]]:
        with self.env.begin(db=self._dbs["patches"]) as txn:
            cur = txn.cursor()
            if target is None:
                rows = iter(cur)
            else:
                prefix = _step_key(target)
                rows = itertools.takewhile(lambda kv: kv[0][:8] == prefix, cur.iternext()) \
                    if cur.set_range(prefix) else iter(())
            return {(_STEP.unpack_from(k, 8)[0], _STEP.unpack_from(k)[0]): _pairs(v) for k, v in rows}

    # -- writes ------------------------------------------------------------------------------
    @_guarded
    def publish(
        self,
        version: Version,
        manifest: Manifest,
        new_objects: dict[str, ObjectInfo],
        new_tensors: dict[str, TensorLocation],
        *,
        require_newest: bool = True,
    ) -> None:
        key = _step_key(version.step)
        with self._write() as txn:
            cur = txn.cursor(db=self._dbs["versions"])
            if not require_newest:
                if txn.get(key, db=self._dbs["versions"]) is not None:
                    raise StepOrderError(f"step {version.step} already exists")
            elif cur.last() and _STEP.unpack(cur.key())[0] >= version.step:
                latest = _STEP.unpack(cur.key())[0]
                raise StepOrderError(
                    f"step {version.step} is not above the latest committed step {latest} "
                    "(another process committed it first)"
                )
            refs = sorted(manifest.objects())
            missing = [o for o in refs
                       if o not in new_objects and txn.get(bytes.fromhex(o), db=self._dbs["objects"]) is None]
            if missing:
                raise unregistered(version.step, missing)
            txn.put(key, json.dumps(version.to_json()).encode(), db=self._dbs["versions"])
            txn.put(key, json.dumps(manifest.to_json()).encode(), db=self._dbs["manifests"])
            txn.put(key, b"".join(bytes.fromhex(o) for o in refs), db=self._dbs["refs"])
            for tag in version.tags:
                txn.put(tag.encode(), key, db=self._dbs["tags"])
            for d, info in new_objects.items():
                val = _STEP.pack(info.size) + b"".join(bytes.fromhex(t) for t in info.tensors)
                txn.put(bytes.fromhex(d), val, db=self._dbs["objects"], overwrite=False)
            for d, loc in new_tensors.items():
                val = _LOC.pack(bytes.fromhex(loc.object), loc.offset, loc.nbytes)
                txn.put(bytes.fromhex(d), val, db=self._dbs["tensors"])  # newest location wins
        self._notify()
        self._reserve(self.env)

    @_guarded
    def set_tag(self, name: str, step: int) -> None:
        with self._write() as txn:
            if txn.get(_step_key(step), db=self._dbs["versions"]) is None:
                raise VersionNotFoundError(f"no version at step {step}")
            txn.put(name.encode(), _step_key(step), db=self._dbs["tags"])
        self._notify()

    @_guarded
    def delete_tag(self, name: str) -> int:
        with self._write(db=self._dbs["tags"]) as txn:
            raw = txn.pop(name.encode())
        if raw is None:
            raise TagNotFoundError(f"no tag named {name!r}")
        self._notify()
        return _STEP.unpack(raw)[0]

    @_guarded
    def set_persisted(self, step: int, remote: str) -> None:
        with self._write() as txn:
            if txn.get(_step_key(step), db=self._dbs["versions"]) is None:
                raise VersionNotFoundError(f"no version at step {step}")
            txn.put(_step_key(step), remote.encode(), db=self._dbs["persisted"])
        self._notify()

    @_guarded
    def persisted(self) -> dict[int, str]:
        with self.env.begin(db=self._dbs["persisted"]) as txn:
            return {_STEP.unpack(k)[0]: v.decode() for k, v in txn.cursor()}

    # -- store-level values ------------------------------------------------------------------
    @_guarded
    def get_meta(self, key: str) -> str | None:
        with self.env.begin(db=self._dbs["meta"]) as txn:
            raw = txn.get(check_meta_key(key).encode())
        return None if raw is None else raw.decode()

    @_guarded
    def swap_meta(self, key: str, expected: str | None, value: str) -> str | None:
        k = check_meta_key(key).encode()
        with self._write(db=self._dbs["meta"]) as txn:
            raw = txn.get(k)
            current = None if raw is None else raw.decode()
            if current != expected:
                return current
            txn.put(k, value.encode())
        return value

    # -- derived records ---------------------------------------------------------------------
    @_guarded
    def swap_derived(self, key: str, expected: bytes | None, record: bytes) -> bytes:
        k, record = check_derived_key(key).encode(), check_derived_record(record)
        with self._write(db=self._dbs["derived"]) as txn:
            current = txn.get(k)
            if current != expected:
                return b"" if current is None else bytes(current)
            txn.put(k, record)
        return record

    @_guarded
    def derived(self, keys: Iterable[str]) -> dict[str, bytes]:
        wanted = [check_derived_key(k) for k in keys]
        with self.env.begin(db=self._dbs["derived"]) as txn:
            got = {k: txn.get(k.encode()) for k in wanted}
        return {k: bytes(v) for k, v in got.items() if v is not None}

    @_guarded
    def derived_keys(self) -> list[str]:
        with self.env.begin(db=self._dbs["derived"]) as txn:
            return sorted(bytes(k).decode() for k, _ in txn.cursor())

    @_guarded
    def drop_derived(self, keys: Iterable[str]) -> None:
        gone = [check_derived_key(k).encode() for k in keys]
        if not gone:
            return
        with self._write(db=self._dbs["derived"]) as txn:
            for k in gone:
                txn.delete(k)

    # -- leases ------------------------------------------------------------------------------
    @_guarded
    def acquire_lease(self, step: int, holder: str) -> Lease:
        pid, start = liveness.this_process()
        lease = Lease(os.urandom(8).hex(), step, holder, pid, liveness.HOST, time.time())
        record = {"step": step, "holder": holder, "pid": pid, "start": start, "host": lease.host,
                  "acquired_at": lease.acquired_at}
        with self._write() as txn:
            if txn.get(_step_key(step), db=self._dbs["versions"]) is None:
                raise VersionNotFoundError(f"no version at step {step} (pruned?)")
            txn.put(lease.id.encode(), json.dumps(record).encode(), db=self._dbs["leases"])
        return lease

    @_guarded
    def release_lease(self, lease_id: str) -> None:
        if self._env is None:  # a snapshot outliving its store: still release, through a fresh handle
            again = LmdbRegistry(self._path)
            try:
                again.release_lease(lease_id)
            finally:
                again.close()
            return
        try:
            with self._write(db=self._dbs["leases"]) as txn:
                found = txn.delete(lease_id.encode())
        except MetadataLostError:
            return  # the lease went with the registry (reported by the store's next call)
        if found:
            self._notify("leases")

    def _live_leases(self, txn: lmdb.Transaction) -> tuple[list[Lease], list[bytes]]:
        live, dead = [], []
        for k, v in txn.cursor(db=self._dbs["leases"]):
            r = json.loads(v)
            if r["host"] == liveness.HOST and liveness.alive(r["pid"], r["start"]):
                live.append(Lease(k.decode(), r["step"], r["holder"], r["pid"], r["host"], r["acquired_at"]))
            else:
                dead.append(bytes(k))
        return live, dead

    @_guarded
    def leases(self) -> list[Lease]:
        with self.env.begin() as txn:
            live, dead = self._live_leases(txn)
        if dead:  # a dead process's leases: released here, by whoever looks first
            with self._write(db=self._dbs["leases"]) as txn:
                for k in dead:
                    txn.delete(k)
            self._notify("leases")
        return live

    # -- removal -----------------------------------------------------------------------------
    @_guarded
    def remove_versions(self, steps: list[int]) -> list[int]:
        removed = []
        with self._write() as txn:
            live, _ = self._live_leases(txn)
            held = {lease.step for lease in live}
            cur = txn.cursor(db=self._dbs["versions"])
            latest = _STEP.unpack(cur.key())[0] if cur.last() else None
            doomed = {s for s in steps if s != latest and s not in held}
            for s in sorted(doomed):
                key = _step_key(s)
                if txn.delete(key, db=self._dbs["versions"]):
                    txn.delete(key, db=self._dbs["manifests"])
                    txn.delete(key, db=self._dbs["refs"])
                    txn.delete(key, db=self._dbs["persisted"])
                    removed.append(s)
            gone = {_step_key(s) for s in removed}
            for k, v in list(txn.cursor(db=self._dbs["tags"])):
                if v in gone:
                    txn.delete(k, db=self._dbs["tags"])
            for k in [k for k, _ in txn.cursor(db=self._dbs["patches"]) if k[:8] in gone or k[8:] in gone]:
                txn.delete(k, db=self._dbs["patches"])
        if removed:
            self._notify()
        return removed

    @_guarded
    def forget_objects(self, digests: set[str]) -> None:
        with self._write() as txn:
            for d in digests:
                key = bytes.fromhex(d)
                raw = txn.pop(key, db=self._dbs["objects"])
                if raw is None:
                    continue
                for i in range(8, len(raw), 32):  # index entries that still point into this object
                    t = raw[i : i + 32]
                    loc = txn.get(t, db=self._dbs["tensors"])
                    if loc is not None and _LOC.unpack(loc)[0] == key:
                        txn.delete(t, db=self._dbs["tensors"])

    # -- peers -------------------------------------------------------------------------------
    @staticmethod
    def _peer_record(peer_id: str, raw: bytes) -> tuple[Peer, bool]:
        r = json.loads(raw)
        live = r["node"] == liveness.HOST and liveness.alive(r["pid"], r["start"])
        return Peer(peer_id, r["session"], r["host"], r["pid"], r["started_at"]), live

    def _drop_peer(self, txn: lmdb.Transaction, peer_id: str) -> None:
        """Delete a peer's record and holdings (inside a write transaction)."""
        pid = peer_id.encode()
        txn.delete(pid, db=self._dbs["peers"])
        prefix = pid + b"\0"
        cur = txn.cursor(db=self._dbs["peer-objects"])
        if cur.set_range(prefix):
            while cur.key().startswith(prefix):
                self._unhold(txn, cur.key()[len(prefix):], pid)
                if not cur.delete():
                    break

    def _unhold(self, txn: lmdb.Transaction, key: bytes, pid: bytes) -> None:
        """In ``txn``: peer ``pid`` no longer holds ``key`` (nor its position, if it had one)."""
        raw = txn.pop(key + pid, db=self._dbs["holders"])
        if raw is not None and len(raw) == 16:
            txn.delete(key + raw[8:], db=self._dbs["ranks"])

    def _drop_dead(self, dead: Iterable[str]) -> None:
        """Drop peers found dead (re-checked inside the write transaction)."""
        with self._write() as txn:
            for peer_id in dead:
                raw = txn.get(peer_id.encode(), db=self._dbs["peers"])
                if raw is None or not self._peer_record(peer_id, raw)[1]:
                    self._drop_peer(txn, peer_id)

    @_guarded
    def announce_peer(self, peer: Peer) -> None:
        check_peer(peer)
        self.env  # noqa: B018 -- after fork: reopened (and the parent's peers set aside) first
        start = liveness.this_process()[1] if peer.pid == os.getpid() else liveness.start_time(peer.pid)
        if start is None:
            raise InvalidArgumentError(f"peer {peer.id}: no process {peer.pid} runs on this host")
        record = {"session": peer.session, "host": peer.host, "pid": peer.pid, "start": start, "node": liveness.HOST,
                  "started_at": peer.started_at}
        with self._write(db=self._dbs["peers"]) as txn:
            txn.put(peer.id.encode(), json.dumps(record).encode())
        self._announced.add(peer.id)

    @_guarded
    def withdraw_peer(self, peer_id: str) -> None:
        check_peer_id(peer_id)
        self.env  # noqa: B018 -- after fork: reopened (and the parent's peers set aside) first
        if peer_id in self._inherited_peers:
            return  # a forked child: the peer is its parent's
        self._announced.discard(peer_id)
        with self._write() as txn:
            self._drop_peer(txn, peer_id)

    @_guarded
    def announce_objects(self, peer_id: str, objects: Mapping[str, int]) -> None:
        check_peer_id(peer_id)
        objects = check_holdings(objects)
        with self._write() as txn:
            self._hold(txn, peer_id, objects)

    def _hold(self, txn: lmdb.Transaction, peer_id: str, objects: Mapping[str, int], ordered: str | None = None) -> int:
        """In ``txn``: ``peer_id`` (live, else InvalidArgumentError) holds ``objects`` at those
        addresses, ``ordered`` (one of them) at the next position, returned (else 0)."""
        pid = peer_id.encode()
        raw = txn.get(pid, db=self._dbs["peers"])
        if raw is None or not self._peer_record(peer_id, raw)[1]:
            raise InvalidArgumentError(f"peer {peer_id} is not announced (or its process is gone)")
        position = 0
        for d, address in objects.items():
            key = bytes.fromhex(d)
            rank = b""  # its position, packed, if announced in order (its own earlier one counts: it moves up)
            if d == ordered:
                position = self._end(txn, key)
                rank = _STEP.pack(position)
            self._unhold(txn, key, pid)
            if rank:
                txn.put(key + rank, pid, db=self._dbs["ranks"])
            txn.put(key + pid, _STEP.pack(address) + rank, db=self._dbs["holders"])
            txn.put(pid + b"\0" + key, b"", db=self._dbs["peer-objects"])
        return position

    def _end(self, txn: lmdb.Transaction, key: bytes) -> int:
        """One more than the largest position a holder of ``key`` has (0: none)."""
        cur = txn.cursor(db=self._dbs["ranks"])
        if not (cur.prev() if cur.set_range(key + b"\xff" * 8) else cur.last()):  # the last entry before key's end
            return 0
        k = cur.key()
        return _STEP.unpack(k[32:])[0] + 1 if k[:32] == key else 0

    @_guarded
    def announce_in_order(self, peer_id: str, key: str, address: int) -> int:
        check_peer_id(peer_id)
        check_digests([key])
        objects = check_holdings({key: address})
        with self._write() as txn:  # one write transaction: the position and the announcement together
            return self._hold(txn, peer_id, objects, key)

    @_guarded
    def withdraw_objects(self, peer_id: str, digests: Iterable[str]) -> None:
        check_peer_id(peer_id)
        digests = check_digests(digests)
        pid = peer_id.encode()
        with self._write() as txn:
            for d in digests:
                key = bytes.fromhex(d)
                self._unhold(txn, key, pid)
                txn.delete(pid + b"\0" + key, db=self._dbs["peer-objects"])

    @_guarded
    def peers(self) -> list[Peer]:
        live, dead = [], []
        with self.env.begin(db=self._dbs["peers"]) as txn:
            for k, v in txn.cursor():
                peer, ok = self._peer_record(k.decode(), v)
                (live if ok else dead).append(peer if ok else peer.id)
        if dead:
            self._drop_dead(dead)
        return live

    @_guarded
    def holders(self, digests: Iterable[str], limit: int | None = None) -> dict[str, list[tuple[Peer, int]]]:
        digests = check_digests(digests)
        limit = check_limit(limit)
        out: dict[str, list[tuple[Peer, int]]] = {}
        seen: dict[str, Peer | None] = {}  # peer id -> the peer, None if dead or unknown
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._dbs["holders"])
            for d in digests:
                key = bytes.fromhex(d)
                row = []
                if cur.set_range(key):
                    for k, v in cur.iternext():
                        if k[:32] != key:
                            break
                        peer = self._live(txn, k[32:], seen)
                        if peer is not None:
                            row.append((peer, _STEP.unpack(v[:8])[0]))
                if limit is not None and len(row) > limit:  # one host's own peers: few, so all are read
                    row = sorted(random.sample(row, limit), key=lambda x: x[0].id)
                if row:
                    out[d] = row
        dead = [p for p, peer in seen.items() if peer is None]
        if dead:
            self._drop_dead(dead)
        return out

    @_guarded
    def in_order(self, key: str, positions: Iterable[int]) -> tuple[int, dict[int, tuple[Peer, int]]]:
        raw_key = bytes.fromhex(check_digests([key])[0])
        positions = check_positions(positions)
        found: dict[int, tuple[Peer, int]] = {}
        seen: dict[str, Peer | None] = {}  # peer id -> the peer, None if dead or unknown
        with self.env.begin() as txn:
            for position in positions:
                pid = txn.get(raw_key + _STEP.pack(position), db=self._dbs["ranks"])
                held = txn.get(raw_key + pid, db=self._dbs["holders"]) if pid is not None else None
                peer = self._live(txn, pid, seen) if held is not None else None
                if peer is not None:
                    found[position] = (peer, _STEP.unpack(held[:8])[0])
            end = self._end(txn, raw_key)
        dead = [p for p, peer in seen.items() if peer is None]
        if dead:
            self._drop_dead(dead)
        return end, found

    def _live(self, txn: lmdb.Transaction, pid: bytes, seen: dict[str, Peer | None]) -> Peer | None:
        """The peer ``pid`` if it is live, else None; remembered in ``seen`` (the dead are dropped
        by the caller after its read)."""
        peer_id = pid.decode()
        if peer_id not in seen:
            raw = txn.get(pid, db=self._dbs["peers"])
            peer, ok = self._peer_record(peer_id, raw) if raw is not None else (None, False)
            seen[peer_id] = peer if ok else None
        return seen[peer_id]

    def watch(self, what: str = "versions") -> Watch:
        return _EventsWatch(self._events[what])


def from_url(url: str | None, meta_dir: str, namespace: str, *, create: bool = True,
             mode: int = 0o600) -> LmdbRegistry:
    """The ``lmdb`` entry point (``paramstore.registries``): the store root's own registry, in
    ``meta_dir``, used when a store is opened with no registry URL (``namespace`` is unused: the
    environment is the store's alone). See :mod:`paramstore.backends.registries` for the signature."""
    if url is not None:
        raise InvalidArgumentError(f"the LMDB registry is the store root's own ({meta_dir}) and has no URL ({url}): "
                                   "open the store without a registry URL")
    return LmdbRegistry(meta_dir, create=create, mode=mode)
