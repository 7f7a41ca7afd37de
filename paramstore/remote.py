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
  seconds is stale (its holder died) and ignored. A lock's body names its holder: host name,
  *node* (host name, boot id and PID namespace: where its pid means something), pid and process
  start time. A lock whose node is this one and whose process is dead (the rule of
  :mod:`paramstore.liveness`, as for leases) is stale at once, and whoever sees it deletes it;
  locks of other nodes keep the TTL rule. As a second line, GC spares unreferenced objects
  younger than ``grace`` seconds.
* **Patches** (see :mod:`paramstore.delta`). A version whose objects have patches against a
  version the remote already holds is pushed as those patch objects instead of the whole objects
  (its record, format 2, maps each such object to ``[patch object, base step, patch size]``),
  unless the chain of patched versions behind it would reach ``full_every``: then it is pushed
  whole, a full base. A pull rebuilds such objects from the base's objects (pulling the base first
  when this host lacks it) and checks each one's digest. Remote retention keeps the bases of every
  version it keeps, and GC the patch objects they reference.
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from . import derived, liveness
from .errors import (
    CorruptObjectError, InvalidArgumentError, ParamStoreError, RemoteError, StepOrderError, VersionNotFoundError, WaitTimeoutError,
)
from .delta import rebuild
from .format import loads, rehash
from .manifest import MAX_MANIFEST_BYTES, Chunk, Manifest, Version, check_manifest
from .validate import check_tag
from .objects import check_entries, check_held, entries_by_object, index_entries
from .progress import progress
from .reports import TransferReport
from .staging import SlabPool, tmp_name
from .root import StoreRoot, VersionSpec

from paramstore.backends.registries.base import MAX_DERIVED_RECORD_BYTES, check_derived_key, check_digests
from paramstore.backends.tiers.remote import RemoteTier

__all__ = ["Remote", "DEFAULT_LOCK_TTL", "MAX_RECORD_BYTES"]

#: A version record larger than this is refused before it is read. A record holds a version's
#: metrics, metadata and objects (~100 bytes per object): a few KiB, unless the commit's
#: metadata is large (commit does not limit it; push does not check this yet).
MAX_RECORD_BYTES = 4 << 20
_MAX_LOCK_BYTES = 64 << 10  # a lock body is a few hundred bytes of JSON

DEFAULT_LOCK_TTL = 600.0  # seconds without refresh after which a lock is stale
_EXCLUSIVE = "locks/exclusive.json"
_RECORD_FORMATS = (1, 2)  # 2: with patches
#: By default a remote version is pushed whole once this many patched versions precede it.
DEFAULT_FULL_EVERY = 8


def _record_key(step: int) -> str:
    return f"versions/{step:020d}.json"


def _manifest_key(step: int) -> str:
    return f"manifests/{step:020d}.json"


def _derived_key(key: str) -> str:
    """The remote's key of derived record ``key`` (``<recipe>@<version>/<unit>``): one flat folder
    (``=`` is in no recipe name nor unit)."""
    return f"derived/{check_derived_key(key).replace('/', '=')}.json"


@dataclass(frozen=True)
class _Record:
    version: Version
    objects: dict[str, int]  # digest -> size
    patches: dict[str, tuple[str, int, int]]  # object stored as a patch -> (patch object, base step, patch size)

    def stored(self) -> dict[str, int]:
        """What the remote holds for this version: its objects not patched, and the patch objects."""
        out = {o: n for o, n in self.objects.items() if o not in self.patches}
        out.update({p: n for p, _, n in self.patches.values()})
        return out


