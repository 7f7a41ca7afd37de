"""paramstore: a versioned parameter store that hands model weights from trainers to rollout workers.

Example:
    >>> import paramstore
    >>> store = paramstore.ParamStore(root)  # root: a directory on /dev/shm, e.g. "/dev/shm/my-run"
    >>> store.commit(1, model).result().step
    1
    >>> with store.checkout("latest") as snap:
    ...     snap.load_into(policy)
    LoadResult(missing_keys=[], unexpected_keys=[])
    >>> store.close()

The heavy parts (torch) are imported on first use, so the CLI's metadata commands start fast.
"""

from __future__ import annotations

import os as _os
from typing import TYPE_CHECKING, Any

# From a plain checkout on PYTHONPATH (a machine with no network to install on, such as the GPU
# one) ``paramstore.backends`` is the repository's ``backends/``, as an install maps it
# (pyproject's package-dir): found through this package's path, which then includes the checkout.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "backends")) \
        and _os.path.isfile(_os.path.join(_checkout, "backends", "__init__.py")):
    __path__.append(_checkout)

# The error tree's roots and the errors callers catch most; every other one is in paramstore.errors
# (its docstring has the whole tree).
from .errors import (
    ConflictError,
    CorruptionError,
    CorruptObjectError,
    InvalidArgumentError,
    NotAStoreError,
    NotFoundError,
    ParamStoreError,
    ParamStoreWarning,
    StepOrderError,
    StorageError,
    StorageFullError,
    UnavailableError,
    VersionNotFoundError,
    WaitTimeoutError,
)
from .manifest import Chunk, Manifest, TensorEntry, Version

if TYPE_CHECKING:
    from .commit import CommitHandle
    from .following import FollowedCommit
    from .reports import FetchReport, LoadResult
    from .snapshot import Snapshot
    from .store import ParamStore

__version__ = "0.1.0"

_LAZY = {
    "ParamStore": "store",
    "Snapshot": "snapshot",
    "LoadResult": "reports",
    "CommitHandle": "commit",
    "FollowedCommit": "following",
    "FetchReport": "reports",
}

__all__ = [
    "ParamStore", "Snapshot", "LoadResult", "CommitHandle", "FollowedCommit", "FetchReport", "Version", "Manifest", "TensorEntry", "Chunk",
    # the error tree's roots (paramstore.errors)
    "ParamStoreError", "NotFoundError", "ConflictError", "CorruptionError", "UnavailableError",
    "InvalidArgumentError", "StorageError",
    # the errors callers catch most (every other one: paramstore.errors)
    "NotAStoreError", "VersionNotFoundError", "StepOrderError", "WaitTimeoutError", "CorruptObjectError",
    "StorageFullError",
    "ParamStoreWarning",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'paramstore' has no attribute {name!r}")
