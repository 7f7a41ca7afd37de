"""Run by test_verl.py in a fresh process: the paramstore backend reached only through verl's config,
built and driven by verl's own worker classes (no Ray), and a JSON report of what happened.

    python verl_worker_paths.py DIR REPORT.json

``DIR`` is an empty directory (the model and the store go there). The process plays one trainer
rank (world size 1; ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in the environment, as
Ray sets them for verl's workers) and one rollout worker; see verl_cpu_workers.py for what is verl's
code and what is not.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


def main(workdir: str, report_path: str) -> None:
    report: dict = {}
    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry

    # Nothing has imported the backend yet: only the config's custom_backend_module will.
    report["registered_before"] = "paramstore" in CheckpointEngineRegistry._registry
    report["imported_before"] = "paramstore.integrations.verl" in sys.modules

    from verl.utils.config import omega_conf_to_dataclass
    from verl_cpu_workers import (
        RolloutWorker,
        TrainerWorker,
        backend_overrides,
        compose_config,
        make_tiny_model,
    )

    model, root = os.path.join(workdir, "model"), os.path.join(workdir, "store")
    make_tiny_model(model)
    cfg = compose_config(model, backend_overrides(root, eta=0, timeout=60))
    ce_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)
    report["config"] = {"backend": ce_config.backend, "custom_backend_module": ce_config.custom_backend_module,
                        "engine_kwargs": ce_config.engine_kwargs,
                        "bucket_bytes": ce_config.update_weights_bucket_megabytes << 20}

    # The controller's side: verl's manager imports custom_backend_module and looks the backend up.
    manager = CheckpointEngineManager(config=ce_config, actor_wg=None, replicas=[])
    report["manager_backend_cls"] = f"{manager.backend_cls.__module__}.{manager.backend_cls.__qualname__}"

    # The workers: verl's ActorRolloutRefWorker.init_model and CheckpointEngineWorker.__init__ build the engines.
    trainer = TrainerWorker(cfg.actor_rollout_ref, role="actor")
    trainer.init_model()
    rollout_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    rollout = RolloutWorker(rollout_config, model_config)
    report["engines"] = {
        role: {"cls": f"{type(e).__module__}.{type(e).__qualname__}", "is_master": e.is_master,
               "bucket_size": e.bucket_size, "root": e.root, "eta": e.eta, "timeout": e.timeout}
        for role, e in (("trainer", trainer.checkpoint_engine), ("rollout", rollout.checkpoint_engine))}

    async def sync(step: int) -> dict:
        # As CheckpointEngineManager.update_weights does for every worker: prepare, topology, init,
        # then the trainer's and the rollout's update_weights together, then finalize.
        meta = [trainer.execute_checkpoint_engine("prepare"), rollout.execute_checkpoint_engine("prepare")]
        t_kwargs, r_kwargs = manager.backend_cls.build_topology(1, 1, meta)
        trainer.execute_checkpoint_engine("init_process_group", **{k: v[0] for k, v in t_kwargs.items()})
        rollout.execute_checkpoint_engine("init_process_group", **{k: v[0] for k, v in r_kwargs.items()})
        metrics, _ = await asyncio.gather(trainer.update_weights(global_steps=step),
                                          rollout.update_weights(global_steps=step))
        want = trainer.full_state()
        store = trainer.checkpoint_engine.store
        leased = [lease.step for lease in store.leases()]
        trainer.execute_checkpoint_engine("finalize")
        rollout.execute_checkpoint_engine("finalize")
        got = rollout.server_adapter.received
        return {
            "metrics": metrics, "rollout_global_steps": rollout.server_adapter.global_steps,
            "names_equal": sorted(got) == sorted(want),
            "differ": sorted(n for n in want if n not in got or not _bits_equal(got[n], want[n])),
            "latest": store.latest().step, "leased_during": leased,
            "leases_after": [lease.step for lease in store.leases()],
            "installed_step": rollout.checkpoint_engine.installed_step,
            "check_installed": rollout.checkpoint_engine.check_installed(got),
        }

    async def run() -> None:
        report["syncs"] = {}
        for step in (0, 1):  # verl's trainer syncs at step 0 (the initial weights), then after each update
            if step:
                trainer.train_step(step)
            report["syncs"][step] = await sync(step)

    asyncio.run(run())
    from paramstore.integrations.verl import close_stores

    close_stores()
    with open(report_path, "w") as f:
        json.dump(report, f, default=str)


def _bits_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