class Remote:
    """Versions kept under a remote URL.

    Args:
        url: any fsspec URL (``s3://bucket/prefix``, ``file:///mnt/ckpt``...).
        options: options of the fsspec filesystem (credentials, ``endpoint_url``...).
        lock_ttl: seconds after which a lock whose holder stopped refreshing it is stale.
        grace: remote GC spares unreferenced objects younger than this (default ``lock_ttl``).
        concurrency: objects moved at once (each large one also moves in parallel parts).
        full_every: push a version whole (a full base) rather than as patches once this many
            versions behind it were pushed as patches (1: never push patches).

    Raises:
        RemoteError: bad URL, missing bucket, access denied, unreachable endpoint.
    """

    def __init__(self, url: str, options: Mapping[str, Any] | None = None, *,
                 lock_ttl: float = DEFAULT_LOCK_TTL, grace: float | None = None, concurrency: int = 4,
                 full_every: int = DEFAULT_FULL_EVERY) -> None:
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise InvalidArgumentError(f"full_every must be an int >= 1, got {full_every!r}")
        self.full_every = full_every
        self.tier = RemoteTier(url, options)
        self.url = self.tier.url
        self.lock_ttl = lock_ttl
        self.grace = lock_ttl if grace is None else grace
        self._concurrency = concurrency
        self._records: dict[int, _Record] = {}  # records are immutable: cached once read
        self._lock = threading.Lock()
        self._lock_holders: dict[str, dict[str, Any]] = {}  # shared lock key -> its body (never rewritten)

    # -- versions ----------------------------------------------------------------------------
    def _record(self, step: int) -> _Record:
        with self._lock:
            rec = self._records.get(step)
        if rec is not None:
            return rec
        key = _record_key(step)
        try:
            raw = _parse(self.tier.get_record(key, max_bytes=MAX_RECORD_BYTES), f"{self.url}/{key}")
        except FileNotFoundError:
            raise self._lacks(f"no version at step {step} in {self.url}") from None
        if raw.get("format") not in _RECORD_FORMATS:
            raise RemoteError(f"version record {step} in {self.url} has format {raw.get('format')!r}")
        rec = _check_record(raw, step, f"{self.url}/{key}")
        with self._lock:
            self._records[step] = rec
        return rec

    def _lacks(self, what: str) -> VersionNotFoundError:
        """The error for a version the remote lacks (``what``), saying so when no paramstore remote
        lives at the URL at all. Raises RemoteError if the bucket does not exist (deleted since)."""
        if self.tier.present(recheck=True):
            return VersionNotFoundError(what)
        return VersionNotFoundError(f"{what}: {self.tier.absent()}")

    def create(self) -> None:
        """Make the URL a paramstore remote if it is not one yet (a write: the writer's first upload)."""
        self.tier.create()

    def steps(self) -> list[int]:
        """Steps of every complete version in the remote, in increasing order (one listing).

        Raises RemoteError when no paramstore remote lives at the URL (a mistyped URL is never an
        empty remote), or its bucket does not exist (deleted since: not "no versions")."""
        self.tier.require()
        names = self.tier.records("versions")
        if not names:  # an empty listing: is the remote (its bucket) still there?
            self.tier.require(recheck=True)
        out = []
        for name in names:
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
        """The manifest of ``step``, checked against its record before it is returned.

        Raises VersionNotFoundError; CorruptObjectError (naming the key) for a manifest over
        :data:`MAX_MANIFEST_BYTES`, malformed, or not the one the record's version digest names
        (or with entries outside the objects the record lists).
        """
        record = self._record(step)  # only complete versions
        where = f"{self.url}/{_manifest_key(step)}"
        try:
            raw = _parse(self.tier.get_record(_manifest_key(step), max_bytes=MAX_MANIFEST_BYTES), where)
        except FileNotFoundError:
            raise VersionNotFoundError(f"version {step} in {self.url} lost its manifest") from None
        try:
            manifest = Manifest.from_json(raw)
        except CorruptObjectError as e:
            raise CorruptObjectError(f"{where} (version {step}): {e}") from None
        check_manifest(manifest, record.version, record.objects, where=where)
        return manifest

    def resolve(self, version: VersionSpec) -> int:
        """The step named by a step, ``"latest"`` or a tag (tags as they were when pushed)."""
        if isinstance(version, int) or (isinstance(version, str) and version.isdigit()):
            step = int(version)
            self._record(step)
            return step
        if not self.tier.present():
            raise VersionNotFoundError(f"no version {version!r} in {self.url}: {self.tier.absent()}")
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
        """Objects any complete version needs: its objects stored whole, and its patch objects; and
        the derived objects of every derived record whose sources are all objects of a version."""
        records = [self._record(s) for s in self.steps()]
        out = {o for r in records for o in r.stored()}
        sources = {o for r in records for o in r.objects}
        for name in self.tier.records("derived"):
            try:
                found = derived.record_objects(self.tier.get_record(f"derived/{name}",
                                                                    max_bytes=MAX_DERIVED_RECORD_BYTES))
            except (FileNotFoundError, CorruptObjectError):
                continue
            if found is not None and found[0] and set(found[0]) <= sources:
                out.update(found[1])
        return out

    def bases(self, steps: list[int]) -> set[int]:
        """The versions that versions ``steps`` are rebuilt from (patch bases, transitively; those
        the remote lacks left out): what retention must keep with them."""
        out: set[int] = set()
        todo = list(steps)
        while todo:
            try:
                record = self._record(todo.pop())
            except VersionNotFoundError:
                continue
            for _, base, _ in record.patches.values():
                if base not in out:
                    out.add(base)
                    todo.append(base)
        return out

    def _depth(self, step: int) -> int:
        """How many patched versions lead from ``step`` back to a version stored whole."""
        depth = 0
        while True:
            bases = {b for _, b, _ in self._record(step).patches.values()}
            if not bases:
                return depth
            depth, step = depth + 1, min(bases)

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
        self.create()  # a push is a write: the first one makes the remote
        with self.shared_lock("push") as lock:
            if self._same_version_exists(version):
                moved = self._push_derived(root, manifest.objects())  # made since it was pushed
                return TransferReport(step, 0, moved, len(manifest.objects()), time.monotonic() - t0)
            objects = sorted(manifest.objects())
            sizes = {o: root.tier.size(o) for o in objects}
            with ThreadPoolExecutor(self._concurrency) as pool:
                present = dict(zip(objects, pool.map(self.tier.exists, objects)))
                absent = [o for o in objects if not present[o]]
                patches = self._patches_to_push(root, step, absent)
                todo = [o for o in absent if o not in patches]  # whole, and the patch objects the remote lacks
                todo += [p for p in sorted({patches[o][0] for o in patches}) if not self.tier.exists(p)]
                sizes.update({p: n for p, _, n in patches.values()})
                with progress(sum(sizes[o] for o in todo), f"push {step}", enabled=show_progress) as bar:
                    def up(o: str) -> None:
                        self.tier.put(o, root.tier.object_path(o))
                        bar.update(sizes[o])
                    list(pool.map(up, sorted(todo, key=lambda o: -sizes[o])))
            self.tier.put_record(_manifest_key(step), json.dumps(manifest.to_json()).encode())
            derived_bytes = self._push_derived(root, set(objects))
            lock.check()  # a lock lost while we were stalled: GC may have run; push again
            record = {"format": 2 if patches else 1, "version": version.to_json(), "tags": list(version.tags),
                      "objects": {o: sizes[o] for o in objects}}
            if patches:
                record["patches"] = {o: list(p) for o, p in patches.items()}
            try:
                self.tier.put_record(_record_key(step), json.dumps(record).encode(), create=True)
            except FileExistsError:
                if not self._same_version_exists(version):
                    raise StepOrderError(f"{self.url} already holds another version at step {step}") from None
            return TransferReport(step, len(todo), sum(sizes[o] for o in todo) + derived_bytes, len(objects) - len(absent),
                                  time.monotonic() - t0, from_patches=tuple(sorted(patches)),
                                  patch_bytes=sum(sizes[p] for p in {p for p, _, _ in patches.values()} if p in todo))

    def _push_derived(self, root: StoreRoot, objects: set[str]) -> int:
        """Upload the derived records of the local registry whose sources are all among ``objects``
        (a version's) and whose derived objects are all on this host, with the derived objects the
        remote lacks (objects first, then the record, create-only); returns the bytes uploaded.
        The caller holds the push lock."""
        found = [(k, r) for k, r in derived.records(root) if r is not None and r.sources
                 and set(r.sources) <= objects and all(root.tier.exists(o) for o in r.objects)]
        if not found:
            return 0
        raw = root.registry.derived([k for k, _ in found])
        sizes = {o: n for _, r in found for o, n in r.objects.items()}
        with ThreadPoolExecutor(self._concurrency) as pool:
            todo = [o for o, there in zip(sorted(sizes), pool.map(self.tier.exists, sorted(sizes))) if not there]
            list(pool.map(lambda o: self.tier.put(o, root.tier.object_path(o)), todo))
        for key, _ in found:
            if key in raw:
                with contextlib.suppress(FileExistsError):
                    self.tier.put_record(_derived_key(key), raw[key], create=True)
        return sum(sizes[o] for o in todo)

    def derived_record(self, key: str) -> bytes | None:
        """Derived record ``key`` as pushed here (None if there is none; the remote's as it is:
        :mod:`paramstore.derived` parses and checks it)."""
        try:
            return self.tier.get_record(_derived_key(key), max_bytes=MAX_DERIVED_RECORD_BYTES)
        except (FileNotFoundError, CorruptObjectError):
            return None

    def fetch_objects(self, root: StoreRoot, sizes: Mapping[str, int]) -> int:
        """Download, verify and place the objects of ``sizes`` (digest -> size) that the remote
        holds and the local tier lacks (derived objects: no version names them); returns the bytes
        moved. The others stay absent."""
        check_digests(sizes)
        with ThreadPoolExecutor(self._concurrency) as pool:
            held = {o: n for (o, n), there in zip(sizes.items(), pool.map(self.tier.exists, list(sizes))) if there}
        with self.shared_lock("pull"):
            moved = self._fetch(root, held, "derived objects", None)
        return sum(held[o] for o in moved)

    def _patches_to_push(self, root: StoreRoot, step: int, absent: list[str]) -> dict[str, tuple[str, int, int]]:
        """The objects of ``step`` (among ``absent``, those the remote lacks) to push as patches:
        ``{object: (patch object, base, patch size)}``, against the newest base the remote holds
        whose chain of patched versions is shorter than ``full_every - 1`` (else none: pushed whole)."""
        if self.full_every <= 1 or not absent:
            return {}
        for (base, _), pairs in sorted(root.registry.patches(step).items(), reverse=True):
            try:
                if self._depth(base) + 1 >= self.full_every:
                    continue
            except VersionNotFoundError:
                continue  # the base is not in the remote
            chosen = {o: pairs[o] for o in absent if o in pairs and root.tier.exists(pairs[o])}
            if chosen:
                sizes = {p: root.tier.size(p) for p in set(chosen.values())}
                return {o: (p, base, sizes[p]) for o, p in chosen.items()}
        return {}

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

        Nothing the remote says is trusted: the record and the manifest are checked against each
        other and against the version digest before anything is downloaded (see
        :meth:`get_manifest`). Objects the local tier already holds are not downloaded. Each
        downloaded object is re-hashed, and each tensor the manifest places in it (each chunk of a
        chunked tensor) checked, before it is renamed into place; one whose bytes do not match raises
        CorruptObjectError and is never placed. The manifest's tensors in objects already here are
        checked too before the version is registered (a manifest that misplaces a tensor would poison
        the tensor index). Idempotent.
        """
        t0 = time.monotonic()
        record, manifest = self._record(step), self.get_manifest(step)
        # Shared GC lock on the local host for the whole pull: the objects we rely on stay put.
        with self.shared_lock("pull"), root.gc_lock():
            moved, rebuilt, patch_bytes = self._obtain(root, record, manifest, f"pull {step}", show_progress)
            try:
                root.registry.get_version(step)  # registered already (pulled meanwhile, or a shared registry)
            except VersionNotFoundError:
                check_held(root, manifest, record.objects, set(moved), f"{self.url}/{_manifest_key(step)}")
                new_objects, new_tensors = index_entries(manifest, record.objects)
                try:
                    root.registry.publish(record.version, manifest, new_objects, new_tensors, require_newest=False)
                except StepOrderError:
                    pass  # pulled meanwhile by another process of this host
                root.registry.set_persisted(step, self.url)
        nbytes = sum(record.objects[o] for o in moved) + patch_bytes
        return TransferReport(step, len(moved), nbytes, len(record.objects) - len(moved) - len(rebuilt),
                              time.monotonic() - t0, tuple(moved), self.url, tuple(rebuilt), patch_bytes)

    def fetch(self, root: StoreRoot, step: int, *, show_progress: bool | None = None) -> TransferReport:
        """Download the objects of remote version ``step`` the local tier lacks (verified; objects
        stored as patches are rebuilt, see :meth:`pull`).

        For a version already registered (a registry shared by several hosts) whose bytes are not
        on this host. The caller holds a lease on the version. Raises CorruptObjectError if the
        remote's version at ``step`` is not the registered one.
        """
        t0 = time.monotonic()
        record = self._record(step)
        ours = root.registry.get_version(step).digest
        if record.version.digest != ours:
            raise CorruptObjectError(f"{self.url}/{_record_key(step)} names version digest "
                                     f"{record.version.digest[:16]}…, the registry {ours[:16]}…: another version")
        with self.shared_lock("pull"):
            moved, rebuilt, patch_bytes = self._obtain(root, record, None, f"fetch {step}", show_progress)
        return TransferReport(step, len(moved), sum(record.objects[o] for o in moved) + patch_bytes,
                              len(record.objects) - len(moved) - len(rebuilt), time.monotonic() - t0, tuple(moved),
                              self.url, tuple(rebuilt), patch_bytes)

    def _obtain(self, root: StoreRoot, record: _Record, manifest: Manifest | None, what: str,
                show_progress: bool | None) -> tuple[list[str], list[str], int]:
        """Make every object of ``record`` present here: download those stored whole, rebuild those
        stored as patches (pulling their base version first when this host lacks its objects).
        Returns the objects downloaded, those rebuilt, and the bytes of patch objects downloaded.
        A patch that does not rebuild its object raises CorruptObjectError (nothing placed)."""
        moved = self._fetch(root, {o: n for o, n in record.objects.items() if o not in record.patches}, what,
                            show_progress, manifest)
        lacking = sorted(o for o in record.patches if not root.tier.exists(o))
        if not lacking:
            return moved, [], 0
        for base in sorted({record.patches[o][1] for o in lacking}):
            if not all(root.tier.exists(o) for o in self.get_manifest(base).objects()):
                self.pull(root, base, show_progress=show_progress)  # the base first, verified and registered
        wanted = {record.patches[o][0]: record.patches[o][2] for o in lacking}
        got = self._fetch(root, wanted, f"{what} (patches)", show_progress)
        pool = SlabPool(root.tier.tmp_dir, pin=False)
        try:
            for o in lacking:
                patch = record.patches[o][0]
                if root.tier.exists(o):
                    continue
                try:
                    rebuild(root, pool, patch, o, record.objects[o])
                except CorruptObjectError:
                    if patch in got:
                        raise
                    # the copy this host had is damaged: set it aside, download the remote's, once
                    root.tier.quarantine(patch)
                    got += self._fetch(root, {patch: wanted[patch]}, f"{what} (patches)", show_progress)
                    rebuild(root, pool, patch, o, record.objects[o])
        finally:
            pool.close()
        return moved, lacking, sum(wanted[p] for p in got)

    def _fetch(self, root: StoreRoot, objects: Mapping[str, int], what: str, show_progress: bool | None,
               manifest: Manifest | None = None) -> list[str]:
        """Download, verify and place the ``objects`` (digest -> size) the local tier lacks; with
        ``manifest``, also check the tensors (chunks) it places in each one before placing it."""
        check_digests(objects)  # (validated by _record already: never a path)
        todo = sorted((o for o in objects if not root.tier.exists(o)), key=lambda o: -objects[o])
        entries = entries_by_object(manifest)
        # Downloads on one pool, verification on another: a hash never holds up the next download.
        with progress(sum(objects[o] for o in todo), what, enabled=show_progress) as bar, \
                ThreadPoolExecutor(self._concurrency) as io, ThreadPoolExecutor(os.cpu_count() or 2) as cpu:
            def down(o: str) -> Any:
                tmp = self._download(root, o, objects[o])
                bar.update(objects[o])
                return cpu.submit(self._verify_and_place, root, o, tmp, objects[o], entries.get(o, []))
            for checked in list(io.map(down, todo)):
                checked.result()
        return todo

    def _download(self, root: StoreRoot, digest: str, size: int) -> str:
        """Download object ``digest`` into a new file of the local tier's ``tmp/``, only if the remote
        holds exactly ``size`` bytes under its key (CorruptObjectError otherwise, nothing read)."""
        tmp = os.path.join(root.tier.tmp_dir, tmp_name())
        try:
            got = self.tier.size(digest)
            if got != size:
                raise CorruptObjectError(f"object {digest} of {self.url} is {got} bytes; its record says {size}")
            self.tier.get_file(digest, tmp)
        except FileNotFoundError:
            raise RemoteError(f"object {digest} of {self.url} is missing") from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return tmp

    def _verify_and_place(self, root: StoreRoot, digest: str, tmp: str, size: int,
                          entries: list[tuple[str, Chunk]]) -> None:
        """Place the downloaded file ``tmp`` as object ``digest`` if its bytes hash to that name, it
        has ``size`` bytes and each of ``entries`` (the manifest's pieces in it: tensors stored
        whole, chunks) lies where it says; else CorruptObjectError, and ``tmp`` is removed."""
        try:
            with _mapped(tmp) as buf:
                try:
                    got, spans = rehash(buf)
                except ValueError as e:
                    raise CorruptObjectError(f"object {digest} from {self.url} is corrupt: {tmp} is not a "
                                             f"well-formed object: {e}") from None
                if got != digest:
                    raise CorruptObjectError(f"object {digest} from {self.url} is corrupt: its bytes hash to {got}")
                if len(buf) != size:
                    raise CorruptObjectError(f"object {digest} from {self.url} is {len(buf)} bytes; its record "
                                             f"says {size}")
                check_entries(buf, entries, spans, f"{self.url}, object {digest}")
            root.tier.put(digest, tmp, move=True)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    # -- locks -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def shared_lock(self, purpose: str) -> Iterator["_HeldLock"]:
        """Held by pushes and pulls: GC waits for it; it waits while GC holds the exclusive lock."""
        key = f"locks/shared-{uuid.uuid4().hex}.json"
        body = _lock_body(purpose)
        delay = 0.05
        while True:
            self.tier.put_record(key, body)
            try:
                gc_body = self.tier.get_record(_EXCLUSIVE, max_bytes=_MAX_LOCK_BYTES)  # one GET (a stat costs more)
                stale = _holder_dead(gc_body) or time.time() - self.tier.record_mtime(_EXCLUSIVE) > self.lock_ttl
            except FileNotFoundError:
                break
            if stale:
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
        self.tier.require()  # GC of a URL that holds no remote: refused before any lock is written
        body = _lock_body("gc")
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.tier.put_record(_EXCLUSIVE, body, create=True)
                break
            except FileExistsError:
                try:
                    stale = (_holder_dead(self.tier.get_record(_EXCLUSIVE, max_bytes=_MAX_LOCK_BYTES))
                             or time.time() - self.tier.record_mtime(_EXCLUSIVE) > self.lock_ttl)
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
                    raise WaitTimeoutError(f"{len(live)} push{'' if len(live) == 1 else 'es'} or pulls still hold {self.url} after {timeout:.4g} s")
                time.sleep(0.1)
            yield held
        finally:
            held.release()

    def live_shared_locks(self) -> list[str]:
        """Keys of shared locks refreshed within ``lock_ttl`` whose holders may be alive.

        A lock held by a dead process of this node is deleted here (whoever looks first)."""
        live, dead, _ = self._shared_locks()
        if dead:
            with contextlib.suppress(RemoteError):
                self.tier.delete_records([f"locks/{k}" for k in dead])
        return live

    def stale_locks(self) -> list[str]:
        """Keys (under ``locks/``) of shared locks whose holders stopped refreshing them, or
        died on this node."""
        _, dead, expired = self._shared_locks()
        return sorted(dead + expired)

    def _shared_locks(self) -> tuple[list[str], list[str], list[str]]:
        """(live, dead, expired) shared locks, from one listing: refreshed within ``lock_ttl``
        with a holder alive or on another node; held by a dead process of this node; not
        refreshed within ``lock_ttl``. Each lock's body is read once (it never changes)."""
        now = time.time()
        locks = {k: t for k, t in self.tier.records("locks").items() if k.startswith("shared-")}
        fresh = [k for k, t in locks.items() if now - t <= self.lock_ttl]
        expired = [k for k, t in locks.items() if now - t > self.lock_ttl]
        live: list[str] = []
        dead: list[str] = []
        for k in fresh:
            with self._lock:
                holder = self._lock_holders.get(k)
            if holder is None:
                try:
                    holder = _parse_holder(self.tier.get_record(f"locks/{k}", max_bytes=_MAX_LOCK_BYTES))
                except FileNotFoundError:
                    continue  # released meanwhile
                with self._lock:
                    self._lock_holders[k] = holder
            (dead if _dead(holder) else live).append(k)
        with self._lock:  # forget bodies of locks that are gone
            for k in set(self._lock_holders) - set(fresh):
                del self._lock_holders[k]
        return live, dead, expired


