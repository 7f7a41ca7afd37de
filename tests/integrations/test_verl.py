"""The verl checkpoint-engine backend (``paramstore.integrations.verl``) with real verl: its config,
its worker classes, its ``CheckpointEngineManager`` over Ray with several trainer ranks and rollout
replicas, and the backend's own contract (staleness, re-sends, draining).

Runs in verl's environment, skipped where verl is not installed. That environment, built apart from
``.venv`` (verl pins its own transformers; paramstore's ``[dev]`` pins may fight it)::

    python3 -m venv .venv-verl
    .venv-verl/bin/pip install torch==2.13.0
    .venv-verl/bin/pip install verl==0.9.1 uvicorn fastapi
    .venv-verl/bin/pip install -e . pytest hypothesis 'redis>=5,<9'
    .venv-verl/bin/python -m pytest tests/integrations/test_verl.py

About 1.5 minutes on 2 cores, most of it verl's imports in the Ray workers. What is verl's code and what stands in for the parts that need an
accelerator (its FSDP training engine) or an inference server (vLLM/SGLang) is said in
``verl_cpu_workers.py``.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("verl", reason="verl is not installed: these tests run in verl's own environment "
                                   "(.venv-verl: see the module docstring)")

import torch
from helpers import assert_state_equal, bits_equal, random_tensor
from verl.checkpoint_engine import CheckpointEngineRegistry

import paramstore
from paramstore.errors import (
    InvalidArgumentError,
    InvalidTensorError,
    StepOrderError,
    WaitTimeoutError,
)
from paramstore.integrations import verl as pv

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _close_stores(shm_dir):
    """Each test's stores are closed after it (the backend caches them per process), before its
    directory is removed."""
    yield
    pv.close_stores()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(seed: int, n: int = 4) -> dict[str, torch.Tensor]:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    return {f"layers.{i}.weight": random_tensor(dtypes[i % len(dtypes)], (16, 8 + i), seed * 100 + i)
            for i in range(n)}


class Counted:
    """A weights generator that counts how many items were pulled (each is a collective in verl)."""

    def __init__(self, items):
        self.items, self.pulled = list(items), 0

    def __iter__(self):
        for item in self.items:
            self.pulled += 1
            yield item


def _engines(root: str, **kwargs):
    """A trainer master and a rollout engine, built as verl builds them (its registry, its arguments)."""
    trainer = CheckpointEngineRegistry.new("paramstore", is_master=True, bucket_size=1 << 20, root=root, **kwargs)
    rollout = CheckpointEngineRegistry.new("paramstore", bucket_size=1 << 20, root=root, **kwargs)
    return trainer, rollout


def _sync_send(trainer, weights, step=None):
    """The trainer's part of a verl sync: ``send_weights`` (which returns once the weights are staged),
    then ``finalize`` (which waits for the version to be published)."""
    metrics = asyncio.run(trainer.send_weights(weights, global_steps=step))
    trainer.finalize()
    return metrics


async def _receive(engine, step):
    return {name: t.clone() async for name, t in engine.receive_weights(step)}


# -- 1 and 2: verl's config and worker classes, in a fresh process -----------------------------
@pytest.fixture(scope="module")
def worker_paths_report(tmp_path_factory):
    """Run verl_worker_paths.py once (a fresh process: nothing imported the backend before verl does)."""
    import shutil
    import tempfile

    from helpers import SHM

    workdir = tempfile.mkdtemp(prefix="paramstore-verl-", dir=SHM)
    report = os.path.join(str(tmp_path_factory.mktemp("verl")), "report.json")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "verl_worker_paths.py"), workdir, report],
                              env=env, capture_output=True, text=True, timeout=240, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        with open(report) as f:
            yield json.load(f)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_backend_is_reached_through_verls_config(worker_paths_report):
    """The backend is reached only through verl's config (custom_backend_module) and built by verl's own
    code (CheckpointEngineManager, ActorRolloutRefWorker.init_model, CheckpointEngineWorker) with the
    arguments verl passes."""
    r = worker_paths_report
    assert not r["registered_before"] and not r["imported_before"]
    assert r["config"]["backend"] == "paramstore"
    assert r["config"]["custom_backend_module"] == "paramstore.integrations.verl"
    assert r["manager_backend_cls"] == "paramstore.integrations.verl.ParamStoreCheckpointEngine"
    kwargs = r["config"]["engine_kwargs"]["paramstore"]
    for role, is_master in (("trainer", True), ("rollout", False)):
        e = r["engines"][role]
        assert e["cls"] == "paramstore.integrations.verl.ParamStoreCheckpointEngine"
        assert e["is_master"] is is_master  # verl passes is_master=(rank == 0) on trainer ranks only
        assert e["bucket_size"] == r["config"]["bucket_bytes"]
        assert (e["root"], e["eta"], e["timeout"]) == (kwargs["root"], kwargs["eta"], kwargs["timeout"])


def test_sync_through_verls_worker_code(worker_paths_report):
    """ActorRolloutRefWorker.update_weights sends, CheckpointEngineWorker.update_weights receives: the
    rollout gets every tensor bit-equal, as the version of the global step, and finalize releases it."""
    for step, s in worker_paths_report["syncs"].items():
        step = int(step)
        assert s["names_equal"] and s["differ"] == [], s
        assert s["metrics"]["paramstore/step"] == step and s["metrics"]["paramstore/written"] == 1
        assert s["metrics"]["paramstore/tensors"] == 27 and s["metrics"]["paramstore/send_s"] > 0
        if step == 0:  # the first send: no version published before it
            assert "paramstore/bytes" not in s["metrics"]
        else:  # the previous send's version, published since (send_weights returns once staged)
            assert s["metrics"]["paramstore/published_step"] == step - 1 and s["metrics"]["paramstore/publish_s"] > 0
            assert 0 < s["metrics"]["paramstore/new_bytes"] <= s["metrics"]["paramstore/bytes"]
        assert s["rollout_global_steps"] == step and s["latest"] == step
        assert s["leased_during"] == [step] and s["leases_after"] == []
        assert s["installed_step"] == step and s["check_installed"] == []  # the adapter holds the version exactly


# -- 3: verl's CheckpointEngineManager over Ray --------------------------------------------------
@pytest.mark.slow
def test_manager_over_ray_two_trainer_ranks_two_replicas(shm_dir):
    """verl's CheckpointEngineManager syncs 2 trainer ranks (FSDP2-sharded, every tensor gathered
    collectively) to 2 rollout replicas over Ray for 3 steps: bit-equal, version == global step,
    only changed tensors stored anew, no lease left."""
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl_cpu_workers import backend_overrides, compose_config, make_tiny_model, start_ray, start_workers

    model, root = os.path.join(shm_dir, "model"), os.path.join(shm_dir, "store")
    make_tiny_model(model)
    cfg = compose_config(model, backend_overrides(root, eta=0, timeout=30, keep_last=None, follow=True))
    start_ray(num_cpus=8)
    try:
        actor_wg, rollout_wg, replicas, ce_config = start_workers(cfg, trainers=2, replicas=2)

        async def run() -> list[tuple[int, dict, dict, list]]:
            await asyncio.gather(*[r.init_hybrid(rollout_wg) for r in replicas])
            assert [len(r.workers) for r in replicas] == [1, 1]
            manager = CheckpointEngineManager(config=ce_config, actor_wg=actor_wg, replicas=replicas)
            out = []
            for step in (1, 2, 3):
                actor_wg.train_step(step, ("embed_tokens",))  # an optimizer step; the embedding is frozen
                want = actor_wg.full_state()[0]
                metrics = await manager.update_weights(step)
                out.append((step, metrics, want, rollout_wg.received()))

            # A commit that fails in the middle of the stream (the master's 3rd tensor is refused):
            # the master drains the rest, so rank 1's gathers complete; the error reaches the controller.
            actor_wg.train_step(4)
            actor_wg.poison("model.layers.0.self_attn.q_proj.weight")
            with pytest.raises(ray.exceptions.RayTaskError, match="only dense tensors"):
                await manager.update_weights(4)
            actor_wg.poison(None)
            # Nothing was published for step 4; re-sending step 3 (as after a resume) writes nothing,
            # and the rollouts (eta 0, min step 3) get step 3 again.
            resent = await manager.update_weights(3)
            out.append((3, resent, out[-1][2], rollout_wg.received()))
            return out

        faulthandler.dump_traceback_later(400, exit=True)  # a hung collective must not hang the suite
        try:
            results = asyncio.run(run())
        finally:
            faulthandler.cancel_dump_traceback_later()
    finally:
        ray.shutdown()

    embed = "model.embed_tokens.weight"
    with paramstore.ParamStore(root) as store:
        for i, (step, metrics, want, received) in enumerate(results[:3]):
            total = sum(t.nbytes for t in want.values())
            assert metrics["paramstore/step"] == step and metrics["paramstore/written"] == 1
            assert metrics["paramstore/tensors"] == len(want)
            if step > 1:  # the previous step's version, published since its send returned
                assert metrics["paramstore/published_step"] == step - 1 and metrics["paramstore/bytes"] == total
            if step > 2:  # everything changed but the frozen embedding, which is deduplicated
                assert metrics["paramstore/new_bytes"] == total - want[embed].nbytes
            assert len(received) == 2  # one per replica
            for global_steps, updates, got in received:
                assert (global_steps, updates) == (step, i + 1)
                assert_state_equal(got, want)
            with store.checkout(step) as snap:
                assert_state_equal(snap, want)
        step, metrics, want, received = results[3]
        assert (metrics["paramstore/step"], metrics["paramstore/written"]) == (3, 0)
        assert "paramstore/published_step" not in metrics  # step 4 failed in its send: nothing to publish
        for global_steps, updates, got in received:  # the failed sync gave the rollouts nothing new
            assert (global_steps, updates) == (3, 4)
            assert_state_equal(got, want)
        assert [(v.step, v.metadata["verl_global_steps"]) for v in store.versions()] == [(1, 1), (2, 2), (3, 3)]
        assert store.leases() == []


# -- 4: staleness -------------------------------------------------------------------------------
def test_eta_1_returns_the_previous_step_at_once(shm_dir):
    root = os.path.join(shm_dir, "store")
    trainer, rollout = _engines(root, eta=1, timeout=30)
    w5 = _weights(5)
    metrics = _sync_send(trainer, iter(w5.items()), 5)
    assert metrics["paramstore/step"] == 5

    start = time.monotonic()
    got = asyncio.run(_receive(rollout, 6))  # the trainer is at step 6; 5 is within eta
    assert time.monotonic() - start < 5
    assert_state_equal(got, w5)
    store = trainer.store
    assert [lease.step for lease in store.leases()] == [5]  # held until finalize
    rollout.finalize()
    assert store.leases() == []
    # The prefetch of step 6 (started when step 5 was installed) waits for it; a receive for which
    # step 5 is still within the bound does not wait for that prefetch.
    assert rollout._next.min_step == 6 and not rollout._next.future.done()
    start = time.monotonic()
    assert_state_equal(asyncio.run(_receive(rollout, 6)), w5)
    assert time.monotonic() - start < 5 and rollout.installed_step == 5
    rollout.finalize()


def test_a_rollout_receives_each_version_in_its_recipes_form(shm_dir):
    """``recipe``: the rollout receives the version as the recipe derives it (what an FP8 server
    loads), made by the trainer as it commits (the ParamStore option ``derive``), so the rollout
    derives nothing; the check compares with that form; ``recipe`` with ``follow`` is refused."""
    from paramstore import recipes

    root = os.path.join(shm_dir, "store")
    trainer, rollout = _engines(root, recipe="fp8-block128", derive=["fp8-block128"], timeout=30)  # verl: the same
    g = torch.Generator().manual_seed(4)
    w = {"model.layers.0.mlp.up_proj.weight": torch.randn(256, 384, generator=g).bfloat16(),
         "model.norm.weight": torch.ones(384).bfloat16()}
    _sync_send(trainer, iter(w.items()), 3)
    trainer.store.flush(timeout=60)  # ... its derivations done
    got = asyncio.run(_receive(rollout, 3))
    want = recipes.derive("fp8-block128", w)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    assert rollout._snapshot.derived.derived == 0  # the trainer made it
    assert rollout.check_installed(got) == []  # compared with the recipe's form
    got[next(iter(want))].view(torch.uint8)[0] ^= 1
    assert rollout.check_installed(got) == [next(iter(want))]
    rollout.finalize()
    with pytest.raises(InvalidArgumentError, match="recipe and follow"):
        CheckpointEngineRegistry.new("paramstore", bucket_size=1 << 20, root=root, recipe="fp8-block128", follow=True)
    with pytest.raises(InvalidArgumentError, match="unknown recipe"):
        CheckpointEngineRegistry.new("paramstore", bucket_size=1 << 20, root=root, recipe="fp3")


def test_eta_0_times_out_with_a_clear_error(shm_dir):
    root = os.path.join(shm_dir, "store")
    _, rollout = _engines(root, eta=0, timeout=0.5)  # nothing committed: not even a store yet
    start = time.monotonic()
    with pytest.raises(WaitTimeoutError) as e:
        asyncio.run(_receive(rollout, 1))
    assert 0.4 < time.monotonic() - start < 10
    msg = str(e.value)
    assert root in msg and "step >= 1" in msg and "global_steps 1 - eta 0" in msg and "0.5 s" in msg, msg

    trainer, rollout = _engines(root, eta=0, timeout=0.5)  # now step 5 exists, the rollout needs 6
    _sync_send(trainer, iter(_weights(5).items()), 5)
    with pytest.raises(WaitTimeoutError, match=r"step >= 6 .*latest: 5"):
        asyncio.run(_receive(rollout, 6))
    assert trainer.store.leases() == []


# -- 5: re-sends, draining, the rest of the contract ---------------------------------------------
def test_resending_a_committed_step_is_a_noop(shm_dir):
    root = os.path.join(shm_dir, "store")
    trainer, rollout = _engines(root)
    first, other = _weights(1), _weights(2)
    assert _sync_send(trainer, iter(first.items()), 3)["paramstore/written"] == 1
    before = trainer.store.get(3)

    again = Counted(other.items())
    metrics = _sync_send(trainer, iter(again), 3)
    assert again.pulled == len(other)  # drained all the same (each item is a collective in verl)
    assert metrics["paramstore/written"] == 0 and metrics["paramstore/step"] == 3
    assert metrics["paramstore/published_step"] == 3  # the first send's version, published since
    assert [v.step for v in trainer.store.versions()] == [3] and trainer.store.get(3) == before
    assert_state_equal(asyncio.run(_receive(rollout, 3)), first)


def test_a_step_below_the_latest_is_refused_after_draining(shm_dir):
    trainer, _ = _engines(os.path.join(shm_dir, "store"))
    _sync_send(trainer, iter(_weights(1).items()), 7)
    late = Counted(_weights(2).items())
    with pytest.raises(StepOrderError, match="fresh root"):
        _sync_send(trainer, iter(late), 5)
    assert late.pulled == len(late.items)


def test_a_failed_commit_still_drains_the_generator(shm_dir):
    """The master drains what its commit left unread, so the other ranks' gathers complete."""
    trainer, _ = _engines(os.path.join(shm_dir, "store"))
    w = _weights(1)
    items = Counted([("a", w["layers.0.weight"]), ("b", "not a tensor"), ("c", w["layers.1.weight"])])
    with pytest.raises(InvalidTensorError):
        _sync_send(trainer, iter(items), 1)
    assert items.pulled == 3
    assert _sync_send(trainer, iter(w.items()), 1)["paramstore/written"] == 1


