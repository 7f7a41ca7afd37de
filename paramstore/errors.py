"""The exception hierarchy: a small tree, grouped by what a caller does about an error.

Every error paramstore raises derives from :class:`ParamStoreError` and from exactly one of six
roots beneath it; catch a root to handle a kind of failure, a leaf to handle one case. Each leaf
also derives from the builtin a caller would naturally catch (``KeyError`` for a missing version,
``TypeError`` for a value that is not a tensor, ...), so ``except KeyError`` keeps working for code
that does not know paramstore. ``paramstore`` exports the roots and the leaves marked ``*``; every
class is importable from ``paramstore.errors``.

==========================  ============================  ===========================================
root (what to do)           class                         also a
==========================  ============================  ===========================================
NotFoundError               NotAStoreError *              FileNotFoundError
(ask for something else,    VersionNotFoundError *        KeyError
or wait for it)             TagNotFoundError              KeyError (a VersionNotFoundError)
ConflictError               StepOrderError *              ValueError
(another writer, rank or    WriterConflictError           RuntimeError
step got there first:       CommitGroupError              RuntimeError
reconcile, then retry)      TornCommitError               RuntimeError
                            UnregisteredObjectsError      RuntimeError
CorruptionError             CorruptObjectError *          OSError
(bytes or metadata are      CorruptStoreError             OSError
damaged: verify, repair,    MetadataLostError             OSError (a CorruptStoreError)
pull a good copy)
UnavailableError            ObjectUnavailableError        FileNotFoundError
(nothing could deliver      WaitTimeoutError *            TimeoutError
now: retry later, start     RegistryError                 ConnectionError
a peer, fix the network)    RemoteError                   OSError
                            TransferError                 ConnectionError
                            BroadcastError                ConnectionError (a TransferError)
                            DeviceError                   RuntimeError
InvalidArgumentError        InvalidTensorError            ValueError, TypeError
(the call is wrong:         InvalidNameError              ValueError
fix the code)               LoadError                     ValueError, RuntimeError
                            StoreClosedError              ValueError, RuntimeError
StorageError                StorageFullError *            OSError
(this host's filesystem     UnsafeStoreError              OSError, PermissionError
refused: space, rights)
==========================  ============================  ===========================================

(The roots: ``NotFoundError``, ``ConflictError``, ``CorruptionError``, ``UnavailableError`` derive
from ``ParamStoreError`` only; ``InvalidArgumentError`` is also a ``ValueError``, ``StorageError`` an
``OSError``.) :class:`ParamStoreWarning` is a warning, not an error: outside the tree.

Example:
    >>> from paramstore.errors import VersionNotFoundError, NotFoundError
    >>> issubclass(VersionNotFoundError, NotFoundError) and issubclass(VersionNotFoundError, KeyError)
    True
"""

from __future__ import annotations

__all__ = [
    "ParamStoreError",
    "NotFoundError",
    "ConflictError",
    "CorruptionError",
    "UnavailableError",
    "InvalidArgumentError",
    "StorageError",
    "NotAStoreError",
    "VersionNotFoundError",
    "TagNotFoundError",
    "StepOrderError",
    "WriterConflictError",
    "CommitGroupError",
    "TornCommitError",
    "UnregisteredObjectsError",
    "CorruptObjectError",
    "CorruptStoreError",
    "MetadataLostError",
    "ObjectUnavailableError",
    "WaitTimeoutError",
    "RegistryError",
    "RemoteError",
    "TransferError",
    "BroadcastError",
    "DeviceError",
    "InvalidTensorError",
    "InvalidNameError",
    "LoadError",
    "StoreClosedError",
    "StorageFullError",
    "UnsafeStoreError",
    "ParamStoreWarning",
]


class ParamStoreError(Exception):
    """Root of every error raised by paramstore."""


class NotFoundError(ParamStoreError):
    """What was asked for does not exist: a store, a version, a tag. Ask for something else, or wait."""


class ConflictError(ParamStoreError):
    """Another writer, rank or step got there first, or changed what a commit was taking: nothing was
    published. Reconcile (a later step, ``takeover=True``, leave the tensors alone) and retry."""


class CorruptionError(ParamStoreError):
    """Bytes or metadata are damaged: an object, a manifest, the store's own files. ``paramstore
    verify --repair`` sets them aside and fetches good copies; a store's lost metadata is pulled back."""


class UnavailableError(ParamStoreError):
    """Nothing could deliver now: no peer, remote, registry, device or new version answered in time.
    Retry later, or start what the message names."""


class InvalidArgumentError(ParamStoreError, ValueError):
    """The call is wrong: a bad argument (metrics that are not numbers, metadata that is not JSON,
    ...), or a store used after ``close()``. Fix the code."""


class StorageError(ParamStoreError, OSError):
    """The store's own filesystem refused a write (permissions, I/O error...). ``errno`` and
    ``filename`` are those of the underlying OSError."""


class ParamStoreWarning(UserWarning):
    """Something works but not as well as it could (e.g. a store root that is not on a tmpfs).

    Silence it with ``warnings.filterwarnings("ignore", category=paramstore.ParamStoreWarning)``.
    """


class NotAStoreError(NotFoundError, FileNotFoundError):
    """The root directory does not hold a paramstore (or holds one of an unknown format)."""


