"""The device path, side by side with what users would otherwise run (issue 15's goals).

Rows, each measured with its baseline in the same run (medians of ``--rounds``):

1. **D2H staging** of ``--gib`` GiB of bf16 on a GPU (default 1,4,16): ``store.commit`` until
   ``staged`` (slabs page-locked once, by :mod:`paramstore.pinning`) vs ``copy_(non_blocking=True)``
   into ``torch.empty(pin_memory=True)`` buffers made beforehand + a sync (goal ≥ 0.8×: the copy's
   time / ours); and the slowdown of a concurrent "training step" (a matmul loop on the default
   stream) while staging runs.
2. **Commit stall** on a GPU: how long the training thread is held before it may queue the
   optimizer step (``commit()`` returning, then ``handle.fence()``, which is what
   ``store.guard(optimizer)`` does: the optimizer's kernels then wait for the copies on the
   device, not on the host) vs DCP ``async_save`` with pinned staging (the call, then
   ``staging_completion``, before which DCP's trainer may not change the weights) (goal ≤ 0.2×).
3. **checkout(device=)** H2D of a version vs a pinned ``copy_`` of the same bytes (goal ≥ 0.8×).
4. **IPC checkout** of the latest in another process, at 100 and 10,000 tensors (goal ≤ 1 ms);
   and, on any machine, its CPU part (lease, manifest, mapping the objects), for a version the
   reader has read before and for one it reads for the first time (parsing its manifest).
5. **Broadcast** of a version from 1 source to ``--receivers`` over a gloo group vs a raw
   ``dist.broadcast`` of the same bytes with the same bucket size (goal ≥ 0.9×; see
   ``tools/bench_broadcast.py``); on NCCL only with ≥ 2 GPUs.

Rows 1–4 need a CUDA GPU: without one they are reported as "not run" (never estimated).

    .venv/bin/python tools/bench_device.py --json out/bench_device.json --markdown out/bench_device.md
    .venv/bin/python tools/docgen.py device out/bench_device.md --json out/bench_device.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import traceback
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import log, machine, write_outputs  # noqa: E402

SHM = "/dev/shm"
NOT_RUN = "not run (no CUDA GPU on this machine)"


def _model(nbytes: int, n: int, device: str) -> dict[str, torch.Tensor]:
    """``n`` bf16 tensors of ``nbytes`` in all on ``device``."""
    per = max(1, nbytes // n // 2)
    return {f"layer{i}.weight": torch.randn(per, device=device, dtype=torch.float32).to(torch.bfloat16) for i in range(n)}


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def staging(gib: float, rounds: int) -> dict[str, Any]:
    """Row 1: commit → staged vs a pinned copy_, and a concurrent matmul's slowdown."""
    from paramstore import ParamStore
    from paramstore.retention import KeepLast

    nbytes = int(gib * (1 << 30))
    model = _model(nbytes, 64, "cuda")
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in model.items()}
    root = tempfile.mkdtemp(prefix="bench-device-", dir=SHM)
    a = torch.randn(4096, 4096, device="cuda")

    def train_step() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - t

    try:
        with ParamStore(os.path.join(root, "s"), create=True, retention=KeepLast(2)) as store:
            store.prepare(model, wait=True)
            ours, base, alone, during = [], [], [], []
            for r in range(rounds + 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                for k, v in model.items():
                    pinned[k].copy_(v, non_blocking=True)
                torch.cuda.synchronize()
                copy_s = time.perf_counter() - t
                t = time.perf_counter()
                handle = store.commit(2 * r + 1, model)
                handle.staged.result()
                staged_s = time.perf_counter() - t
                alone_s = train_step()
                handle = store.commit(2 * r + 2, model)
                during_s = train_step()  # runs while the stager's D2H copies run
                handle.staged.result()
                store.flush()
                if r:  # the first round pins and faults
                    ours.append(staged_s), base.append(copy_s), alone.append(alone_s), during.append(during_s)
        return {"gib": gib, "staged_s": _median(ours), "pinned_copy_s": _median(base),
                "ratio": _median(base) / _median(ours), "step_alone_s": _median(alone),
                "step_during_s": _median(during), "slowdown": _median(during) / _median(alone)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def stall(gib: float, rounds: int) -> dict[str, Any]:
    """Row 2: the training thread's wait for a commit vs DCP async_save with pinned staging."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from paramstore import ParamStore
    from paramstore.retention import KeepLast

    model = _model(int(gib * (1 << 30)), 64, "cuda")
    root = tempfile.mkdtemp(prefix="bench-device-", dir=SHM)
    try:
        ours, theirs, copied = [], [], []
        options = StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                 use_non_blocking_copy=True)
        with ParamStore(os.path.join(root, "s"), create=True, retention=KeepLast(2)) as store:
            store.prepare(model, wait=True)
            for r in range(rounds + 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                handle = store.commit(r + 1, model)
                handle.fence()  # what store.guard(optimizer) does before optimizer.step()
                mine = time.perf_counter() - t
                handle.staged.result()
                staged = time.perf_counter() - t
                store.flush()
                t = time.perf_counter()
                # A stager per save: torch 2.11's DefaultStager closes its StateDictStager after each
                # save, which clears its copy table (and its cache of pinned buffers: so a new one
                # costs DCP nothing it would not pay anyway); the next save through it fails
                # (KeyError: <class 'type'>, copying the dict itself).
                stager = DefaultStager(options)
                resp = dcp.async_save(model, checkpoint_id=os.path.join(root, f"dcp{r}"), async_stager=stager)
                resp.staging_completion.result()
                dcp_s = time.perf_counter() - t
                resp.upload_completion.result()
                if r:
                    ours.append(mine), theirs.append(dcp_s), copied.append(staged)
        return {"gib": gib, "ours_s": _median(ours), "dcp_s": _median(theirs), "ratio": _median(ours) / _median(theirs),
                "staged_s": _median(copied)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def h2d(gib: float, rounds: int) -> dict[str, Any]:
    """Row 3: checkout(device=) vs a pinned copy_ of the same bytes; and where its time goes, on
    another version's objects: the CPU checkout alone, filling pinned memory from a fresh mapping
    (the tier's copy threads: page faults and memcpy), again on one thread (memcpy alone), an
    unpinned ``copy_`` straight from the mapping, and the tier's load alone. (A JSON from 931b7f8 also
    has ``tier_load_registered_s``: the load with its sources page-locked read-only instead of
    bounced, an option that measured 19-24x slower and was removed.)"""
    from paramstore import ParamStore
    from paramstore.backends.tiers import device as tiers_device

    cpu = _model(int(gib * (1 << 30)), 64, "cpu")
    pinned = {k: v.pin_memory() for k, v in cpu.items()}
    dst = {k: torch.empty_like(v, device="cuda") for k, v in cpu.items()}
    root = tempfile.mkdtemp(prefix="bench-device-", dir=SHM)
    parts: dict[str, list[float]] = {"cpu_checkout_s": [], "fill_warm_1_thread_s": [], "fill_fresh_threads_s": [],
                                     "unpinned_copy_s": [], "tier_load_s": []}

    def timed(fn: Any) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    try:
        ours, base = [], []
        with ParamStore(os.path.join(root, "s"), create=True) as store:
            for r in range(rounds + 1):
                store.commit(2 * r + 1, {k: v + (r + 1) for k, v in cpu.items()}).result()  # every object new
                torch.cuda.synchronize()
                t = time.perf_counter()
                with store.checkout(2 * r + 1, device="cuda:0") as snap:
                    torch.cuda.synchronize()
                    mine = time.perf_counter() - t
                    assert snap.device_bytes > 0
                t = time.perf_counter()
                for k in cpu:
                    dst[k].copy_(pinned[k], non_blocking=True)
                torch.cuda.synchronize()
                if r:
                    ours.append(mine), base.append(time.perf_counter() - t)
                # The breakdown, each on a fresh mapping of a new version's objects.
                step = 2 * r + 2
                store.commit(step, {k: v - (r + 1) for k, v in cpu.items()}).result()
                with store.checkout(step) as snap:
                    hosts = list(snap._host.values())
                    total = sum(h.numel() for h in hosts)
                    bounce = torch.empty(min(total, 64 << 20), dtype=torch.uint8, pin_memory=True)
                    tier = tiers_device.DeviceTier("cuda:0")
                    ones = tiers_device.COPY_THREADS
                    try:
                        def fill(threads: int) -> None:
                            tiers_device.COPY_THREADS = threads
                            for h in hosts:
                                for a in range(0, h.numel(), bounce.numel()):
                                    n = min(bounce.numel(), h.numel() - a)
                                    tier._fill(bounce[:n], h[a : a + n])
                        fn = timed(lambda: fill(ones))  # first touch of this mapping: its page faults too
                        f1 = timed(lambda: fill(1))  # the mapping faulted in: memcpy alone
                        gpu = [torch.empty(h.numel(), dtype=torch.uint8, device="cuda") for h in hosts]
                        un = timed(lambda: [g.copy_(h) for g, h in zip(gpu, hosts)])
                        del gpu
                        tl = timed(lambda: tier.load(dict(snap._maps)))
                    finally:
                        tiers_device.COPY_THREADS = ones
                        tier.close()
                t = time.perf_counter()  # the CPU part alone (a mapping already made once)
                store.checkout(step).close()
                cpu_s = time.perf_counter() - t
                if r:
                    for key, val in (("cpu_checkout_s", cpu_s), ("fill_warm_1_thread_s", f1), ("fill_fresh_threads_s", fn),
                                     ("unpinned_copy_s", un), ("tier_load_s", tl)):
                        parts[key].append(val)
        return {"gib": gib, "checkout_s": _median(ours), "pinned_copy_s": _median(base),
                "ratio": _median(base) / _median(ours), "copy_threads": tiers_device.COPY_THREADS,
                **{k: _median(v) for k, v in parts.items()}}
    finally:
        shutil.rmtree(root, ignore_errors=True)


_READER = r"""
import json, sys, time, torch
from paramstore import ParamStore
root, step, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.cuda.set_device(0)
times, source = [], None
with ParamStore(root) as store:
    for _ in range(rounds + 1):
        t = time.perf_counter()
        snap = store.checkout(step, device="cuda:0")
        times.append(time.perf_counter() - t)
        source = snap.device_source
        snap.close()
print(json.dumps({"times": times[1:], "source": source}))
"""


def ipc(tensors: int, rounds: int) -> dict[str, Any]:
    """Row 4: a second process's checkout of the latest, mapped through CUDA IPC."""
    from paramstore import ParamStore

    model = _model(256 << 20, tensors, "cuda")
    root = tempfile.mkdtemp(prefix="bench-device-", dir=SHM)
    try:
        with ParamStore(os.path.join(root, "s"), create=True, device_latest="cuda:0") as store:
            store.commit(1, model).result()
            store._write.exporter.wait(1, timeout=120)
            out = subprocess.run([sys.executable, "-c", _READER, os.path.join(root, "s"), "1", str(rounds)],
                                 capture_output=True, text=True, timeout=600, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        return {"tensors": tensors, "checkout_s": _median(got["times"]), "source": got["source"]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def checkout_latency(tensors: int, rounds: int) -> dict[str, Any]:
    """What an IPC checkout does besides opening the owner's handles (one per object): resolve,
    lease, read the manifest, map and check the objects. A reader's first checkout of a version
    parses its manifest; later ones find it parsed. Runs anywhere (CPU)."""
    from paramstore import ParamStore

    root = tempfile.mkdtemp(prefix="bench-device-", dir=SHM)
    try:
        with ParamStore(os.path.join(root, "s"), create=True) as store:
            for step in range(1, rounds + 2):
                store.commit(step, {f"model.layers.{i}.weight": torch.full((64,), float(step + i)) for i in range(tensors)}).result()
        first, again = [], []
        with ParamStore(os.path.join(root, "s")) as reader:
            for step in range(1, rounds + 2):
                t = time.perf_counter()
                reader.checkout(step).close()
                first.append(time.perf_counter() - t)
                t = time.perf_counter()
                reader.checkout(step).close()
                again.append(time.perf_counter() - t)
        return {"tensors": tensors, "first_s": _median(first[1:]), "again_s": _median(again[1:])}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def broadcast(mib: int, receivers: int, bucket_mib: int, rounds: int) -> dict[str, Any]:
    """Row 5 (gloo, CPU): see tools/bench_broadcast.py."""
    from bench_broadcast import run

    return run(mib, receivers, bucket_mib, rounds)


def markdown(res: dict[str, Any]) -> str:
    gpu = res.get("gpu")
    md = [f"GPU: {gpu or NOT_RUN}.", "", "| row | paramstore | baseline | ratio | goal |", "|---|---|---|---|---|"]
    missing = "not run in this run (`--rows`, or it failed: below)" if gpu else NOT_RUN
    if res.get("staging"):
        for r in res["staging"]:
            md.append(f"| D2H staging {r['gib']:g} GiB (commit → staged) | {r['staged_s'] * 1e3:.0f} ms | pinned "
                      f"`copy_` {r['pinned_copy_s'] * 1e3:.0f} ms | {r['ratio']:.2f}× | ≥ 0.8× |")
            md.append(f"| concurrent training step during staging {r['gib']:g} GiB | {r['step_during_s'] * 1e3:.1f} ms | "
                      f"alone {r['step_alone_s'] * 1e3:.1f} ms | {r['slowdown']:.2f}× slower | |")
    else:
        md.append(f"| D2H staging 1/4/16 GiB, concurrent step slowdown | {missing} | | | ≥ 0.8× |")
    if res.get("stall"):
        for r in res["stall"]:
            md.append(f"| trainer blocked by a commit, {r['gib']:g} GiB (copy done after {r['staged_s'] * 1e3:.0f} ms) | "
                      f"{r['ours_s'] * 1e3:.1f} ms | DCP `async_save` (pinned) {r['dcp_s'] * 1e3:.0f} ms | "
                      f"{r['ratio']:.2f}× | ≤ 0.2× |")
    else:
        md.append(f"| trainer blocked by a commit vs DCP `async_save` | {missing} | | | ≤ 0.2× |")
    if res.get("h2d"):
        for r in res["h2d"]:
            md.append(f"| `checkout(device=)` {r['gib']:g} GiB | {r['checkout_s'] * 1e3:.0f} ms | pinned `copy_` "
                      f"{r['pinned_copy_s'] * 1e3:.0f} ms | {r['ratio']:.2f}× | ≥ 0.8× |")
            if "tier_load_s" in r:
                md.append(f"| its parts, {r['gib']:g} GiB: CPU checkout / fill pinned from a fresh mapping, "
                          f"{r['copy_threads']} threads / again, 1 thread / unpinned `copy_` from the mapping / "
                          f"the tier's load from it | {r['cpu_checkout_s'] * 1e3:.1f} / "
                          f"{r['fill_fresh_threads_s'] * 1e3:.0f} / {r['fill_warm_1_thread_s'] * 1e3:.0f} / "
                          f"{r['unpinned_copy_s'] * 1e3:.0f} / "
                          f"{r['tier_load_s'] * 1e3:.0f} ms | | | |")
            if "tier_load_registered_s" in r:
                md.append(f"| the tier's load from a fresh mapping, sources registered read-only (no bounce "
                          f"copy; an option since removed), {r['gib']:g} GiB | {r['tier_load_registered_s'] * 1e3:.0f} ms | pinned `copy_` "
                          f"{r['pinned_copy_s'] * 1e3:.0f} ms | {r['pinned_copy_s'] / r['tier_load_registered_s']:.2f}× "
                          f"| ≥ 0.8× |")
    else:
        md.append(f"| `checkout(device=)` H2D vs pinned `copy_` | {missing} | | | ≥ 0.8× |")
    if res.get("ipc"):
        for r in res["ipc"]:
            md.append(f"| IPC checkout of the latest, {r['tensors']} tensors ({r['source']}) | "
                      f"{r['checkout_s'] * 1e3:.2f} ms | | | ≤ 1 ms |")
    else:
        md.append(f"| IPC checkout of the latest, 100 / 10k tensors | {missing} | | | ≤ 1 ms |")
    for r in res.get("latency", []):
        md.append(f"| its CPU part (lease, manifest, mapping), {r['tensors']} tensors: a version read before / "
                  f"read for the first time | {r['again_s'] * 1e3:.2f} ms / {r['first_s'] * 1e3:.1f} ms | | | ≤ 1 ms |")
    b = res.get("broadcast")
    if b:
        md.append(f"| broadcast {b['mib']} MiB to {b['receivers']} receivers, gloo, {b['bucket_mib']} MiB buckets | "
                  f"{b['paramstore_s'] * 1e3:.0f} ms | raw `dist.broadcast` {b['raw_s'] * 1e3:.0f} ms | "
                  f"{b['ratio']:.2f}× | ≥ 0.9× |")
        md.insert(1, f"Broadcast: medians of {b['rounds']} rounds; other processes used {b.get('foreign_cpu_pct', '?')}% "
                     "of the machine's CPU meanwhile.")
    md.append("| broadcast over NCCL | not run (needs ≥ 2 GPUs) | | | ≥ 0.9× |")
    md += [f"| failed: {e.splitlines()[0][:200]} | | | | |" for e in res.get("errors", [])]
    return "\n".join(md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", default="1,4,16", help="sizes of the staging rows (GPU)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ipc-tensors", default="100,10000")
    ap.add_argument("--broadcast-mib", type=int, default=256)
    ap.add_argument("--receivers", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--rows", default="staging,stall,h2d,ipc,latency,broadcast", help="which rows to run")
    ap.add_argument("--from-json", help="measure nothing: write the tables of an earlier run's JSON")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            earlier = json.load(f)
        write_outputs(None, None, args.markdown, markdown(earlier))
        print(markdown(earlier))
        return 0
    res: dict[str, Any] = {"argv": ["tools/bench_device.py", *sys.argv[1:]], "machine": machine(), "errors": []}
    t0 = time.monotonic()

    def save() -> None:  # after every row: a run stopped part way still leaves what it measured
        res["total_seconds"] = time.monotonic() - t0
        write_outputs(args.json, res, args.markdown, markdown(res))

    def row(key: str, fn: Any, *params: Any) -> None:
        if key not in rows:
            return
        log(f"{key} {params}")
        try:
            res.setdefault(key, []).append(fn(*params))
        except Exception as e:  # one failing row must not hide the others: it is reported instead
            traceback.print_exc()
            res["errors"].append(f"{key}{params}: {type(e).__name__}: {e}")
        save()

    rows = set(args.rows.split(","))
    sizes = [float(x) for x in args.gib.split(",")]
    if torch.cuda.is_available():
        res["gpu"] = torch.cuda.get_device_name(0)
        free = torch.cuda.mem_get_info()[0]
        fits = [g for g in sizes if g * 3 * (1 << 30) < free]  # the model, staging and a matmul
        log(f"GPU rows on {res['gpu']}: {fits} GiB")
        for i, g in enumerate(fits):  # every kind of row at the smallest size first
            row("staging", staging, g, args.rounds)
            if i < 2:
                row("stall", stall, g, args.rounds)
                row("h2d", h2d, g, args.rounds)
            if i == 0:
                for n in args.ipc_tensors.split(","):
                    row("ipc", ipc, int(n), args.rounds)
    for n in args.ipc_tensors.split(","):
        row("latency", checkout_latency, int(n), args.rounds)
    if "broadcast" in rows:
        log("broadcast over gloo")
        try:
            res["broadcast"] = broadcast(args.broadcast_mib, args.receivers, args.bucket_mib, args.rounds)
        except Exception as e:
            traceback.print_exc()
            res["errors"].append(f"broadcast: {type(e).__name__}: {e}")
    save()
    print(markdown(res))
    return 1 if res["errors"] else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