def test_non_master_ranks_drain_and_return_nothing(shm_dir):
    root = os.path.join(shm_dir, "store")
    other_rank = CheckpointEngineRegistry.new("paramstore", is_master=False, bucket_size=1 << 20, root=root)
    items = Counted(_weights(1).items())
    assert asyncio.run(other_rank.send_weights(iter(items), global_steps=1)) == {}
    assert items.pulled == len(items.items)
    assert not os.path.exists(root)  # only the master writes (it creates the store)


def test_global_steps_none_and_get_weights(shm_dir):
    root = os.path.join(shm_dir, "store")
    trainer, rollout = _engines(root)
    w0, w1 = _weights(0), _weights(1)
    assert _sync_send(trainer, iter(w0.items()))["paramstore/step"] == 0  # empty store: step 0
    assert _sync_send(trainer, iter(w1.items()))["paramstore/step"] == 1  # then latest + 1
    assert_state_equal(asyncio.run(_receive(rollout, None)), w1)  # None: the newest there is

    async def cached():
        return {name: t.clone() async for name, t in rollout.get_weights()}

    assert_state_equal(asyncio.run(cached()), w1)
    assert [lease.step for lease in trainer.store.leases()] == [1]  # one lease: the previous one was released
    rollout.finalize()
    assert trainer.store.leases() == []