def _read_first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def _node_id() -> str:
    """Where a pid of this process means something: host name, boot id and PID namespace.

    Two containers sharing a host name but not a PID namespace (or a kernel) differ here, so
    neither judges the other's locks by pid. Empty if the boot id cannot be read (then no lock
    is judged by liveness, only by its TTL).
    """
    boot = _read_first_line("/proc/sys/kernel/random/boot_id")
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return f"{liveness.HOST}/{boot}/{pidns}" if boot else ""


def _lock_body(purpose: str) -> bytes:
    """The body of a lock key this process writes: what it is for and who holds it."""
    pid, start = liveness.this_process()
    return json.dumps({"purpose": purpose, "host": liveness.HOST, "node": _node_id(), "pid": pid,
                       "start": start}).encode()


def _parse_holder(body: bytes) -> dict[str, Any]:
    """A lock body as a dict (empty if it is not one: such a lock is judged by its TTL only)."""
    try:
        return loads(body, dict, "a lock body")
    except ValueError:
        return {}


def _dead(holder: Mapping[str, Any]) -> bool:
    """Whether a lock's holder is a process of this node that is no longer running."""
    node, pid, start = holder.get("node"), holder.get("pid"), holder.get("start")
    if not node or node != _node_id() or type(pid) is not int or type(start) is not int:
        return False  # another node (or an older paramstore): the TTL decides
    return not liveness.alive(pid, start)


