"""The remote protocol: versions in a remote tier, push, pull, locks. No torch.

A remote (S3, a shared filesystem; see ``paramstore.backends.tiers.remote`` for the layout) holds
content-addressed objects and, per version, a manifest and a small *record* (the version, its tags
at push time, and the objects it references). Rules:

* **A version exists remotely only when complete.** :meth:`Remote.push` uploads the missing
  objects, then the manifest, then the record with a create-only put (S3 ``If-None-Match: *``).
  A push that dies midway leaves objects and maybe a manifest, never a record.
* **Objects are uploaded once.** An object already in the remote (from an earlier version, or
  another store sharing the prefix) is not uploaded again.
* **Pulled bytes are verified.** :meth:`Remote.pull` downloads missing objects into temporary
  files of the local tier, re-hashes each (blake3, both levels) and renames it into place only if
  it matches its name; then registers the version locally.
* **Remote GC never deletes what a manifest or a push in progress references.** Pushes and pulls
  hold a *shared* lock (a key ``locks/shared-<id>.json``, refreshed while held); GC takes the
  *exclusive* lock (``locks/exclusive.json``, create-only) and then waits until no live shared
  lock remains; a pusher that sees the exclusive lock withdraws its own and waits. Each side writes
  its own key before looking for the other's, so on a store with read-after-write consistency (S3,
  MinIO, a POSIX filesystem) they never both proceed. A lock not refreshed for ``lock_ttl``
  seconds is stale (its holder died) and ignored. As a second line, GC spares unreferenced objects
  younger than ``grace`` seconds.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from .errors import CorruptObjectError, RemoteError, StepOrderError, VersionNotFoundError, WaitTimeoutError
from .format import rehash
from .manifest import Manifest, Version
from .progress import progress
from .staging import tmp_name
from .root import StoreRoot, VersionSpec

from paramstore.backends.registries.base import ObjectInfo, TensorLocation
from paramstore.backends.tiers.remote import RemoteTier

__all__ = ["Remote", "TransferReport", "DEFAULT_LOCK_TTL"]

DEFAULT_LOCK_TTL = 600.0  # seconds without refresh after which a lock is stale
_EXCLUSIVE = "locks/exclusive.json"
_RECORD_FORMAT = 1


def _record_key(step: int) -> str:
    return f"versions/{step:020d}.json"


def _manifest_key(step: int) -> str:
    return f"manifests/{step:020d}.json"


@dataclass(frozen=True)
class TransferReport:
    """What a push or pull moved."""

    step: int
    objects: int  # objects moved
    bytes: int  # bytes moved
    skipped: int  # objects the other side already had
    seconds: float
    moved: tuple[str, ...] = ()  # digests of the objects moved (pull only)
    url: str = ""  # the remote's URL

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "objects": self.objects, "bytes": self.bytes, "skipped": self.skipped,
                "seconds": self.seconds}


@dataclass(frozen=True)
class _Record:
    version: Version
    objects: dict[str, int]  # digest -> size


class Remote:
    """Versions kept under a remote URL.

    Args:
        url: any fsspec URL (``s3://bucket/prefix``, ``file:///mnt/ckpt``...).
        options: options of the fsspec filesystem (credentials, ``endpoint_url``...).
        lock_ttl: seconds after which a lock whose holder stopped refreshing it is stale.
        grace: remote GC spares unreferenced objects younger than this (default ``lock_ttl``).
        concurrency: objects moved at once (each large one also moves in parallel parts).

    Raises:
        RemoteError: bad URL, missing bucket, access denied, unreachable endpoint.
    """

    def __init__(self, url: str, options: Mapping[str, Any] | None = None, *,
                 lock_ttl: float = DEFAULT_LOCK_TTL, grace: float | None = None, concurrency: int = 4) -> None:
        self.tier = RemoteTier(url, options)
        self.url = self.tier.url
        self.lock_ttl = lock_ttl
        self.grace = lock_ttl if grace is None else grace
        self._concurrency = concurrency
        self._records: dict[int, _Record] = {}  # records are immutable: cached once read
        self._lock = threading.Lock()

    # -- versions ----------------------------------------------------------------------------
    def _record(self, step: int) -> _Record:
        with self._lock:
            rec = self._records.get(step)
        if rec is not None:
            return rec
        try:
            raw = json.loads(self.tier.get_record(_record_key(step)))
        except FileNotFoundError:
            raise VersionNotFoundError(f"no version at step {step} in {self.url}") from None
        if raw.get("format") != _RECORD_FORMAT:
            raise RemoteError(f"version record {step} in {self.url} has format {raw.get('format')!r}")
        rec = _Record(Version.from_json(raw["version"], tuple(raw["tags"])), dict(raw["objects"]))
        with self._lock:
            self._records[step] = rec
        return rec

    def steps(self) -> list[int]:
        """Steps of every complete version in the remote, in increasing order (one listing)."""
        out = []
        for name in self.tier.records("versions"):
            stem = name.removesuffix(".json")
            if stem.isdigit() and name.endswith(".json"):
                out.append(int(stem))
        return sorted(out)

    def versions(self) -> list[Version]:
        """Every complete version, in increasing step order."""
        steps = self.steps()
        with ThreadPoolExecutor(8) as pool:  # new records are read in parallel; known ones are cached
            return [r.version for r in pool.map(self._record, steps)]

    def get_version(self, step: int) -> Version:
        """The version at ``step``. Raises VersionNotFoundError."""
        return self._record(step).version

    def get_manifest(self, step: int) -> Manifest:
        """The manifest of ``step``. Raises VersionNotFoundError."""
        self._record(step)  # only complete versions
        try:
            return Manifest.from_json(json.loads(self.tier.get_record(_manifest_key(step))))
        except FileNotFoundError:
            raise VersionNotFoundError(f"version {step} in {self.url} lost its manifest") from None

    def resolve(self, version: VersionSpec) -> int:
        """The step named by a step, ``"latest"`` or a tag (tags as they were when pushed)."""
        if isinstance(version, int) or (isinstance(version, str) and version.isdigit()):
            step = int(version)
            self._record(step)
            return step
        versions = self.versions()
        if version == "latest":
            if not versions:
                raise VersionNotFoundError(f"{self.url} has no version yet")
            return versions[-1].step
        tagged = [v.step for v in versions if version in v.tags]
        if not tagged:
            raise VersionNotFoundError(f"no version tagged {version!r} in {self.url}")
        return tagged[-1]

    def referenced(self) -> set[str]:
        """Objects any complete version references."""
        return {o for s in self.steps() for o in self._record(s).objects}

    def remove(self, steps: list[int]) -> None:
        """Delete versions: the record first (the version disappears), then the manifest."""
        self.tier.delete_records([_record_key(s) for s in steps])
        self.tier.delete_records([_manifest_key(s) for s in steps])
        with self._lock:
            for s in steps:
                self._records.pop(s, None)

    # -- push --------------------------------------------------------------------------------
    def push(self, root: StoreRoot, step: int, *, show_progress: bool | None = None) -> TransferReport:
        """Upload version ``step`` of the local store and mark it persisted there.

        Holds a local lease on the version meanwhile. Idempotent: a version already in the remote
        is left alone (its digest must match). Raises VersionNotFoundError (not in the local
        store), RemoteError, StepOrderError (the remote holds another version at this step).
        """
        with root.leased([step], holder="paramstore push"):
            report = self._push(root, step, show_progress)
            root.registry.set_persisted(step, self.url)
            return report

    def _push(self, root: StoreRoot, step: int, show_progress: bool | None) -> TransferReport:
        t0 = time.monotonic()
        version, manifest = root.registry.get_version(step), root.registry.get_manifest(step)
        with self.shared_lock("push") as lock:
            if self._same_version_exists(version):
                return TransferReport(step, 0, 0, len(manifest.objects()), time.monotonic() - t0)
            objects = sorted(manifest.objects())
            sizes = {o: root.tier.size(o) for o in objects}
            with ThreadPoolExecutor(self._concurrency) as pool:
                present = dict(zip(objects, pool.map(self.tier.exists, objects)))
                todo = [o for o in objects if not present[o]]
                with progress(sum(sizes[o] for o in todo), f"push {step}", enabled=show_progress) as bar:
                    def up(o: str) -> None:
                        self.tier.put(o, root.tier.object_path(o))
                        bar.update(sizes[o])
                    list(pool.map(up, sorted(todo, key=lambda o: -sizes[o])))
            self.tier.put_record(_manifest_key(step), json.dumps(manifest.to_json()).encode())
            lock.check()  # a lock lost while we were stalled: GC may have run; push again
            record = {"format": _RECORD_FORMAT, "version": version.to_json(), "tags": list(version.tags),
                      "objects": sizes}
            try:
                self.tier.put_record(_record_key(step), json.dumps(record).encode(), create=True)
            except FileExistsError:
                if not self._same_version_exists(version):
                    raise StepOrderError(f"{self.url} already holds another version at step {step}") from None
            return TransferReport(step, len(todo), sum(sizes[o] for o in todo), len(objects) - len(todo),
                                  time.monotonic() - t0)

    def _same_version_exists(self, version: Version) -> bool:
        try:
            other = self._record(version.step).version
        except VersionNotFoundError:
            return False
        if other.digest != version.digest:
            raise StepOrderError(f"{self.url} already holds another version at step {version.step} "
                                 f"(digest {other.digest[:12]}, local {version.digest[:12]})")
        return True

    # -- pull --------------------------------------------------------------------------------
    def pull(self, root: StoreRoot, step: int, *, show_progress: bool | None = None) -> TransferReport:
        """Download version ``step`` into the local store, verified, and register it there.

        Objects the local tier already holds are not downloaded. Each downloaded object is
        re-hashed before it is renamed into place; one whose bytes do not match its name raises
        CorruptObjectError and is never placed. Idempotent.
        """
        t0 = time.monotonic()
        record, manifest = self._record(step), self.get_manifest(step)
        # Shared GC lock on the local host for the whole pull: the objects we rely on stay put.
        with self.shared_lock("pull"), root.gc_lock():
            moved = self._fetch(root, record.objects, f"pull {step}", show_progress)
            try:
                root.registry.get_version(step)  # registered already (pulled meanwhile, or a shared registry)
            except VersionNotFoundError:
                new_objects, new_tensors = _index(manifest, record.objects)
                try:
                    root.registry.publish(record.version, manifest, new_objects, new_tensors, require_newest=False)
                except StepOrderError:
                    pass  # pulled meanwhile by another process of this host
                root.registry.set_persisted(step, self.url)
        nbytes = sum(record.objects[o] for o in moved)
        return TransferReport(step, len(moved), nbytes, len(record.objects) - len(moved), time.monotonic() - t0,
                              tuple(moved), self.url)

    def fetch(self, root: StoreRoot, step: int, *, show_progress: bool | None = None) -> list[str]:
        """Download the objects of remote version ``step`` the local tier lacks (verified).

        For a version already registered (a registry shared by several hosts) whose bytes are not
        on this host. The caller holds a lease on the version. Returns the digests downloaded.
        """
        with self.shared_lock("pull"):
            return self._fetch(root, self._record(step).objects, f"fetch {step}", show_progress)

    def _fetch(self, root: StoreRoot, objects: Mapping[str, int], what: str, show_progress: bool | None) -> list[str]:
        todo = sorted((o for o in objects if not root.tier.exists(o)), key=lambda o: -objects[o])
        # Downloads on one pool, verification on another: a hash never holds up the next download.
        with progress(sum(objects[o] for o in todo), what, enabled=show_progress) as bar, \
                ThreadPoolExecutor(self._concurrency) as io, ThreadPoolExecutor(os.cpu_count() or 2) as cpu:
            def down(o: str) -> Any:
                tmp = self._download(root, o)
                bar.update(objects[o])
                return cpu.submit(self._verify_and_place, root, o, tmp)
            for checked in list(io.map(down, todo)):
                checked.result()
        return todo

    def _download(self, root: StoreRoot, digest: str) -> str:
        tmp = os.path.join(root.tier.tmp_dir, tmp_name())
        try:
            self.tier.get_file(digest, tmp)
        except FileNotFoundError:
            raise RemoteError(f"object {digest} of {self.url} is missing") from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return tmp

    def _verify_and_place(self, root: StoreRoot, digest: str, tmp: str) -> None:
        try:
            try:
                got = rehash_file(tmp)
            except CorruptObjectError as e:
                raise CorruptObjectError(f"object {digest} from {self.url} is corrupt: {e}") from None
            if got != digest:
                raise CorruptObjectError(f"object {digest} from {self.url} is corrupt: its bytes hash to {got}")
            root.tier.put(digest, tmp, move=True)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    # -- locks -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def shared_lock(self, purpose: str) -> Iterator["_HeldLock"]:
        """Held by pushes and pulls: GC waits for it; it waits while GC holds the exclusive lock."""
        key = f"locks/shared-{uuid.uuid4().hex}.json"
        body = json.dumps({"purpose": purpose, "pid": os.getpid(), "host": os.uname().nodename}).encode()
        delay = 0.05
        while True:
            self.tier.put_record(key, body)
            try:
                self.tier.get_record(_EXCLUSIVE)  # one GET; a missing key costs more through stat
                mtime = self.tier.record_mtime(_EXCLUSIVE)
            except FileNotFoundError:
                break
            if time.time() - mtime > self.lock_ttl:
                self.tier.delete_records([_EXCLUSIVE])  # its GC died; a new GC would wait for us
                continue
            self.tier.delete_records([key])  # GC is running or waiting: let it go first
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        held = _HeldLock(self, key, body)
        try:
            yield held
        finally:
            held.release()

    @contextlib.contextmanager
    def exclusive_lock(self, timeout: float = 60.0) -> Iterator["_HeldLock"]:
        """Held by GC: no push or pull runs meanwhile. Waits up to ``timeout`` for them to finish.

        Raises WaitTimeoutError (the lock is not taken) if another GC holds it or pushes and
        pulls are still running after ``timeout`` seconds.
        """
        body = json.dumps({"purpose": "gc", "pid": os.getpid(), "host": os.uname().nodename}).encode()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.tier.put_record(_EXCLUSIVE, body, create=True)
                break
            except FileExistsError:
                try:
                    stale = time.time() - self.tier.record_mtime(_EXCLUSIVE) > self.lock_ttl
                except FileNotFoundError:
                    continue
                if stale:
                    self.tier.delete_records([_EXCLUSIVE])
                elif time.monotonic() > deadline:
                    raise WaitTimeoutError(f"another GC holds {self.url}/{_EXCLUSIVE}") from None
                else:
                    time.sleep(0.2)
        held = _HeldLock(self, _EXCLUSIVE, body)
        try:
            while True:  # pushes that started before we wrote the lock finish first
                live = self.live_shared_locks()
                if not live:
                    break
                if time.monotonic() > deadline:
                    raise WaitTimeoutError(f"{len(live)} pushes or pulls still hold {self.url} after {timeout} s")
                time.sleep(0.1)
            yield held
        finally:
            held.release()

    def live_shared_locks(self) -> list[str]:
        """Keys of shared locks refreshed within ``lock_ttl``."""
        now = time.time()
        return [k for k, t in self.tier.records("locks").items()
                if k.startswith("shared-") and now - t <= self.lock_ttl]

    def stale_locks(self) -> list[str]:
        """Keys (under ``locks/``) of shared locks whose holders stopped refreshing them."""
        now = time.time()
        return [k for k, t in self.tier.records("locks").items()
                if k.startswith("shared-") and now - t > self.lock_ttl]


class _HeldLock:
    """A lock key this process holds: refreshed every ``ttl/4`` on a daemon thread."""

    def __init__(self, remote: Remote, key: str, body: bytes) -> None:
        self._remote, self._key, self._body = remote, key, body
        self._stop = threading.Event()
        self._lost: BaseException | None = None
        self._thread = threading.Thread(target=self._refresh, name="paramstore-lock", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(self._remote.lock_ttl / 4):
            try:
                self._remote.tier.put_record(self._key, self._body)
            except RemoteError as e:  # reported by check(); the holder decides
                self._lost = e

    def check(self) -> None:
        """Raise RemoteError if the lock may have lapsed (a refresh failed or the key is gone)."""
        try:
            age = time.time() - self._remote.tier.record_mtime(self._key)
        except FileNotFoundError:
            raise RemoteError(f"lock {self._key} on {self._remote.url} was removed as stale", transient=True) from None
        if self._lost is not None or age > self._remote.lock_ttl:
            raise RemoteError(f"lock {self._key} on {self._remote.url} lapsed", transient=True)

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(RemoteError):
            self._remote.tier.delete_records([self._key])


def rehash_file(path: str) -> str:
    """The object digest recomputed from the bytes of the file at ``path``.

    Raises CorruptObjectError if the file is not a well-formed object (empty, a bad header...).
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise CorruptObjectError(f"{path} is empty: not an object")
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m, memoryview(m) as mv:
            try:
                return rehash(mv)[0]
            except ValueError as e:
                raise CorruptObjectError(f"{path} is not a well-formed object: {e}") from None


def _index(manifest: Manifest, sizes: Mapping[str, int]) -> tuple[dict[str, ObjectInfo], dict[str, TensorLocation]]:
    """Registry entries for a pulled version: each object's tensors in file order, and the index.

    Spans are keyed by (start, end): an empty tensor starts where the next one does, and sorts
    before it (as the commit laid them out); entries naming the same span are one tensor.
    """
    spans: dict[str, dict[tuple[int, int], str]] = {o: {} for o in sizes}
    tensors: dict[str, TensorLocation] = {}
    for e in manifest.tensors.values():
        spans[e.object][(e.offset, e.offset + e.nbytes)] = e.digest
        tensors[e.digest] = TensorLocation(e.object, e.offset, e.nbytes)
    objects = {o: ObjectInfo(sizes[o], tuple(d for _, d in sorted(spans[o].items()))) for o in sizes}
    return objects, tensors