def test_new_bytes_counts_what_dedup_did_not_store(shm_dir):
    trainer, _ = _engines(os.path.join(shm_dir, "store"), keep_last=None)
    w = _weights(1)
    _sync_send(trainer, iter(w.items()), 1)
    w["layers.0.weight"] = w["layers.0.weight"] + 1  # one tensor changes
    first = _sync_send(trainer, iter(w.items()), 2)  # reports step 1, published
    second = _sync_send(trainer, iter(w.items()), 2)  # a re-send: reports step 2
    assert first["paramstore/published_step"] == 1 and second["paramstore/published_step"] == 2
    assert first["paramstore/new_bytes"] == first["paramstore/bytes"] == sum(t.nbytes for t in w.values())
    assert second["paramstore/bytes"] == first["paramstore/bytes"]
    assert second["paramstore/new_bytes"] == w["layers.0.weight"].nbytes


def test_dtype_option_casts_while_storing(shm_dir):
    trainer, rollout = _engines(os.path.join(shm_dir, "store"), dtype="bfloat16")
    w = {"w": torch.randn(8, 8), "ids": torch.arange(4)}
    _sync_send(trainer, iter(w.items()), 1)
    got = asyncio.run(_receive(rollout, 1))
    assert_state_equal(got, {"w": w["w"].to(torch.bfloat16), "ids": w["ids"]})


