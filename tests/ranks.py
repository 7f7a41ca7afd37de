"""Ranks of a trainer as real processes: ``torch.multiprocessing`` spawn with a gloo group on CPU.

:func:`run_ranks` starts ``world`` processes that join one gloo group (``file://`` rendezvous) and
run ``fn(rank, world, *args)``; each returns a JSON-able value (or raises). The parent gets the
values by rank, or an AssertionError naming the rank that failed, died or hung. Every run is
bounded in time and leaves no process behind.

Also the sharded model the tests commit (:func:`full_model`, :func:`sharded_model`): a pure function
of its seed, so any process can check any version bit for bit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
import warnings
import zlib
from typing import Any, Callable

import torch

SPAWN = mp.get_context("spawn")


def _child(fn: Callable, rank: int, world: int, init: str, results: Any, args: tuple) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MC_FORCE_TCP", "1")
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 120, allow_missing: tuple[int, ...] = ()
              ) -> dict[int, Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; returns ``{rank: value}``.

    ``allow_missing``: ranks that may end without a result (killed on purpose). Raises
    AssertionError if a rank raised, or any other rank gave no result within ``timeout``.
    """
    init = tempfile.mktemp(prefix="paramstore-gloo-", dir="/dev/shm")
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=_child, args=(fn, r, world, init, results, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors: list[str] = []
    try:
        import time

        deadline = time.monotonic() + timeout
        need = set(range(world)) - set(allow_missing)
        while not need <= set(got) | {r for r, _ in errors_by_rank(errors)}:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            if status == "ok":
                got[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(init):
            os.unlink(init)
    if errors:
        raise AssertionError("\n".join(errors))
    missing = sorted(set(range(world)) - set(allow_missing) - set(got))
    if missing:
        raise AssertionError(f"ranks {missing} gave no result within {timeout} s "
                             f"(exit codes {[p.exitcode for p in procs]})")
    return got


def errors_by_rank(errors: list[str]) -> list[tuple[int, str]]:
    return [(int(e.split()[1].rstrip(":")), e) for e in errors]


# -- the model ---------------------------------------------------------------------------------
#: name -> (shape, dtype, placements by mesh): "1d" a (world,) mesh, "2d" a (2, world // 2) mesh.
LAYOUT: dict[str, tuple[tuple[int, ...], torch.dtype, str, tuple[str, ...]]] = {
    "embed.weight": ((64, 24), torch.bfloat16, "1d", ("S0",)),
    "layer.0.wq": ((24, 40), torch.float32, "1d", ("S1",)),
    "layer.0.uneven": ((7, 5), torch.float32, "1d", ("S0",)),  # 4 ranks: rows 2, 2, 2, 1
    "layer.0.tiny": ((3, 4), torch.float16, "1d", ("S0",)),  # 4 ranks: one rank holds nothing
    "layer.0.norm": ((24,), torch.float32, "1d", ("R",)),
    "layer.1.grid": ((12, 10), torch.bfloat16, "2d", ("S0", "S1")),
    "layer.1.rows": ((10, 6), torch.float32, "2d", ("S0", "R")),
    "layer.1.same_dim": ((16, 3), torch.float32, "2d", ("S0", "S0")),
}
PLAIN = {"step_count": ((), torch.int64), "rope.inv_freq": ((6,), torch.float32)}


def full_tensor(name: str, seed: int) -> torch.Tensor:
    """The whole tensor ``name`` of the model of ``seed`` (every bit pattern possible for floats)."""
    shape, dtype = (LAYOUT[name][:2] if name in LAYOUT else PLAIN[name])
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{seed}".encode()))  # the same in every process
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(0, 1000, shape, generator=g, dtype=dtype)


def full_model(seed: int, world: int = 4) -> dict[str, torch.Tensor]:
    """The whole model of ``seed`` as ``world`` ranks commit it (2-D mesh tensors need 4+ ranks)."""
    two_d = world % 2 == 0 and world > 2
    return {n: full_tensor(n, seed) for n in [*LAYOUT, *PLAIN] if two_d or n not in LAYOUT or LAYOUT[n][2] != "2d"}


def meshes(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    out = {"1d": init_device_mesh("cpu", (world,))}
    if world % 2 == 0 and world > 2:
        out["2d"] = init_device_mesh("cpu", (2, world // 2))
    return out


def sharded_model(world: int, seed: int) -> dict[str, torch.Tensor]:
    """The model of ``seed`` as this rank holds it: DTensors per :data:`LAYOUT` (2-D ones only
    with 4+ ranks), plain tensors as they are."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    made = meshes(world)
    out: dict[str, torch.Tensor] = {}
    for name, (_, _, mesh, places) in LAYOUT.items():
        if mesh not in made:
            continue
        placements = [Replicate() if p == "R" else Shard(int(p[1:])) for p in places]
        out[name] = distribute_tensor(full_tensor(name, seed), made[mesh], placements)
    for name in PLAIN:
        out[name] = full_tensor(name, seed)
    return out
