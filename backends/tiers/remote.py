"""The remote tier: immutable objects and small records under any fsspec URL.

``s3://bucket/prefix`` goes through s3fs (any S3 API: AWS, MinIO, moto...), ``file:///path`` is
a shared filesystem; other fsspec protocols work when their package is installed. This module
moves bytes and knows the layout; the protocol on top (what a version is, locks, GC) lives in
:mod:`paramstore.remote`. Layout under the URL::

    paramstore-remote.json            marker {"format": 1}
    objects/ab/ab…cd.safetensors      content-addressed objects, the same bytes as the local tier
    manifests/<step:020d>.json        a version's manifest, written before its record
    versions/<step:020d>.json         a version's record, written last, create-only
    locks/…                           see paramstore.remote

Writes are atomic per key: S3 ``PutObject`` and multipart completion publish a key whole; on a
local filesystem a file is written under a temporary name and renamed (or hard-linked, for a
create-only put). Credentials and endpoints come the usual way for the protocol (for S3: the
environment, ``~/.aws``, or ``storage_options={"key":…, "secret":…, "endpoint_url":…}``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import uuid
import warnings
from typing import Any, Iterator, Mapping

from paramstore.errors import CorruptObjectError, InvalidArgumentError, RemoteError

from .base import OBJECTS_DIR, Tier, check_range, digest_of_key, object_key

__all__ = ["RemoteTier", "REMOTE_FORMAT", "is_transient"]

REMOTE_FORMAT = 1
MARKER = "paramstore-remote.json"
_PART_BYTES = 64 << 20  # multipart chunk; several parts of one object go up at once
_MAX_MARKER_BYTES = 64 << 10  # the marker is a few bytes of JSON; a larger one is refused unread


def is_transient(e: BaseException) -> bool:
    """Whether retrying ``e`` later may succeed (a network or server fault, not a refusal)."""
    return isinstance(e, RemoteError) and e.transient


class RemoteTier(Tier):
    """Objects and records under ``url``; one instance per process (it reconnects after fork).

    Args:
        url: an fsspec URL of a directory or prefix (``s3://bucket/prefix``, ``file:///mnt/ckpt``).
        options: passed to the fsspec filesystem (for s3fs: ``key``, ``secret``, ``profile``,
            ``endpoint_url`` or ``client_kwargs``...).
        concurrency: parts of one object moved at once (multipart upload and ranged download).

    Raises:
        RemoteError: bad URL, missing bucket, access denied, unreachable endpoint, or a remote of
            another format.
    """

    mappable = False
    ranged_reads = True
    atomic_put = True

    def __init__(self, url: str, options: Mapping[str, Any] | None = None, *, concurrency: int = 8) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise InvalidArgumentError(f"remote must be a URL such as s3://bucket/prefix or file:///path, got {url!r}")
        scheme, rest = url.split("://", 1)
        if not scheme or not rest.strip("/"):
            raise InvalidArgumentError(f"remote {url!r} names no bucket or path: use e.g. s3://bucket/prefix "
                                       "or file:///mnt/ckpt")
        self.url = f"{scheme}://{rest.rstrip('/')}" if rest.strip("/") != "" else url
        self._options = dict(options or {})
        self._concurrency = concurrency
        self._lock = threading.Lock()
        self._pid = -1
        self._fs: Any = None
        self._base = ""
        self._connect()
        #: whether a paramstore remote lives at the URL (its marker seen); False until a write makes one
        self.created = self._read_marker()

    # -- connection --------------------------------------------------------------------------
    def _connect(self) -> None:
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - a dependency of the s3 extra
            raise RemoteError("the remote tier needs fsspec: pip install 'paramstore[s3]'") from e
        opts = dict(self._options)
        protocol = self.url.split("://", 1)[0]
        if protocol in ("s3", "s3a"):
            opts.setdefault("use_listings_cache", False)  # other processes write here too
            opts.setdefault("max_concurrency", self._concurrency)
        try:
            fs, base = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **opts)
        except (ValueError, ImportError, TypeError) as e:
            raise RemoteError(f"cannot open remote {self.url}: {e}") from e
        self._fs, self._base, self._pid = fs, base.rstrip("/"), os.getpid()
        self.local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (a fresh one in a forked child: async clients do not survive fork)."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._connect()
        return self._fs

    def _path(self, key: str) -> str:
        return f"{self._base}/{key}"

    # -- the marker: a read never creates one; a write (push, the first commit) does ---------------
    def _read_marker(self) -> bool:
        """Whether a paramstore remote lives at the URL (its marker, whose format is checked).

        Creates nothing. Raises RemoteError if the bucket does not exist, or for another format."""
        try:
            raw = self.get_record(MARKER, max_bytes=_MAX_MARKER_BYTES)
        except FileNotFoundError:
            self._check_bucket()
            return False
        try:
            fmt = json.loads(raw).get("format")
        except (ValueError, AttributeError):
            fmt = None
        if fmt != REMOTE_FORMAT:
            raise RemoteError(f"{self.url} holds a paramstore remote of format {fmt!r}; this paramstore "
                              f"reads format {REMOTE_FORMAT}")
        return True

    def _check_bucket(self) -> None:
        """Raise RemoteError if the URL's bucket does not exist (an object store; a local directory
        is made by the first write)."""
        if self.local:
            return
        bucket = self._base.split("/", 1)[0]
        try:
            self.fs.invalidate_cache()
            self._call("stat", self.fs.info, bucket, missing_ok=True)
        except FileNotFoundError:
            raise RemoteError(f"the bucket {bucket} does not exist (deleted after it was used, or a typo in "
                              f"{self.url}?): create it, or check the URL", transient=False) from None

    def present(self, *, recheck: bool = False) -> bool:
        """Whether a paramstore remote lives at the URL; ``recheck`` reads the marker again even
        when it was seen (a bucket deleted since). Raises RemoteError if the bucket does not exist."""
        if recheck or not self.created:
            self.created = self._read_marker()
        return self.created

    def absent(self) -> str:
        """Why a read finds nothing at the URL, and what makes a remote there."""
        gone = " (the directory does not exist)" if self.local and not os.path.isdir(self._base) else ""
        return (f"no paramstore remote at {self.url} (no {MARKER} there{gone}): nothing was ever pushed to this "
                "URL, or it is mistyped. A read never creates a remote; a push, or the first commit of a store "
                "opened with this remote, does")

    def require(self, *, recheck: bool = False) -> None:
        """For a read: raise RemoteError unless a paramstore remote lives at the URL (see :meth:`absent`)."""
        if not self.present(recheck=recheck):
            raise RemoteError(self.absent(), transient=False)

    def create(self) -> None:
        """For a write: make the URL a paramstore remote (its marker, create-only) unless it is one."""
        if self.created:
            return
        try:
            self.put_record(MARKER, json.dumps({"format": REMOTE_FORMAT}).encode(), create=True)
        except FileExistsError:  # another process created it at the same moment
            pass
        self.created = self._read_marker()  # and checks the format of one another process wrote

    def _call(self, what: str, fn: Any, *args: Any, missing_ok: bool = False, **kwargs: Any) -> Any:
        """Run one filesystem call; translate its failure into FileNotFoundError (passed through
        when ``missing_ok``), FileExistsError, or RemoteError (transient or not)."""
        try:
            return fn(*args, **kwargs)
        except FileExistsError:
            raise
        except FileNotFoundError as e:
            if missing_ok:
                raise
            raise RemoteError(f"{what} on {self.url}: not found ({e}); does the bucket exist?", transient=False) from e
        except PermissionError as e:
            raise RemoteError(f"{what} on {self.url}: access denied ({e})", transient=False) from e
        except (ValueError, TypeError, NotImplementedError) as e:
            raise RemoteError(f"{what} on {self.url}: {e}", transient=False) from e
        except Exception as e:  # noqa: BLE001 - connection refused, timeouts, 5xx: retry later
            raise RemoteError(f"{what} on {self.url}: {type(e).__name__}: {e}", transient=True) from e

    # -- objects: the Tier contract -----------------------------------------------------------
    def exists(self, digest: str) -> bool:
        # One ranged GET: s3fs's exists() costs a HEAD and a LIST for a missing key.
        try:
            self._call("exists", self.fs.cat_file, self._path(object_key(digest)), start=0, end=1,
                       missing_ok=True)
        except FileNotFoundError:
            return False
        return True

    def size(self, digest: str) -> int:
        self.fs.invalidate_cache()
        info = self._call("stat", self.fs.info, self._path(object_key(digest)), missing_ok=True)
        return int(info.get("size") or 0)

    def list(self) -> Iterator[str]:
        return iter(sorted(self.objects()))

    def get(self, digest: str, start: int = 0, end: int | None = None) -> bytes:
        check_range(start, end)
        if end is not None and end == start:
            if not self.exists(digest):
                raise FileNotFoundError(object_key(digest))
            return b""
        return self._call("read", self.fs.cat_file, self._path(object_key(digest)), start=start, end=end,
                          missing_ok=True)

    def get_file(self, digest: str, path: str) -> None:
        """Download object ``digest`` into the local file ``path`` (streamed, ranged in parallel).

        Raises FileNotFoundError if the remote has no such object, FileExistsError if ``path`` exists.
        """
        key = object_key(digest)  # validated before anything is touched
        if os.path.lexists(path):
            raise FileExistsError(path)
        self._call("download", self.fs.get_file, self._path(key), path, missing_ok=True,
                   **({} if self.local else {"max_concurrency": self._concurrency, "chunksize": _PART_BYTES}))

    def put(self, digest: str, path: str, *, move: bool = False) -> bool:
        """Upload the local file ``path`` as object ``digest`` (streamed; multipart when large).

        S3 publishes a key whole when the upload (or multipart completion) ends. Returns False
        without uploading if the object is already there.
        """
        key = object_key(digest)
        if self.exists(digest):
            new = False
        else:
            if not os.path.isfile(path):
                raise FileNotFoundError(path)
            self._put_file(path, key)
            new = True
        if move:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return new

    def delete(self, digest: str) -> None:
        self.delete_records([object_key(digest)])

    def objects(self) -> dict[str, tuple[int, float]]:
        """Every object: digest -> (size, last-modified time, seconds since the epoch). One listing."""
        out = {}
        for path, info in self._find(OBJECTS_DIR).items():
            digest = digest_of_key(path)
            if digest is not None:
                out[digest] = (int(info.get("size") or 0), _mtime(info))
        return out

    def delete_objects(self, digests: list[str]) -> None:
        """Delete several objects in one call (absent ones are ignored)."""
        self.delete_records([object_key(d) for d in digests])

    def close(self) -> None:
        self._fs = None
        self._pid = -1

    # -- records (small JSON files) ------------------------------------------------------------
    def get_record(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The bytes of record ``key``. Raises FileNotFoundError.

        With ``max_bytes``, the record's size is looked up first and one larger than that raises
        CorruptObjectError before any byte is read; the read itself stops after ``max_bytes + 1``
        bytes (the key may be replaced in between).
        """
        if max_bytes is None:
            return self._call("read", self.fs.cat_file, self._path(key), missing_ok=True)
        self.fs.invalidate_cache()
        size = int(self._call("stat", self.fs.info, self._path(key), missing_ok=True).get("size") or 0)
        data = b""
        if 0 < size <= max_bytes:
            data = self._call("read", self.fs.cat_file, self._path(key), start=0, end=max_bytes + 1, missing_ok=True)
        if max(size, len(data)) > max_bytes:
            raise CorruptObjectError(f"{self.url}/{key} is {max(size, len(data))} bytes, over the limit of "
                                     f"{max_bytes} for this record: not written by paramstore (or a newer one)")
        return data

    def put_record(self, key: str, data: bytes, *, create: bool = False) -> None:
        """Write record ``key`` whole. With ``create``, only if it does not exist yet (S3
        ``If-None-Match: *``; a hard link on a local filesystem): raises FileExistsError."""
        if self.local:
            self._local_put(key, data=data, create=create)
            return
        kwargs: dict[str, Any] = {"mode": "create"} if create else {}
        try:
            self._call("write", self.fs.pipe_file, self._path(key), data, **kwargs)
        except RemoteError as e:
            if not (create and isinstance(e.__cause__, TypeError)):
                raise
            # This filesystem has no conditional put: check, then write (not atomic).
            warnings.warn(f"{self.url}: no create-only put; a concurrent writer of {key} may be overwritten",
                          RuntimeWarning, stacklevel=2)
            if self.fs.exists(self._path(key)):
                raise FileExistsError(key) from None
            self._call("write", self.fs.pipe_file, self._path(key), data)

    def records(self, prefix: str) -> dict[str, float]:
        """Records under ``prefix`` (a folder): name -> last-modified time."""
        return {path.rsplit("/", 1)[-1]: _mtime(info) for path, info in self._find(prefix).items()}

    def record_mtime(self, key: str) -> float:
        """Last-modified time of record ``key``, in the remote's clock. Raises FileNotFoundError."""
        self.fs.invalidate_cache()
        return _mtime(self._call("stat", self.fs.info, self._path(key), missing_ok=True))

    def delete_records(self, keys: list[str]) -> None:
        """Delete these keys; absent ones are ignored."""
        if not keys:
            return
        paths = [self._path(k) for k in keys]
        if self.local:
            for p in paths:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            return
        try:
            self._call("delete", self.fs.rm, paths, missing_ok=True)
        except FileNotFoundError:
            pass

    # -- helpers -----------------------------------------------------------------------------
    def _find(self, prefix: str) -> dict[str, dict[str, Any]]:
        self.fs.invalidate_cache()
        try:
            return self._call("list", self.fs.find, self._path(prefix), detail=True, missing_ok=True)
        except FileNotFoundError:
            return {}

    def _put_file(self, path: str, key: str) -> None:
        if self.local:
            self._local_put(key, src=path, create=False)
        else:
            self._call("upload", self.fs.put_file, path, self._path(key), missing_ok=False,
                       chunksize=_PART_BYTES, max_concurrency=self._concurrency)

    def _local_put(self, key: str, *, data: bytes | None = None, src: str | None = None, create: bool) -> None:
        # Write under a temporary name, fsync, then rename (or link: fails if the key exists).
        final = self._path(key)
        tmp = f"{final}.tmp-{uuid.uuid4().hex}"
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            if src is not None:
                self.fs.put_file(src, tmp)
            else:
                with open(tmp, "wb") as f:
                    f.write(data or b"")
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            if create:
                os.link(tmp, final)  # FileExistsError if someone was first
            else:
                os.replace(tmp, final)
        except FileExistsError:
            raise
        except OSError as e:
            raise RemoteError(f"write {key} on {self.url}: {e}", transient=not isinstance(e, PermissionError)) from e
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r})"


def _mtime(info: Mapping[str, Any]) -> float:
    t = info.get("LastModified", info.get("mtime", info.get("last_modified", 0.0)))
    if isinstance(t, datetime.datetime):
        return t.timestamp()
    if isinstance(t, str):
        return datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
    return float(t or 0.0)