def test_bad_arguments_are_refused_clearly(shm_dir):
    root = os.path.join(shm_dir, "store")
    with pytest.raises(InvalidArgumentError, match="unknown engine_kwargs.paramstore option.*'bogus'.*shard_size_bytes"):
        CheckpointEngineRegistry.new("paramstore", bucket_size=1, root=root, bogus=1)
    with pytest.raises(InvalidArgumentError, match="needs a store root"):
        CheckpointEngineRegistry.new("paramstore", bucket_size=1)
    for bad in ({"eta": -1}, {"eta": 1.5}, {"timeout": "soon"}, {"keep_last": 0}, {"dtype": "int8"}, {"follow": "yes"},
                {"registry": "redis://127.0.0.1:1/0"}):
        with pytest.raises(InvalidArgumentError):
            CheckpointEngineRegistry.new("paramstore", bucket_size=1, root=root, **bad)
    # ParamStore options pass through
    e = CheckpointEngineRegistry.new("paramstore", bucket_size=1, root=root, shard_size_bytes=1 << 20)
    assert e.store.root == os.path.abspath(root)


def test_build_topology_checks_that_workers_meet_in_one_store(shm_dir):
    root = os.path.join(shm_dir, "store")
    cls = pv.ParamStoreCheckpointEngine
    master = cls(1, is_master=True, root=root).prepare()
    rank1 = cls(1, is_master=False, root=root).prepare()
    rollout = cls(1, root=root).prepare()
    t, r = cls.build_topology(2, 2, [master, rank1, rollout, rollout])
    assert t == {"rank": [0, 1]} and r == {"rank": [0, 1]}
    with pytest.raises(InvalidArgumentError, match="exactly one trainer rank"):
        cls.build_topology(2, 1, [rank1, rank1, rollout])
    elsewhere = cls(1, root=os.path.join(shm_dir, "other")).prepare()
    with pytest.raises(InvalidArgumentError, match="same root"):
        cls.build_topology(1, 2, [master, rollout, elsewhere])
    other_host = dict(rollout, boot_id="another-kernel", host="h2")
    with pytest.raises(InvalidArgumentError, match="registry=redis"):
        cls.build_topology(1, 1, [master, other_host])


