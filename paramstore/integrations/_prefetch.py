"""The next version, brought to this host while the engine generates (used by the verl, SGLang and
vLLM integrations; issue 28).

After an engine installs step ``s`` it calls :meth:`NextVersion.start` with ``s + 1``: a daemon
thread waits for the first version with a step ``>= s + 1`` and has the store prefetch it
(:meth:`paramstore.ParamStore.prefetch`: its objects come here from patches, peers or the remote,
verified). The next update first calls :meth:`NextVersion.settle` with the step it is about to take:
when the prefetch covers that step it waits for it (the bytes are then here, or arriving), so the
checkout that follows maps what is already here and moves nothing (``snap.fetch.moved`` False).

The wait and the retries run on a daemon thread of their own (the store's prefetch thread takes one
prefetch at a time, in order: a retry loop there would hold up the next one). A version published
before any source holds its bytes (it reaches the remote after it is published) is tried again for
up to :data:`RETRY_FOR_S`. A failed prefetch is not an error: the checkout fetches what is missing
itself, and raises its own errors.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

from paramstore.errors import ObjectUnavailableError

__all__ = ["NextVersion", "RETRY_FOR_S"]

#: Seconds a prefetch keeps trying a version published before any source holds its bytes.
RETRY_FOR_S = 60.0


class NextVersion:
    """One engine's prefetch of the version after the one it installed (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._future: concurrent.futures.Future[Any] | None = None
        self._min_step: int | None = None
        self._recipe: str | None = None

    @property
    def min_step(self) -> int | None:
        """The step the pending (or last) prefetch waits for at least; None before the first."""
        return self._min_step

    @property
    def future(self) -> concurrent.futures.Future[Any] | None:
        """The pending (or last) prefetch: a Future of the :class:`~paramstore.Version` prefetched."""
        return self._future

    def start(self, store: Any, min_step: int, *, recipe: str | None = None) -> concurrent.futures.Future[Any]:
        """Prefetch the first version with a step ``>= min_step`` once it is committed (at once when it
        is there), in ``recipe``'s form if one is named (its derived objects made or fetched too:
        :meth:`paramstore.ParamStore.prefetch`). A prefetch already pending for the same
        ``min_step`` and recipe is kept."""
        with self._lock:
            if self._future is not None and (self._min_step, self._recipe) == (min_step, recipe) \
                    and not self._future.done():
                return self._future
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._future, self._min_step, self._recipe = future, min_step, recipe
        threading.Thread(target=self._run, args=(store, min_step, recipe, future), daemon=True,
                         name=f"paramstore-next-{min_step}").start()
        return future

    @staticmethod
    def _run(store: Any, min_step: int, recipe: str | None, future: concurrent.futures.Future[Any]) -> None:
        try:
            version = store.wait_for(min_step, timeout=None)  # ends with StoreClosedError when the store closes
            deadline, delay = time.monotonic() + RETRY_FOR_S, 0.05
            while True:
                try:
                    future.set_result(store.prefetch(version.step, recipe=recipe).result())
                    return
                except ObjectUnavailableError:
                    # Published before any source holds its bytes: a version reaches the remote
                    # after it is published (and a peer may not serve it yet). Try again shortly.
                    if time.monotonic() + delay > deadline:
                        raise
                    time.sleep(delay)
                    delay = min(2 * delay, 1.0)
        except BaseException as e:  # noqa: BLE001 - handed to whoever settles
            future.set_exception(e)

    def settle(self, step: int, timeout: float | None) -> Any:
        """Before a checkout of ``step`` (or newer): wait (at most ``timeout`` seconds) for the prefetch
        when it covers ``step`` (its ``min_step <= step``). Returns the Version it prefetched, or None
        (no prefetch covers it, it failed, or it took longer than ``timeout``)."""
        with self._lock:
            future, min_step = self._future, self._min_step
        if future is None or min_step is None or min_step > step:
            return None  # it waits for a version not needed now: the checkout does not wait for it
        try:
            return future.result(timeout)
        except Exception:  # noqa: BLE001 - an optimization only: the checkout fetches (and raises) itself
            return None
