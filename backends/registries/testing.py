"""The registry conformance suite: what every :class:`~paramstore.backends.registries.base.Registry` must do.

Shipped with the package so that a new registry is tested by it. Subclass :class:`RegistryTests` in
a pytest module, provide a ``registry_spec`` fixture (a JSON-able description of a fresh, empty
store: a directory, a URL and a namespace...) and :meth:`RegistryTests.open_registry` (a handle on
the store a spec describes)::

    import pytest
    from paramstore.backends.registries.testing import RegistryTests

    class TestMyRegistry(RegistryTests):
        @pytest.fixture
        def registry_spec(self, tmp_path):
            return {"path": str(tmp_path / "meta")}

        def open_registry(self, spec, ttl_s):
            return MyRegistry(spec["path"], create=True)

Every test below then runs against it (paramstore's own tests do this for LMDB and Redis). Tests
open several handles on one store (as several processes would), fork, and start other processes:
what only another process can show (a watch woken from elsewhere, a lease holder or a peer killed
with SIGKILL) runs in a child started with this interpreter and ``sys.path``, which imports the
subclass's module and calls its ``open_registry`` (so keep that method free of fixtures). Versions
and manifests are built with :mod:`paramstore.manifest`. Requires pytest (``paramstore[dev]``).
"""

from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import blake3
import pytest

from paramstore import liveness
from paramstore.errors import (
    InvalidArgumentError, StepOrderError, TagNotFoundError, UnregisteredObjectsError, VersionNotFoundError,
)
from paramstore.manifest import Manifest, TensorEntry, Version

from .base import MAX_DERIVED_RECORD_BYTES, ObjectInfo, Peer, Registry, TensorLocation

__all__ = ["RegistryTests", "digest", "location", "make_version", "publish", "steps", "peer"]

#: The lease and peer TTL (seconds) the suite opens registries with, short so that renewal is exercised.
TTL_S = 2.0


# -- versions ----------------------------------------------------------------------------------
def digest(label: str) -> str:
    """A digest (64 hex digits) named by ``label``."""
    return blake3.blake3(label.encode()).hexdigest()


def location(obj: str, offset: int, nbytes: int = 16) -> TensorLocation:
    """Where a tensor lies: ``nbytes`` bytes at ``offset`` of object ``obj``."""
    return TensorLocation(obj, offset, nbytes)


def make_version(step: int, placement: dict[str, TensorLocation] | None = None,
                 tags: tuple[str, ...] = ()) -> tuple[Version, Manifest, dict[str, TensorLocation]]:
    """A version at ``step`` whose tensors (digest -> location) are ``placement`` (default: one of its own)."""
    placement = placement or {digest(f"t{step}"): location(digest(f"o{step}"), 64)}
    manifest = Manifest({f"t{i}": TensorEntry("float32", (loc.nbytes // 4,), d, loc.object, loc.offset, loc.nbytes)
                         for i, (d, loc) in enumerate(placement.items())})
    version = Version(step, 1.7e9 + step / 7, manifest.nbytes, manifest.digest(), len(manifest.tensors),
                      tuple(sorted(tags)), {"loss": 1 / (step + 1)}, {"run": "contract", "step": step})
    return version, manifest, placement


def publish(reg: Registry, step: int, placement: dict[str, TensorLocation] | None = None,
            tags: tuple[str, ...] = (), **kw: bool) -> Version:
    """Publish ``make_version(step, ...)``, registering its objects (64-byte header + 16 bytes per tensor)."""
    version, manifest, placement = make_version(step, placement, tags)
    held: dict[str, list[str]] = {}
    for d, loc in placement.items():
        held.setdefault(loc.object, []).append(d)
    objects = {o: ObjectInfo(64 + 16 * len(ts), tuple(ts)) for o, ts in held.items()}
    reg.publish(version, manifest, objects, placement, **kw)
    return version


def steps(reg: Registry, after: int | None = None) -> list[int]:
    """The steps of ``reg.versions(after)``."""
    return [v.step for v in reg.versions(after)]


class Forked:
    """``body`` run in a forked child of this process (as a registry must survive: one object per
    process, the parent's leases and peers left alone). The child exits 0 when ``body`` returns,
    1 (its traceback printed) when it raises; :meth:`join` waits and asserts it succeeded."""

    def __init__(self, body: Callable[[], None]) -> None:
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                body()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)

    def join(self) -> None:
        assert os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1]) == 0, "the forked child failed"


def peer(name: str, pid: int | None = None) -> Peer:
    """A peer named ``name`` (its id), of this process unless ``pid`` is given."""
    return Peer(name, f"10.0.0.{len(name)}:15012", f"host-{name}", pid or os.getpid(), 1.7e9)


D, TL, PEER = digest, location, peer  # short names for the tests below


