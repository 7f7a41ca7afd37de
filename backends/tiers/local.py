"""The local tier: object files in a directory, normally on tmpfs (``/dev/shm``), i.e. shared memory.

Layout under the tier directory::

    objects/<d[:2]>/<digest>.safetensors   immutable, published objects (see base.object_key)
    tmp/slab-<pid>-<start>-<n>             buffers being written (or prepared for the next commit),
                                           named by the owning process (pid and start time)
    quarantine/<digest>.<ns>.safetensors   damaged objects moved aside (see LocalTier.quarantine)

How a byte gets here on commit: the committer copies the tensors into a *slab* of ``tmp/``
(:mod:`paramstore.staging`), hashes them there, then :meth:`LocalTier.put` with ``move=True``
fsyncs the file and renames it to its digest. That copy is the only one: readers map the same pages.

Readers map objects copy-on-write (``MAP_PRIVATE``): zero-copy, and writing through a view only
changes that process's private copy of the page, never the store. A published object is never
modified; on tmpfs an object unlinked by GC stays readable by whoever still maps it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import time
import uuid
from typing import Iterator

from .base import OBJECT_SUFFIX, OBJECTS_DIR, Tier, check_range, digest_of_key, object_key

__all__ = ["LocalTier", "QUARANTINE_DIR"]

#: Where damaged objects are moved (renamed, never deleted) for forensics; GC leaves it alone.
QUARANTINE_DIR = "quarantine"


class LocalTier(Tier):
    """Objects as files under ``path`` (use a tmpfs such as ``/dev/shm`` for shared memory).

    Args:
        path: the tier's directory (a store root).
        create: create ``objects/`` and ``tmp/`` if missing.

    Example:
        >>> tier = LocalTier(root, create=True)  # root: a directory on /dev/shm
        >>> tier.mappable, list(tier.list())
        (True, [])
    """

    mappable = True
    ranged_reads = True
    atomic_put = True

    def __init__(self, path: str, *, create: bool = False) -> None:
        self.path = self.url = path
        self.objects_dir = os.path.join(path, OBJECTS_DIR)
        self.tmp_dir = os.path.join(path, "tmp")
        self.quarantine_dir = os.path.join(path, QUARANTINE_DIR)
        if create:
            os.makedirs(self.objects_dir, exist_ok=True)
            os.makedirs(self.tmp_dir, exist_ok=True)

    def object_path(self, digest: str) -> str:
        """Where the object ``digest`` lives (whether or not it exists)."""
        return os.path.join(self.path, object_key(digest))

    # -- the contract ---------------------------------------------------------------------------
    def exists(self, digest: str) -> bool:
        return os.path.exists(self.object_path(digest))

    def size(self, digest: str) -> int:
        return os.stat(self.object_path(digest)).st_size

    def list(self) -> Iterator[str]:
        if not os.path.isdir(self.objects_dir):
            return
        for sub in sorted(os.listdir(self.objects_dir)):
            d = os.path.join(self.objects_dir, sub)
            if not os.path.isdir(d):
                continue
            for name in sorted(os.listdir(d)):
                digest = digest_of_key(name)
                if digest is not None:
                    yield digest

    def get(self, digest: str, start: int = 0, end: int | None = None) -> bytes:
        check_range(start, end)
        with open(self.object_path(digest), "rb") as f:
            f.seek(start)
            return f.read(-1 if end is None else max(0, end - start))

    def get_file(self, digest: str, path: str) -> None:
        with open(self.object_path(digest), "rb") as fin, open(path, "xb") as fout:
            shutil.copyfileobj(fin, fout, 16 << 20)

    def put(self, digest: str, path: str, *, move: bool = False) -> bool:
        """Publish the file ``path`` as object ``digest``: fsync, then rename into place.

        With ``move`` the file itself is renamed when it lies on the tier's filesystem (a slab of
        ``tmp/``), else copied and then removed; without it, it is first copied into ``tmp/``. Returns False (and, with
        ``move``, removes ``path``) if the object already exists: same digest, same bytes.
        A slab stays mapped: the caller unmaps it when convenient (unmapping costs ~20 ms per
        256 MiB of page tables, better spent off the visibility path). ``fsync`` of the file
        covers what was written through a shared mapping.
        """
        final = self.object_path(digest)
        if os.path.exists(final):
            if move:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            return False
        source, copied = path, False
        if not move or os.stat(path).st_dev != os.stat(self.tmp_dir).st_dev:
            tmp = os.path.join(self.tmp_dir, f"put-{uuid.uuid4().hex}")
            shutil.copyfile(path, tmp)
            path, copied = tmp, True
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._make_object_dir(os.path.dirname(final))
            os.rename(path, final)  # atomic: readers see no object or the whole object
        except BaseException:
            if copied:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        _fsync_dir(os.path.dirname(final))
        if move and copied:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(source)
        return True

    def _make_object_dir(self, path: str) -> None:
        """Make ``objects/<d[:2]>`` if missing, with the mode of ``objects/`` itself whatever the
        umask: in a group store (``2750``) members read objects but never add one under a digest
        the trainer would then deduplicate against."""
        if os.path.isdir(path):
            return
        os.makedirs(self.objects_dir, exist_ok=True)
        try:
            os.mkdir(path)
        except FileExistsError:
            return
        os.chmod(path, os.stat(self.objects_dir).st_mode & 0o7777)

    def delete(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.object_path(digest))

    def map(self, digest: str, *, private: bool = False) -> mmap.mmap:
        """Map an object (objects are never empty: a header is at least 64 bytes).

        ``private=False``: read-only, for hashing, serving and export. ``private=True``:
        copy-on-write, for tensors handed to users (reads share the store's pages, writes stay in
        this process).
        """
        fd = os.open(self.object_path(digest), os.O_RDONLY)
        try:
            if private:
                return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            return mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    # -- local extras ---------------------------------------------------------------------------
    def leftovers(self) -> list[str]:
        """Temporary files in ``tmp/`` (slabs in flight, prepared, or left by a crash)."""
        return sorted(os.listdir(self.tmp_dir)) if os.path.isdir(self.tmp_dir) else []

    def quarantine(self, digest: str) -> str | None:
        """Move the object ``digest`` out of ``objects/`` into ``quarantine/``, for forensics.

        The file is renamed, never deleted or changed: ``quarantine/<digest>.<ns>.safetensors``
        (``<ns>``: the time, so that an object quarantined twice keeps both files). Readers that
        still map it keep their pages. GC never touches ``quarantine/``: remove its files by hand
        once examined. Returns the new path, or None if the object is not here.

        Example:
            >>> import shutil
            >>> tier = LocalTier(root, create=True)
            >>> d = "ab" * 32
            >>> with open(f"{root}/tmp/x", "wb") as f:
            ...     _ = f.write(b"damaged bytes")
            >>> tier.put(d, f"{root}/tmp/x", move=True)
            True
            >>> path = tier.quarantine(d)
            >>> tier.exists(d), os.path.relpath(path, root).startswith(f"quarantine/{d}.")
            (False, True)
            >>> tier.quarantine(d) is None
            True
        """
        source = self.object_path(digest)
        os.makedirs(self.quarantine_dir, exist_ok=True)
        target = os.path.join(self.quarantine_dir, f"{digest}.{time.time_ns()}{OBJECT_SUFFIX}")
        try:
            os.rename(source, target)
        except FileNotFoundError:
            return None
        _fsync_dir(os.path.dirname(source))
        _fsync_dir(self.quarantine_dir)
        return target

    def quarantined(self) -> list[str]:
        """Files in ``quarantine/`` (damaged objects moved aside by ``verify --repair`` or
        ``checkout(verify=True)``), oldest name first within each digest."""
        return sorted(os.listdir(self.quarantine_dir)) if os.path.isdir(self.quarantine_dir) else []

    def __repr__(self) -> str:
        return f"LocalTier({self.path!r})"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

