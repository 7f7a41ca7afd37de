"""A version broadcast over a process group: one trainer host, three rollout hosts, one call each.

Run: ``python examples/broadcast.py`` (CPU, gloo; with GPUs, pass ``--backend nccl`` and each rank
uses ``cuda:<rank>``). Options: ``--mib``, ``--steps``.

Each rank is a process with a store of its own (its own "host": ``/dev/shm/paramstore-bcast/host<r>``).
Rank 0 is the trainer: it commits a version at every step. Then every rank, the trainer included,
calls the same line::

    snap = store.checkout("latest", group=pg, src=0, device=device)

and the version moves from rank 0 to the others over the group: only the objects a rank lacks (here,
at each step, the shards that changed), each checked against the manifest's digests before it is
placed in that rank's store. Each rank prints what it received; the last line compares the digests.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile

import torch

ROOT = "/dev/shm/paramstore-bcast"


def rank_main(rank: int, world: int, init: str, args: argparse.Namespace, out: "mp.Queue[tuple]") -> None:
    import torch.distributed as dist

    import paramstore

    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(args.backend, init_method=f"file://{init}", rank=rank, world_size=world)
    device = f"cuda:{rank}" if args.backend == "nccl" else "cpu"
    store = paramstore.ParamStore(f"{ROOT}/host{rank}", create=True, shard_size_bytes=16 << 20)
    g = torch.Generator().manual_seed(0)
    layers = {f"layers.{i}.weight": torch.randn(args.mib << 19, generator=g).to(torch.bfloat16) for i in range(8)}
    try:
        for step in range(1, args.steps + 1):
            if rank == 0:
                layers[f"layers.{step % 8}.weight"] += 1  # one layer in eight changes per step
                store.commit(step, layers).result()
            with store.checkout("latest", group=dist.group.WORLD, src=0, device=device) as snap:
                out.put((rank, snap.step, snap.digest[:12], len(snap.fetch.from_group), snap.fetch.bytes))
    finally:
        store.close()
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=4, help="MiB of bf16 per layer (8 layers)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = ap.parse_args()
    shutil.rmtree(ROOT, ignore_errors=True)
    init = tempfile.mktemp(prefix="paramstore-bcast-pg-", dir="/dev/shm")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, init, args, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = [out.get(timeout=300) for _ in range(args.ranks * args.steps)]
    for p in procs:
        p.join(timeout=60)
    if os.path.exists(init):
        os.unlink(init)
    print("| step | rank | digest | objects received | MiB received |\n|---|---|---|---|---|")
    for rank, step, digest, objects, nbytes in sorted(rows, key=lambda r: (r[1], r[0])):
        print(f"| {step} | {rank} | {digest} | {objects} | {nbytes / (1 << 20):.1f} |")
    digests = {(step, digest) for _, step, digest, _, _ in rows}
    same = len(digests) == args.steps
    print(f"every rank holds the same {args.steps} versions: {same}")
    print(f"the stores are left at {ROOT}/host*: `paramstore ls {ROOT}/host1`; remove them with rm -rf {ROOT}")
    if not same or any(p.exitcode for p in procs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
