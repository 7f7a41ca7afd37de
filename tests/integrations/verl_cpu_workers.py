"""verl workers for the paramstore backend's tests, runnable on a CPU-only host (imported by test_verl.py,
by the Ray workers it starts, and by tools/bench_verl_manager.py).

What is verl's own code and what is not:

- **Config**: verl's real Hydra config (``verl/trainer/config/ppo_trainer.yaml``), composed with the
  same overrides a user passes on the command line (:func:`compose_config`).
- **Trainer**: :class:`TrainerWorker` *is* verl's ``ActorRolloutRefWorker`` (its ``__init__``,
  ``init_model`` — which builds the checkpoint engine from the config, as in a real run —,
  ``update_weights`` and ``execute_checkpoint_engine``), with one change: its ``actor_worker_cls``
  (the training engine, verl's ``TrainingWorker`` with the FSDP engine) is :class:`CpuTrainingWorker`.
  verl 0.9.1 cannot run its FSDP engine without an accelerator: its platform registry knows
  nvidia, npu and rocm only, falls back to ``nvidia`` on a CPU host, and the engine then dies in
  ``init_device_mesh("cuda")`` (``AttributeError: module 'torch._C' has no attribute
  '_cuda_setDevice'``); ``TrainingWorker.__init__`` also initializes the process group with
  ``cpu:gloo,cpu:nccl``, which a CPU build of torch refuses ("Distributed package doesn't have NCCL
  built in"). :class:`CpuTrainingWorker` does what that engine does for a weight sync, for real:
  the Hugging Face model's parameters are sharded over the trainer ranks with FSDP2
  (``fully_shard`` on a gloo CPU mesh), and ``get_per_tensor_param`` yields
  ``(name, param.full_tensor())`` for each parameter: one all-gather per tensor, collective over
  the trainer ranks, exactly as verl's FSDP engine does.
- **Rollout**: :class:`RolloutWorker` *is* verl's ``CheckpointEngineWorker`` (which builds the
  checkpoint engine from the config and runs ``update_weights``), given a server adapter
  (:class:`RecordingRollout`, a ``BaseRollout``) that keeps what it receives instead of loading it
  into vLLM or SGLang (neither is installed in this environment). :class:`LocalReplica` is a
  ``RolloutReplica`` with no HTTP server to launch (verl's replica methods then have no servers to
  call).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

try:
    import verl
except ImportError:  # pytest's doctest collection in an environment without verl: nothing to test here
    import pytest

    pytest.skip("verl is not installed", allow_module_level=True)
from verl.checkpoint_engine.base import CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.distributed import initialize_global_process_group_ray
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout import BaseRollout, RolloutReplica

VERL_CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def make_tiny_model(path: str, *, hidden: int = 32, layers: int = 2, vocab: int = 128, seed: int = 0) -> None:
    """Save a small random Qwen2 causal LM (config and safetensors weights) at ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def backend_overrides(root: str, **engine_kwargs: Any) -> list[str]:
    """The command-line overrides that select the paramstore backend (as the module docstring says)."""
    prefix = "actor_rollout_ref.rollout.checkpoint_engine"
    out = [f"{prefix}.backend=paramstore", f"{prefix}.custom_backend_module=paramstore.integrations.verl",
           f"+{prefix}.engine_kwargs.paramstore.root={root}"]
    out += [f"+{prefix}.engine_kwargs.paramstore.{k}={'null' if v is None else v}" for k, v in engine_kwargs.items()]
    return out


def compose_config(model_path: str, overrides: list[str]) -> Any:
    """verl's PPO trainer config (Hydra, ``ppo_trainer.yaml``) with ``overrides``, for a CPU run of a
    tiny model: the model at ``model_path`` (no tokenizer), micro batches of 1, rollout replicas of
    one worker (tensor parallel size 1)."""
    from hydra import compose, initialize_config_dir

    base = [
        f"actor_rollout_ref.model.path={model_path}",
        "+actor_rollout_ref.model.load_tokenizer=false",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # one worker per replica
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    ]
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=base + list(overrides))


def start_ray(num_cpus: int) -> None:
    """A local Ray instance (loopback only) whose workers can import this module."""
    import ray

    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}})


