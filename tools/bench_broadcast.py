"""Collective checkout against a raw ``dist.broadcast``: one source, ``k`` receivers, gloo on this machine.

``1 + k`` spawned processes join one gloo group (``file://`` rendezvous); each has its own store on
/dev/shm (its own "host"), with retention (keep the last 2, as RL hosts run it: prune and GC run in
the background after the source's commit and after each receiver's checkout, its slab pool
recycles, the source sends from the mappings it kept of what it committed and a receiver receives
into the slabs of the version retention dropped). Each round, side by side in the same processes
and group, in alternating order:

* **paramstore**: the source commits a fresh version of ``--mib`` MiB of bf16 tensors (random bits,
  outside the timing); then every member runs ``store.checkout(step, group=WORLD, src=0,
  bucket_bytes=...)``: the whole protocol (agreement, offer, status, buckets, verification of every
  received object, placement, registration, lease and mapping). Afterwards retention and the
  receivers' pools prepare the next destinations, as they do between training steps; every timing
  starts after a pause (``settle``) in which that background work ends.
* **raw**: ``dist.broadcast`` of the same number of bytes, in buckets of the same size, from a
  preallocated buffer of the source into a preallocated (faulted) buffer of each receiver: no
  verification, nothing stored.

A round's time is the slowest member's (each starts after a barrier); the figures are medians over
``--rounds`` rounds after one warm-up round. ``ratio`` = raw time / paramstore time (goal ≥ 0.9).

    .venv/bin/python tools/bench_broadcast.py --mib 256 --receivers 3 --bucket-mib 64 --rounds 5 \\
        --json out/bench_broadcast.json

``--phases`` also times the parts of each collective checkout on every member (agreement, the small
rounds, the bucket loop, registration, the checkout's own part: :data:`PHASES`), and
``--no-verify`` is a diagnostic run in which receivers skip verification (labelled so in its
table), to tell what verification costs from what the transfer costs:

    .venv/bin/python tools/bench_broadcast.py --mib 1024 --receivers 7 --rounds 3 --phases [--no-verify]

Other benchmarks call :func:`run` (``tools/bench_device.py``'s broadcast row).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import CpuMeter, log, machine, write_outputs  # noqa: E402

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
TENSORS = 8  # the version's bf16 tensors (one object: the default shard is 256 MiB)


#: The parts of a collective checkout ``--phases`` times: (label, class in paramstore.collective,
#: method); each call's seconds are added up per checkout. What the checkout spends outside
#: ``_Broadcast.run`` (lease, manifest, mapping) is reported as "the checkout's own part".
PHASES = (("agreement", "_Broadcast", "_agree"), ("small rounds", "_Broadcast", "_exchange"),
          ("bucket loop", "_Buckets", "run"), ("registration", "_Broadcast", "_register"),
          ("broadcast", "_Broadcast", "run"))


def _time_phases(spent: dict[str, float]) -> None:
    """Wrap the methods :data:`PHASES` names so that each call adds its seconds to ``spent``."""
    from paramstore import collective

    for label, cls, name in PHASES:
        klass = getattr(collective, cls)
        method = getattr(klass, name)

        def timed(*a: Any, _m: Any = method, _label: str = label, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _m(*a, **k)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.perf_counter() - t

        setattr(klass, name, timed)


def _verification_off() -> None:
    """Diagnostic only (the product never does this): receivers neither hash nor check what they
    receive, to show what verification costs."""
    from paramstore import collective

    collective._InOrder.upto = lambda self, end: None  # type: ignore[method-assign]
    collective._InOrder.result = lambda self: None  # type: ignore[method-assign]


def _member(rank: int, world: int, base: str, mib: int, bucket: int, rounds: int, settle: float,
            results: Any, phases: bool = False, verify: bool = True) -> None:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    import paramstore

    spent: dict[str, float] = {}
    if phases:
        _time_phases(spent)
    if not verify:
        _verification_off()
    try:
        dist.init_process_group("gloo", init_method=f"file://{base}/pg", rank=rank, world_size=world)
        store = paramstore.ParamStore(f"{base}/host{rank}", create=True, retention={"keep_last": 2})
        total = mib << 20
        raw = torch.empty(total, dtype=torch.uint8)
        if rank == 0:
            raw.random_()
        else:
            raw.zero_()  # faulted, as the store's prepared slabs are
        per = total // TENSORS
        times: dict[str, list[float]] = {"paramstore": [], "raw": []}
        cpu: dict[str, list[float]] = {"paramstore": [], "raw": []}  # this process's CPU-seconds (all threads)
        moved: list[int] = []
        parts: list[dict[str, float]] = []  # per paramstore round: seconds per phase (--phases)

        def timed(what: str, step: int) -> None:
            time.sleep(settle)  # background work (slabs faulted after a commit or a receive) is done
            dist.barrier()
            spent.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            if what == "raw":
                for lo in range(0, total, bucket):
                    dist.broadcast(raw[lo: lo + bucket], src=0)
            else:
                with store.checkout(step, group=dist.group.WORLD, src=0, bucket_bytes=bucket) as snap:
                    moved.append(snap.fetch.bytes)
            times[what].append(time.perf_counter() - t0)
            cpu[what].append(time.process_time() - c0)
            if what == "paramstore" and phases:
                parts.append({**spent, "the checkout's own part": times[what][-1] - spent.get("broadcast", 0.0)})

        for r in range(rounds + 1):  # round 0: warm-up
            step = r + 1
            if rank == 0:
                bits = torch.empty(total, dtype=torch.uint8).random_()
                model = {f"layer{i}.weight": bits[i * per:(i + 1) * per].view(torch.bfloat16).view(-1, 1024)
                         for i in range(TENSORS)}
                store.commit(step, model).result()
                del model, bits
            order = ("raw", "paramstore") if r % 2 else ("paramstore", "raw")
            for what in order:
                timed(what, step)
        store.close()
        results.put((rank, "ok", {"paramstore": times["paramstore"][1:], "raw": times["raw"][1:],
                                  "moved": moved[1:], "phases": parts[1:],
                                  "cpu_paramstore": cpu["paramstore"][1:], "cpu_raw": cpu["raw"][1:]}))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run(mib: int = 256, receivers: int = 3, bucket_mib: int = 64, rounds: int = 5, *,
        settle: float = 1.5, timeout: float = 900.0, phases: bool = False, verify: bool = True) -> dict[str, Any]:
    """Broadcast a version of ``mib`` MiB (bf16) from one source to ``receivers`` over gloo, with
    paramstore and with a raw ``dist.broadcast`` of the same bytes and bucket size.

    Args:
        mib: the version's size (MiB; a multiple of 8 keeps the tensors whole rows).
        receivers: members that receive it (the group has ``receivers + 1`` processes).
        bucket_mib: bytes per broadcast, MiB (both sides).
        rounds: timed rounds (after one warm-up round).
        settle: seconds every member pauses before each timing, so that background work (the
            slabs a store faults after a commit or a receive, for the next one) is not measured.
        timeout: seconds the whole run may take before every process is killed.
        phases: also time the parts of each collective checkout (:data:`PHASES`) on every member.
        verify: False is a diagnostic: receivers skip verification (what it costs; the product
            always verifies).

    Returns:
        ``{"mib", "receivers", "bucket_mib", "rounds", "paramstore_s", "raw_s", "ratio",
        "paramstore_all", "raw_all", "ratio_all", "bytes_per_receiver", "cpu_s_per_gib", "foreign_cpu_pct",
        "machine"}``: medians over the rounds of the slowest member's time; ``ratio`` = raw / paramstore;
        ``cpu_s_per_gib``: ``{"paramstore"|"raw": {"receiver", "source"}}``, a member's CPU-seconds
        (every thread of its process) per GiB of the version, medians over the rounds (receivers:
        their mean);
        ``foreign_cpu_pct``: the machine's CPU other processes used during the run (noise);
        ``verify``; with ``phases``: ``"phases": {"source"|"receivers": {part: seconds}}``, the
        median over rounds of the source's and of the slowest receiver's seconds in each part.

    Raises:
        RuntimeError: a member failed or did not finish within ``timeout``.
    """
    world = receivers + 1
    base = tempfile.mkdtemp(prefix="paramstore-bench-broadcast-", dir=SHM)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, world, base, mib, bucket_mib << 20, rounds, settle, results,
                                                 phases, verify), daemon=True)
             for r in range(world)]
    got: dict[int, Any] = {}
    meter = CpuMeter(lambda: [os.getpid(), *(p.pid for p in procs if p.pid is not None)])
    try:
        for p in procs:
            p.start()
        meter.start()
        deadline = time.monotonic() + timeout
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"members {sorted(set(range(world)) - set(got))} did not finish in {timeout} s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a member died (exit codes {[p.exitcode for p in procs]})") from None
                continue
            if status != "ok":
                raise RuntimeError(f"member {rank} failed:\n{value}")
            got[rank] = value
        noise = meter.stop()
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(base, ignore_errors=True)
    slowest = {what: [max(got[r][what][i] for r in got) for i in range(rounds)] for what in ("paramstore", "raw")}
    ours, raw = statistics.median(slowest["paramstore"]), statistics.median(slowest["raw"])
    gib = mib / 1024
    # CPU-seconds per GiB moved (all of a member's threads: gloo's, hashing, copies), median over
    # rounds of the receivers' mean, and the source's
    cpu = {what: {"receiver": statistics.median(
                      statistics.mean(got[r][f"cpu_{what}"][i] for r in got if r) for i in range(rounds)) / gib
                  if receivers else 0.0,
                  "source": statistics.median(got[0][f"cpu_{what}"]) / gib}
           for what in ("paramstore", "raw")}
    return {"mib": mib, "receivers": receivers, "bucket_mib": bucket_mib, "rounds": rounds,
            "paramstore_s": ours, "raw_s": raw, "ratio": raw / ours,
            "paramstore_all": slowest["paramstore"], "raw_all": slowest["raw"],
            "ratio_all": [r / o for r, o in zip(slowest["raw"], slowest["paramstore"])],
            "bytes_per_receiver": statistics.median(got[1]["moved"]) if receivers else 0,
            "cpu_s_per_gib": cpu, "foreign_cpu_pct": noise["foreign_pct"], "machine": machine(), "verify": verify,
            **({"phases": _phases(got, rounds)} if phases else {})}


def _phases(got: dict[int, Any], rounds: int) -> dict[str, dict[str, float]]:
    """Median over rounds of the source's seconds in each part, and of the slowest receiver's."""
    labels = [label for label, _, _ in PHASES if label != "broadcast"] + ["the checkout's own part"]
    out: dict[str, dict[str, float]] = {"source": {}, "receivers": {}}
    for label in labels:
        out["source"][label] = statistics.median(got[0]["phases"][i].get(label, 0.0) for i in range(rounds))
        if len(got) > 1:
            out["receivers"][label] = statistics.median(
                max(got[r]["phases"][i].get(label, 0.0) for r in got if r) for i in range(rounds))
    return out


def _cpu(res: dict[str, Any], what: str) -> str:
    c = res.get("cpu_s_per_gib", {}).get(what)
    return f"{c['receiver']:.2f} / {c['source']:.2f}" if c else ""


def markdown(res: dict[str, Any]) -> str:
    return "\n".join([
        f"Collective checkout, {res['mib']} MiB of bf16 from 1 source to {res['receivers']} receivers, gloo "
        f"(loopback), {res['bucket_mib']} MiB buckets; median of {res['rounds']} rounds, slowest member; other "
        f"processes used {res['foreign_cpu_pct']}% of the machine's CPU meanwhile.",
        "",
        "| | time | throughput per receiver | CPU-s per GiB: receiver / source | ratio (raw / paramstore) | goal |",
        "|---|---|---|---|---|---|",
        f"| `store.checkout(v, group=, src=0)` | {res['paramstore_s'] * 1e3:.0f} ms | "
        f"{res['mib'] / 1024 / res['paramstore_s']:.2f} GiB/s | {_cpu(res, 'paramstore')} | {res['ratio']:.2f}× | ≥ 0.9× |",
        f"| raw `dist.broadcast` | {res['raw_s'] * 1e3:.0f} ms | {res['mib'] / 1024 / res['raw_s']:.2f} GiB/s | "
        f"{_cpu(res, 'raw')} | 1.00× | |",
        *([] if res.get("verify", True) else [
            "", "**Diagnostic run: receivers did not verify what they received** (the product always does)."]),
        *([] if "phases" not in res else [
            "", "Where a collective checkout's time went (ms; medians over rounds; receivers: the slowest "
            "in each round): " + "; ".join(
                f"{label} {res['phases']['source'][label] * 1e3:.1f} / "
                f"{res['phases']['receivers'].get(label, 0.0) * 1e3:.1f}"
                for label in res["phases"]["source"]) + " (source / receivers)."]),
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the version (MiB of bf16)")
    ap.add_argument("--receivers", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--phases", action="store_true", help="also time the parts of each collective checkout")
    ap.add_argument("--no-verify", action="store_true",
                    help="diagnostic: receivers skip verification (what it costs; the product always verifies)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--markdown", help="write the table here")
    args = ap.parse_args()
    log(f"broadcast {args.mib} MiB to {args.receivers} receivers, {args.bucket_mib} MiB buckets, {args.rounds} rounds")
    res = run(args.mib, args.receivers, args.bucket_mib, args.rounds, phases=args.phases, verify=not args.no_verify)
    md = markdown(res)
    print(md)
    write_outputs(args.json, res, args.markdown, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