# -- 6: prefetch (issue 28): the next version comes while the rollout generates ------------------
def test_the_next_version_is_prefetched_and_the_next_receive_moves_nothing(redis_url, shm_dir, tmp_path):
    """Trainer and rollout on two "hosts" (two roots, a shared Redis registry, a remote): the first
    receive fetches its bytes; once it is installed the rollout prefetches the next step in the
    background, so the second receive's checkout moves nothing."""
    name = f"verl-prefetch-{os.getpid()}-{time.time()}"
    common = dict(registry=redis_url, name=name, remote=f"file://{tmp_path}/bucket",
                  storage_options={"auto_mkdir": True}, keep_last=None, eta=0, timeout=60)
    trainer = CheckpointEngineRegistry.new("paramstore", is_master=True, bucket_size=1 << 20,
                                           root=os.path.join(shm_dir, "h1"), **common)
    rollout = CheckpointEngineRegistry.new("paramstore", bucket_size=1 << 20, root=os.path.join(shm_dir, "h2"),
                                           **common)
    wa, wb = _weights(1), _weights(2)
    _sync_send(trainer, iter(wa.items()), 1)
    trainer.store.wait_persisted(timeout=60)

    assert_state_equal(asyncio.run(_receive(rollout, 1)), wa)
    assert rollout.installed_step == 1 and rollout.last_fetch.moved  # step 1's bytes came from the remote
    rollout.finalize()
    assert rollout._next.min_step == 2 and not rollout._next.future.done()  # waiting for step 2

    # Step 2 is published before it reaches the remote (a commit uploads after it publishes): the
    # prefetch tries again until the remote holds it.
    _sync_send(trainer, iter(wb.items()), 2)
    assert rollout._next.future.result(60).step == 2  # brought here in the background
    assert all(rollout.store._root.tier.exists(o) for o in trainer.store.manifest(2).objects())

    assert_state_equal(asyncio.run(_receive(rollout, 2)), wb)
    fetch = rollout.last_fetch
    assert fetch.step == 2 and not fetch.moved and fetch.bytes == 0, fetch
    assert rollout.installed_step == 2 and rollout._next.min_step == 3
    rollout.finalize()
    assert trainer.store.leases() == []