def start_workers(cfg: Any, trainers: int, replicas: int, rollout_cls: Any = None) -> tuple[Any, Any, list[Any], Any]:
    """On the Ray instance :func:`start_ray` made: ``trainers`` :class:`TrainerWorker` ranks (their
    ``init_model`` run: each built its checkpoint engine from ``cfg``), one rollout worker of
    ``rollout_cls`` (default :class:`RolloutWorker`) per replica, and the replicas. Returns
    ``(actor_wg, rollout_wg, replicas, checkpoint-engine config)``: what a ``CheckpointEngineManager``
    is made of (after each replica's ``init_hybrid(rollout_wg)``)."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import split_resource_pool
    from verl.utils.config import omega_conf_to_dataclass

    rollout_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    pool = RayResourcePool(process_on_nodes=[trainers + replicas], use_gpu=False, max_colocate_count=1)
    trainer_pool, rollout_pool = split_resource_pool(pool, [trainers, replicas])
    actor_wg = RayWorkerGroup(resource_pool=trainer_pool, device_name="cpu", ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(TrainerWorker), config=cfg.actor_rollout_ref, role="actor"))
    rollout_wg = RayWorkerGroup(resource_pool=rollout_pool, device_name="cpu", ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(rollout_cls or RolloutWorker), rollout_config=rollout_config, model_config=model_config))
    actor_wg.init_model()  # builds each rank's checkpoint engine from the config
    made = [LocalReplica(replica_rank=i, config=rollout_config, model_config=model_config) for i in range(replicas)]
    return actor_wg, rollout_wg, made, omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)


# -- trainer -----------------------------------------------------------------------------------
class CpuFSDPEngine:
    """The weight-sync side of verl's FSDP engine, on CPU: the model sharded with FSDP2 over the
    trainer ranks (gloo), and :meth:`get_per_tensor_param` gathering one full tensor at a time."""

    def __init__(self, model_config: Any) -> None:
        self.model_config = model_config
        self.module: torch.nn.Module | None = None
        self.poison: str | None = None  # see :meth:`TrainerWorker.poison`

    def initialize(self) -> None:
        """Load the model from its path and shard it (every parameter a DTensor, ``Shard(0)``)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        module = AutoModelForCausalLM.from_pretrained(self.model_config.local_path, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("fsdp",))
        for layer in module.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
        self.module = module

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Any, None]:
        """As verl's FSDP engine: ``(name, full tensor)`` per state-dict entry, each a collective gather."""
        from torch.distributed.tensor import DTensor

        params = self.module.state_dict()
        gen = ((name, p.full_tensor() if isinstance(p, DTensor) else p) for name, p in params.items())
        if self.poison is not None and torch.distributed.get_rank() == 0:
            gen = self._poisoned(gen, self.poison)
        return gen, None

    @staticmethod
    def _poisoned(gen: Any, poison: str) -> Any:
        for name, t in gen:  # every gather still happens, on every rank
            yield name, (t.to_sparse() if name == poison else t)

    def train_step(self, seed: int, frozen: tuple[str, ...] = ()) -> None:
        """Change the weights as an optimizer step would: every local shard gets seeded noise, except
        parameters whose name contains one of ``frozen`` (their bytes stay equal: deduplicated)."""
        from torch.distributed.tensor import DTensor

        g = torch.Generator().manual_seed(seed * 1000 + torch.distributed.get_rank())
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                if any(f in name for f in frozen):
                    continue
                local = p.to_local() if isinstance(p, DTensor) else p
                local.add_(torch.randn(local.shape, generator=g, dtype=local.dtype))

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every tensor, gathered (collective)."""
        gen, _ = self.get_per_tensor_param()
        return {name: t.detach().clone() for name, t in gen}


class CpuTrainingWorker:
    """Stands in for verl's ``TrainingWorker`` as ``ActorRolloutRefWorker.actor_worker_cls`` (see the
    module docstring): the same process-group set-up, with the CPU backend, and :class:`CpuFSDPEngine`."""

    def __init__(self, config: Any) -> None:
        initialize_global_process_group_ray(timeout_second=None, backend="cpu:gloo")
        self.config = config
        self.engine = CpuFSDPEngine(config.model_config)
        self.loss_fn = None

    def reset(self) -> None:
        """Initialize the engine (load and shard the model)."""
        self.engine.initialize()

    def set_loss_fn(self, loss_fn: Any) -> None:
        """Kept, unused: no training here."""
        self.loss_fn = loss_fn

    def get_dispatch_collect(self) -> dict[str, Any]:
        """Data-parallel dispatch: every rank its own dp rank, every rank collected."""
        rank = torch.distributed.get_rank()
        return {"dispatch_dp_rank": {"train": rank}, "collect_dp_rank": {"train": True}}


class TrainerWorker(ActorRolloutRefWorker):
    """verl's ``ActorRolloutRefWorker`` with :class:`CpuTrainingWorker` as its training engine."""

    actor_worker_cls = CpuTrainingWorker

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, seed: int, frozen: tuple[str, ...] = ()) -> None:
        """Change the weights (see :meth:`CpuFSDPEngine.train_step`)."""
        self.actor.engine.train_step(seed, frozen)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_s(self, copy: bool) -> float | None:
        """Seconds to drain verl's export (:meth:`CpuFSDPEngine.get_per_tensor_param`, every rank),
        with ``copy``: each tensor also copied into buffers made (and faulted in) beforehand, as any
        backend that takes the weights out of the trainer must. Rank 0 returns it."""
        engine = self.actor.engine
        scratch = getattr(engine, "_export_scratch", None)
        t0 = time.perf_counter()
        gen, _ = engine.get_per_tensor_param()
        made = {}
        for name, t in gen:
            if copy:
                dst = scratch.get(name) if scratch is not None else None
                if dst is None:
                    dst = torch.zeros_like(t)
                dst.copy_(t)
                made[name] = dst
        took = time.perf_counter() - t0
        if copy:
            engine._export_scratch = made
        return took if torch.distributed.get_rank() == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def poison(self, name: str | None) -> None:
        """From now on rank 0's export yields tensor ``name`` as a sparse tensor, which a commit refuses
        (a commit that fails in the middle of the stream); None: no more."""
        self.actor.engine.poison = name

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's tensors (gathered on every rank; rank 0 returns them)."""
        state = self.actor.engine.full_state()
        return state if torch.distributed.get_rank() == 0 else None


