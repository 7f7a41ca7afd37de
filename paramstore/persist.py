"""Write-through to the remote: each committed version is pushed in the background.

The :class:`Persister` takes a local lease on a version the moment it is committed (so local
retention cannot prune it before it is durable remotely), then pushes versions in commit order on
one thread. Transient failures (the endpoint down, timeouts, server errors) are retried with
exponential backoff for up to ``retry_for`` seconds; refusals (missing bucket, access denied)
fail at once. Either way the version stays usable locally, ``ls`` shows it as not persisted, and
the error is on ``handle.persisted``. No torch.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from concurrent.futures import Future
from typing import Callable

from .errors import ParamStoreError, RemoteError
from .manifest import Version
from .remote import Remote
from .root import StoreRoot

__all__ = ["Persister"]

_HOLDER = "paramstore push"


class Persister:
    """Pushes committed versions to ``remote`` on a background thread, in order.

    Args:
        root: the local store.
        remote: where versions go.
        retry_for: seconds a version is retried through transient failures before its future fails.
        on_persisted: called (on the push thread) with each version once it is durable remotely.
    """

    def __init__(self, root: StoreRoot, remote: Remote, *, retry_for: float = 900.0,
                 on_persisted: Callable[[Version], None] | None = None) -> None:
        self._root = root
        self._remote = remote
        self._retry_for = retry_for
        self._on_persisted = on_persisted
        self._queue: queue.Queue[tuple[int, str, Future[Version]] | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self.last_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="paramstore-persist", daemon=True)
        self._thread.start()

    def submit(self, step: int, future: Future[Version] | None = None) -> Future[Version]:
        """Queue version ``step`` for upload; its local lease is taken now. Returns its future."""
        future = future if future is not None else Future()
        lease = self._root.registry.acquire_lease(step, _HOLDER)
        with self._lock:
            self._pending += 1
        self._queue.put((step, lease.id, future))
        return future

    @property
    def pending(self) -> int:
        """Versions queued or being pushed."""
        return self._pending

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued version is pushed (or failed). False on timeout."""
        with self._drained:
            return self._drained.wait_for(lambda: self._pending == 0, timeout)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, lease_id, future = item
            try:
                version = self._push(step)
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                self.last_error = e
                future.set_exception(e)
            else:
                future.set_result(version)
                if self._on_persisted is not None:
                    try:
                        self._on_persisted(version)
                    except Exception as e:  # noqa: BLE001
                        warnings.warn(f"paramstore: after persisting step {step}: {e}", RuntimeWarning, stacklevel=1)
            finally:
                try:
                    self._root.registry.release_lease(lease_id)
                except (ParamStoreError, RuntimeError, OSError):
                    pass
                with self._drained:
                    self._pending -= 1
                    self._drained.notify_all()

    def _push(self, step: int) -> Version:
        deadline = time.monotonic() + self._retry_for
        delay = 0.5
        warned = False
        while True:
            try:
                self._remote.push(self._root, step, show_progress=False)
                return self._root.registry.get_version(step)
            except RemoteError as e:
                if not e.transient or time.monotonic() + delay > deadline:
                    raise
                if not warned:
                    warnings.warn(f"paramstore: pushing step {step} to {self._remote.url} failed ({e}); "
                                  f"retrying for up to {self._retry_for:.0f} s", RuntimeWarning, stacklevel=1)
                    warned = True
                time.sleep(delay)
                delay = min(delay * 2, 30.0)

    def close(self) -> None:
        """Finish every queued push (each bounded by ``retry_for``), then stop."""
        self._queue.put(None)
        self._thread.join()
