"""Sharded trainer ranks commit one version, each storing only its own blocks; readers with another
layout read what they need.

Run with any number of ranks (CPU, gloo)::

    torchrun --standalone --nproc_per_node 4 examples/sharded.py [ROOT]

Every rank holds DTensors (``Shard(0)``, ``Shard(1)``, ``Replicate``) and calls ``store.commit`` with
the same step: no rank gathers a tensor, replicated tensors are stored once, and the version
appears once every rank's blocks are stored. Then each rank checks the version out and reads a
tensor-parallel slice of it (a different layout from the one committed), and rank 0 reads every
tensor whole.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import paramstore


def main(root: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)  # a fresh store for the example
    dist.barrier()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # every rank builds the same full tensors, then keeps its shard
    full = {"embed.weight": torch.randn(1000, 64), "proj.weight": torch.randn(64, 256), "norm.weight": torch.ones(64)}
    state = {
        "embed.weight": distribute_tensor(full["embed.weight"], mesh, [Shard(0)]),
        "proj.weight": distribute_tensor(full["proj.weight"], mesh, [Shard(1)]),
        "norm.weight": distribute_tensor(full["norm.weight"], mesh, [Replicate()]),
    }
    with paramstore.ParamStore(root) as store:
        version = store.commit(1, state, dtype=torch.bfloat16).result(timeout=120)  # on every rank
        with store.checkout(version.step) as snap:
            # A tensor-parallel reader of 2 ranks wants half of proj's columns: copy just those.
            half = snap.read("proj.weight", offsets=(0, 128 * (rank % 2)), sizes=(64, 128))
            assert torch.equal(half, full["proj.weight"][:, 128 * (rank % 2):][:, :128].bfloat16())
            if rank == 0:
                whole = {k: snap[k] for k in full}  # whole tensors, assembled from the blocks
                assert all(torch.equal(whole[k], full[k].bfloat16()) for k in full)
                chunks = {k: len(e.chunks) for k, e in snap.manifest.tensors.items()}
                print(f"step {version.step}: {version.nbytes} bytes from {world} ranks, chunks per tensor {chunks}, "
                      f"digest {version.digest[:12]}")
        dist.barrier()  # every rank has read before rank 0 removes the example's store
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join("/dev/shm", "paramstore-example-sharded"))
