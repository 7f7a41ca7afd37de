"""Prometheus metrics of a store in this process (``ParamStore(..., metrics=True)``; extra ``metrics``).

``prometheus_client`` is imported here only, and only by a store opened with ``metrics=True`` (or
:func:`serve`). The names, types and labels are tabled in ``docs/api.md`` ("Metrics"). They follow the
engines' weight-update metrics (vLLM's ``vllm:rl_weight_update_operations_total{operation,status}`` and
``..._duration_seconds``, SGLang's ``sglang:weight_load_duration_seconds{source}``), prefixed
``paramstore_``, units in the names.

**Registry.** The metrics live in ``prometheus_client``'s default registry, once per process, and every
series carries a ``store`` label (the store's ``name`` with a shared registry, else its root path). So the
``/metrics`` endpoint a rollout engine already serves (vLLM's, SGLang's: the default registry) shows them
beside the engine's own with no wiring, and two stores in one process never collide: a second store adds
series with its own label instead of registering the same names twice (which ``prometheus_client``
refuses). Two handles of one store (a trainer and a reader in one process) share their series.

**Hooks.** The read and write sides, and maintenance, call in here through :func:`observed` (a decorator:
one line per operation) and :func:`fetched`; both cost a dictionary lookup when metrics are off. The
gauges (latest step, leases, staleness) are read from the store's registry when scraped.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from .errors import InvalidArgumentError
from .reports import FetchReport, GcReport, PruneReport

if TYPE_CHECKING:
    from .manifest import Manifest

__all__ = ["check_available", "attach", "observed", "fetched", "serve", "SOURCES"]

#: Values of the ``source`` label of the fetch metrics.
SOURCES = ("local", "peer", "remote", "patch", "group")
_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_INSTALL = "pip install 'paramstore[metrics]'"

F = TypeVar("F", bound=Callable[..., Any])


def check_available() -> None:
    """InvalidArgumentError unless ``prometheus_client`` can be imported (``metrics=True`` needs it)."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError as e:
        raise InvalidArgumentError(f"metrics=True needs prometheus_client: {_INSTALL}") from e


class _Families:
    """The process's metric families (made once, in the default registry)."""

    def __init__(self) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        self.operations = Counter("paramstore_operations_total", "Store operations by outcome (status: ok, error).",
                                  ["store", "operation", "status"])
        self.duration = Histogram("paramstore_operation_duration_seconds",
                                  "Time of a store operation, from its call to its end (a commit: until visible).",
                                  ["store", "operation"], buckets=_BUCKETS_S)
        self.in_flight = Gauge("paramstore_operations_in_flight", "Store operations started and not ended.",
                               ["store", "operation"])
        self.stage = Histogram("paramstore_commit_stage_duration_seconds",
                               "Time from a commit's call until its copy is taken (the trainer may go on).",
                               ["store"], buckets=_BUCKETS_S)
        self.commit_bytes = Counter("paramstore_commit_bytes_total", "Logical bytes of the versions committed.",
                                    ["store"])
        self.fetch_bytes = Counter("paramstore_fetch_bytes_total",
                                   "Bytes of the versions checked out or prefetched, by where they came from.",
                                   ["store", "source"])
        self.fetch_objects = Counter("paramstore_fetch_objects_total",
                                     "Objects of the versions checked out or prefetched, by how they got here.",
                                     ["store", "source"])
        self.fetch_duration = Histogram("paramstore_fetch_duration_seconds",
                                        "Time spent obtaining a version's bytes, by the source of most of them.",
                                        ["store", "source"], buckets=_BUCKETS_S)
        self.pruned = Counter("paramstore_pruned_versions_total", "Versions removed by prune.", ["store", "tier"])
        self.gc_objects = Counter("paramstore_gc_deleted_objects_total", "Objects deleted by GC.", ["store", "tier"])
        self.gc_bytes = Counter("paramstore_gc_freed_bytes_total", "Bytes freed by GC.", ["store", "tier"])
        REGISTRY.register(_StoreCollector())


_lock = threading.Lock()
_families: _Families | None = None
#: id(an Opening, its StoreRoot or its Remote) -> the store's metrics (dropped when the object goes)
_stores: dict[int, "StoreMetrics"] = {}


def _get_families() -> _Families:
    global _families
    with _lock:
        if _families is None:
            _families = _Families()
        return _families


