"""Quickstart: one trainer process commits a small transformer while two rollout processes follow.

Run with ``make demo`` (or ``python examples/quickstart.py [--root DIR] [--steps N]``).
The trainer fine-tunes a toy model for a few steps (its embedding and first block frozen, as in
partial fine-tuning) and commits each one; every rollout process subscribes, checks out each new
version zero-copy, loads it into its own copy of the policy and prints the version, its digest and
the latency from ``commit`` to loaded. Frozen tensors are stored once (``du`` shows the dedup).
The store is left in place for you to try the CLI on; the last line says how to remove it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time

import torch

import paramstore


class TinyTransformer(torch.nn.Module):
    """A small decoder-style model with tied input/output embeddings."""

    def __init__(self, vocab: int = 4096, dim: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        block = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def trainer(root: str, steps: int, ready: "mp.synchronize.Barrier") -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    for frozen in (model.embed, model.blocks.layers[0]):  # unchanged from step to step: stored once
        frozen.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with paramstore.ParamStore(root) as store:
        store.guard(opt)  # optimizer.step() waits for the last snapshot to be taken
        store.prepare(model)  # fault the shared-memory buffers before the first commit
        ready.wait()
        for step in range(1, steps + 1):
            tokens = torch.randint(0, 4096, (8, 64))
            logits = model(tokens[:, :-1])  # next-token prediction
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            store.commit(step, model, metrics={"loss": loss.item()}, metadata={"last": step == steps},
                         tags=["final"] if step == steps else ())
            time.sleep(0.3)  # stands for the rest of a training step
        v = store.flush()
        print(f"[trainer] committed {steps} versions; latest step {v.step} digest {v.digest[:12]}", flush=True)


def rollout(root: str, rank: int, ready: "mp.synchronize.Barrier") -> None:
    policy = TinyTransformer()
    with paramstore.ParamStore(root) as store:  # a reader: waits for the store, never creates it
        ready.wait()
        for v in store.subscribe(min_step=0, timeout=60):
            with store.checkout(v.step) as snap:
                snap.load_into(policy)
                latency_ms = (time.time() - v.created_at) * 1e3
            print(f"[rollout {rank}] step {v.step:>3}  digest {v.digest[:12]}  "
                  f"commit->loaded {latency_ms:6.1f} ms  loss {v.metrics['loss']:.3f}", flush=True)
            if v.metadata.get("last"):
                return
    raise SystemExit(f"rollout {rank}: no final version within the timeout")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/dev/shm/paramstore-demo")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    shutil.rmtree(args.root, ignore_errors=True)
    # No need to create the store first: the trainer's first commit does, and the rollouts wait for it.

    ctx = mp.get_context("spawn")
    ready = ctx.Barrier(3)
    procs = [ctx.Process(target=trainer, args=(args.root, args.steps, ready))]
    procs += [ctx.Process(target=rollout, args=(args.root, r, ready)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"a process failed: exit codes {[p.exitcode for p in procs]}")

    for cmd in (["ls"], ["du"], ["verify"]):
        print(f"\n$ paramstore --root {args.root} {' '.join(cmd)}", flush=True)
        subprocess.run([sys.executable, "-m", "paramstore", "--root", args.root, *cmd], check=True)
    used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.root) for f in fs)
    print(f"\nThe store is left at {args.root} ({used / 2**20:.0f} MiB of shared memory) for you to try the CLI "
          f"on; remove it with: rm -rf {args.root}", flush=True)


if __name__ == "__main__":
    main()
