"""Prune and garbage collection: what they remove, what they must never remove, against real processes.

The main test is the reader/pruner race: readers in four processes check out "latest" over and over
while a trainer process commits 300 versions with ``retention=KeepLast(2)`` (prune + GC in the
background after each commit). Every version's contents are a pure function of its step
(:func:`state_for`), so readers check every bit without talking to the trainer. Tensors are small
and shards are 2 KiB, so each version has several objects, some shared with older versions (a
tensor that never changes, one that changes every tenth step): GC must keep an old object as long
as any surviving version points into it.

Crashes are real: a committing child process is SIGKILLed in the middle of a commit (while the test
holds the registry's write lock, so the child has renamed its new objects into ``objects/`` but
cannot register them) and GC must then reclaim exactly its leftovers.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback
import warnings

import pytest
import torch

from helpers import assert_bits_equal, assert_checkout_equal, gather_and_join, objects_bytes, random_tensor, tree

from paramstore import ParamStore, VersionNotFoundError
from paramstore.errors import TagNotFoundError
from paramstore.liveness import this_process
from paramstore.ops import verify
from paramstore.retention import AnyOf, KeepEvery, KeepLast, KeepTagged, Policy

SPAWN = mp.get_context("spawn")
SHARD = 2048
NUM_COMMITS = 300
NUM_READERS = 4
_VARYING = [(torch.float32, (8, 16)), (torch.bfloat16, (300,)), (torch.int64, (40,)), (torch.uint8, (700,))]


def state_for(step: int) -> dict[str, torch.Tensor]:
    """The model at ``step``: about 3 KiB in 7 tensors; random bits (NaNs included).

    ``const.*`` never change (deduplicated against step 1 forever), ``slow`` changes every tenth
    step, ``v*`` change at every step.
    """
    out = {
        "const.a": random_tensor(torch.float32, (96,), seed=11),
        "const.b": random_tensor(torch.int8, (300,), seed=12),
        "slow": random_tensor(torch.float16, (200,), seed=1_000_000 + step // 10),
    }
    for i, (dtype, shape) in enumerate(_VARYING):
        out[f"v{i}"] = random_tensor(dtype, shape, seed=10 * step + i)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


def wrong_tensors(snap, step: int) -> list[str]:
    want = state_for(step)
    if sorted(snap) != sorted(want):
        return [f"names {sorted(snap)}"]
    return [n for n, t in want.items() if not _same(snap[n], t)]


def assert_version(store: ParamStore, step: int) -> None:
    assert_checkout_equal(store, step, state_for(step))


def files(root: str) -> dict:
    """Every file under the store root with its bytes, except LMDB's lock file (a reader table)."""
    return {k: v for k, v in tree(root).items() if k != os.path.join("meta", "lock.mdb")}


def disk_objects(store: ParamStore) -> set[str]:
    return set(store._root.tier.list())


def referenced(store: ParamStore) -> set[str]:
    return store._root.registry.referenced_objects()


def cli(root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paramstore.cli", "--root", root, *args],
                          capture_output=True, text=True, timeout=120)


# -- children (module level: spawn imports them by name) ---------------------------------------
def trainer_main(root: str, n: int, results) -> None:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ParamStore(root, create=False, retention=KeepLast(2), shard_size_bytes=SHARD) as store:
                handles = []
                for step in range(1, n + 1):
                    handles.append(store.commit(step, state_for(step)))
                    if len(handles) > 2:
                        handles.pop(0).result(timeout=60)
                    time.sleep(0.002)  # a trainer does other work between commits
                store.flush(timeout=60)
                m = store._write.maintainer
                report = {"runs": m.runs, "last_error": repr(m.last_error) if m.last_error else None}
        report["warnings"] = [str(w.message) for w in caught]
        results.put(("trainer", report, None))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put(("trainer", None, traceback.format_exc()))