def _holder_dead(body: bytes) -> bool:
    return _dead(_parse_holder(body))


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
    with _mapped(path) as mv:
        try:
            return rehash(mv)[0]
        except ValueError as e:
            raise CorruptObjectError(f"{path} is not a well-formed object: {e}") from None


@contextlib.contextmanager
def _mapped(path: str) -> Iterator[memoryview]:
    """The bytes of the file at ``path``, mapped read-only. CorruptObjectError if it is empty."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise CorruptObjectError(f"{path} is empty: not an object")
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m, memoryview(m) as mv:
            yield mv


def _parse(data: bytes, where: str) -> dict[str, Any]:
    """The JSON object in ``data`` (a record or manifest read from ``where``); else CorruptObjectError."""
    try:
        return loads(data, dict, where)
    except ValueError as e:  # not JSON, nested too deeply, or not an object
        raise CorruptObjectError(str(e)) from None


def _check_record(raw: Mapping[str, Any], step: int, where: str) -> _Record:
    """The version record ``raw`` read from ``where`` (the key of ``step``), checked: its version
    is well-formed and at ``step``, its tags are tags, its objects 64-hex digests with positive
    sizes; format 2 adds ``patches``: objects of the version, each with a patch object, a base step
    below ``step`` and a positive size. Else CorruptObjectError."""
    try:
        fields = {"format", "version", "tags", "objects"} | ({"patches"} if raw.get("format") == 2 else set())
        if set(raw) != fields:
            raise CorruptObjectError(f"fields {sorted(raw)}, expected {', '.join(sorted(fields))}")
        tags, objects = raw["tags"], raw["objects"]
        if not isinstance(tags, list) or not isinstance(objects, dict):
            raise CorruptObjectError("tags must be a JSON list and objects a JSON object")
        patches = {o: tuple(p) if isinstance(p, list) else () for o, p in raw.get("patches", {}).items()} \
            if isinstance(raw.get("patches", {}), dict) else None
        if patches is None or any(len(p) != 3 for p in patches.values()):
            raise CorruptObjectError("patches must map objects to [patch object, base step, size]")
        check_digests([*patches, *(p for p, _, _ in patches.values())])
        if not set(patches) <= set(objects) or any(
                not (_count(b) and b < step and _count(n) and n > 0) for _, b, n in patches.values()):
            raise CorruptObjectError("a patch names an object the version lacks, a base not below it, or a bad size")
        version = Version.from_json(raw["version"], tuple(check_tag(t) for t in tags))
        check_digests(objects)
        bad = [n for n in objects.values() if isinstance(n, bool) or not isinstance(n, int) or n <= 0]
        if bad:
            raise CorruptObjectError(f"object sizes must be positive ints, got {bad[0]!r}")
    except ParamStoreError as e:
        raise CorruptObjectError(f"version record {where} is malformed: {e}") from None
    if version.step != step:
        raise CorruptObjectError(f"{where} holds the record of step {version.step}, not {step}: tampered or moved")
    return _Record(version, dict(objects), patches)  # type: ignore[arg-type]


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0