# -- rollout -----------------------------------------------------------------------------------
class RecordingRollout(BaseRollout):
    """A verl server adapter that keeps the weights it is sent (a copy of each) and the step."""

    def __init__(self, config: Any, model_config: Any) -> None:
        super().__init__(config, model_config, device_mesh=None)
        self.received: dict[str, torch.Tensor] = {}
        self.global_steps: int | None = None
        self.updates = 0

    async def resume(self, tags: list[str]) -> None:
        """Nothing to resume: no device memory."""

    async def release(self) -> None:
        """Nothing to release: no device memory."""

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        """Copy every ``(name, tensor)`` received (verl's adapters copy into the inference engine)."""
        assert wire_format == "named_tensors", wire_format
        got: dict[str, torch.Tensor] = {}
        async for name, tensor in weights:
            got[name] = tensor.clone()
        self.received = got
        self.global_steps = kwargs.get("global_steps")
        self.updates += 1


class RolloutWorker(CheckpointEngineWorker):
    """verl's ``CheckpointEngineWorker`` with a :class:`RecordingRollout` (``adapter_cls``) as its server adapter."""

    adapter_cls: Any = RecordingRollout

    def __init__(self, rollout_config: Any, model_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(rollout_config, model_config, self.adapter_cls(rollout_config, model_config), *args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self) -> tuple[int | None, int, dict[str, torch.Tensor]]:
        """``(global_steps, number of updates, weights)`` of the last update."""
        a = self.server_adapter
        return a.global_steps, a.updates, a.received


class InstallingRollout(RecordingRollout):
    """A server adapter that installs as an inference engine does: every tensor copied into weights
    it keeps (made and faulted at the first update), how long each update took and, of that, how
    long after its last copy the received weights ended (``time.monotonic``)."""

    def __init__(self, config: Any, model_config: Any) -> None:
        super().__init__(config, model_config)
        self.durations: list[float] = []
        self.tails: list[float] = []

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        import time

        assert wire_format == "named_tensors", wire_format
        start = last = time.monotonic()
        async for name, tensor in weights:
            if name not in self.received:
                self.received[name] = torch.zeros_like(tensor)
            self.received[name].copy_(tensor)
            last = time.monotonic()
        end = time.monotonic()
        self.durations.append(end - start)
        self.tails.append(end - last)
        self.global_steps = kwargs.get("global_steps")
        self.updates += 1


class InstallingRolloutWorker(RolloutWorker):
    """A :class:`RolloutWorker` whose server adapter is an :class:`InstallingRollout`."""

    adapter_cls = InstallingRollout

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def durations(self) -> list[float]:
        """Seconds each update took in the adapter (the install)."""
        return list(self.server_adapter.durations)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tails(self) -> list[float]:
        """Seconds of each update after its last copy (waiting for the weights to end)."""
        return list(self.server_adapter.tails)


class LocalReplica(RolloutReplica):
    """A rollout replica made of workers of an existing group, with no HTTP server to launch."""

    async def launch_servers(self) -> None:
        """No server: the replica's methods (abort, release kv cache...) have nothing to call."""

    def get_ray_class_with_init_args(self) -> Any:
        """Unused: the workers come from :meth:`init_hybrid`."""
        raise NotImplementedError("LocalReplica builds no Ray worker class: its workers come from init_hybrid()")


__all__ = ["CpuFSDPEngine", "CpuTrainingWorker", "InstallingRollout", "InstallingRolloutWorker", "LocalReplica",
           "RecordingRollout", "RolloutWorker", "TrainerWorker", "Worker", "backend_overrides", "compose_config",
           "make_tiny_model", "start_ray", "start_workers"]