# -- 7: installed equals committed (issue 28) -----------------------------------------------------
class FusedModel(torch.nn.Module):
    """An inference engine's copy of the policy: q and k fused into one parameter, names prefixed."""

    def __init__(self) -> None:
        super().__init__()
        self.qk_proj = torch.nn.Parameter(torch.zeros(8, 8))
        self.o_proj = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16))
        self.norm = torch.nn.Parameter(torch.zeros(8))


#: The loader's name mapping: the version's name -> the engine's name, or (name, where in it).
LOADER_NAMES = {"q.weight": ("qk_proj", slice(0, 4)), "k.weight": ("qk_proj", slice(4, 8)),
                "o.weight": "o_proj", "norm.weight": "norm"}


async def _install(engine, model, step):
    """As a server adapter does: every received tensor copied into the engine's parameters."""
    params = dict(model.named_parameters())
    async for name, t in engine.receive_weights(step):
        key, where = LOADER_NAMES[name] if isinstance(LOADER_NAMES[name], tuple) else (LOADER_NAMES[name], slice(None))
        with torch.no_grad():
            params[key][where].copy_(t)


def _policy(seed: int, norm: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"q.weight": torch.randn(4, 8, generator=g), "k.weight": torch.randn(4, 8, generator=g),
            "o.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
            "norm.weight": torch.randn(8, generator=g) if norm is None else norm}


