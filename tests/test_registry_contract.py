"""The registry contract (``backends/registries/base.py``), run against every implementation.

Each test runs on LMDB (in ``tmp_path``) and on Redis (a real redis-server started once per session
on a free loopback port: conftest's ``redis_url``, see ``redis_server.py``; each test gets its own
namespace). Versions and
manifests are built with :mod:`paramstore.manifest`. What only another process can show (a watch
woken from elsewhere, a lease holder or a peer killed with SIGKILL) uses this file run as a script:
see :func:`_child`.
"""

from __future__ import annotations

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
from typing import Sequence

import blake3
import lmdb
import pytest
import redis

import redis_server
from paramstore import liveness
from paramstore.backends.registries import (
    LmdbRegistry, ObjectInfo, Peer, RedisRegistry, Registry, TensorLocation, open_registry,
)
from paramstore.errors import (
    InvalidArgumentError, ParamStoreWarning, RegistryError, StepOrderError, TagNotFoundError, UnregisteredObjectsError,
    VersionNotFoundError,
)
from paramstore.manifest import Manifest, TensorEntry, Version

#: (Redis URL or None for LMDB, LMDB directory, Redis namespace): all a process needs to open it.
Spec = Sequence

TTL = 2.0  # Redis lease TTL in these tests, short so that renewal is exercised

needs_server = pytest.mark.skipif(not os.path.exists(redis_server.BINARY),
                                  reason="redis-server is not installed (Debian: apt-get install redis-server)")


# -- versions ----------------------------------------------------------------------------------
def D(label: str) -> str:
    """A digest (64 hex digits) named by ``label``."""
    return blake3.blake3(label.encode()).hexdigest()


def TL(obj: str, offset: int, nbytes: int = 16) -> TensorLocation:
    return TensorLocation(obj, offset, nbytes)