class StoreMetrics:
    """The series of one store (its ``store`` label) and what records into them."""

    def __init__(self, opening: Any, label: str) -> None:
        self.f = _get_families()
        self.label = label
        self.opening = weakref.ref(opening)

    # -- operations ------------------------------------------------------------------------
    def run(self, operation: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        flight = self.f.in_flight.labels(self.label, operation)
        flight.inc()
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            self._end(operation, "error", t0)
            raise
        if operation == "commit":  # the handle's futures end it
            self._follow_commit(result, t0)
            return result
        self._end(operation, "ok", t0)
        try:
            self._record(operation, result)
        except Exception:  # noqa: BLE001 - metrics never fail the operation they watch
            pass
        return result

    def _end(self, operation: str, status: str, t0: float) -> None:
        self.f.in_flight.labels(self.label, operation).dec()
        self.f.operations.labels(self.label, operation, status).inc()
        self.f.duration.labels(self.label, operation).observe(time.perf_counter() - t0)

    def _follow_commit(self, handle: Any, t0: float) -> None:
        def staged(fut: Any) -> None:
            if fut.exception() is None:
                self.f.stage.labels(self.label).observe(time.perf_counter() - t0)

        def committed(fut: Any) -> None:
            error = fut.exception()
            self._end("commit", "ok" if error is None else "error", t0)
            if error is None:
                self.f.commit_bytes.labels(self.label).inc(fut.result().nbytes)

        handle.staged.add_done_callback(staged)
        handle.committed.add_done_callback(committed)

    def _record(self, operation: str, result: Any) -> None:
        tier = "remote" if operation.startswith("remote_") else "local"
        if isinstance(result, PruneReport) and not result.dry_run:
            self.f.pruned.labels(self.label, tier).inc(len(result.removed))
        elif isinstance(result, GcReport) and not result.dry_run:
            self.f.gc_objects.labels(self.label, tier).inc(len(result.objects))
            self.f.gc_bytes.labels(self.label, tier).inc(result.bytes_freed)
        elif operation == "checkout" and isinstance(getattr(result, "fetch", None), FetchReport):
            self.fetched(result.fetch, result.manifest)

    # -- fetches ---------------------------------------------------------------------------
    def fetched(self, report: FetchReport, manifest: "Manifest") -> None:
        opening = self.opening()
        root = None if opening is None else opening.opened
        remote = None if opening is None else opening.remote
        objects = list(manifest.objects())
        sizes = root.registry.object_sizes(objects) if root is not None else {}
        nbytes, count = split(report, objects, sizes, None if remote is None else remote.url)
        for source in SOURCES:
            if nbytes[source]:
                self.f.fetch_bytes.labels(self.label, source).inc(nbytes[source])
            if count[source]:
                self.f.fetch_objects.labels(self.label, source).inc(count[source])
        main = max(("peer", "remote", "patch", "group"), key=lambda s: nbytes[s])
        self.f.fetch_duration.labels(self.label, main if nbytes[main] else "local").observe(report.seconds)


def split(report: FetchReport, objects: list[str], sizes: dict[str, int],
          remote_url: str | None) -> tuple[Counter[str], Counter[str]]:
    """``(bytes, objects)`` of a fetch by source (:data:`SOURCES`).

    ``local``: objects already here, and their sizes. ``peer``, ``remote``, ``group``: the report's
    ``bytes_from`` by kind of source (a peer's session, the remote's URL, ``group:<rank>``), less the
    patch bytes among them; ``patch``: the bytes of patch objects moved (``report.patch_bytes``) and the
    objects rebuilt from them. So the sources but ``local`` add up to ``report.bytes``. Patch bytes from
    the remote are its bytes beyond the whole objects it delivered; the rest came from peers.

    Example:
        >>> r = FetchReport(3, local=1, from_peers=["b"], from_patches=["c"], patch_bytes=10,
        ...                 bytes_from=Counter({"10.0.0.2:7000": 110}))
        >>> nbytes, count = split(r, ["a", "b", "c"], {"a": 50, "b": 100, "c": 100}, None)
        >>> sorted(nbytes.items()), sorted(count.items())
        ([('local', 50), ('patch', 10), ('peer', 100)], [('local', 1), ('patch', 1), ('peer', 1)])
    """
    nbytes: Counter[str] = Counter()
    for key, n in report.bytes_from.items():
        kind = "group" if key.startswith("group:") else "remote" if key == remote_url or "://" in key else "peer"
        nbytes[kind] += n
    if report.patch_bytes:
        whole = sum(sizes.get(o, 0) for o in report.from_remote)
        from_remote = min(max(nbytes["remote"] - whole, 0), report.patch_bytes)
        nbytes["remote"] -= from_remote
        nbytes["peer"] -= min(nbytes["peer"], report.patch_bytes - from_remote)
        nbytes["patch"] = report.patch_bytes
    fetched = set(report.fetched)
    local = [o for o in objects if o not in fetched]
    nbytes["local"] = sum(sizes.get(o, 0) for o in local)
    count = Counter({"local": len(local), "peer": len(report.from_peers), "remote": len(report.from_remote),
                     "patch": len(report.from_patches), "group": len(report.from_group)})
    return +nbytes, +count


# -- what the store's code calls ------------------------------------------------------------
def attach(opening: Any) -> None:
    """Give the store that ``opening`` opens its metrics, if its options ask for them (idempotent)."""
    if not opening.opts.metrics or id(opening) in _stores:
        return
    m = StoreMetrics(opening, opening.opts.name if opening.opts.registry else opening.path)
    _register(opening, m)
    opening.on_open(lambda root, _pool: _register(root, m))
    if opening.remote is not None:
        _register(opening.remote, m)


def _register(owner: Any, m: StoreMetrics) -> None:
    with _lock:
        _stores[id(owner)] = m
    weakref.finalize(owner, _stores.pop, id(owner), None)


def _of(owner: Any) -> StoreMetrics | None:
    if not _stores:
        return None
    m = _stores.get(id(owner))
    if m is None and hasattr(owner, "_open"):  # a read or write side: its Opening
        m = _stores.get(id(owner._open))
    return m


def observed(operation: str) -> Callable[[F], F]:
    """Count and time ``operation``: decorates a function whose first argument is the store's read or
    write side, its StoreRoot or its Remote (a no-op for a store without metrics)."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(owner: Any, *args: Any, **kwargs: Any) -> Any:
            m = _of(owner)
            if m is None:
                return fn(owner, *args, **kwargs)
            return m.run(operation, fn, (owner, *args), kwargs)
        return run  # type: ignore[return-value]
    return wrap


def fetched(owner: Any, report: FetchReport, manifest: "Manifest") -> None:
    """Count what a fetch (a prefetch's, with what a pull placed before it absorbed) moved, by source."""
    m = _of(owner)
    if m is not None:
        try:
            m.fetched(report, manifest)
        except Exception:  # noqa: BLE001 - metrics never fail the operation they watch
            pass


def serve(port: int, host: str = "127.0.0.1") -> Any:
    """Serve this process's metrics (the default registry) over HTTP at ``http://host:port/metrics``
    on a daemon thread; returns the HTTP server (``.shutdown()`` stops it)."""
    check_available()
    from prometheus_client import start_http_server

    started = start_http_server(port, addr=host)
    return started[0] if isinstance(started, tuple) else started


class _StoreCollector:
    """The gauges read from each store's registry when scraped: latest step, live leases, the oldest
    leased step and the staleness (latest step − oldest leased step; 0 while nothing is leased)."""

    def describe(self) -> list[Any]:
        return []  # collected on scrape only (describing would read every store's registry)

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        latest = GaugeMetricFamily("paramstore_latest_step", "The store's latest committed step.", labels=["store"])
        leases = GaugeMetricFamily("paramstore_leases", "Live leases: readers holding a version.", labels=["store"])
        oldest = GaugeMetricFamily("paramstore_oldest_leased_step", "The oldest step a reader holds.",
                                   labels=["store"])
        stale = GaugeMetricFamily("paramstore_staleness_steps",
                                  "Latest step minus the oldest leased step (0 while nothing is leased).",
                                  labels=["store"])
        seen: set[str] = set()
        with _lock:
            stores = list(dict.fromkeys(_stores.values()))
        for m in stores:
            opening = m.opening()
            if m.label in seen or opening is None or opening.closed or opening.opened is None:
                continue
            try:
                reg = opening.opened.registry
                step, held = reg.latest_step(), [lease.step for lease in reg.leases()]
            except Exception:  # noqa: BLE001 - closing meanwhile, a registry unreachable: no sample
                continue
            seen.add(m.label)
            leases.add_metric([m.label], len(held))
            if held:
                oldest.add_metric([m.label], min(held))
            if step is not None:
                latest.add_metric([m.label], step)
                stale.add_metric([m.label], max(step - min(held), 0) if held else 0)
        yield from (latest, leases, oldest, stale)