def test_check_installed_finds_corruption_and_one_update_restores_every_bit(shm_dir):
    trainer, rollout = _engines(os.path.join(shm_dir, "store"), keep_last=None)
    model = FusedModel()
    with pytest.raises(InvalidArgumentError, match="installed no version"):
        rollout.check_installed(model)
    w1 = _policy(1)
    _sync_send(trainer, iter(w1.items()), 1)
    asyncio.run(_install(rollout, model, 1))
    rollout.finalize()
    assert rollout.installed_step == 1
    assert rollout.check_installed(model, rename=LOADER_NAMES) == []
    assert rollout.check_installed(model) == sorted(w1)  # without the loader's names nothing matches

    with torch.no_grad():  # the rollout's weights go bad: one bit of the norm, one element of k in the fused qk
        model.norm.view(torch.int32)[3] ^= 1
        model.qk_proj[6, 2] += 1
    assert rollout.check_installed(model, rename=LOADER_NAMES) == ["k.weight", "norm.weight"]
    assert rollout.check_installed(dict(model.named_parameters()), rename=LOADER_NAMES.get) == ["k.weight", "norm.weight"]

    # Step 2 leaves the norm unchanged (deduplicated in the store): it is installed all the same.
    w2 = _policy(2, norm=w1["norm.weight"])
    _sync_send(trainer, iter(w2.items()), 2)

    async def partial():  # an install that stops after the first tensor
        gen = rollout.receive_weights(2)
        await gen.__anext__()
        await gen.aclose()

    asyncio.run(partial())
    assert rollout.installed_step == 1  # the reported version changes only after a complete install

    asyncio.run(_install(rollout, model, 2))
    rollout.finalize()
    assert rollout.installed_step == 2
    assert rollout.check_installed(model, rename=LOADER_NAMES) == []
    fused = torch.cat([w2["q.weight"], w2["k.weight"]])
    for have, want in ((model.qk_proj, fused), (model.o_proj, w2["o.weight"]), (model.norm, w2["norm.weight"])):
        assert torch.equal(have.detach().view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
    assert rollout.check_installed(model, rename=LOADER_NAMES, step=1) == ["k.weight", "o.weight", "q.weight"]
    assert trainer.store.leases() == []


# -- 6: the rollout installs the commit as the trainer stages it ---------------------------------
def _send_in_thread(trainer, items, step):
    """The trainer's send on a thread of its own (its streaming commit pulls on its loop's thread)."""
    box = {}

    def run():
        try:
            box["metrics"] = _sync_send(trainer, iter(items), step)
        except Exception as e:  # noqa: BLE001 - examined by the test
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


async def _install_copies(engine, step, into):
    """Install as an engine does: copy each received tensor into weights it keeps."""
    async for name, t in engine.receive_weights(step):
        into.setdefault(name, torch.zeros_like(t)).copy_(t)


def _slowly(items, delay=0.05, fail_at=None):
    for i, item in enumerate(items):
        if i == fail_at:
            yield ("broken", "not a tensor")  # the commit refuses it: it fails in the middle of the stream
        time.sleep(delay)
        yield item


def test_the_rollout_installs_as_the_trainer_stages(shm_dir):
    root = os.path.join(shm_dir, "store")
    trainer, rollout = _engines(root, eta=0, timeout=60, follow=True)
    engine: dict[str, torch.Tensor] = {}
    w1, w2 = _weights(1, n=6), _weights(2, n=6)
    thread, box = _send_in_thread(trainer, w1.items(), 1)
    asyncio.run(_install_copies(rollout, 1, engine))
    thread.join()
    assert box["metrics"]["paramstore/written"] == 1 and rollout.installed_step == 1
    assert_state_equal(engine, w1)
    rollout.finalize()

    thread, box = _send_in_thread(trainer, list(_slowly(w2.items())), 2)  # staged one by one
    thread.join(0)
    asyncio.run(_install_copies(rollout, 2, engine))
    thread.join()
    assert_state_equal(engine, w2)
    assert rollout.installed_step == 2 and rollout.check_installed(engine) == []
    rollout.finalize()


def test_a_failed_commit_leaves_the_engine_on_its_previous_version(shm_dir):
    """The trainer's commit of step 2 fails after three tensors, which the rollout has installed
    meanwhile: it hands those back as they are in step 1, then raises; the engine holds step 1
    bit for bit and reports it."""
    root = os.path.join(shm_dir, "store")
    trainer, rollout = _engines(root, eta=0, timeout=60, follow=True)
    engine: dict[str, torch.Tensor] = {}
    w1, w2 = _weights(1, n=6), _weights(2, n=6)
    _sync_send(trainer, iter(w1.items()), 1)
    asyncio.run(_install_copies(rollout, 1, engine))
    rollout.finalize()

    copies = []  # (name, whether the bytes copied were step 2's) in the order the engine copied them

    async def install_logged():
        async for name, t in rollout.receive_weights(2):
            copies.append((name, bits_equal(t, w2[name])))
            engine[name].copy_(t)

    thread, box = _send_in_thread(trainer, _slowly(w2.items(), delay=0.1, fail_at=3), 2)
    with pytest.raises(paramstore.errors.VersionNotFoundError, match="step 2 was not installed.*holds step 1 again"):
        asyncio.run(install_logged())
    thread.join()
    assert isinstance(box["error"], InvalidTensorError)
    # Installed from the trainer's staging (step 2's bytes), then the same names restored from step 1.
    k = len(copies) // 2
    assert 1 <= k <= 3 and copies == [(n, True) for n in list(w2)[:k]] + [(n, False) for n in list(w2)[:k]]
    assert_state_equal(engine, w1)
    assert rollout.installed_step == 1 and rollout.check_installed(engine) == []
    assert trainer.store.latest().step == 1 and trainer.store.leases() == []
