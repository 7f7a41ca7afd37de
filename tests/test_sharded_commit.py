"""Sharded trainers: every rank commits its own blocks into one version (real spawned ranks, gloo).

The model (``ranks.LAYOUT``) mixes ``Shard(0)``, ``Shard(1)``, uneven shards, a rank holding
nothing, ``Replicate`` and a 2-D mesh (``Shard`` on both dims, ``Shard`` + ``Replicate``, two mesh
dims sharding one tensor dim), plus plain tensors. Every check compares bits with the whole
tensors, which any process can rebuild from the seed.
"""

from __future__ import annotations

import os
import signal
import struct
import time
import uuid
import weakref

import pytest
import torch

import paramstore
from paramstore import ParamStore
from paramstore.errors import CommitGroupError, InvalidTensorError

from helpers import assert_bits_equal
from ranks import LAYOUT, PLAIN, full_model, full_tensor, run_ranks, sharded_model


# -- what the ranks run (module level: spawned processes import it) ----------------------------
def _commit(rank: int, world: int, root: str, step: int, seed: int, registry: str | None = None,
            name: str | None = None, remote: tuple[str, dict] | None = None) -> dict:
    url, options = remote or (None, None)
    store = ParamStore(root, registry=registry, name=name, remote=url, storage_options=options)
    if registry is not None:
        store.serve("127.0.0.1")  # this "host" serves its blocks to the others
    try:
        handle = store.commit(step, sharded_model(world, seed), metrics={"loss": 0.5 + rank}, tags=["last"])
        v = handle.result(timeout=60)
        if handle.persisted is not None:  # the lead pushes, after fetching the other host's blocks
            handle.persisted.result(timeout=60)
        if registry is not None:  # stay up until every host has checked out (the parent says when)
            while not os.path.exists(os.path.join(root, "..", "done")):
                time.sleep(0.1)
        return {"digest": v.digest, "step": v.step, "metrics": dict(v.metrics), "tags": list(v.tags)}
    finally:
        store.close()


def _checkout_whole(rank: int, world: int, root: str, step: int, seed: int, committers: int,
                    registry: str | None = None, name: str | None = None) -> dict:
    """In another process: every tensor whole (as ``committers`` ranks committed it), compared bit for bit."""
    with ParamStore(root, registry=registry, name=name) as store, store.checkout(step) as snap:
        want = full_model(seed, committers)
        assert sorted(snap) == sorted(want)
        for n, t in want.items():
            assert_bits_equal(snap[n], t, n)
        return {"moved": snap.fetch.bytes, "from_peers": len(snap.fetch.from_peers)}


def _killed_mid_commit(rank: int, world: int, root: str) -> dict:
    store = ParamStore(root)
    model = sharded_model(world, 7)

    def stream():
        for i, item in enumerate(model.items()):
            if rank == world - 1 and i == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-commit: some blocks staged, some not
            yield item

    t0 = time.monotonic()
    handle = store.commit(1, stream())
    try:
        handle.result(timeout=60)
    except CommitGroupError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    finally:
        store.close()
    return {"error": None}


def _disagree(rank: int, world: int, root: str) -> str:
    store = ParamStore(root)
    model = sharded_model(world, 3)
    if rank == 1:
        model["extra"] = torch.ones(3)
    try:
        store.commit(1, model).result(timeout=60)
    except CommitGroupError as e:
        return str(e)
    finally:
        store.close()
    return "published"