def reader_main(root: str, n: int, idx: int, results) -> None:
    verified: list[int] = []
    errors: list[str] = []
    wrong: list[str] = []
    checkouts = 0
    try:
        with ParamStore(root, create=False) as store:
            tier = store._root.tier
            store.wait_for(1, timeout=120)
            step = 0
            give_up = time.monotonic() + 120  # should the trainer die
            while step < n and len(errors) < 5 and time.monotonic() < give_up:
                checkouts += 1
                try:
                    snap = store.checkout("latest", holder=f"reader {idx}")
                except Exception:  # noqa: BLE001 - counted
                    errors.append(traceback.format_exc())
                    continue
                try:
                    step = snap.step
                    bad = wrong_tensors(snap, step)
                    if checkouts % 5 == idx % 5:  # hold this one a while: commits, prunes, GCs go on
                        time.sleep(0.02)
                        bad += wrong_tensors(snap, step)
                    missing = [o for o in snap.manifest.objects() if not tier.exists(o)]
                    if missing:
                        errors.append(f"step {step}: objects deleted while leased: {missing}")
                    if bad:
                        wrong.append(f"step {step}: {bad}")
                    if not verified or verified[-1] != step:
                        verified.append(step)
                finally:
                    snap.close()
                time.sleep(0.001)
        results.put((f"reader {idx}", {"verified": verified, "errors": errors, "wrong": wrong,
                                       "checkouts": checkouts}, None))
    except BaseException:  # noqa: BLE001
        results.put((f"reader {idx}", None, traceback.format_exc()))


def committer_main(root: str) -> None:
    """Commit versions latest+1, latest+2, ... until killed, two in flight."""
    store = ParamStore(root, create=False, shard_size_bytes=SHARD)
    latest = store.latest()
    step = (latest.step if latest else 0) + 1
    handles = []
    while True:
        handles.append(store.commit(step, state_for(step)))
        if len(handles) > 2:
            handles.pop(0).result()
        step += 1


def slab_owner_main(root: str, conn) -> None:
    """Open the store, commit step 1, report the slabs the pool prepared; commit step 2 on request."""
    try:
        with ParamStore(root, create=False) as store:
            store.commit(1, state_for(1)).result(timeout=60)
            tmp = os.path.join(store.root, "tmp")
            deadline = time.monotonic() + 30  # the publisher asks the pool for the next slabs after commit 1...
            while not os.listdir(tmp) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert store._pool.wait_prepared(30), "the pool did not finish preparing"  # ...and gets them all
            conn.send(("ok", sorted(os.listdir(tmp))))
            conn.recv()
            store.commit(2, state_for(2)).result(timeout=60)
            conn.send(("ok", sorted(os.listdir(tmp))))
            conn.recv()
    except BaseException:  # noqa: BLE001
        conn.send(("err", traceback.format_exc()))


# -- the race ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_readers_never_see_bad_bits_while_retention_prunes_and_collects(store_root):
    ParamStore(store_root, create=True).close()
    results = SPAWN.Queue()
    readers = [SPAWN.Process(target=reader_main, args=(store_root, NUM_COMMITS, i, results))
               for i in range(NUM_READERS)]
    trainer = SPAWN.Process(target=trainer_main, args=(store_root, NUM_COMMITS, results))
    procs = [*readers, trainer]
    for p in procs:
        p.start()
    reports = gather_and_join(
        procs, lambda: {name: (rep, err) for name, rep, err in (results.get(timeout=240) for _ in procs)})
    for name, (_, err) in reports.items():
        assert err is None, f"{name} failed:\n{err}"
    assert [p.exitcode for p in procs] == [0] * len(procs)

    trainer_report = reports["trainer"][0]
    assert trainer_report["last_error"] is None, trainer_report
    assert trainer_report["warnings"] == [], trainer_report
    assert trainer_report["runs"] > 0
    for i in range(NUM_READERS):
        rep = reports[f"reader {i}"][0]
        assert rep["errors"] == [], f"reader {i} read errors:\n" + "\n".join(rep["errors"])
        assert rep["wrong"] == [], f"reader {i} wrong bits: {rep['wrong'][:5]}"
        assert rep["verified"] == sorted(set(rep["verified"])), f"reader {i} went back in time"
        assert len(rep["verified"]) >= 20, f"reader {i} verified only {len(rep['verified'])} versions"
        assert rep["verified"][-1] == NUM_COMMITS

    with ParamStore(store_root, create=False) as store:
        steps = [v.step for v in store.versions()]
        assert steps[-1] == NUM_COMMITS
        # KeepLast(2), plus versions readers held at the last run, plus the last commit's run
        assert len(steps) <= 2 + NUM_READERS + 1, steps
        assert store.leases() == []
        for s in steps:
            assert_version(store, s)
        reg = store._root.registry
        refs = referenced(store)
        assert disk_objects(store) == refs, "objects on disk that no version references (or the reverse)"
        assert set(reg.objects()) == refs, "registered objects that no version references"
        assert os.listdir(os.path.join(store_root, "tmp")) == []
        report = verify(store._root, show_progress=False)
        assert report["ok"] and report["orphans"] == [] and report["leftovers"] == []


