"""Benchmarks of the retention issue: prune + GC over 10,000 versions, and what a lease adds to a checkout.

Run: ``python tools/bench_retention.py [--versions 10000] [--tensors 300] [--json OUT]``

* prune + gc: a store with N versions of a T-tensor model where every version changes one tensor
  (so every version has an object of its own to collect), then ``prune(KeepLast(2))`` and ``gc()``
  timed separately. Goal: < 5 s together at 10,000 versions.
* lease cost: checkout + close of one version, with the lease (``store.checkout``) against the same
  snapshot without one (``Snapshot`` built directly from the registry), side by side, interleaved.
  Goal: < 1 ms added.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import paramstore
from paramstore.retention import KeepLast
from paramstore.snapshot import Snapshot


def build(root: str, versions: int, tensors: int) -> float:
    t0 = time.perf_counter()
    sd = {f"layer{i}.weight": torch.full((4,), -1.0 - i) for i in range(tensors)}  # never equal to a step
    with paramstore.ParamStore(root, prepare_buffers=False) as store:
        for step in range(1, versions + 1):
            sd[f"layer{step % tensors}.weight"] = torch.full((4,), float(step))
            store.commit(step, sd)
            if step % 500 == 0:
                store.flush()
        store.flush()
    return time.perf_counter() - t0


def bench_prune_gc(root: str) -> dict:
    with paramstore.ParamStore(root) as store:
        n_versions = len(store.versions())
        n_objects = len(store._root.registry.objects())
        t0 = time.perf_counter()
        pruned = store.prune(KeepLast(2))
        t1 = time.perf_counter()
        collected = store.gc()
        t2 = time.perf_counter()
    return {"versions": n_versions, "objects": n_objects, "removed": len(pruned.removed),
            "objects_deleted": len(collected.objects), "prune_s": t1 - t0, "gc_s": t2 - t1,
            "total_s": t2 - t0}


def bench_lease(root: str, repeats: int) -> dict:
    with paramstore.ParamStore(root) as store:
        reg, tier = store._root.registry, store._root.tier
        step = store.latest().step
        with_lease, without = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            store.checkout(step).close()
            t1 = time.perf_counter()
            Snapshot(reg.get_version(step), reg.get_manifest(step), tier).close()
            t2 = time.perf_counter()
            with_lease.append(t1 - t0)
            without.append(t2 - t1)
    med_with, med_without = statistics.median(with_lease), statistics.median(without)
    return {"checkout_close_with_lease_ms": med_with * 1e3, "checkout_close_without_lease_ms": med_without * 1e3,
            "lease_cost_ms": (med_with - med_without) * 1e3, "repeats": repeats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=10_000)
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ps-bench-retention-", dir="/dev/shm")
    root = os.path.join(base, "store")
    try:
        build_s = build(root, args.versions, args.tensors)
        lease = bench_lease(root, args.repeats)
        pg = bench_prune_gc(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result = {"build_s": build_s, **pg, **lease, "python": sys.version.split()[0], "torch": torch.__version__}
    print(f"built {args.versions} versions x {args.tensors} tensors in {build_s:.1f} s")
    print(f"prune + gc: {pg['total_s']:.3f} s (prune {pg['prune_s']:.3f} s removing {pg['removed']} versions, "
          f"gc {pg['gc_s']:.3f} s deleting {pg['objects_deleted']} objects)   goal < 5 s: "
          f"{'PASS' if pg['total_s'] < 5 else 'MISS'}")
    print(f"lease: checkout+close {lease['checkout_close_with_lease_ms']:.3f} ms with, "
          f"{lease['checkout_close_without_lease_ms']:.3f} ms without -> {lease['lease_cost_ms']:.3f} ms per "
          f"lease   goal < 1 ms: {'PASS' if lease['lease_cost_ms'] < 1 else 'MISS'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
