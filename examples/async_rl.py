"""Asynchronous RL with a staleness bound: one trainer, four rollout processes, t − v ≤ η as a store contract.

Run: ``python examples/async_rl.py`` (also part of ``make demo``). Options: ``--steps``, ``--eta 0 1 2``.

The trainer at step t trains on samples requested *for* step t. It asks for them early, η steps
ahead, so that rollouts can generate while it trains. A rollout that takes a request for step t
checks out ``store.checkout(min_step=t - η)``: the newest version, and at least t − η. The store
blocks it until such a version exists, and holds a lease on it while it generates, so retention never
prunes the weights a rollout is using. Each sample records the version (step and digest) it was
generated with; the trainer counts every sample it trains on at step t with t − v > η (a violation)
and the fraction of its time it sits idle waiting for samples. With η = 0 the loop is synchronous;
larger η lets generation overlap training and the idle fraction falls.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import random
import shutil
import time
from dataclasses import dataclass

import torch

import paramstore
from paramstore.retention import KeepLast

BATCH = 8  # samples per training step
STOP = -1


def make_policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 16))


@dataclass
class Sample:
    request_step: int  # the trainer step it was requested for
    version: int  # the step of the weights it was generated with
    digest: str
    reward: float


def rollout(root: str, eta: int, requests: "mp.Queue[int]", samples: "mp.Queue[Sample]", seed: int) -> None:
    rng = random.Random(seed)
    policy = make_policy()
    loaded = None
    with paramstore.ParamStore(root) as store:  # a reader: waits for the store, never creates it
        while (t := requests.get()) != STOP:
            with store.checkout(min_step=max(t - eta, 0), timeout=120, holder=f"rollout {seed}") as snap:
                if snap.step != loaded:
                    snap.load_into(policy)
                    loaded = snap.step
                time.sleep(rng.uniform(0.02, 0.12))  # generation takes a random time
                with torch.no_grad():
                    reward = float(policy(torch.randn(1, 256)).mean())
                samples.put(Sample(t, snap.step, snap.digest, reward))


def train(root: str, eta: int, steps: int, train_s: float, rollouts: int = 4) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    ctx = mp.get_context("spawn")
    requests: mp.Queue = ctx.Queue()
    samples: mp.Queue = ctx.Queue()
    model = make_policy()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # Shared memory keeps a few versions; leased ones are kept whatever the policy says.
    with paramstore.ParamStore(root, retention=KeepLast(eta + 2)) as store:
        store.guard(opt)
        store.commit(0, model).result()
        procs = [ctx.Process(target=rollout, args=(root, eta, requests, samples, i)) for i in range(rollouts)]
        for p in procs:
            p.start()
        for s in range(eta + 1):  # ask early: rollouts may start with weights up to η steps old
            for _ in range(BATCH):
                requests.put(s)
        pending: dict[int, list[Sample]] = {}
        violations = used = 0
        idle, lag = 0.0, 0
        start = time.perf_counter()
        for t in range(steps):
            waited = time.perf_counter()
            while len(pending.get(t, [])) < BATCH:
                try:
                    smp = samples.get(timeout=120)
                except queue.Empty:
                    raise SystemExit("rollouts stopped answering") from None
                pending.setdefault(smp.request_step, []).append(smp)
            idle += time.perf_counter() - waited
            batch = pending.pop(t)
            violations += sum(t - smp.version > eta for smp in batch)  # checked here, independently
            used += len(batch)
            oldest = store.oldest_leased_step()
            lag = max(lag, 0 if oldest is None else t - oldest)
            # one training step on the batch, stretched to train_s to stand for a real model
            t0 = time.perf_counter()
            loss = model(torch.randn(BATCH, 256)).pow(2).mean() - sum(smp.reward for smp in batch) / BATCH
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(max(0.0, train_s - (time.perf_counter() - t0)))
            store.commit(t + 1, model, metrics={"loss": loss.item()})
            for _ in range(BATCH):
                requests.put(t + 1 + eta)
        total = time.perf_counter() - start
        for _ in procs:
            requests.put(STOP)
        for p in procs:
            p.join()
        kept = [v.step for v in store.versions()]
    shutil.rmtree(root, ignore_errors=True)
    return {"eta": eta, "steps": steps, "samples": used, "violations": violations,
            "idle_fraction": idle / total, "wall_s": total, "max_reader_lag": lag, "versions_kept": len(kept)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/dev/shm/paramstore-async-rl")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eta", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--train-s", type=float, default=0.15, help="seconds one training step takes")
    args = ap.parse_args()
    rows = [train(args.root, eta, args.steps, args.train_s) for eta in args.eta]
    print("| η | steps | samples | violations of t − v ≤ η | trainer idle | wall | max reader lag | versions kept |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['eta']} | {r['steps']} | {r['samples']} | {r['violations']} | {r['idle_fraction']:.0%} | "
              f"{r['wall_s']:.1f} s | {r['max_reader_lag']} | {r['versions_kept']} |")
    if any(r["violations"] for r in rows):
        raise SystemExit("staleness bound violated")


if __name__ == "__main__":
    main()