def _partial(rank: int, world: int, root: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    dt = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    with ParamStore(root) as store:
        try:
            store.commit(1, {"grad_like": dt})
        except InvalidTensorError as e:
            return str(e)
    return "accepted"


def _stream_with_group(rank: int, world: int, root: str) -> dict:
    """verl's trainer side: every rank drains a generator of whole (gathered) tensors."""
    import torch.distributed as dist

    drained = []

    def gathered():
        for name, t in full_model(11).items():
            drained.append(name)
            yield name, t.clone()

    with ParamStore(root) as store:
        v = store.commit(5, gathered(), group=dist.group.WORLD, dtype=torch.bfloat16).result(timeout=60)
    return {"digest": v.digest, "drained": len(drained)}


# -- tests -------------------------------------------------------------------------------------
def _data_bytes(root: str) -> int:
    """Bytes of tensor data in every object file (headers left out)."""
    total = 0
    for d, _, files in os.walk(os.path.join(root, "objects")):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
            total += os.path.getsize(os.path.join(d, f)) - 8 - n
    return total


def test_four_ranks_commit_one_version_each_storing_its_blocks(shm_dir):
    root = os.path.join(shm_dir, "store")
    got = run_ranks(4, _commit, root, 1, 1)
    assert len({r["digest"] for r in got.values()}) == 1  # every rank's future: the same version
    assert all(r["step"] == 1 and r["tags"] == ["last"] for r in got.values())
    assert {r["metrics"]["loss"] for r in got.values()} == {0.5}  # the lead's metrics

    with ParamStore(root) as store:
        assert [v.step for v in store.versions()] == [1]
        man = store.manifest(1)
        chunks = {n: len(e.chunks) for n, e in man.tensors.items()}
        assert chunks == {"embed.weight": 4, "layer.0.wq": 4, "layer.0.uneven": 4, "layer.0.tiny": 3,
                          "layer.0.norm": 0, "layer.1.grid": 4, "layer.1.rows": 2, "layer.1.same_dim": 4,
                          "step_count": 0, "rope.inv_freq": 0}
        assert [c.sizes for c in man.tensors["layer.0.uneven"].chunks] == [(2, 5), (2, 5), (2, 5), (1, 5)]
        model = full_model(1)
        assert store.get(1).nbytes == sum(t.nbytes for t in model.values())
    # Each block stored once: replicated blocks and plain tensors by one rank only, not 4 times.
    assert _data_bytes(root) == sum(t.nbytes for t in model.values())
    # Read back whole in another process, bit for bit.
    run_ranks(1, _checkout_whole, root, 1, 1, 4)


def test_the_same_weights_and_layout_give_the_same_digest_and_dedup(shm_dir):
    root = os.path.join(shm_dir, "store")
    first = run_ranks(2, _commit, root, 1, 4)[0]["digest"]
    stored = _data_bytes(root)
    second = run_ranks(2, _commit, root, 2, 4)[0]["digest"]
    assert first == second
    assert _data_bytes(root) == stored  # nothing stored again
    with ParamStore(root) as store:
        assert store.get(1).digest == store.get(2).digest


def test_a_rank_killed_mid_commit_leaves_no_version_and_gc_reclaims_its_space(shm_dir):
    root = os.path.join(shm_dir, "store")
    got = run_ranks(3, _killed_mid_commit, root, allow_missing=(2,), timeout=90)
    assert sorted(got) == [0, 1]
    for r in got.values():  # the survivors fail, quickly, saying what happened
        assert r["error"] is not None and "lost a member" in r["error"] and "Nothing was published" in r["error"]
        assert r["seconds"] < 30
    with ParamStore(root) as store:
        assert store.versions() == []
        report = store.gc()
        assert report.temporary_files  # the killed rank's slabs
        assert report.objects  # the survivors' objects, which no version references
    files = [f for d, _, fs in os.walk(os.path.join(root, "objects")) for f in fs]
    assert files == [] and os.listdir(os.path.join(root, "tmp")) == []
    # The next group commits the step that failed, normally.
    again = run_ranks(3, _commit, root, 1, 7)
    assert len({r["digest"] for r in again.values()}) == 1


def test_ranks_that_commit_different_names_fail_together(shm_dir):
    root = os.path.join(shm_dir, "store")
    got = run_ranks(2, _disagree, root)
    assert got[0] == got[1] != "published"
    assert "'extra'" in got[0] and "same names" in got[0]
    with ParamStore(root, create=False) as store:
        assert store.versions() == []


def test_a_partial_placement_is_refused_with_what_to_do(shm_dir):
    got = run_ranks(2, _partial, os.path.join(shm_dir, "store"))
    assert all("Partial" in m and "redistribute" in m for m in got.values())


def test_plain_tensors_streamed_by_a_group_are_written_once(shm_dir):
    root = os.path.join(shm_dir, "store")
    got = run_ranks(2, _stream_with_group, root)
    assert got[0]["digest"] == got[1]["digest"]
    assert got[0]["drained"] == got[1]["drained"] == len(LAYOUT) + len(PLAIN)  # every rank drains it
    want = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in full_model(11).items()}
    assert _data_bytes(root) == sum(t.nbytes for t in want.values())
    with ParamStore(root) as store, store.checkout(5) as snap:
        for n, t in want.items():
            assert_bits_equal(snap[n], t, n)


