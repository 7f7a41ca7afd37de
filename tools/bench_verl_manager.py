"""verl weight syncs through verl's own ``CheckpointEngineManager`` over Ray, on CPU (issue 28, item 2).

Run in verl's environment (``make test-integrations`` builds it)::

    .venv-verl/bin/python tools/bench_verl_manager.py [--gib 1] [--syncs 10] [--json F] [--markdown F]

What runs: verl's real controller path, as ``tests/integrations/test_verl.py`` drives it: a trainer
worker (verl's ``ActorRolloutRefWorker`` with a CPU FSDP2 engine, one rank, a Qwen2 model of about
``--gib`` GiB in fp32 built here) and one rollout replica of one worker (verl's
``CheckpointEngineWorker``) whose server adapter installs as an engine does: every tensor copied
into weights it keeps. Each sync: the trainer's weights change (an optimizer step's worth of
noise, not timed), ``--pause`` seconds pass, then ``await manager.update_weights(step)``: verl aborts
the replicas' requests, runs the trainer's ``send_weights`` and the rollout's ``receive_weights``
together, finalizes both and resumes generation. That whole call is the rollout's pause in verl.

Reported per sync: the pause, how long the trainer's ``send_weights`` took (``paramstore/send_s``:
it returns once the weights are staged), how long the publish took after it (``paramstore/publish_s``,
reported by the next sync's send; none for the last), and the rollout adapter's ``update_weights``
(it starts with the trainer's send: the wait for the published version, then its copies; with
``--follow``, its copies each as soon as the trainer staged the tensor, then the wait for the
version to be published), and of that, the time after its last copy. Baselines in the same run, in this process: verl's ``naive`` in-process handoff of a
state dict of the same size (the generator handed over, each tensor copied), and a bare copy of it;
in the trainer worker, after the syncs, verl's own export (its generator drained: FSDP2's
``state_dict`` and a ``full_tensor`` per parameter) alone and with each tensor copied out into
buffers made beforehand: the part of the trainer's hold any backend that copies pays.
Issue 28's goals over syncs 2..N: pause ≤ 1.5× naive, trainer held ≤ 1.3× the bare copy, slowest
sync ≤ 1.5× the median.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(os.path.dirname(HERE), "tests", "integrations")
sys.path[:0] = [HERE, WORKERS]
from benchlib import machine, write_outputs  # noqa: E402

#: hidden size of the model built; its layer count is chosen for --gib (fp32, ~37.7 MB per layer)
HIDDEN = 1024


def _layers(gib: float) -> int:
    h = HIDDEN
    per_layer = (h * h + h) + 2 * (h * h // 2 + h // 2) + h * h + 3 * h * 2 * h + 2 * h  # attention, MLP, norms
    return max(1, round(gib * (1 << 30) / 4 / per_layer))


def _naive(state: dict[str, torch.Tensor], syncs: int) -> tuple[list[float], list[float]]:
    """verl's naive backend on a state dict of the same size, in this process; and a bare copy."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    naive = CheckpointEngineRegistry.new("naive", bucket_size=2048 << 20, is_master=True)
    dst = {n: torch.zeros_like(t) for n, t in state.items()}
    scratch = {n: torch.zeros_like(t) for n, t in state.items()}
    handoff, bare = [], []
    for step in range(1, syncs + 1):
        for t in state.values():
            t.add_(1)
        t0 = time.monotonic()
        naive.send_weights(((n, t) for n, t in state.items()), global_steps=step)
        for name, tensor in naive.receive_weights(global_steps=step):
            dst[name].copy_(tensor)
        handoff.append(time.monotonic() - t0)
        t0 = time.monotonic()
        for n, t in state.items():
            scratch[n].copy_(t)
        bare.append(time.monotonic() - t0)
    return handoff, bare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--syncs", type=int, default=10)
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between syncs (the training step)")
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--follow", action="store_true",
                    help="the backend's follow option: the rollout installs each tensor as the trainer stages it")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    res: dict = {"argv": ["tools/bench_verl_manager.py", *sys.argv[1:]], "machine": machine()}
    t_start = time.monotonic()

    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl_cpu_workers import (InstallingRolloutWorker, backend_overrides, compose_config, make_tiny_model,
                                  start_ray, start_workers)

    work = tempfile.mkdtemp(prefix="bench-verl-manager-", dir=args.shm_dir)
    model_dir, root = os.path.join(work, "model"), os.path.join(work, "store")
    steps = list(range(1, args.syncs + 1))
    try:
        make_tiny_model(model_dir, hidden=HIDDEN, layers=_layers(args.gib))
        cfg = compose_config(model_dir, backend_overrides(root, eta=0, timeout=600,
                                                          **({"follow": True} if args.follow else {})))
        start_ray(num_cpus=4)
        try:
            actor_wg, rollout_wg, (replica,), ce_config = start_workers(cfg, trainers=1, replicas=1,
                                                                        rollout_cls=InstallingRolloutWorker)
            state = actor_wg.full_state()[0]  # for the in-process baselines: the same tensors, sizes, dtypes
            nbytes, ntensors = sum(t.nbytes for t in state.values()), len(state)
            print(f"model: {len(state)} tensors, {nbytes / (1 << 30):.3f} GiB (fp32)", flush=True)

            async def run() -> tuple[list[float], list[dict]]:
                await replica.init_hybrid(rollout_wg)
                manager = CheckpointEngineManager(config=ce_config, actor_wg=actor_wg, replicas=[replica])
                pauses, metrics = [], []
                for step in steps:
                    actor_wg.train_step(step)
                    await asyncio.sleep(args.pause)
                    t0 = time.monotonic()
                    metrics.append(await manager.update_weights(step))
                    pauses.append(time.monotonic() - t0)
                    print(f"sync {step}: rollout paused {pauses[-1]:.3f} s (trainer send "
                          f"{metrics[-1]['paramstore/send_s']:.3f} s)", flush=True)
                return pauses, metrics

            pauses, metrics = asyncio.run(run())
            installs, tails = rollout_wg.durations()[0], rollout_wg.tails()[0]
            export, export_copy = [], []  # verl's own export, alone and with a copy out (any backend's floor)
            for _ in steps:
                export.append(actor_wg.export_s(False)[0])
                export_copy.append(actor_wg.export_s(True)[0])
        finally:
            ray.shutdown()
        naive, bare = _naive(state, args.syncs)
        del state
    finally:
        shutil.rmtree(work, ignore_errors=True)

    send = [m["paramstore/send_s"] for m in metrics]
    # step s's publish (after its send returned) is reported by the send of step s + 1
    wait = [m.get("paramstore/publish_s", float("nan")) for m in metrics[1:]] + [float("nan")]
    med = lambda xs: statistics.median(xs[1:] or xs)  # noqa: E731 - over syncs 2..N
    goals = {"pause / naive": (med(pauses) / med(naive), 1.5),
             "trainer held / bare copy": (med(send) / med(bare), 1.3),
             "slowest sync / median": (max(pauses[1:] or pauses) / med(pauses), 1.5)}
    res.update(gib=round(nbytes / (1 << 30), 3), tensors=ntensors,
               pause_s=pauses, send_s=send, publish_s=wait, adapter_update_s=installs, adapter_after_last_copy_s=tails,
               naive_s=naive, bare_copy_s=bare, export_s=export, export_copy_s=export_copy,
               goals={k: {"ratio": v[0], "goal": v[1]} for k, v in goals.items()},
               total_seconds=time.monotonic() - t_start)
    summary = (f"medians over syncs 2..{len(steps)}: rollout paused {med(pauses):.3f} s (its adapter's update "
               f"{med(installs):.3f} s, of which {med(tails):.3f} s after its last copy), trainer send {med(send):.3f} s (then the publish, in the background, "
               f"{statistics.median(wait[1:-1] or wait):.3f} s); naive handoff {med(naive):.3f} s, bare copy "
               f"{med(bare):.3f} s; in the trainer worker, verl's export alone {med(export):.3f} s, and with each "
               f"tensor copied out {med(export_copy):.3f} s")
    print(summary)
    for name, (got, goal) in goals.items():
        print(f"  {name}: {got:.2f}x (goal <= {goal}x: {'met' if got <= goal else 'missed'})")
    md = [f"verl's `CheckpointEngineManager.update_weights` over Ray, a {res['gib']} GiB fp32 Qwen2 "
          f"({args.pause} s between syncs; one trainer rank, one rollout replica"
          f"{'; the rollout follows the commit (`follow: true`)' if args.follow else ''}):", "",
          "| sync | rollout paused (s) | adapter's update: copies + wait (s) | of which after its last copy (s) "
          "| trainer send (s) | then its publish (s) | naive handoff (s) | bare copy (s) |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {s} | {p:.3f} | {i:.3f} | {t:.3f} | {c:.3f} | {'–' if w != w else f'{w:.3f}'} | {n:.3f} | {b:.3f} |"
           for s, p, i, t, c, w, n, b in zip(steps, pauses, installs, tails, send, wait, naive, bare)]
    md += ["", summary[0].upper() + summary[1:] + ".", "", "| goal (syncs 2..N) | measured | goal | |",
           "|---|---:|---:|---|"]
    md += [f"| {name} | {got:.2f}× | ≤ {goal}× | {'met' if got <= goal else 'missed'} |"
           for name, (got, goal) in goals.items()]
    md.append(f"| trainer held / (verl's export + a copy out), for reading | {med(send) / med(export_copy):.2f}× | – | |")
    write_outputs(args.json, res, args.markdown, "\n".join(md))


if __name__ == "__main__":
    main()