def make(step: int, placement: dict[str, TensorLocation] | None = None,
         tags: tuple[str, ...] = ()) -> tuple[Version, Manifest, dict[str, TensorLocation]]:
    """A version at ``step`` whose tensors (digest -> location) are ``placement`` (default: one of its own)."""
    placement = placement or {D(f"t{step}"): TL(D(f"o{step}"), 64)}
    manifest = Manifest({f"t{i}": TensorEntry("float32", (loc.nbytes // 4,), d, loc.object, loc.offset, loc.nbytes)
                         for i, (d, loc) in enumerate(placement.items())})
    version = Version(step, 1.7e9 + step / 7, manifest.nbytes, manifest.digest(), len(manifest.tensors),
                      tuple(sorted(tags)), {"loss": 1 / (step + 1)}, {"run": "contract", "step": step})
    return version, manifest, placement


def publish(reg: Registry, step: int, placement: dict[str, TensorLocation] | None = None,
            tags: tuple[str, ...] = (), **kw: bool) -> Version:
    """Publish ``make(step, ...)``, registering its objects (64-byte header + 16 bytes per tensor)."""
    version, manifest, placement = make(step, placement, tags)
    held: dict[str, list[str]] = {}
    for d, loc in placement.items():
        held.setdefault(loc.object, []).append(d)
    objects = {o: ObjectInfo(64 + 16 * len(ts), tuple(ts)) for o, ts in held.items()}
    reg.publish(version, manifest, objects, placement, **kw)
    return version


def steps(reg: Registry, after: int | None = None) -> list[int]:
    return [v.step for v in reg.versions(after)]


# -- fixtures ----------------------------------------------------------------------------------
def open_spec(spec: Spec, lease_ttl_s: float = TTL) -> Registry:
    url, meta, namespace = spec
    return RedisRegistry(url, namespace, lease_ttl_s=lease_ttl_s) if url else LmdbRegistry(meta, create=True)


@pytest.fixture(params=["lmdb", "redis"])
def spec(request, tmp_path) -> Spec:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    return url, str(tmp_path / "meta"), uuid.uuid4().hex


@pytest.fixture
def opened(spec):
    """Opens registries on the test's store (each its own handle); closes them afterwards."""
    regs: list[Registry] = []

    def open_(**kw: float) -> Registry:
        regs.append(open_spec(spec, **kw))
        return regs[-1]

    yield open_
    for r in regs:
        r.close()


@pytest.fixture
def reg(opened) -> Registry:
    return opened()


def child(spec: Spec, *args: object) -> subprocess.Popen:
    """This file run as a script in a new process (see ``_child``); its stdout is a pipe."""
    return subprocess.Popen([sys.executable, __file__, json.dumps(list(spec)), *map(str, args)],
                            stdout=subprocess.PIPE, text=True)


# -- versions, order, tags ---------------------------------------------------------------------
def test_publish_and_read(reg):
    assert reg.latest_step() is None and steps(reg) == [] and reg.tags() == {}
    for read in (reg.get_version, reg.get_manifest):
        with pytest.raises(VersionNotFoundError):
            read(1)
    v1 = publish(reg, 1, tags=("a",))
    publish(reg, 5)
    v7 = publish(reg, 7, tags=("c", "b"))
    assert reg.latest_step() == 7
    assert reg.get_version(1) == v1 and reg.get_version(7) == v7 and v7.tags == ("b", "c")
    assert reg.get_manifest(5) == make(5)[1]
    assert list(reg.versions()) == [v1, reg.get_version(5), v7]
    assert steps(reg, after=1) == [5, 7] and steps(reg, after=4) == [5, 7] and steps(reg, after=-1) == [1, 5, 7]
    assert steps(reg, after=7) == []


def test_step_order(reg):
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


def test_publish_older_step_without_require_newest(reg):
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


def test_tags(reg):
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


# -- tensor index and objects ------------------------------------------------------------------
def test_locate_tensors(reg):
    a, b, c, o1, o2 = D("a"), D("b"), D("c"), D("o1"), D("o2")
    publish(reg, 1, {a: TL(o1, 64), b: TL(o1, 80, 8)})
    assert reg.locate_tensors([a, b, c]) == {a: TL(o1, 64), b: TL(o1, 80, 8)}
    assert reg.locate_tensors([]) == {}
    publish(reg, 2, {a: TL(o2, 128)})  # the newest location wins
    assert reg.locate_tensors([a, b]) == {a: TL(o2, 128), b: TL(o1, 80, 8)}


def test_objects_referenced_and_forgotten(reg):
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


def test_publish_refuses_objects_no_longer_registered(reg):
    """Issue 25, item 7: GC on another host forgot an object between a commit's dedup lookup and its
    publish. The publish must fail (nothing of it visible) unless it registers the object again."""
    a, b, o1, o2 = D("a"), D("b"), D("o1"), D("o2")
    publish(reg, 1, {a: TL(o1, 64)})
    publish(reg, 2, {b: TL(o2, 64)})
    assert reg.remove_versions([1]) == [1]
    reg.forget_objects({o1})  # another host's GC: o1 is referenced by no version
    version, manifest, placement = make(3, {a: TL(o1, 64), b: TL(o2, 64)})
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


def test_patch_records_live_as_long_as_both_versions(reg):
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


def test_object_sizes_looks_up_only_what_is_asked(reg):
    o1, o2 = D("o1"), D("o2")
    publish(reg, 1, {D("a"): TL(o1, 64), D("b"): TL(o2, 80)})
    assert reg.object_sizes([o2, D("unknown")]) == {o2: reg.objects()[o2]}
    assert reg.object_sizes([]) == {}
    assert reg.object_sizes([o1, o2]) == reg.objects()
    with pytest.raises(InvalidArgumentError):
        reg.object_sizes(["../../etc/passwd"])


def test_persisted_marks(reg):
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


# -- leases and removal ------------------------------------------------------------------------
def test_store_level_values_compare_and_set(reg):
    assert reg.get_meta("writer") is None
    assert reg.swap_meta("writer", None, "a") == "a"
    assert reg.swap_meta("writer", None, "b") == "a"  # already set: the current value comes back
    assert reg.swap_meta("writer", "x", "b") == "a"  # wrong expectation
    assert reg.swap_meta("writer", "a", "b") == "b"
    assert reg.get_meta("writer") == "b" and reg.get_meta("store_id") is None
    with pytest.raises(InvalidArgumentError):
        reg.get_meta("../etc")


def test_leases(opened):
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


def test_remove_versions_spares_latest_and_leased(reg):
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


def test_prune_and_lease_race(opened):
    """A lease and a removal of the same version, started together: exactly one wins, every round."""
    reader, pruner = opened(), opened()  # separate handles (for Redis, separate connections)
    barrier = threading.Barrier(2)
    wins: Counter = Counter()
    jitter = random.Random(0)

    def start(delay: float) -> None:  # a random head start for either side, so both orders occur
        barrier.wait()
        time.sleep(delay)

    def acquire(step: int, delay: float):
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


def test_lease_of_killed_holder_disappears(reg, spec):
    publish(reg, 1)
    publish(reg, 2)
    proc = child(spec, "lease", 1, 1.0)  # Redis: a 1 s TTL
    try:
        lease_id = proc.stdout.readline().strip()
        assert [lease.id for lease in reg.leases()] == [lease_id]
        if spec[0]:
            time.sleep(1.4)  # past its TTL: renewed by the holder's heartbeat
            assert [lease.id for lease in reg.leases()] == [lease_id]
        assert reg.remove_versions([1]) == []
    finally:
        proc.kill()
        proc.communicate()
    killed = time.monotonic()
    while reg.leases():  # LMDB: at once (the process is dead); Redis: when the TTL runs out
        assert time.monotonic() - killed < 3, "the dead holder's lease outlived its TTL"
        time.sleep(0.05)
    assert reg.remove_versions([1]) == [1]


# -- watches -----------------------------------------------------------------------------------
def test_watch_wakes_on_publish_from_another_process(reg, spec):
    publish(reg, 1)
    with reg.watch() as w:
        proc = child(spec, "publish", 2)
        assert w.wait(timeout=20)
        woke = time.monotonic()
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0
        before, after = map(float, out.split())
        assert before <= woke, "woke before the other process published"
        assert woke - after < 0.5, f"woke {woke - after:.3f} s after the publish returned"
        assert reg.latest_step() == 2


def test_watch_times_out_without_spinning(reg):
    with reg.watch() as w:
        t0, cpu0 = time.monotonic(), time.process_time()
        assert not w.wait(0.4)
        elapsed, cpu = time.monotonic() - t0, time.process_time() - cpu0
    assert 0.39 <= elapsed < 1.5 and cpu < 0.1, (elapsed, cpu)


def test_watch_wakes_on_every_change(reg):
    publish(reg, 1)
    publish(reg, 2)
    changes = [lambda: reg.set_tag("x", 1), lambda: reg.delete_tag("x"), lambda: reg.set_persisted(1, "s3://b"),
               lambda: reg.remove_versions([1]), lambda: publish(reg, 3)]
    for change in changes:
        with reg.watch() as w:
            change()
            assert w.wait(5)


def test_lease_watch_wakes_on_release(reg):
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


# -- fork --------------------------------------------------------------------------------------
def test_fork(opened, spec):
    """A forked child uses the registry on its own handle and leaves the parent's leases alone."""
    reg = opened(lease_ttl_s=1.0)
    publish(reg, 1)
    lease = reg.acquire_lease(1, "parent")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            assert steps(reg) == [1] and [x.id for x in reg.leases()] == [lease.id]
            publish(reg, 2)
            mine = reg.acquire_lease(2, "child")
            reg.release_lease(mine.id)
            if spec[0]:
                reg.release_lease(lease.id)  # the parent's: a child never releases it
            reg.close()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert reg.latest_step() == 2  # the parent's handle works after the child closed its own
    assert [x.id for x in reg.leases()] == [lease.id]
    if spec[0]:
        time.sleep(1.3)  # past the TTL: the parent's heartbeat still renews it
        assert [x.id for x in reg.leases()] == [lease.id]
    reg.release_lease(lease.id)


# -- peers -------------------------------------------------------------------------------------
def PEER(name: str, pid: int | None = None) -> Peer:
    """A peer named ``name`` (its id), of this process unless ``pid`` is given."""
    return Peer(name, f"10.0.0.{len(name)}:15012", f"host-{name}", pid or os.getpid(), 1.7e9)


def test_peers_announce_refresh_withdraw(opened):
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


def test_holders(opened):
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


def test_peer_arguments(reg, spec):
    with pytest.raises(InvalidArgumentError):
        reg.announce_objects("nobody", {D("o"): 1})  # not announced
    a = PEER("a")
    reg.announce_peer(a)
    for bad in ({"not-a-digest": 1}, {D("o").upper(): 1}, {D("o"): -1}, {D("o"): 1 << 64}, {D("o"): 1.5},
                {D("o"): True}, [D("o")]):
        with pytest.raises(InvalidArgumentError):
            reg.announce_objects(a.id, bad)
    for bad_peer in (a._replace(id=""), a._replace(id="a b"), a._replace(id="x" * 129), a._replace(pid=0),
                     a._replace(session=""), a._replace(host=None), tuple(a)):
        with pytest.raises(InvalidArgumentError):
            reg.announce_peer(bad_peer)
    for bad_digests in (D("o"), ["xyz"]):  # a single string is not a list of digests
        with pytest.raises(InvalidArgumentError):
            reg.holders(bad_digests)
        with pytest.raises(InvalidArgumentError):
            reg.withdraw_objects(a.id, bad_digests)
    with pytest.raises(InvalidArgumentError):
        reg.withdraw_peer("a/b")
    if not spec[0]:  # LMDB: the peer's process must run on this host
        gone = subprocess.Popen([sys.executable, "-c", ""])
        gone.wait()
        with pytest.raises(InvalidArgumentError):
            reg.announce_peer(PEER("gone", pid=gone.pid))
    assert reg.peers() == [a] and reg.holders([D("o")]) == {}  # nothing bad was written


def test_removal_leaves_announcements(reg):
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


def test_peer_of_killed_process_disappears(reg, spec):
    proc = child(spec, "peer", 1.0)  # Redis: a 1 s TTL
    try:
        peer_id = proc.stdout.readline().strip()
        [p] = reg.peers()
        assert p.id == peer_id and p.pid == proc.pid
        assert reg.holders([D("k1"), D("k2")]) == {D("k1"): [(p, 111)], D("k2"): [(p, 222)]}
    finally:
        proc.kill()
        proc.communicate()
    killed = time.monotonic()
    while reg.holders([D("k1"), D("k2")]):  # LMDB: at once (the process is dead); Redis: within the TTL
        assert spec[0], "LMDB: the dead peer was still listed on the next read"
        assert time.monotonic() - killed < 3, "the dead peer outlived its TTL"
        time.sleep(0.05)
    assert reg.peers() == []
    if spec[0]:  # nothing of it lingers in the database
        client = redis.Redis.from_url(spec[0])
        try:
            assert client.keys(f"ps:{{{spec[2]}}}:*") == []
        finally:
            client.close()


def test_peer_fork(opened, spec):
    """A forked child neither renews nor withdraws the peer its parent announced."""
    reg = opened(lease_ttl_s=1.0)
    parent = PEER("parent")
    reg.announce_peer(parent)
    reg.announce_objects(parent.id, {D("p"): 1})
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ready_r)
            os.close(go_w)
            assert reg.peers() == [parent]
            reg.withdraw_peer(parent.id)  # the parent's: a child never withdraws it
            mine = PEER("child", pid=os.getpid())
            reg.announce_peer(mine)  # (Redis: the child's own heartbeat runs from now on)
            reg.announce_objects(mine.id, {D("c"): 2})
            os.write(ready_w, b"r")
            os.read(go_r, 1)  # wait until the parent closes its end
            reg.close()  # withdraws the child's peer only
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(go_r)
    try:
        assert os.read(ready_r, 1) == b"r", "the child failed"
        kid = PEER("child", pid=pid)
        assert reg.peers() == [kid, parent]
        if spec[0]:
            time.sleep(1.3)  # past the TTL: each peer renewed by its own process
            assert reg.peers() == [kid, parent]
        reg.withdraw_peer(parent.id)
        if spec[0]:
            time.sleep(0.5)  # the child's heartbeat beats meanwhile: it must not bring the parent's back
        assert reg.peers() == [kid] and reg.holders([D("p"), D("c")]) == {D("c"): [(kid, 2)]}
    finally:
        os.close(go_w)
        os.close(ready_r)
        status = os.waitpid(pid, 0)[1]
    assert os.waitstatus_to_exitcode(status) == 0
    assert reg.peers() == []


# -- LMDB only ---------------------------------------------------------------------------------
def test_lmdb_store_from_before_peers_opens(tmp_path):
    """A store created before the peer databases existed opens; they are created on the way."""
    path = str(tmp_path / "meta")
    env = lmdb.open(path, max_dbs=8, subdir=True, create=True)
    for name in ("versions", "manifests", "tags", "tensors", "objects", "refs", "leases", "persisted"):
        env.open_db(name.encode())
    env.close()
    reg = LmdbRegistry(path)
    try:
        publish(reg, 1)
        reg.announce_peer(PEER("a"))
        reg.announce_objects("a", {D("o"): 1})
        assert reg.latest_step() == 1 and reg.holders([D("o")]) == {D("o"): [(PEER("a"), 1)]}
    finally:
        reg.close()


# -- Redis only: URLs, errors, namespaces ------------------------------------------------------
def test_open_registry(tmp_path, redis_url):
    lmdb_reg = open_registry(None, str(tmp_path / "meta"), "ns")
    redis_reg = open_registry(redis_url, str(tmp_path / "unused"), uuid.uuid4().hex)
    try:
        assert isinstance(lmdb_reg, LmdbRegistry) and isinstance(redis_reg, RedisRegistry)
    finally:
        lmdb_reg.close()
        redis_reg.close()
    for bad in ("http://127.0.0.1:6379/0", "127.0.0.1:6379", "unix:///tmp/redis.sock"):
        with pytest.raises(InvalidArgumentError):
            open_registry(bad, str(tmp_path / "meta"), "ns")
    for namespace in ("", "a{b}"):
        with pytest.raises(InvalidArgumentError):
            RedisRegistry(redis_url, namespace)


def test_unreachable_server_raises_registry_error():
    port = redis_server.free_port()
    with pytest.raises(RegistryError) as e:
        RedisRegistry(f"redis://:hunter2@127.0.0.1:{port}/0", "ns", connect_timeout_s=1)
    assert f"redis://:***@127.0.0.1:{port}/0" in str(e.value) and "hunter2" not in str(e.value)
    assert isinstance(e.value, ConnectionError)


@needs_server
def test_password_in_url_and_server_going_away():
    with redis_server.running(password=None) as bare, redis_server.running(password="s3cret") as url:
        with pytest.warns(ParamStoreWarning, match="no password"):  # open_registry warns for a bare URL
            open_registry(bare, "unused", "ns").close()
        url = url.replace(":s3cret@", "")
        with pytest.raises(RegistryError) as e:
            RedisRegistry(url.replace("redis://", "redis://:wrong@"), "ns")
        assert "wrong" not in str(e.value)
        reg = RedisRegistry(url.replace("redis://", "redis://:s3cret@"), "ns")
        publish(reg, 1)
        assert reg.latest_step() == 1
    with pytest.raises(RegistryError) as e:  # the server is gone
        reg.latest_step()
    assert "s3cret" not in str(e.value) and ":***@127.0.0.1" in str(e.value)
    reg.close()


def test_namespaces_are_separate(redis_url):
    a, b = RedisRegistry(redis_url, uuid.uuid4().hex), RedisRegistry(redis_url, uuid.uuid4().hex)
    try:
        with b.watch() as w:
            publish(a, 1, tags=("t",))
            lease = a.acquire_lease(1, "reader")
            assert not w.wait(0.1)
        assert (b.latest_step(), b.tags(), b.leases(), b.objects()) == (None, {}, [], {})
        a.release_lease(lease.id)
    finally:
        a.close()
        b.close()


def test_lapsed_peer_is_announced_again(redis_url):
    """A peer whose key expired while its process lives (a stall) comes back with its objects."""
    namespace = uuid.uuid4().hex
    reg, other = RedisRegistry(redis_url, namespace, lease_ttl_s=0.6), RedisRegistry(redis_url, namespace)
    client = redis.Redis.from_url(redis_url)
    try:
        a = PEER("a")
        reg.announce_peer(a)
        reg.announce_objects(a.id, {D("o1"): 1, D("o2"): 2})
        reg.withdraw_objects(a.id, [D("o2")])
        client.delete(f"ps:{{{namespace}}}:peer:{a.id}")  # as if it had expired
        assert other.peers() == [] and other.holders([D("o1")]) == {}  # and a reader dropped its objects

        def relisted() -> None:
            deadline = time.monotonic() + 3
            while not other.peers():
                assert time.monotonic() < deadline, "the heartbeat did not announce the lapsed peer again"
                time.sleep(0.05)

        with pytest.warns(RuntimeWarning, match="announced again"):
            relisted()
        assert other.holders([D("o1"), D("o2")]) == {D("o1"): [(a, 1)]}
    finally:
        client.close()
        reg.close()
        other.close()


# -- the other process -------------------------------------------------------------------------
def _child(spec_json: str, action: str, *args: str) -> None:
    """``publish STEP``: print the monotonic time before and after publishing it.
    ``lease STEP TTL``: take a lease (Redis TTL in seconds), print its id, and wait to be killed.
    ``peer TTL``: announce a peer of this process holding ``D("k1")`` at 111 and ``D("k2")`` at 222,
    print its id, and wait to be killed."""
    spec = json.loads(spec_json)
    ttl = {"lease": lambda: float(args[1]), "peer": lambda: float(args[0])}.get(action, lambda: TTL)()
    reg = open_spec(spec, lease_ttl_s=ttl)
    if action == "publish":
        before = time.monotonic()
        publish(reg, int(args[0]))
        print(before, time.monotonic(), flush=True)
    elif action == "lease":
        print(reg.acquire_lease(int(args[0]), "child").id, flush=True)
        time.sleep(60)
    elif action == "peer":
        peer = Peer(uuid.uuid4().hex, "127.0.0.1:15012", liveness.HOST, os.getpid(), time.time())
        reg.announce_peer(peer)
        reg.announce_objects(peer.id, {D("k1"): 111, D("k2"): 222})
        print(peer.id, flush=True)
        time.sleep(60)
    reg.close()


if __name__ == "__main__":
    _child(*sys.argv[1:])