def test_ranks_on_two_hosts_commit_one_version_a_third_host_checks_out(shm_dir, redis_url, s3_remote):
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda and libibverbs1")
    import threading

    name = f"sharded-{uuid.uuid4().hex[:8]}"
    hosts = [os.path.join(shm_dir, f"host{i}", "store") for i in range(3)]
    for h in hosts:
        os.makedirs(os.path.dirname(h))
    result: dict = {}

    def trainer() -> None:
        try:
            result["ranks"] = run_ranks(2, _commit_on_own_host, hosts, redis_url, name, s3_remote, timeout=120)
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=trainer)
    t.start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            with ParamStore(hosts[2], registry=redis_url, name=name) as probe:
                if probe.latest() is not None:
                    break
            time.sleep(0.2)
        got = run_ranks(1, _checkout_whole, hosts[2], 1, 2, 2, redis_url, name)[0]
    finally:
        for h in hosts[:2]:
            open(os.path.join(os.path.dirname(h), "done"), "w").close()
        t.join(60)
    assert "error" not in result, result.get("error")
    assert len({r["digest"] for r in result["ranks"].values()}) == 1
    assert got["from_peers"] >= 2  # blocks of both hosts came over the transfer engine
    with ParamStore(hosts[0], registry=redis_url, name=name) as store:
        objects = store.manifest(1).objects()
    assert _has_some(hosts[1], objects)  # host 1 stored its own blocks only
    assert objects <= _files(hosts[0])  # the lead fetched host 1's blocks to push the whole version
    # The remote got the whole version: a store of its own restores it bit for bit.
    with ParamStore(os.path.join(shm_dir, "restored"), remote=s3_remote[0], storage_options=s3_remote[1]) as store, \
            store.checkout(1) as snap:
        assert snap.fetch.from_remote
        for n, t in full_model(2, 2).items():
            assert_bits_equal(snap[n], t, n)


def _commit_on_own_host(rank: int, world: int, hosts: list[str], registry: str, name: str,
                        remote: tuple[str, dict]) -> dict:
    return _commit(rank, world, hosts[rank], 1, 2, registry, name, remote)


def _files(root: str) -> set[str]:
    return {f.split(".")[0] for d, _, fs in os.walk(os.path.join(root, "objects")) for f in fs}


def _has_some(root: str, objects: set[str]) -> bool:
    files = _files(root)
    return bool(files & objects) and not objects <= files


def test_a_streaming_commit_holds_at_most_a_couple_of_tensors(store):
    alive: list[weakref.ref] = []
    most = 0

    def weights(seed: int):
        nonlocal most
        for i in range(12):
            t = torch.full((256, 64), float(i + seed))  # fresh each time, like a gathered tensor
            alive.append(weakref.ref(t))
            most = max(most, sum(r() is not None for r in alive))
            yield f"layer.{i}.weight", t
            del t
        gone = [r() is None for r in alive[-12:]]
        assert all(gone[:-1]), gone  # also the first one: nothing keeps a tensor once it is copied

    v1 = store.commit(1, weights(0), dtype=torch.bfloat16).result()
    assert most <= 2, most
    assert v1.nbytes == 12 * 256 * 64 * 2  # cast to bf16 while copying
    # Step 1 left a layout (one shard) whose buffers are prepared ahead: none is faulted on step 2's path.
    deadline = time.monotonic() + 10
    while not store._pool._want and time.monotonic() < deadline:  # asked for after `committed` resolves
        time.sleep(0.02)
    assert store._write._get_committer().wait_prepared(30)
    faulted = store._pool.stats["on_the_spot"]
    v2 = store.commit(2, weights(100), dtype=torch.bfloat16).result()
    assert store._pool.stats["on_the_spot"] == faulted
    with store.checkout(2) as snap:
        for i in range(12):
            assert torch.equal(snap[f"layer.{i}.weight"].float(), torch.full((256, 64), float(i + 100)))
        assert len(snap.manifest.objects()) == 1
    with store.checkout(1) as snap:
        assert snap["layer.3.weight"].dtype == torch.bfloat16
        assert torch.equal(snap["layer.3.weight"].float(), torch.full((256, 64), 3.0))
    assert most <= 2, most