# -- crashes ----------------------------------------------------------------------------------
def test_gc_reclaims_what_a_killed_commit_left(store_root):
    ParamStore(store_root, create=True).close()
    child = SPAWN.Process(target=committer_main, args=(store_root,))
    child.start()
    try:
        with ParamStore(store_root, create=False) as store:
            reg, tier = store._root.registry, store._root.tier
            store.wait_for(3, timeout=120)
            # Freeze the registry: the child's next publish renames its objects into objects/ and
            # then waits for this write lock; kill it there.
            txn = reg.env.begin(write=True)
            try:
                registered = {bytes(k).hex() for k, _ in txn.cursor(db=reg._dbs["objects"])}
                prefix = f"slab-{child.pid}-"
                deadline = time.monotonic() + 60
                while not (set(tier.list()) - registered and any(f.startswith(prefix) for f in tier.leftovers())):
                    assert time.monotonic() < deadline and child.is_alive(), "the child never got stuck in a publish"
                    time.sleep(0.005)
                os.kill(child.pid, signal.SIGKILL)
                child.join(30)
            finally:
                txn.abort()
            assert child.exitcode == -signal.SIGKILL

            steps = [v.step for v in store.versions()]
            assert steps == list(range(1, len(steps) + 1))
            orphans = disk_objects(store) - referenced(store) - set(reg.objects())
            dead_slabs = {f for f in tier.leftovers() if f.startswith(prefix)}
            assert orphans and dead_slabs
            before = json.loads(cli(store_root, "verify", "--json").stdout)
            assert before["ok"] and set(before["orphans"]) == orphans and set(before["leftovers"]) == dead_slabs

            sizes = sum(tier.size(o) for o in orphans)
            report = store.gc()
            assert set(report.objects) == orphans
            assert report.bytes_freed == sizes
            assert set(report.temporary_files) == dead_slabs
            assert not any(tier.exists(o) for o in orphans)
            assert tier.leftovers() == []

            after = cli(store_root, "verify", "--json")
            r = json.loads(after.stdout)
            assert after.returncode == 0 and r["ok"] and r["orphans"] == [] and r["leftovers"] == [], r
            for s in steps:
                assert_version(store, s)
            # the store goes on: the step the killed commit never published is free
            nxt = steps[-1] + 1
            store.commit(nxt, state_for(nxt)).result(timeout=60)
            assert_version(store, nxt)
    finally:
        if child.is_alive():
            child.kill()
        child.join()