class VersionNotFoundError(NotFoundError, KeyError):
    """No version matches the requested step, tag or selector."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class TagNotFoundError(VersionNotFoundError):
    """The named tag does not exist."""


class StepOrderError(ConflictError, ValueError):
    """A commit's step is not greater than the latest committed (or in-flight) step."""


class InvalidTensorError(InvalidArgumentError, TypeError):
    """A value cannot be stored: not a tensor, or a sparse, quantized, meta or unsupported-dtype one."""


class InvalidNameError(InvalidArgumentError):
    """A tensor or tag name is empty, not a string, contains NUL, or is reserved."""


class CorruptObjectError(CorruptionError, OSError):
    """An object's bytes (or a manifest, index entry or record received from another tier, host or
    registry) do not match their digest, size or the version that names them."""


class CorruptStoreError(CorruptionError, OSError):
    """The store's own metadata on this host is damaged: a truncated or unreadable LMDB file, a
    manifest or marker that is not valid JSON. The message names the file and what to do."""


class MetadataLostError(CorruptStoreError):
    """The store's metadata was deleted or replaced (e.g. ``meta/`` removed by a /dev/shm cleaner)
    while its objects remain, or while this process had the store open. Nothing is re-created:
    the message says how to restore (``pull`` from the remote) or to remove the directory."""


class UnsafeStoreError(StorageError, PermissionError):
    """The store root is not safe to use: owned by another user, or writable by other users."""


class WriterConflictError(ConflictError, RuntimeError):
    """Another live trainer (another run id) writes this store; pass ``takeover=True`` to take it
    over explicitly (see :mod:`paramstore.writer`)."""


class CommitGroupError(ConflictError, RuntimeError):
    """A sharded commit (several ranks committing one version) failed as a group: a rank died or
    did not take part in time, the ranks committed different names or shapes, or one rank's part
    failed (the message names it). Nothing of that version was published, on any rank."""


class TornCommitError(ConflictError, RuntimeError):
    """A tensor was changed in place between ``commit()`` and the end of its copy (torch's in-place
    version counter moved): the version would have mixed the bytes of two steps, so the commit
    failed and nothing was published. Wait for ``handle.staged`` (or use ``store.guard(optimizer)``)
    before changing the parameters."""


class UnregisteredObjectsError(ConflictError, RuntimeError):
    """A publish referenced objects the registry no longer records (GC on another host of a shared
    registry forgot them after this commit deduplicated against them). Nothing was published;
    ``digests`` are the objects missing. The commit path re-registers them (their files are on its
    host, kept by its GC lock) and publishes again: callers of ``store.commit`` never see it."""

    def __init__(self, message: str, *, digests: "frozenset[str] | set[str]" = frozenset()) -> None:
        super().__init__(message)
        self.digests = frozenset(digests)


class ObjectUnavailableError(UnavailableError, FileNotFoundError):
    """An object a version needs is not on this host, and no peer or remote could deliver it.

    The message says what to start: ``paramstore serve`` on a host that holds the version, or a
    remote that has it.
    """


class StoreClosedError(InvalidArgumentError, RuntimeError):
    """The store (or snapshot) was used after ``close()``."""


class WaitTimeoutError(UnavailableError, TimeoutError):
    """A wait for a version (or for readers) ran past its timeout."""


class LoadError(InvalidArgumentError, RuntimeError):
    """``load_into`` could not load a version into a module (names or shapes differ)."""


class RegistryError(UnavailableError, ConnectionError):
    """A registry server (Redis) cannot be reached or failed; the message names its URL, password masked."""


class RemoteError(UnavailableError, OSError):
    """The remote tier (S3, a shared filesystem...) refused or failed: missing bucket, access
    denied, unreachable endpoint, bad URL. The local store is unaffected.

    ``transient`` is True for faults that a retry may cure (connection refused, timeouts, server
    errors), False for refusals (missing bucket, access denied, bad URL).
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class StorageFullError(StorageError):
    """The filesystem holding the store is full (ENOSPC) or over quota. The message names the
    filesystem, the bytes needed and the bytes free."""


class TransferError(UnavailableError, ConnectionError):
    """A peer-to-peer transfer failed: the peer is unreachable, died or froze, refused the range,
    or the read ran past its timeout; also raised when the transfer engine cannot start.

    ``peer`` is the peer's session (``host:port``, None when no peer was involved) and ``code`` the
    transfer engine's return code (None when it gave none; see
    :class:`paramstore.backends.transports.MooncakeTransport` for the codes). After a failed read
    the destination buffer holds garbage.
    """

    def __init__(self, message: str, *, peer: str | None = None, code: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.code = code


class DeviceError(UnavailableError, RuntimeError):
    """A device path failed or cannot be taken: the device named is not available in this process
    (no CUDA/NPU, a bad index), host memory could not be pinned where pinning was required, or a
    colocated reader could not open the owner's device buffers (CUDA IPC). The message names the
    device and says what to do (e.g. check ``out of the owner's process``)."""


class BroadcastError(TransferError):
    """A collective checkout (``checkout(..., group=pg, src=r)``) failed on some member: a member
    died or left the group, the source could not resolve the version, or a member received bytes
    that do not match the manifest. Raised on every member of the group, naming the rank that
    failed and why; nothing that failed verification was placed in any store."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
