"""Background scrub: re-hash the objects of this host's versions at a bounded rate.

Off by default (``ParamStore(scrub_rate=None)``). With ``scrub_rate=B`` (bytes per second) a thread
walks the objects the store's versions reference, one at a time, re-hashes each (blake3, as
``verify`` does) and sleeps so that it reads at most ``B`` bytes per second on average. An object
whose bytes no longer match its digest is quarantined (:func:`paramstore.objects.quarantine`: moved
aside, dropped from the dedup index, so no commit reuses it) and reported with a ParamStoreWarning
that names the versions it damages and says to run ``paramstore verify --repair``. A full pass
starts over after ``pause`` seconds. Objects that disappear meanwhile (pruned) are skipped.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Callable

from .errors import CorruptObjectError, InvalidArgumentError, ParamStoreError, ParamStoreWarning
from .objects import hash_object, quarantine
from .root import StoreRoot

__all__ = ["Scrubber", "check_rate"]


def check_rate(rate: object) -> float | None:
    """``rate`` if it is None or a positive number of bytes per second, else InvalidArgumentError."""
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise InvalidArgumentError(f"scrub_rate must be None or a positive number of bytes per second, got {rate!r}")
    return float(rate)


class Scrubber:
    """The scrub thread of one store (see the module's doc).

    Args:
        root: the open store.
        rate: bytes per second, on average.
        pause: seconds between two full passes.
        on_damage: called with each quarantined digest (after the warning); for tests and hooks.
    """

    def __init__(self, root: StoreRoot, rate: float, *, pause: float = 60.0,
                 on_damage: Callable[[str], None] | None = None) -> None:
        self._root, self._rate, self._pause = root, check_rate(rate), pause
        self._on_damage = on_damage
        self._stop = threading.Event()
        self.checked = 0  #: objects re-hashed so far
        self.quarantined: list[str] = []  #: digests found damaged
        self._thread = threading.Thread(target=self._loop, name="paramstore-scrub", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                for digest in sorted(self._root.registry.referenced_objects()):
                    if self._stop.is_set():
                        return
                    self._check(digest)
            except Exception as e:  # noqa: BLE001 -- the store is gone or damaged: say so once, stop
                warnings.warn(f"paramstore scrub of {self._root.path} stopped: {e}", ParamStoreWarning, stacklevel=1)
                return
            self._stop.wait(self._pause)

    def _check(self, digest: str) -> None:
        t0 = time.monotonic()
        try:
            size = self._root.tier.size(digest)
            got, _ = hash_object(self._root, digest)
            bad = got != digest
        except FileNotFoundError:
            return  # pruned meanwhile, or already quarantined
        except CorruptObjectError:
            size, bad = 0, True
        self.checked += 1
        if bad:
            self._report(digest)
        self._stop.wait(max(0.0, size / self._rate - (time.monotonic() - t0)))  # the rate bound

    def _report(self, digest: str) -> None:
        steps = [s for s in self._root.registry.versions() if digest in self._manifest_objects(s.step)]
        quarantine(self._root, [digest])
        self.quarantined.append(digest)
        warnings.warn(f"paramstore scrub: object {digest} in {self._root.path} is damaged (its bytes no longer match "
                      f"its digest); moved to quarantine. Versions affected: {[v.step for v in steps] or 'none'}; "
                      "run `paramstore verify --repair` to fetch a good copy", ParamStoreWarning, stacklevel=1)
        if self._on_damage is not None:
            self._on_damage(digest)

    def _manifest_objects(self, step: int) -> set[str]:
        try:
            return set(self._root.registry.get_manifest(step).objects())
        except ParamStoreError:
            return set()