class RegistryTests:
    """Conformance tests for a registry; subclasses provide the ``registry_spec`` fixture and
    :meth:`open_registry`, and say how the registry finds dead processes (:attr:`expires`)."""

    #: False: a dead process's leases and peers are gone on the next read (LMDB: by pid on this
    #: host). True: they live by a TTL their process renews (Redis: a heartbeat), and go within the
    #: ``ttl_s`` given to :meth:`open_registry`.
    expires: bool = False

    @pytest.fixture
    def registry_spec(self) -> Any:  # pragma: no cover - overridden
        """A JSON-able description of a fresh, empty store (read by :meth:`open_registry`)."""
        raise NotImplementedError("subclass RegistryTests and provide a `registry_spec` fixture")

    def open_registry(self, spec: Any, ttl_s: float) -> Registry:  # pragma: no cover - overridden
        """A new handle on the store ``spec`` describes; leases and peers live ``ttl_s`` seconds
        unless renewed where the registry has TTLs. Called in child processes too (no fixtures)."""
        raise NotImplementedError("subclass RegistryTests and implement open_registry(spec, ttl_s)")

    def leftovers(self, spec: Any) -> list[str]:
        """What the store ``spec`` describes still keeps (keys, records) when nothing was published
        to it and every peer it had is gone: the suite expects nothing. The default looks at
        nothing; a subclass that can look lists them."""
        return []

    @pytest.fixture
    def opened(self, registry_spec: Any) -> Iterator[Callable[..., Registry]]:
        """Opens handles on the test's store (``opened(ttl_s=...)``); closes them afterwards."""
        regs: list[Registry] = []

        def open_(ttl_s: float = TTL_S) -> Registry:
            regs.append(self.open_registry(registry_spec, ttl_s))
            return regs[-1]

        yield open_
        for r in regs:
            r.close()

    @pytest.fixture
    def reg(self, opened: Callable[..., Registry]) -> Registry:
        """A handle on a fresh, empty store."""
        return opened()

    def child(self, spec: Any, *args: object) -> subprocess.Popen:
        """A new process running ``_child`` on this store (see :func:`_child`); its stdout is a pipe."""
        cls = type(self)
        code = "from paramstore.backends.registries.testing import _child; _child()"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        return subprocess.Popen([sys.executable, "-c", code, cls.__module__, cls.__qualname__, json.dumps(spec),
                                 *map(str, args)], stdout=subprocess.PIPE, text=True, env=env)

    # -- versions, order, tags -----------------------------------------------------------------
    def test_publish_and_read(self, reg: Registry) -> None:
        assert reg.latest_step() is None and steps(reg) == [] and reg.tags() == {}
        for read in (reg.get_version, reg.get_manifest):
            with pytest.raises(VersionNotFoundError):
                read(1)
        v1 = publish(reg, 1, tags=("a",))
        publish(reg, 5)
        v7 = publish(reg, 7, tags=("c", "b"))
        assert reg.latest_step() == 7
        assert reg.get_version(1) == v1 and reg.get_version(7) == v7 and v7.tags == ("b", "c")
        assert reg.get_manifest(5) == make_version(5)[1]
        assert list(reg.versions()) == [v1, reg.get_version(5), v7]
        assert steps(reg, after=1) == [5, 7] and steps(reg, after=4) == [5, 7] and steps(reg, after=-1) == [1, 5, 7]
        assert steps(reg, after=7) == []
        with pytest.raises(VersionNotFoundError):
            reg.get_version(6)

    def test_step_order(self, reg: Registry) -> None:
        publish(reg, 10)
        for step in (10, 3):
            with pytest.raises(StepOrderError):
                publish(reg, step, {D("new"): TL(D("new-object"), 64)}, tags=("refused",))
        assert steps(reg) == [10] and reg.tags() == {}  # a refused publish writes nothing
        assert reg.locate_tensors([D("new")]) == {} and D("new-object") not in reg.objects()
        big = 2**63 - 1  # beyond a double's precision: the order must still be exact
        publish(reg, big)
        with pytest.raises(StepOrderError):
            publish(reg, big - 1)
        assert steps(reg) == [10, big] and steps(reg, after=big - 1) == [big] and reg.latest_step() == big
        assert reg.get_version(big).step == big

    def test_publish_older_step_without_require_newest(self, reg: Registry) -> None:
        publish(reg, 10)
        publish(reg, 4, require_newest=False)  # restored from a remote: older than the latest is fine
        assert steps(reg) == [4, 10] and reg.latest_step() == 10
        for step in (4, 10):
            with pytest.raises(StepOrderError):
                publish(reg, step, require_newest=False)  # but never twice
        publish(reg, 11, require_newest=False)
        with pytest.raises(StepOrderError):
            publish(reg, 5)  # a commit still has to be the newest
        assert steps(reg) == [4, 10, 11]

    def test_tags(self, reg: Registry) -> None:
        publish(reg, 1, tags=("best",))
        publish(reg, 2)
        reg.set_tag("best", 2)  # moves
        reg.set_tag("stable", 1)
        assert reg.tags() == {"best": 2, "stable": 1}
        assert reg.get_version(2).tags == ("best",) and reg.get_version(1).tags == ("stable",)
        with pytest.raises(VersionNotFoundError):
            reg.set_tag("nowhere", 99)
        assert reg.delete_tag("best") == 2
        with pytest.raises(TagNotFoundError):
            reg.delete_tag("best")
        publish(reg, 3, tags=("stable",))  # a tag published with a version moves as well
        assert reg.tags() == {"stable": 3}

    # -- tensor index and objects --------------------------------------------------------------
    def test_locate_tensors(self, reg: Registry) -> None:
        a, b, c, o1, o2 = D("a"), D("b"), D("c"), D("o1"), D("o2")
        publish(reg, 1, {a: TL(o1, 64), b: TL(o1, 80, 8)})
        assert reg.locate_tensors([a, b, c]) == {a: TL(o1, 64), b: TL(o1, 80, 8)}
        assert reg.locate_tensors([]) == {}
        publish(reg, 2, {a: TL(o2, 128)})  # the newest location wins
        assert reg.locate_tensors([a, b]) == {a: TL(o2, 128), b: TL(o1, 80, 8)}

    def test_objects_referenced_and_forgotten(self, reg: Registry) -> None:
        a, b, c, o1, o2 = D("a"), D("b"), D("c"), D("o1"), D("o2")
        publish(reg, 1, {a: TL(o1, 64), b: TL(o1, 80)})
        publish(reg, 2, {a: TL(o2, 64), c: TL(o2, 80)})  # a is now indexed in o2
        assert reg.objects() == {o1: 96, o2: 96}
        assert reg.referenced_objects() == {o1, o2}
        assert reg.remove_versions([1]) == [1]
        assert reg.referenced_objects() == {o2} and reg.objects() == {o1: 96, o2: 96}
        reg.forget_objects({o1, D("never registered")})
        reg.forget_objects(set())
        assert reg.objects() == {o2: 96}

        # b pointed into o1 and goes; a pointed elsewhere by then and stays
        assert reg.locate_tensors([a, b, c]) == {a: TL(o2, 64), c: TL(o2, 80)}

    def test_publish_refuses_objects_no_longer_registered(self, reg: Registry) -> None:
        """GC on another host forgot an object between a commit's dedup lookup and its publish.
        The publish must fail (nothing of it visible) unless it registers the object again."""
        a, b, o1, o2 = D("a"), D("b"), D("o1"), D("o2")
        publish(reg, 1, {a: TL(o1, 64)})
        publish(reg, 2, {b: TL(o2, 64)})
        assert reg.remove_versions([1]) == [1]
        reg.forget_objects({o1})  # another host's GC: o1 is referenced by no version
        version, manifest, placement = make_version(3, {a: TL(o1, 64), b: TL(o2, 64)})
        with reg.watch() as w:
            with pytest.raises(UnregisteredObjectsError) as err:
                reg.publish(version, manifest, {}, {})  # deduplicated against o1 and o2: registers none
            assert err.value.digests == {o1} and o1 in str(err.value)
            assert not w.wait(0.2)  # nothing changed
        assert reg.latest_step() == 2 and reg.objects() == {o2: 80} and reg.locate_tensors([a]) == {}
        with pytest.raises(UnregisteredObjectsError):  # also for a version received from elsewhere
            reg.publish(version, manifest, {}, {}, require_newest=False)
        reg.publish(version, manifest, {o1: ObjectInfo(80, (a,))}, {a: TL(o1, 64)})  # registered again: published
        assert reg.latest_step() == 3 and reg.objects() == {o1: 80, o2: 80}
        assert reg.locate_tensors([a, b]) == {a: TL(o1, 64), b: TL(o2, 64)}

    def test_patch_records_live_as_long_as_both_versions(self, reg: Registry) -> None:
        for s in (1, 2, 3, 4):
            publish(reg, s)
        p12, p23, p13, p34 = D("p12"), D("p23"), D("p13"), D("p34")
        assert reg.add_patches(1, 2, {D("o2"): (p12, 100)})
        assert reg.add_patches(2, 3, {D("o3"): (p23, 50)})
        assert reg.add_patches(1, 3, {D("o3"): (p13, 70)})
        assert reg.add_patches(3, 4, {D("o4"): (p34, 30)})
        assert reg.add_patches(3, 4, {D("x4"): (D("px"), 40)})  # merged with the pair's record
        assert reg.patches(3) == {(2, 3): {D("o3"): p23}, (1, 3): {D("o3"): p13}}
        assert reg.patches(4) == {(3, 4): {D("o4"): p34, D("x4"): D("px")}}
        assert reg.patches(7) == {}
        with reg.watch() as w:
            assert reg.add_patches(2, 4, {})  # made, none worth keeping: an empty record
            assert w.wait(5)  # and it wakes watchers
        assert reg.patches(4) == {(3, 4): {D("o4"): p34, D("x4"): D("px")}, (2, 4): {}}
        assert set(reg.patches()) == {(1, 2), (2, 3), (1, 3), (3, 4), (2, 4)}
        assert reg.object_sizes([p12, p23, D("px")]) == {p12: 100, p23: 50, D("px"): 40}  # registered as objects
        assert {p12, p23, p13, p34, D("px")} <= reg.referenced_objects()  # kept by GC while recorded
        lease = reg.acquire_lease(3, "reader")
        assert reg.remove_versions([2]) == [2]  # 1->2, 2->3 and 2->4 lose a version; 1->3 and 3->4 stay
        assert set(reg.patches()) == {(1, 3), (3, 4)}
        assert p12 not in reg.referenced_objects() and p13 in reg.referenced_objects()
        assert not reg.add_patches(2, 4, {D("o4"): (D("p24"), 10)})  # base gone: nothing recorded
        assert not reg.add_patches(3, 9, {D("o9"): (D("p39"), 10)})
        assert set(reg.patches()) == {(1, 3), (3, 4)} and D("p24") not in reg.objects()
        reg.release_lease(lease.id)
        assert reg.remove_versions([1, 3]) == [1, 3]
        assert reg.patches() == {} and reg.referenced_objects() == {D("o4")}
        for bad in [(2, 2, {}), (3, 1, {}), (-1, 2, {}), (True, 2, {}), (1, 2, {"nope": (D("p"), 1)}),
                    (1, 2, {D("o"): (D("p"), 0)}), (1, 2, {D("o"): D("p")}), (1, 2, [])]:
            with pytest.raises(InvalidArgumentError):
                reg.add_patches(*bad)

    def test_object_sizes_looks_up_only_what_is_asked(self, reg: Registry) -> None:
        o1, o2 = D("o1"), D("o2")
        publish(reg, 1, {D("a"): TL(o1, 64), D("b"): TL(o2, 80)})
        assert reg.object_sizes([o2, D("unknown")]) == {o2: reg.objects()[o2]}
        assert reg.object_sizes([]) == {}
        assert reg.object_sizes([o1, o2]) == reg.objects()
        with pytest.raises(InvalidArgumentError):
            reg.object_sizes(["../../etc/passwd"])

    def test_persisted_marks(self, reg: Registry) -> None:
        publish(reg, 1)
        publish(reg, 2)
        assert reg.persisted() == {}
        reg.set_persisted(1, "s3://bucket/a")
        reg.set_persisted(2, "s3://bucket/a")
        with pytest.raises(VersionNotFoundError):
            reg.set_persisted(9, "s3://bucket/a")
        assert reg.persisted() == {1: "s3://bucket/a", 2: "s3://bucket/a"}
        assert reg.remove_versions([1]) == [1]
        assert reg.persisted() == {2: "s3://bucket/a"}  # the mark goes with its version

    # -- store-level values, leases and removal ------------------------------------------------
    def test_store_level_values_compare_and_set(self, reg: Registry) -> None:
        assert reg.get_meta("writer") is None
        assert reg.swap_meta("writer", None, "a") == "a"
        assert reg.swap_meta("writer", None, "b") == "a"  # already set: the current value comes back
        assert reg.swap_meta("writer", "x", "b") == "a"  # wrong expectation
        assert reg.swap_meta("writer", "a", "b") == "b"
        assert reg.get_meta("writer") == "b" and reg.get_meta("store_id") is None
        with pytest.raises(InvalidArgumentError):
            reg.get_meta("../etc")

    def test_derived_records_first_writer_wins_and_are_shared(self, opened: Callable[..., Registry]) -> None:
        reg, other = opened(), opened()  # two handles: as two processes (or hosts) see one registry
        a, b = "fp8-block128@1/" + D("o1"), "fp8-block128@1/t-" + D("t1")
        assert reg.derived([a, b]) == {} and reg.derived_keys() == []
        assert reg.swap_derived(a, None, b'{"x":1}') == b'{"x":1}'
        assert other.swap_derived(a, None, b'{"x":2}') == b'{"x":1}'  # already made: the first record comes back
        assert other.swap_derived(a, b'{"x":9}', b'{"x":2}') == b'{"x":1}'  # wrong expectation
        assert other.swap_derived(a, b'{"x":1}', b'{"x":2}') == b'{"x":2}'  # a damaged record replaced
        assert other.swap_derived(b, b'{"x":1}', b'{"y":1}') == b""  # expected one, none there: nothing set
        assert reg.swap_derived(b, None, "é".encode()) == "é".encode()
        assert reg.derived([a, b, "r@1/" + D("zz")]) == {a: b'{"x":2}', b: "é".encode()}
        assert other.derived_keys() == sorted([a, b])
        other.drop_derived([a, "r@1/" + D("zz")])  # an absent key is ignored
        assert reg.derived_keys() == [b] and reg.derived([a]) == {}
        reg.drop_derived([])
        for bad_key in ("../etc", "fp8", "", "a/b/c", 7, "a b/c"):
            with pytest.raises(InvalidArgumentError):
                reg.derived([bad_key])  # type: ignore[list-item]
        for bad_record in (b"", b"\xff\xfe", "text", b"x" * (MAX_DERIVED_RECORD_BYTES + 1)):
            with pytest.raises(InvalidArgumentError):
                reg.swap_derived(a, None, bad_record)  # type: ignore[arg-type]
        assert reg.derived_keys() == [b]

    def test_leases(self, opened: Callable[..., Registry]) -> None:
        reg, other = opened(), opened()
        publish(reg, 1)
        publish(reg, 2)
        with pytest.raises(VersionNotFoundError):
            reg.acquire_lease(9, "reader")
        a, b, c = reg.acquire_lease(1, "reader-a"), reg.acquire_lease(1, "reader-b"), reg.acquire_lease(2, "reader-c")
        assert (a.step, a.holder, a.pid, a.host) == (1, "reader-a", os.getpid(), liveness.HOST)
        assert abs(a.acquired_at - time.time()) < 60
        assert sorted(other.leases()) == sorted([a, b, c])  # seen through another handle
        reg.release_lease(a.id)
        reg.release_lease(a.id)  # already gone: no error
        assert sorted(other.leases()) == sorted([b, c])
        reg.close()
        reg.release_lease(b.id)  # a snapshot may outlive its store: its lease is still released
        reg.release_lease(c.id)
        assert other.leases() == []

    def test_remove_versions_spares_latest_and_leased(self, reg: Registry) -> None:
        for s in (1, 2, 3, 4):
            publish(reg, s, tags=(f"t{s}",))
        lease = reg.acquire_lease(2, "reader")
        assert reg.remove_versions([4, 2, 1, 99]) == [1]
        assert steps(reg) == [2, 3, 4] and reg.tags() == {"t2": 2, "t3": 3, "t4": 4}  # tags go with versions
        with pytest.raises(VersionNotFoundError):
            reg.get_manifest(1)
        with pytest.raises(VersionNotFoundError):
            reg.acquire_lease(1, "late reader")
        reg.release_lease(lease.id)
        assert reg.remove_versions([3, 2]) == [2, 3]
        assert reg.remove_versions([4]) == [] and steps(reg) == [4]

    def test_prune_and_lease_race(self, opened: Callable[..., Registry]) -> None:
        """A lease and a removal of the same version, started together: exactly one wins, every round."""
        reader, pruner = opened(), opened()  # separate handles (for a server, separate connections)
        barrier = threading.Barrier(2)
        wins: Counter = Counter()
        jitter = random.Random(0)

        def start(delay: float) -> None:  # a random head start for either side, so both orders occur
            barrier.wait()
            time.sleep(delay)

        def acquire(step: int, delay: float) -> Any:
            start(delay)
            try:
                return reader.acquire_lease(step, "racer")
            except VersionNotFoundError:
                return None

        def remove(step: int, delay: float) -> list[int]:
            start(delay)
            return pruner.remove_versions([step])

        publish(pruner, 0)
        with ThreadPoolExecutor(2) as pool:
            for i in range(200):
                victim = 2 * i + 1
                publish(pruner, victim)
                publish(pruner, victim + 1)  # so the victim is not the latest
                delays = (jitter.uniform(0, 3e-4), 0.0)[:: jitter.choice((1, -1))]
                got, removed = pool.submit(acquire, victim, delays[0]), pool.submit(remove, victim, delays[1])
                lease, removed = got.result(timeout=10), removed.result(timeout=10)
                assert (lease is None) == (removed == [victim]), (i, lease, removed)
                if lease is not None:
                    assert pruner.get_version(victim).step == victim  # the leased version survived
                    reader.release_lease(lease.id)
                    assert pruner.remove_versions([victim]) == [victim]
                assert pruner.remove_versions([victim - 1]) == [victim - 1]
                wins["lease" if lease else "prune"] += 1
        assert steps(pruner) == [400] and pruner.leases() == []
        assert wins["lease"] and wins["prune"], f"one side always won, nothing raced: {dict(wins)}"

    def test_lease_of_killed_holder_disappears(self, reg: Registry, registry_spec: Any) -> None:
        publish(reg, 1)
        publish(reg, 2)
        proc = self.child(registry_spec, "lease", 1, 1.0)  # a 1 s TTL where leases expire
        try:
            lease_id = proc.stdout.readline().strip()  # type: ignore[union-attr]
            assert [lease.id for lease in reg.leases()] == [lease_id]
            if self.expires:
                time.sleep(1.4)  # past its TTL: renewed by the holder's heartbeat
                assert [lease.id for lease in reg.leases()] == [lease_id]
            assert reg.remove_versions([1]) == []
        finally:
            proc.kill()
            proc.communicate()
        killed = time.monotonic()
        while reg.leases():  # found dead at once, or when the TTL runs out
            assert self.expires, "the dead holder's lease was still listed on the next read"
            assert time.monotonic() - killed < 3, "the dead holder's lease outlived its TTL"
            time.sleep(0.05)
        assert reg.remove_versions([1]) == [1]

    # -- watches -------------------------------------------------------------------------------
    def test_watch_wakes_on_publish_from_another_process(self, reg: Registry, registry_spec: Any) -> None:
        publish(reg, 1)
        with reg.watch() as w:
            proc = self.child(registry_spec, "publish", 2)
            assert w.wait(timeout=20)
            woke = time.monotonic()
            out, _ = proc.communicate(timeout=20)
            assert proc.returncode == 0
            before, after = map(float, out.split())
            assert before <= woke, "woke before the other process published"
            assert woke - after < 0.5, f"woke {woke - after:.3f} s after the publish returned"
            assert reg.latest_step() == 2

    def test_watch_times_out_without_spinning(self, reg: Registry) -> None:
        with reg.watch() as w:
            t0, cpu0 = time.monotonic(), time.process_time()
            assert not w.wait(0.4)
            elapsed, cpu = time.monotonic() - t0, time.process_time() - cpu0
        assert 0.39 <= elapsed < 1.5 and cpu < 0.1, (elapsed, cpu)

    def test_watch_wakes_on_every_change(self, reg: Registry) -> None:
        publish(reg, 1)
        publish(reg, 2)
        changes = [lambda: reg.set_tag("x", 1), lambda: reg.delete_tag("x"), lambda: reg.set_persisted(1, "s3://b"),
                   lambda: reg.remove_versions([1]), lambda: publish(reg, 3)]
        for change in changes:
            with reg.watch() as w:
                change()
                assert w.wait(5)

    def test_lease_watch_wakes_on_release(self, reg: Registry) -> None:
        publish(reg, 1)
        with reg.watch("leases") as w:
            lease = reg.acquire_lease(1, "reader")
            assert not w.wait(0.1)  # acquiring wakes nobody
            releaser = threading.Thread(target=lambda: (time.sleep(0.2), reg.release_lease(lease.id)))
            t0 = time.monotonic()
            releaser.start()
            try:
                assert w.wait(5)
                assert 0.15 < time.monotonic() - t0 < 2
            finally:
                releaser.join()

    # -- fork ----------------------------------------------------------------------------------
    def test_fork(self, opened: Callable[..., Registry]) -> None:
        """A forked child uses the registry on its own handle and leaves the parent's leases alone."""
        reg = opened(ttl_s=1.0)
        publish(reg, 1)
        lease = reg.acquire_lease(1, "parent")

        def child() -> None:
            assert steps(reg) == [1] and [x.id for x in reg.leases()] == [lease.id]
            publish(reg, 2)
            mine = reg.acquire_lease(2, "child")
            reg.release_lease(mine.id)
            reg.close()

        Forked(child).join()
        assert reg.latest_step() == 2  # the parent's handle works after the child closed its own
        assert [x.id for x in reg.leases()] == [lease.id]
        if self.expires:
            time.sleep(1.3)  # past the TTL: the parent's heartbeat still renews it
            assert [x.id for x in reg.leases()] == [lease.id]
        reg.release_lease(lease.id)

    # -- peers ---------------------------------------------------------------------------------
    def test_peers_announce_refresh_withdraw(self, opened: Callable[..., Registry]) -> None:
        reg, other = opened(), opened()
        assert reg.peers() == []
        a, b = PEER("a"), PEER("b")
        reg.announce_peer(b)
        reg.announce_peer(a)
        assert other.peers() == [a, b]  # ordered by id, seen through another handle
        reg.announce_objects(a.id, {D("o1"): 4096})
        a2 = a._replace(session="10.0.0.9:15013", started_at=1.8e9)
        reg.announce_peer(a2)  # refresh: new fields, its objects stay announced
        assert other.peers() == [a2, b] and other.holders([D("o1")]) == {D("o1"): [(a2, 4096)]}
        reg.withdraw_peer(a.id)
        assert other.peers() == [b] and other.holders([D("o1")]) == {}  # its objects went with it
        with pytest.raises(InvalidArgumentError):
            reg.announce_objects(a.id, {D("o1"): 4096})
        reg.withdraw_peer(a.id)  # already gone, or never announced: no error
        reg.withdraw_peer("never-announced")
        reg.announce_objects(b.id, {D("o2"): 8})
        reg.close()  # closing the registry object that announced a peer withdraws it
        assert other.peers() == [] and other.holders([D("o2")]) == {}

    def test_holders(self, opened: Callable[..., Registry]) -> None:
        reg, other = opened(), opened()
        a, b, c = PEER("a"), PEER("b"), PEER("c")
        for p in (c, a, b):
            reg.announce_peer(p)
        o1, o2, o3, o4 = D("o1"), D("o2"), D("o3"), D("o4")
        reg.announce_objects(b.id, {o1: 100, o2: 200})
        reg.announce_objects(a.id, {o1: 10})
        reg.announce_objects(c.id, {o3: 3000, o1: 1000})
        assert other.holders([o4, o3, o1, o2, o1]) == {o1: [(a, 10), (b, 100), (c, 1000)], o2: [(b, 200)],
                                                       o3: [(c, 3000)]}  # holders ordered by peer id
        assert reg.holders([]) == {} and reg.holders([o4]) == {} and reg.holders(iter([o2])) == {o2: [(b, 200)]}
        reg.announce_objects(a.id, {o1: 11, o4: 0})  # again: the new address replaces the old one
        assert other.holders([o1, o4]) == {o1: [(a, 11), (b, 100), (c, 1000)], o4: [(a, 0)]}
        reg.withdraw_objects(b.id, [o1, o2, o3])  # o3 was never b's: no error
        reg.withdraw_objects(b.id, [])
        reg.withdraw_objects("never-announced", [o1])
        assert other.holders([o1, o2, o3]) == {o1: [(a, 11), (c, 1000)], o3: [(c, 3000)]}
        assert other.peers() == [a, b, c]  # a peer holding nothing is still a peer
        reg.withdraw_peer(c.id)
        assert other.holders([o1, o2, o3, o4]) == {o1: [(a, 11)], o4: [(a, 0)]}

    def test_holders_limit(self, opened: Callable[..., Registry]) -> None:
        """With a limit: at most that many per digest, ordered by peer id, a sample drawn anew each
        call (every holder turns up), all of them where as few hold it; a bad limit is refused."""
        reg, other = opened(), opened()
        peers = [PEER(f"h{i}") for i in range(5)]
        for i, p in enumerate(peers):
            reg.announce_peer(p)
            reg.announce_objects(p.id, {D("many"): i})
        reg.announce_objects(peers[3].id, {D("one"): 33})
        full = other.holders([D("many")])[D("many")]
        assert len(full) == 5
        seen = set()
        for _ in range(60):  # a holder left out of 60 draws of 2 of 5: p = 0.6**60
            got = other.holders([D("many"), D("one"), D("none")], limit=2)
            assert set(got) == {D("many"), D("one")} and got[D("one")] == [(peers[3], 33)]
            row = got[D("many")]
            assert len(row) == 2 and row == sorted(row, key=lambda x: x[0].id) and set(row) <= set(full)
            seen.update(row)
        assert seen == set(full)
        assert other.holders([D("many")], limit=5) == other.holders([D("many")], limit=99) == {D("many"): full}
        for bad in (0, -1, 1.5, True, "2"):
            with pytest.raises(InvalidArgumentError):
                other.holders([D("many")], limit=bad)  # type: ignore[arg-type]

    def test_announce_in_order(self, opened: Callable[..., Registry]) -> None:
        """Positions count up per key across handles, only the top one is given again, a holder's
        position and address are found by position, and a lookup after a call returned sees that
        caller ahead of any later one (threads race here)."""
        reg, other = opened(), opened()
        a, b, c = PEER("a"), PEER("b"), PEER("c")
        reg.announce_peer(a)
        other.announce_peer(b)
        other.announce_peer(c)
        k1, k2 = D("k1"), D("k2")
        assert reg.in_order(k1, [0, 1]) == (0, {})
        assert reg.announce_in_order(a.id, k1, 77) == 0
        assert other.announce_in_order(b.id, k1, 88) == 1
        assert other.announce_in_order(b.id, k2, 99) == 0  # each key its own positions
        assert other.announce_in_order(c.id, k1, 1 << 63) == 2
        assert reg.holders([k1, k2]) == {k1: [(a, 77), (b, 88), (c, 1 << 63)], k2: [(b, 99)]}  # a holding like any
        assert other.in_order(k1, [2, 0, 5, 1, 2]) == (3, {0: (a, 77), 1: (b, 88), 2: (c, 1 << 63)})
        assert reg.in_order(k1, []) == (3, {}) and reg.in_order(k2, iter([0])) == (1, {0: (b, 99)})
        reg.withdraw_objects(a.id, [k1])  # a position below others' is never given again
        assert other.in_order(k1, [0, 1, 2]) == (3, {1: (b, 88), 2: (c, 1 << 63)})
        assert reg.announce_in_order(a.id, k1, 7) == 3
        reg.withdraw_objects(a.id, [k1])  # the top one is
        assert reg.announce_in_order(a.id, k1, 8) == 3
        assert reg.announce_in_order(a.id, k1, 9) == 4  # announced again: a new position, the old one freed
        assert other.in_order(k1, [3, 4]) == (5, {4: (a, 9)}) and other.holders([k1])[k1][0] == (a, 9)
        other.withdraw_peer(c.id)  # its positions go with it
        reg.announce_objects(b.id, {k1: 5})  # announced plainly: no position any more
        assert reg.in_order(k1, range(6)) == (5, {4: (a, 9)})
        with pytest.raises(InvalidArgumentError):
            reg.announce_in_order("nobody", k1, 1)
        for bad in ("not-a-key", k1.upper()):
            with pytest.raises(InvalidArgumentError):
                reg.announce_in_order(a.id, bad, 1)
            with pytest.raises(InvalidArgumentError):
                reg.in_order(bad, [0])
        for bad_address in (-1, 1 << 64, 1.5, True):
            with pytest.raises(InvalidArgumentError):
                reg.announce_in_order(a.id, k2, bad_address)  # type: ignore[arg-type]
        for bad_positions in ([-1], [1 << 53], [1.0], [True], "0", 3):
            with pytest.raises(InvalidArgumentError):
                reg.in_order(k1, bad_positions)  # type: ignore[arg-type]
        peers = [PEER(f"r{i}") for i in range(6)]
        handles = [opened() for _ in peers]
        for h, p in zip(handles, peers):
            h.announce_peer(p)
        seen: dict[str, tuple[int, set[str]]] = {}
        key = D("race")

        def join(h: Registry, p: Peer) -> None:
            n = h.announce_in_order(p.id, key, 1)
            seen[p.id] = (n, {q.id for q, _ in h.in_order(key, range(n))[1].values()})

        threads = [threading.Thread(target=join, args=hp) for hp in zip(handles, peers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(n for n, _ in seen.values()) == list(range(len(peers)))
        for pid, (n, ahead) in seen.items():  # everyone with a smaller position was seen by this one
            assert ahead == {q for q, (m, _) in seen.items() if m < n}, pid

    def test_peer_arguments(self, reg: Registry) -> None:
        with pytest.raises(InvalidArgumentError):
            reg.announce_objects("nobody", {D("o"): 1})  # not announced
        a = PEER("a")
        reg.announce_peer(a)
        for bad in ({"not-a-digest": 1}, {D("o").upper(): 1}, {D("o"): -1}, {D("o"): 1 << 64}, {D("o"): 1.5},
                    {D("o"): True}, [D("o")]):
            with pytest.raises(InvalidArgumentError):
                reg.announce_objects(a.id, bad)  # type: ignore[arg-type]
        for bad_peer in (a._replace(id=""), a._replace(id="a b"), a._replace(id="x" * 129), a._replace(pid=0),
                         a._replace(session=""), a._replace(host=None), tuple(a)):
            with pytest.raises(InvalidArgumentError):
                reg.announce_peer(bad_peer)  # type: ignore[arg-type]
        for bad_digests in (D("o"), ["xyz"]):  # a single string is not a list of digests
            with pytest.raises(InvalidArgumentError):
                reg.holders(bad_digests)
            with pytest.raises(InvalidArgumentError):
                reg.withdraw_objects(a.id, bad_digests)
        with pytest.raises(InvalidArgumentError):
            reg.withdraw_peer("a/b")
        assert reg.peers() == [a] and reg.holders([D("o")]) == {}  # nothing bad was written

    def test_removal_leaves_announcements(self, reg: Registry) -> None:
        """Pruning versions and forgetting objects (GC) do not touch what peers announced."""
        o = D("o1")
        publish(reg, 1, {D("t"): TL(o, 64)})
        publish(reg, 2)
        a = PEER("a")
        reg.announce_peer(a)
        reg.announce_objects(a.id, {o: 64})
        assert reg.remove_versions([1]) == [1]
        reg.forget_objects({o})
        assert o not in reg.objects() and reg.holders([o]) == {o: [(a, 64)]}

    def test_peer_of_killed_process_disappears(self, reg: Registry, registry_spec: Any) -> None:
        proc = self.child(registry_spec, "peer", 1.0)  # a 1 s TTL where peers expire
        try:
            peer_id = proc.stdout.readline().strip()  # type: ignore[union-attr]
            [p] = reg.peers()
            assert p.id == peer_id and p.pid == proc.pid
            assert reg.holders([D("k1"), D("k2")]) == {D("k1"): [(p, 111)], D("k2"): [(p, 222)]}
        finally:
            proc.kill()
            proc.communicate()
        killed = time.monotonic()
        while reg.holders([D("k1"), D("k2")]):  # found dead at once, or within the TTL
            assert self.expires, "the dead peer was still listed on the next read"
            assert time.monotonic() - killed < 3, "the dead peer outlived its TTL"
            time.sleep(0.05)
        assert reg.peers() == []
        assert self.leftovers(registry_spec) == []  # nothing of it lingers

    def test_peer_fork(self, opened: Callable[..., Registry]) -> None:
        """A forked child neither renews nor withdraws the peer its parent announced."""
        reg = opened(ttl_s=1.0)
        parent = PEER("parent")
        reg.announce_peer(parent)
        reg.announce_objects(parent.id, {D("p"): 1})
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()

        def child() -> None:
            os.close(ready_r)
            os.close(go_w)
            assert reg.peers() == [parent]
            reg.withdraw_peer(parent.id)  # the parent's: a child never withdraws it
            mine = PEER("child", pid=os.getpid())
            reg.announce_peer(mine)  # (where peers expire, the child's own heartbeat runs from now on)
            reg.announce_objects(mine.id, {D("c"): 2})
            os.write(ready_w, b"r")
            os.read(go_r, 1)  # wait until the parent closes its end
            reg.close()  # withdraws the child's peer only

        forked = Forked(child)
        os.close(ready_w)
        os.close(go_r)
        try:
            assert os.read(ready_r, 1) == b"r", "the child failed"
            kid = PEER("child", pid=forked.pid)
            assert reg.peers() == [kid, parent]
            if self.expires:
                time.sleep(1.3)  # past the TTL: each peer renewed by its own process
                assert reg.peers() == [kid, parent]
            reg.withdraw_peer(parent.id)
            if self.expires:
                time.sleep(0.5)  # the child's heartbeat beats meanwhile: it must not bring the parent's back
            assert reg.peers() == [kid] and reg.holders([D("p"), D("c")]) == {D("c"): [(kid, 2)]}
        finally:
            os.close(go_w)
            os.close(ready_r)
            forked.join()
        assert reg.peers() == []

    # -- capabilities --------------------------------------------------------------------------
    def test_capability_flags_are_bools(self, reg: Registry) -> None:
        for flag in ("shared",):
            assert isinstance(getattr(reg, flag), bool), flag


# -- the other process -------------------------------------------------------------------------
def _child() -> None:
    """Run in a child process by :meth:`RegistryTests.child`; ``sys.argv[1:]`` is the test class's
    module and qualified name, the store's spec (JSON), then an action:

    ``publish STEP``: print the monotonic time before and after publishing it.
    ``lease STEP TTL``: take a lease (TTL in seconds where leases expire), print its id, wait to be killed.
    ``peer TTL``: announce a peer of this process holding ``digest("k1")`` at 111 and ``digest("k2")``
    at 222, print its id, and wait to be killed.
    """
    module, qualname, spec_json, action, *args = sys.argv[1:]
    cls: Any = importlib.import_module(module)
    for name in qualname.split("."):
        cls = getattr(cls, name)
    ttl = {"lease": lambda: float(args[1]), "peer": lambda: float(args[0])}.get(action, lambda: TTL_S)()
    reg = cls().open_registry(json.loads(spec_json), ttl)
    if action == "publish":
        before = time.monotonic()
        publish(reg, int(args[0]))
        print(before, time.monotonic(), flush=True)
    elif action == "lease":
        print(reg.acquire_lease(int(args[0]), "child").id, flush=True)
        time.sleep(60)
    elif action == "peer":
        me = Peer(uuid.uuid4().hex, "127.0.0.1:15012", liveness.HOST, os.getpid(), time.time())
        reg.announce_peer(me)
        reg.announce_objects(me.id, {D("k1"): 111, D("k2"): 222})
        print(me.id, flush=True)
        time.sleep(60)
    reg.close()