def test_the_sharded_example_runs_under_torchrun(shm_dir):
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "sharded.py")
    out = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", example, os.path.join(shm_dir, "ex")],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 1:" in out.stdout and "'embed.weight': 2" in out.stdout


def _one_rank_refused(rank: int, world: int, root: str) -> dict:
    """Rank 1 gives a step below the latest (refused at once, on its thread); the others' commit of
    that step must fail too, quickly, and the next step must work on every rank."""
    out = {}
    with ParamStore(root) as store:
        store_model = sharded_model(world, 5)
        store.commit(3, store_model).result(timeout=60)
        t0 = time.monotonic()
        try:
            store.commit(2 if rank == 1 else 4, store_model).result(timeout=60)
            out["bad"] = "published"
        except paramstore.ParamStoreError as e:
            out["bad"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - t0
        out["next"] = store.commit(5, store_model).result(timeout=60).step
    return out


def test_a_commit_refused_on_one_rank_fails_on_all_and_the_next_step_works(shm_dir):
    got = run_ranks(3, _one_rank_refused, os.path.join(shm_dir, "store"))
    assert got[1]["bad"].startswith("StepOrderError")
    for r in (0, 2):
        assert got[r]["bad"].startswith("CommitGroupError") and "StepOrderError" in got[r]["bad"], got[r]
        assert got[r]["seconds"] < 30
    assert all(g["next"] == 5 for g in got.values())


def _late_once(rank: int, world: int, root: str) -> dict:
    """group_timeout=3 and rank 1 arrives 5 s late for step 2: step 2 fails on both; the broken
    group is replaced and step 3 works. Also a NaN metric on one rank only (step 4): refused there,
    and the others fail step 4 too, instead of drifting out of step."""
    out = {}
    with ParamStore(root, group_timeout=3) as store:
        model = sharded_model(world, 9)
        store.commit(1, model).result(timeout=60)
        if rank == 1:
            time.sleep(5)
        try:
            store.commit(2, model).result(timeout=60)
            out[2] = "published"
        except CommitGroupError as e:
            out[2] = str(e)
        out[3] = store.commit(3, model).result(timeout=60).step
        try:
            store.commit(4, model, metrics={"loss": float("nan") if rank == 1 else 1.0}).result(timeout=60)
            out[4] = "published"
        except paramstore.ParamStoreError as e:
            out[4] = type(e).__name__
        out[5] = store.commit(5, model).result(timeout=60).step
    return out


def test_a_timed_out_group_is_replaced_and_a_rank_local_error_keeps_ranks_in_step(shm_dir):
    root = os.path.join(shm_dir, "store")
    got = run_ranks(2, _late_once, root, timeout=120)
    assert all(g[2] != "published" and "lost a member" in g[2] for g in got.values()), got
    assert [g[3] for g in got.values()] == [3, 3]
    assert got[0][4] == "CommitGroupError" and got[1][4] == "InvalidArgumentError"
    assert [g[5] for g in got.values()] == [5, 5]
    with ParamStore(root) as store:
        assert [v.step for v in store.versions()] == [1, 3, 5]


def _dies_after_the_exchange(rank: int, world: int, root: str) -> dict:
    import paramstore.sharded

    if rank == 1:  # dies right after the parts were exchanged, before it hears the outcome
        paramstore.sharded.CommitGroup.broadcast = lambda self, data: os._exit(0)
    store = ParamStore(root)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        v = store.commit(1, sharded_model(world, 2)).result(timeout=60)
    store.close()
    return {"step": v.step, "warned": any("not every rank could be told" in str(w.message) for w in caught)}


def test_the_lead_keeps_a_published_version_when_a_rank_dies_before_hearing_of_it(shm_dir):
    root = os.path.join(shm_dir, "store")
    got = run_ranks(2, _dies_after_the_exchange, root, allow_missing=(1,))
    assert got[0] == {"step": 1, "warned": True}
    with ParamStore(root) as store:
        assert store.latest().step == 1