def test_gc_never_deletes_the_slabs_of_a_live_process(store_root):
    ParamStore(store_root, create=True).close()
    conn, child_conn = SPAWN.Pipe()
    owner = SPAWN.Process(target=slab_owner_main, args=(store_root, child_conn))
    owner.start()
    try:
        assert conn.poll(120), "slab owner did not start"
        status, slabs = conn.recv()
        assert status == "ok", slabs
        assert slabs and all(s.startswith(f"slab-{owner.pid}-") for s in slabs)
        tmp = os.path.join(store_root, "tmp")
        # a slab-like name whose owner is gone (this pid, another start time), and a foreign file
        pid, start = this_process()
        dead = f"slab-{pid}-{start + 1}-0"
        for name in (dead, "not-a-slab"):
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(b"x" * 100)
        with ParamStore(store_root, create=False) as store:
            report = store.gc()
            assert report.temporary_files == [dead]
            assert sorted(os.listdir(tmp)) == sorted([*slabs, "not-a-slab"])
            # and from another process, through the CLI
            r = json.loads(cli(store_root, "gc", "--json").stdout)
            assert r["temporary_files_deleted"] == [] and r["objects_deleted"] == 0
            assert set(slabs) <= set(os.listdir(tmp))
            conn.send("commit")  # the owner's next commit uses its pooled slab
            assert conn.poll(60)
            status, after = conn.recv()
            assert status == "ok", after
            assert_version(store, 1)
            assert_version(store, 2)
    finally:
        try:
            conn.send("exit")
        except OSError:
            pass
        owner.join(30)
        if owner.is_alive():
            owner.kill()
            owner.join()
    assert owner.exitcode == 0


_FORKED_CHILD_EXITS = textwrap.dedent("""
    import json, os, sys, time, torch
    from paramstore import ParamStore
    store = ParamStore(sys.argv[1])
    store.commit(1, {"w": torch.arange(256.0)}).result()
    tmp = os.path.join(store.root, "tmp")
    deadline = time.monotonic() + 30
    # the pool prepares the next commit's slab in the background: wait until it is in the pool
    while not (os.listdir(tmp) and any(store._pool._free.values())):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    slabs = sorted(os.listdir(tmp))
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a forked helper that exits normally: atexit handlers run in it
    os.waitpid(pid, 0)
    gone = [s for s in slabs if not os.path.exists(os.path.join(tmp, s))]
    try:
        committed = store.commit(2, {"w": torch.arange(256.0) + 1}).result(timeout=60).step == 2
    except Exception as e:
        committed = repr(e)
    store.close()
    print(json.dumps({"slabs": slabs, "gone": gone, "committed": committed}))
""")


def test_a_forked_child_exiting_leaves_the_parents_slabs_alone(store_root):
    proc = subprocess.run([sys.executable, "-c", _FORKED_CHILD_EXITS, store_root], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["slabs"]
    assert r["gone"] == [], f"the child deleted the parent's slabs {r['gone']}"
    assert r["committed"] is True, r["committed"]


# -- dry run, reasons, what prune keeps -------------------------------------------------------
def test_gc_dry_run_deletes_nothing(store_root):
    # no buffers prepared in the background: tmp/ changes only by what the test does
    with ParamStore(store_root, shard_size_bytes=SHARD, prepare_buffers=False) as store:
        for s in range(1, 6):
            store.commit(s, state_for(s)).result()
        assert store.prune(KeepLast(1)).removed == [1, 2, 3, 4]
        pid, start = this_process()
        dead = f"slab-{pid}-{start + 1}-0"  # this pid, but another process (another start time)
        with open(os.path.join(store_root, "tmp", dead), "wb") as f:
            f.write(b"\0" * 64)
        reg = store._root.registry
        before = (files(store_root), reg.objects(), reg.tags(), [v.step for v in store.versions()])
        dry = store.gc(dry_run=True)
        assert dry.dry_run and dry.objects and dry.temporary_files == [dead]
        assert dry.bytes_freed == sum(store._root.tier.size(o) for o in dry.objects) > 0
        assert set(dry.objects) == disk_objects(store) - referenced(store)
        assert (files(store_root), reg.objects(), reg.tags(), [v.step for v in store.versions()]) == before
        # dedup still finds the tensors of the objects a dry run would delete
        digests = [e.digest for e in reg.get_manifest(5).tensors.values()]
        assert set(reg.locate_tensors(digests)) == set(digests)
        total = objects_bytes(store_root)
        real = store.gc()
        assert (sorted(real.objects), real.bytes_freed, real.temporary_files) == \
            (sorted(dry.objects), dry.bytes_freed, dry.temporary_files)
        assert objects_bytes(store_root) == total - real.bytes_freed
        assert disk_objects(store) == referenced(store)
        assert store.gc().objects == []  # nothing left to do
        assert_version(store, 5)


def test_prune_reports_reasons(store_root):
    with ParamStore(store_root) as store:
        for s in range(1, 8):
            store.commit(s, state_for(s), tags=["release"] if s == 2 else ()).result()
        with store.checkout(3):
            r = store.prune(AnyOf(KeepLast(2), KeepEvery(5), KeepTagged("release")), dry_run=True)
            assert r.dry_run
            assert dict(r.kept) == {
                2: ["tagged release"],
                3: ["leased"],
                5: ["step divisible by 5"],
                6: ["one of the last 2"],
                7: ["one of the last 2", "latest"],
            }
            assert r.removed == [1, 4] and r.spared == []
            assert r.policy == "keep the last 2; keep every 5th step; keep versions tagged release"
            assert [v.step for v in store.versions()] == list(range(1, 8))  # dry run
            assert r.as_dict()["kept"]["3"] == ["leased"]
            real = store.prune(AnyOf(KeepLast(2), KeepEvery(5), KeepTagged("release")))
            assert real.removed == [1, 4] and not real.dry_run and real.kept == r.kept
            assert [v.step for v in store.versions()] == [2, 3, 5, 6, 7]


def test_prune_never_removes_the_latest_or_a_leased_version(store_root):
    with ParamStore(store_root) as store:
        for s in range(1, 6):
            store.commit(s, state_for(s)).result()
        a, b = store.checkout(1), store.checkout(3)
        r = store.prune(KeepLast(0))
        assert r.removed == [2, 4]
        assert dict(r.kept) == {1: ["leased"], 3: ["leased"], 5: ["latest"]}
        store.gc()
        assert [v.step for v in store.versions()] == [1, 3, 5]
        for s in (1, 3, 5):
            assert_version(store, s)
        assert wrong_tensors(a, 1) == [] and wrong_tensors(b, 3) == []
        a.close()
        b.close()
        r = store.prune(KeepLast(0))
        assert r.removed == [1, 3] and dict(r.kept) == {5: ["latest"]}
        store.gc()
        assert disk_objects(store) == referenced(store)
        assert_version(store, 5)
        # a store of one version: prune removes nothing
        assert store.prune(KeepLast(0)).removed == []
        with pytest.raises(VersionNotFoundError):
            store.checkout(3)  # pruned
        assert store.leases() == []


class LeaseWhileDeciding(Policy):
    """KeepLast(1) that, while prune is deciding, has a reader check out ``step`` (a lease that the
    lease list prune read before deciding does not show)."""

    def __init__(self, store: ParamStore, step: int) -> None:
        self.store, self.step, self.snaps = store, step, []

    def keep(self, versions, now):
        self.snaps.append(self.store.checkout(self.step, holder="late reader"))
        return KeepLast(1).keep(versions, now)

    def __str__(self) -> str:
        return "keep the last 1 (and lease meanwhile)"


def test_a_lease_taken_while_prune_decides_spares_the_version(store_root):
    with ParamStore(store_root) as store:
        for s in range(1, 5):
            store.commit(s, state_for(s)).result()
        policy = LeaseWhileDeciding(store, 2)
        r = store.prune(policy)
        assert r.removed == [1, 3] and r.spared == [2]
        assert [v.step for v in store.versions()] == [2, 4]
        store.gc()
        assert wrong_tensors(policy.snaps[0], 2) == []
        assert_version(store, 2)
        policy.snaps[0].close()
        assert store.prune(KeepLast(1)).removed == [2]


def test_tags_of_removed_versions_are_removed(store_root):
    with ParamStore(store_root) as store:
        store.commit(1, state_for(1), tags=["a"]).result()
        store.commit(2, state_for(2), tags=["b", "bb"]).result()
        store.commit(3, state_for(3)).result()
        store.tag(3, "c")
        store.tag(1, "also-1")
        assert store._root.registry.tags() == {"a": 1, "also-1": 1, "b": 2, "bb": 2, "c": 3}
        with store.checkout("b"):  # leased: kept with its tags
            assert store.prune(KeepLast(1)).removed == [1]
            assert store._root.registry.tags() == {"b": 2, "bb": 2, "c": 3}
        assert store.prune(KeepLast(1)).removed == [2]
        assert store._root.registry.tags() == {"c": 3}
        for gone in ("a", "also-1", "b", "bb"):
            with pytest.raises(TagNotFoundError):
                store.checkout(gone)
        assert store.get("c").tags == ("c",)
        # a removed version's tag name can be used again
        store.commit(4, state_for(4), tags=["a"]).result()
        assert store.get("a").step == 4


def test_dedup_after_gc_stores_a_collected_tensor_again(store_root):
    a = random_tensor(torch.float32, (300,), seed=1)
    b = random_tensor(torch.float32, (300,), seed=2)
    c = random_tensor(torch.int16, (50,), seed=3)
    with ParamStore(store_root, create=True) as store:
        reg, tier = store._root.registry, store._root.tier
        store.commit(1, {"x": a, "c": c}).result()
        store.commit(2, {"x": b}).result()
        e1 = reg.get_manifest(1).tensors
        da, obj_a = e1["x"].digest, e1["x"].object
        dc = e1["c"].digest
        assert store.prune(KeepLast(1)).removed == [1]
        assert set(reg.locate_tensors([da, dc])) == {da, dc}  # collected only by gc
        report = store.gc()
        assert obj_a in report.objects and not tier.exists(obj_a)
        assert reg.locate_tensors([da, dc]) == {}, "index entries still point into a collected object"
        store.commit(3, {"x": a, "y": b, "c": c}).result()
        e3 = reg.get_manifest(3).tensors
        assert e3["x"].digest == da and tier.exists(e3["x"].object) and tier.exists(e3["c"].object)
        assert e3["y"].object == reg.get_manifest(2).tensors["x"].object  # b is deduplicated
        assert set(reg.locate_tensors([da, dc])) == {da, dc}
        with store.checkout(3) as snap:
            assert_bits_equal(snap["x"], a, "x")
            assert_bits_equal(snap["y"], b, "y")
            assert_bits_equal(snap["c"], c, "c")
        assert verify(store._root, show_progress=False)["ok"]
        assert store.gc().objects == []


# -- background retention -------------------------------------------------------------------
class SlowKeepLast(Policy):
    """KeepLast(n) that takes a while to decide (a user policy, e.g. one that reads a dashboard)."""

    def __init__(self, n: int, delay: float) -> None:
        self.inner, self.delay = KeepLast(n), delay

    def keep(self, versions, now):
        time.sleep(self.delay)
        return self.inner.keep(versions, now)

    def __str__(self) -> str:
        return f"slowly, {self.inner}"


def test_background_retention_keeps_the_store_small(store_root):
    with ParamStore(store_root, retention=KeepLast(2)) as store:
        for s in range(1, 11):
            store.commit(s, state_for(s)).result()
            store._write.maintainer.wait_idle(10)
        assert [v.step for v in store.versions()][-2:] == [9, 10]
        assert len(store.versions()) <= 3
        assert store._write.maintainer.last_error is None


def test_close_runs_the_retention_the_last_commit_asked_for(store_root):
    with ParamStore(store_root, retention=SlowKeepLast(2, 0.3)) as store:
        for s in range(1, 6):
            store.commit(s, state_for(s))
    with ParamStore(store_root, create=False) as store:
        assert [v.step for v in store.versions()] == [4, 5]
        assert disk_objects(store) == referenced(store)
