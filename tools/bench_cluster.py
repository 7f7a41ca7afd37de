"""Simulated cluster: weights from 1 trainer to N rollout hosts over rate-limited links, 4 strategies.

The hosts are network namespaces on this machine (tools/netcluster.py): each has its own address
and a link to a switch limited by ``tc tbf`` (``--rate``, each direction); this kernel has no
``sch_netem``, so there is **no latency emulation** (the round trip is a veth's, microseconds).
redis-server (the shared registry) runs in the trainer's namespace on the trainer's address
(``--registry-host``: on a host of its own, so the trainer's egress carries no registry replies); each
host runs a process of tools/cluster_host.py with its own store root on /dev/shm and its own
Mooncake transfer engine (TCP). The trainer commits a synthetic model of bf16 tensors (``--mib``,
``--tensors``). Strategies, each on the same links in the same run:

1. **swarm**: paramstore as it is; every rollout host checks version 0 out at once (they fetch
   slices from the trainer and from each other, coordinated through the registry; ``--fanout``
   fixes the relay's fan-out, 1 a chain, 2 a binary tree). Measured twice
   per round (the first version of the ``patches=False`` store and of the ``patches=True`` one).
2. **chain**: a chain broadcast trainer → 1 → 2 → … (as verl's Mooncake checkpoint backend does):
   each host reads the model from its predecessor with raw Mooncake reads in ``--slice-mib`` (1 MiB)
   slices, each as soon as the predecessor has it (a TCP side channel says how far it has got).
3. **star**: every host reads the whole model straight from the trainer with raw Mooncake reads,
   all at once.
4. **update** at each fraction of ``--fraction``: every host holds version v; the trainer commits
   v+1 with that fraction of every tensor's elements changed (bit patterns), then all hosts check
   v+1 out: with ``ParamStore(patches=False)`` (whole objects, nearly the whole model moves) and,
   when the store has the option, ``patches=True`` (sparse patches; "not run" otherwise).

Per strategy: time until all N hosts hold the model (the driver's clock from the moment it sends
the command; the hosts' clocks are the same machine's), over ideal = model bytes / link rate; the
time to reach k hosts, taken from the same all-at-once run (the k-th host to finish; no separate
runs with k hosts); the trainer's egress from its namespace's eth0 ``tx_bytes`` counter (every
byte it sent, headers and registry traffic included) over the model bytes; CPU: the machine's busy
share (every core, softirq included) during the transfer. All N + 1 hosts and redis share this
machine's cores: where the busy share is near 100% the run was CPU-bound, not link-bound.
This machine is shared: before each measurement the driver waits (up to ``--quiet-wait`` s) for
processes other than the benchmark's to use < 10% of it, and reports their share during the
measurement. Before each checkout every host waits (up to 10 s) for its store's slab pool to have
prepared its destinations (a host's idle time between versions); ``--kick-pool`` is an experiment
that wakes the pool's fill thread where it is not ready (see the flag's help).
The link rate a transfer actually gets (``tc tbf`` and TCP headers take their share) is measured
in the same run: the chain's first host reads the model alone from the trainer with raw Mooncake
reads over one link (its own clock); ideal = model / that rate. Goals (issue 27): time to all ≤
1.5× ideal at 1 Gbit/s and ≤ 1.3× at 100 Mbit/s; trainer egress ≤ 1.05× the model on every store
run; one peer fetch (1 host) ≥ 0.9× the raw read of the same bytes on the same link; patches ≤
0.1× the whole-object time at 1% changed; each row with the CPU-seconds per rollout host per GiB
of model (where 8 hosts share 2 cores, that figure says how CPU-bound a row is).

**Sweep**: ``--hosts`` and ``--rate`` take comma-separated lists; each (rate, hosts) pair is its own
cluster, run one after the other. The report then has one row per pair (time to all against the
measured ideal, trainer egress and bytes received per host against the model, CPU-s per host per
GiB), the goal rows, and the detailed tables of the largest host count at each rate; ``--plots``
writes the plots against host count (:data:`SWEEP_SVGS`, under ``docs/``).

Everything (namespaces, processes, /dev/shm roots) is removed at the end, also on an error, Ctrl-C,
SIGTERM or ``--timeout``. Needs root.

    .venv/bin/python tools/bench_cluster.py --quick                       # 3 hosts, 16 MiB, < 1 min
    .venv/bin/python tools/bench_cluster.py --fraction 0.001,0.01,0.05 --json out/bench_cluster.json --write
    .venv/bin/python tools/bench_cluster.py --hosts 1,2,4,8 --rate 1gbit,100mbit --no-star \
        --json out/cluster_sweep.json --markdown out/cluster_sweep.md --plots   # the sweep
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import CpuMeter, log, machine, wait_quiet, write_outputs
from cluster_host import ClusterRun, MiB, running_cluster
from netcluster import _bits_per_s
from svgplot import line_plot

DOCS = os.path.join(os.path.dirname(HERE), "docs")
TIME_SVG, BYTES_SVG = "bench_cluster_time.svg", "bench_cluster_bytes.svg"
#: The sweep's plots, under docs/ (linked from the Markdown as seen from docs/benchmarks.md).
SWEEP_SVGS = {"time": "img/cluster_hosts_time.svg", "bytes": "img/cluster_hosts_bytes.svg"}
STRATEGIES = ("swarm", "chain", "star")
GiB = 1 << 30
#: Issue 27's goals for time to all over the measured ideal, by link rate (bits/s); other rates have none.
TIME_GOALS = {10**9: 1.5, 10**8: 1.3}
EGRESS_GOAL = 1.05  # trainer egress / model, every store run
FETCH_GOAL = 0.9  # one peer fetch (1 host) / a raw read of the same bytes on the same link


def store_has_patches() -> bool:
    """Whether the paramstore under test has patches (an older checkout, for a baseline, may not)."""
    try:
        from paramstore.options import StoreOptions
    except ImportError:  # before StoreOptions: the options were ParamStore's keyword arguments
        import inspect

        from paramstore import ParamStore

        return "patches" in inspect.signature(ParamStore).parameters
    return "patches" in {f.name for f in dataclasses.fields(StoreOptions)}


def _cpu_s(pids: list[int]) -> list[float]:
    """User + system CPU seconds of each process (every thread; 0 if gone)."""
    tick, out = os.sysconf("SC_CLK_TCK"), []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):
            out.append(0.0)
    return out


def _cpu_times() -> list[int]:
    """The machine's /proc/stat cpu line: user nice system idle iowait irq softirq steal (ticks)."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


class Meter:
    """Wall time, CPU and eth0 counters of every host around one all-at-once operation."""

    def __init__(self, run: ClusterRun, quiet_wait: float) -> None:
        self.run, self.quiet_wait = run, quiet_wait

    def __call__(self, fn: Callable[[], list[dict[str, Any]]], settle: bool | None = None) -> dict[str, Any]:
        """``fn()`` measured, every host's slab pool ready first (its background thread, at the
        lowest CPU priority, would otherwise fault the last phase's next slabs in this one: with
        the raw baselines unsettled, the chain took 2.91-3.21 s against 2.58-2.61 s), outside the
        measurement. ``settle``: a store checkout's (True: kick a rollout's pool if it is not
        ready; see ``--kick-pool``), whose rollouts' replies then say whether it was."""
        every = self.run.settle_all(self.run.hosts, kick=bool(settle))
        settled = None if settle is None else every[1:]
        pids = self.run.pids()
        quiet = None
        if self.quiet_wait > 0:  # other processes on this machine (tests...) take the cores the hosts share
            quiet = wait_quiet(CpuMeter(lambda: pids), self.quiet_wait, 10.0, window_s=0.5)
            if quiet["foreign_pct"] >= 10:
                log(f"  (machine not quiet: other processes use {quiet['foreign_pct']:.0f}% after "
                    f"{quiet['waited_s']:.0f} s)")
        c0, g0 = self.run.counters(), self.run.registry_counters()
        cpu, p0, m0 = CpuMeter(lambda: pids), _cpu_s(pids), _cpu_times()
        t0 = time.perf_counter()
        reps = fn()
        wall = time.perf_counter() - t0
        use, p1, m1 = cpu.stop(), _cpu_s(pids), _cpu_times()
        dm = [b - a for a, b in zip(m0, m1)]
        per = [b - a for a, b in zip(p0, p1)]  # trainer, rollouts..., redis
        c1, g1 = self.run.counters(), self.run.registry_counters()
        tx = [b["tx"] - a["tx"] for a, b in zip(c0, c1)]
        rx = [b["rx"] - a["rx"] for a, b in zip(c0, c1)]
        done = [r["done_s"] for r in reps]
        for r, st in zip(reps, settled or []):
            r["settled"] = st
        unsettled = sum(not r.get("settled", {"settled": True})["settled"] for r in reps)
        kicked = sum(bool(r.get("settled", {}).get("kicked")) for r in reps)
        trainer = self.run.hosts[0].address + ":"  # what the rollout hosts say the trainer's peer served them
        served = sum(b for r in reps for p, b in ((r.get("fetch") or {}).get("bytes_from") or {}).items()
                     if p.startswith(trainer))
        failed = sum(sum(((r.get("fetch") or {}).get("failed") or {}).values()) for r in reps)
        return {"time_all_s": max(done), "done_s": done, "wall_s": wall, "trainer_tx": tx[0], "trainer_served": served,
                "failed": failed,
                "registry_tx": None if g0 is None or g1 is None else g1["tx"] - g0["tx"],
                "rollout_rx": sum(rx[1:]), "tx": tx, "rx": rx, "busy_pct": use["busy_pct"],
                "ours_pct": round(use["busy_pct"] - use["foreign_pct"], 1), "unsettled": unsettled, "kicked": kicked,
                "softirq_pct": round(100.0 * dm[6] / max(1, sum(dm)), 1), "quiet": quiet,
                "cpu_s": {"trainer": per[0], "rollouts": per[1:-1], "redis": per[-1]}, "replies": reps}


def _raw(run: ClusterRun, meter: Meter, objects: list[list[Any]], a: argparse.Namespace,
         timeout: float) -> dict[str, Any]:
    """chain and star with raw Mooncake reads of the trainer's objects (version 0)."""
    segments, off = [], 0
    for _, addr, n in objects:
        segments.append([off, addr, n])
        off += n
    total = off
    rs = run.rollouts
    prep = run.all(rs, "raw_prepare", 60, total=total)
    # connect every engine to the peers it will read from (the trainer; its chain predecessor)
    run.all(rs, "raw_warm", 60, peer=run.trainer.session, remote=objects[0][1])
    for i, h in enumerate(rs[1:], 1):
        h.ask("raw_warm", 60, peer=rs[i - 1].session, remote=prep[i - 1]["addr"])
    slice_b, window = int(a.slice_mib * MiB), a.window
    out = {}
    for how in ("chain",) if a.no_star else ("chain", "star"):
        def go(how: str = how) -> list[dict[str, Any]]:
            t0 = time.time()
            for i, h in enumerate(rs):
                if how == "star" or i == 0:
                    h.send(how, peer=run.trainer.session, segments=segments, slice=slice_b, window=window,
                           timeout=timeout, successor=how == "chain" and len(rs) > 1)
                else:
                    h.send(how, peer=rs[i - 1].session, segments=[[0, prep[i - 1]["addr"], total]], slice=slice_b,
                           window=window, timeout=timeout, successor=i < len(rs) - 1,
                           notify=[rs[i - 1].address, prep[i - 1]["port"]])
            reps = [h.expect(timeout + 30) for h in rs]
            for r in reps:
                r["done_s"] = r["end"] - t0
            return reps

        out[how] = meter(go)
        check = rs[-1].ask("raw_check", 120, objects=objects, segments=segments)  # the bytes that arrived
        if not check["ok"]:
            raise RuntimeError(f"{how}: the last host's bytes differ from the trainer's objects")
        log(f"  {how}: all {len(rs)} hosts in {out[how]['time_all_s']:.2f} s")
    run.all(rs, "raw_free", 60)
    return out


def _registry_tx(m: dict[str, Any]) -> str:
    """", registry egress X MiB" where redis-server runs on a host of its own (``--registry-host``)."""
    return "" if m.get("registry_tx") is None else f", registry egress {m['registry_tx'] / MiB:.2f} MiB"


def one_round(run: ClusterRun, r: int, a: argparse.Namespace, patches: bool, fractions: list[float]) -> dict[str, Any]:
    meter = Meter(run, a.quiet_wait)
    seed = 100 * r + 1
    timeout = a.op_timeout
    row: dict[str, Any] = {"round": r, "updates": {}}
    for mode in (["full", "patches"] if patches else ["full"]):
        name = f"r{r}-{mode}"
        run.open_all(name, patches=(mode == "patches") if patches else None, shard_mib=a.shard_mib)
        v0 = run.commit(0, seed)
        row.setdefault("model_bytes", v0["model_bytes"])
        row.setdefault("objects", len(v0["objects"]))
        key = "swarm" if mode == "full" else "swarm_b"
        # checkouts: the slab pools get ready first (settle), outside the measurement
        row[key] = meter(lambda: run.checkout_all(0, timeout=timeout, settle=0), settle=a.kick_pool)
        log(f"round {r} ({mode}): swarm: all {len(run.rollouts)} hosts in {row[key]['time_all_s']:.2f} s, "
            f"trainer egress {row[key]['trainer_tx'] / v0['model_bytes']:.2f}x model" + _registry_tx(row[key]))
        if mode == "full":
            row.update(_raw(run, meter, v0["objects"], a, timeout))
        for j, f in enumerate(fractions, 1):
            v = run.commit(j, seed + j, f, digests=a.check)
            m = meter(lambda j=j, v=v: run.checkout_all(j, check=v["tensor_digests"], timeout=timeout, settle=0),
                      settle=a.kick_pool)
            if a.check and not all(x["ok"] for x in m["replies"]):
                raise RuntimeError(f"{mode} update to {f}: a host's tensors differ from the trainer's")
            m.update(fraction=f, changed=v["changed"] / v["elements"], patch_s=v["patch_s"], commit_s=v["commit_s"],
                     patch_bytes=v["patch_bytes"],
                     moved=statistics.mean(x["fetch"]["bytes"] for x in m["replies"]),
                     from_patches=sum(x["fetch"].get("from_patches", 0) for x in m["replies"]))
            row["updates"].setdefault(mode, {})[str(f)] = m
            log(f"  update {f:g} ({mode}): all in {m['time_all_s']:.2f} s, {m['moved'] / MiB:.2f} MiB per host, "
                f"trainer egress {m['trainer_tx'] / MiB:.1f} MiB (patches made in {v['patch_s']:.2f} s)" + _registry_tx(m))
        run.close_all()
    return row


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds, per strategy: time to all, ratios, time to k hosts, egress, CPU."""
    rows, model, n = res["rounds"], res["model_bytes"], res["hosts"]
    ideal = res["link_s"]  # model / the measured raw link rate
    med = statistics.median

    def agg(ms: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
        ks = [sorted(m["done_s"]) for m in ms]
        return {"time_all_s": med(m["time_all_s"] for m in ms),
                "vs_ideal": med(m["time_all_s"] for m in ms) / ideal,
                "vs_nominal": med(m["time_all_s"] for m in ms) / res["ideal_s"],
                "time_to_k": [med(k[i] for k in ks) for i in range(n)],
                "egress_vs_model": med(m["trainer_tx"] for m in ms) / model,
                "egress_max_vs_model": max(m["trainer_tx"] for m in ms) / model,
                "served_vs_model": med(m.get("trainer_served", 0) for m in ms) / model,
                "rx_per_host": med(m["rollout_rx"] for m in ms) / n,
                "busy_pct": med(m["busy_pct"] for m in ms), "ours_pct": med(m["ours_pct"] for m in ms),
                "softirq_pct": med(m.get("softirq_pct", 0.0) for m in ms),
                "others_pct": med(max(0.0, m["busy_pct"] - m["ours_pct"] - m.get("softirq_pct", 0.0)) for m in ms),
                "unsettled": sum(m["unsettled"] for m in ms), "kicked": sum(m["kicked"] for m in ms),
                "failed": sum(m.get("failed", 0) for m in ms),
                "cpu_rollout_s": med(statistics.mean(m["cpu_s"]["rollouts"]) for m in ms),
                "cpu_per_gib": med(statistics.mean(m["cpu_s"]["rollouts"]) for m in ms) / (model / GiB),
                "cpu_trainer_s": med(m["cpu_s"]["trainer"] for m in ms),
                "cpu_redis_s": med(m["cpu_s"]["redis"] for m in ms),
                "runs": len(ms), **(extra or {})}

    out: dict[str, Any] = {"swarm": agg([x["swarm"] for x in rows] + [x["swarm_b"] for x in rows if "swarm_b" in x]),
                           **{k: agg([x[k] for x in rows]) for k in ("chain", "star") if k in rows[0]}}
    for mode in ("full", "patches"):
        for f in res["fractions"]:
            ms = [x["updates"][mode][str(f)] for x in rows if mode in x["updates"]]
            if ms:
                out[f"{mode}@{f}"] = agg(ms, {
                    "fraction": f, "moved_per_host": med(m["moved"] for m in ms),
                    "patch_bytes": med(m["patch_bytes"] or 0 for m in ms), "patch_s": med(m["patch_s"] for m in ms),
                    "from_patches": med(m["from_patches"] for m in ms)})
    return out


Goal = tuple[str, str, str, str, "bool | None"]  # what, measured, target, CPU-s per host per GiB, met


def _store_runs(s: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in s.items() if k == "swarm" or k.startswith(("full@", "patches@"))}


def goals(res: dict[str, Any]) -> list[Goal]:
    """Issue 27's goal rows for one cluster run (``res``: one (rate, hosts) pair)."""
    s, f1, n = res["summary"], res["goal_fraction"], res["hosts"]
    sw = s["swarm"]
    target = TIME_GOALS.get(_bits_per_s(res["rate"]))
    rows: list[Goal] = [
        (f"swarm: time to all / ideal (measured link rate), {n} host{'s' if n > 1 else ''} at {res['rate']}",
         f"{sw['vs_ideal']:.2f}× ({sw['time_all_s']:.2f} s / {res['link_s']:.2f} s)",
         f"≤ {target}×" if target else "— (no goal at this rate)", f"{sw['cpu_per_gib']:.2f}",
         sw["vs_ideal"] <= target if target else None)]
    if n == 1:
        ratio = res["link_s"] / sw["time_all_s"]
        rows.append((f"one peer fetch / a raw transfer-engine read of the same bytes, one link at {res['rate']}",
                     f"{ratio:.2f}× ({res['link_s']:.2f} s raw, {sw['time_all_s']:.2f} s fetch)", f"≥ {FETCH_GOAL}×",
                     f"{sw['cpu_per_gib']:.2f}", ratio >= FETCH_GOAL))
    full, patch = s.get(f"full@{f1}"), s.get(f"patches@{f1}")
    if patch:
        ratio = patch["time_all_s"] / full["time_all_s"]
        rows.append((f"patches: time to all / whole objects, {f1 * 100:g}% changed, {n} host{'s' if n > 1 else ''} at "
                     f"{res['rate']}", f"{ratio:.3f}×", "≤ 0.1×",
                     f"{patch['cpu_per_gib']:.2f}", ratio <= 0.1))
    else:
        rows.append((f"patches at {f1 * 100:g}% changed", "not run: store has no patches option", "≤ 0.1×", "", None))
    worst_k, worst = max(((k, v["egress_max_vs_model"]) for k, v in _store_runs(s).items()), key=lambda x: x[1])
    rows.append((f"trainer egress / model bytes, worst store run ({worst_k})", f"{worst:.2f}×", f"≤ {EGRESS_GOAL}×",
                 f"{s[worst_k]['cpu_per_gib']:.2f}", worst <= EGRESS_GOAL))
    return rows


def _goal_table(rows: list[Goal]) -> list[str]:
    out = ["| goal | measured | target | CPU-s per host per GiB | |", "|---|---|---|---|---|"]
    for what, value, target, cpu, ok in rows:
        out.append(f"| {what} | {value} | {target} | {cpu} | {'' if ok is None else 'PASS' if ok else 'MISS'} |")
    return out


def report(res: dict[str, Any]) -> str:
    s, n, model = res["summary"], res["hosts"], res["model_bytes"]
    ideal = res["ideal_s"]
    ks = [k for k in (1, 2, 4, 8, 16, 32) if k < n] + [n]
    lines = [
        (f"1 trainer + {n} rollout hosts (network namespaces on one machine, {res['cpus']} CPUs shared by all), "
        f"links {res['rate']} each direction (`tc tbf`; no latency emulation: this kernel has no `sch_netem`); "
        f"model {model / MiB:.0f} MiB of bf16 in {res['tensors']} tensors ({res['objects']} objects); ideal = model / "
        f"measured link rate = {res['link_s']:.2f} s (the chain's first host reading it alone from the trainer, raw: "
        f"{model * 8 / res['link_s'] / 1e6:.0f} Mbit/s; nominal {ideal:.2f} s); "
        f"medians of {len(res['rounds'])} round(s). Time to k hosts: the k-th host to "
        f"finish in the all-at-once run. Served by the trainer's peer: the bytes the rollout hosts' own "
        f"reports (`snap.fetch.bytes_from`) say its peer server gave them (data only). "
        + ("Trainer egress: its eth0 `tx_bytes` (headers included; redis-server runs on a host of its own). "
           if res.get("registry_host") else
           "Trainer egress: its eth0 `tx_bytes` (headers and registry traffic included: redis-server runs "
           "in its namespace). ") +
        f"CPU busy: the whole machine during the transfer (100% = every core; in parentheses, the "
        f"share of processes not of this benchmark, softirq excluded: each measurement first waits up to "
        f"{res['quiet_wait']:g} s for them to use < 10%); CPU-s: user + system "
        f"seconds of the host processes and redis-server (the kernel's network work done in softirq "
        f"context is not always charged to them); per GiB: a rollout host's CPU-s over the model's GiB."),
        "",
        "| strategy | time to all | / ideal | " + " | ".join(f"k={k}" for k in ks)
        + " | trainer egress / model | served by the trainer's peer / model | CPU busy (others) "
        "| CPU-s: per rollout / trainer / redis | CPU-s per host per GiB |",
        "|---|---|---|" + "---|" * len(ks) + "---|---|---|---|---|",
    ]
    names = {"swarm": "swarm (paramstore checkout)", "chain": "chain (raw Mooncake, pipelined)",
             "star": "star (raw Mooncake, all from trainer)"}
    keys = [k for k in STRATEGIES if k in s] + [k for k in s if k.startswith(("full@", "patches@"))]
    for k in keys:
        v = s[k]
        if k in names:
            label = names[k]
        else:
            mode, f = k.split("@")
            label = f"update, {float(f) * 100:g}% changed: " + ("whole objects (patches=False)" if mode == "full"
                                                                  else "patches=True")
        lines.append(f"| {label} | {v['time_all_s']:.2f} s | {v['vs_ideal']:.2f}× | "
                     + " | ".join(f"{v['time_to_k'][k_ - 1]:.2f}" for k_ in ks)
                     + f" | {v['egress_vs_model']:.2f}× | "
                     + ("–" if k in ("chain", "star") else f"{v.get('served_vs_model', 0.0):.2f}×")
                     + f" | {v['busy_pct']:.0f}% ({v['others_pct']:.0f}%) | "
                     f"{v['cpu_rollout_s']:.2f} / "
                     f"{v['cpu_trainer_s']:.2f} / {v['cpu_redis_s']:.2f} | {v['cpu_per_gib']:.2f} |")
    if not res["patches_supported"]:
        lines.append("| update: patches=True | not run: store has no patches option | | " + " | " * len(ks) + " | | |")
    upd = [(k, s[k]) for k in keys if k.startswith(("full@", "patches@"))]
    if upd:
        lines += ["", ("| update | fraction changed | moved per host | patches made (trainer) | objects rebuilt from "
                       "patches (all hosts) | trainer egress |"), "|---|---|---|---|---|---|"]
        for k, v in upd:
            mode = "whole objects" if k.startswith("full@") else "patches"
            made = (f"{v['patch_bytes'] / MiB:.2f} MiB in {v['patch_s']:.2f} s" if k.startswith("patches@")
                    else "—")
            lines.append(f"| {mode} | {v['fraction'] * 100:g}% | {v['moved_per_host'] / MiB:.2f} MiB | {made} | "
                         f"{v['from_patches']:.0f} | {v['egress_vs_model'] * model / MiB:.2f} MiB |")
    lines += ["", *_goal_table(goals(res))]
    cpu_bound = [k for k in keys if s[k]["busy_pct"] >= 90]
    foreign = statistics.median(s[k]["busy_pct"] - s[k]["ours_pct"] for k in keys)
    softirq = statistics.median(s[k]["softirq_pct"] for k in keys)
    star = (f"Star's own floor is {n}× ideal ({n * res['link_s']:.2f} s: the trainer's link carries {n} copies). "
            if "star" in s else "Star not run (`--no-star`). ")
    lines += ["", star
              + (f"CPU-bound (machine ≥ 90% busy during the transfer): {', '.join(cpu_bound)}." if cpu_bound
                 else "No run kept the machine ≥ 90% busy.")
              + f" Busy time not charged to the benchmark's processes (kernel network work in softirq, other "
              f"processes on the machine): median {foreign:.0f}% of the machine, of which softirq {softirq:.0f}%."
              + " Peer reads that failed (`snap.fetch.failed`: transport errors, such as no progress for the "
              "transfer engine's 1 s timeout; nobody was stopped or killed here), all hosts and runs: "
              + ", ".join(f"{k} {s[k]['failed']}" for k in keys if k not in ("chain", "star")) + "."]
    unsettled = {k: s[k]["unsettled"] for k in keys if s[k]["unsettled"]}
    if unsettled:
        lines += ["", "Slab pool not ready after 10 s of idle time before the checkout (the store's pool wanted "
                  "slabs its fill thread was not making; checkouts then create destinations on the spot), "
                  "host-runs: " + ", ".join(f"{k} {v}" for k, v in unsettled.items()) + "."]
    kicked = {k: s[k]["kicked"] for k in keys if s[k]["kicked"]}
    if kicked:
        lines += ["", "Experiment `--kick-pool`: where the slab pool was not ready after 10 s, the host called "
                  "`pool.prepare` again (waking its fill thread) and waited once more; host-runs: "
                  + ", ".join(f"{k} {v}" for k, v in kicked.items()) + "."]
    if res.get("svg"):
        lines += ["", f"![time to reach k hosts]({res['svg']['time']})", "",
                  f"![bytes moved per host vs fraction changed]({res['svg']['bytes']})"]
    return "\n".join(lines)


def plots(res: dict[str, Any]) -> tuple[str, str]:
    s, n = res["summary"], res["hosts"]
    f1 = res["goal_fraction"]
    series = {k: [(i + 1, t) for i, t in enumerate(s[k]["time_to_k"])] for k in STRATEGIES if k in s}
    for mode, label in (("full", "update, whole objects"), ("patches", "update, patches")):
        if f"{mode}@{f1}" in s:
            series[f"{label} ({f1 * 100:g}%)"] = [(i + 1, t) for i, t in enumerate(s[f"{mode}@{f1}"]["time_to_k"])]
    time_svg = line_plot(series, title=f"Time to reach k of {n} hosts ({res['model_bytes'] / MiB:.0f} MiB, {res['rate']})",
                         xlabel="hosts holding the version (k)", ylabel="seconds", xticks=list(range(1, n + 1)),
                         hlines={"ideal: model / measured link": res["link_s"]}, width=760,
                         note=f"k-th host to finish in one all-at-once run; {res['cpus']} CPUs shared by all hosts")
    by = {}
    for mode, label in (("full", "whole objects (patches=False)"), ("patches", "patches=True")):
        pts = [(f, s[f"{mode}@{f}"]["moved_per_host"] / MiB) for f in res["fractions"] if f"{mode}@{f}" in s]
        if pts:
            by[label] = pts
    bytes_svg = line_plot(by, title="Bytes moved per host for one update", xlabel="fraction of elements changed",
                          ylabel="MiB per host", logx=True, logy=True,
                          hlines={"model": res["model_bytes"] / MiB}, width=760,
                          note=f"{res['model_bytes'] / MiB:.0f} MiB bf16 model; every tensor changed")
    return time_svg, bytes_svg


def write_docs(res: dict[str, Any], markdown: str, doc: str) -> None:
    """Replace the ``cluster`` block of docs/benchmarks.md (appended with a heading if absent)."""
    import docgen

    content = docgen.provenance(res, time.time()) + "\n\n" + markdown
    with open(doc) as f:
        text = f.read()
    try:
        text = docgen.replace_block(text, "cluster", content)
    except KeyError:
        text = (text.rstrip("\n") + "\n\n# Simulated cluster: `tools/bench_cluster.py`\n\n"
                "<!-- BEGIN generated:cluster -->\n" + content.strip() + "\n<!-- END generated:cluster -->\n")
    with open(doc, "w") as f:
        f.write(text)
    log(f"wrote the cluster block of {doc}")


def sweep_report(sweep: list[dict[str, Any]], svg: dict[str, str] | None) -> str:
    """The Markdown of a sweep: one row per (rate, hosts) pair, the goal rows, then the detailed
    report of the largest host count at each rate."""
    first = sweep[0]
    rates = list(dict.fromkeys(r["rate"] for r in sweep))
    lines = [
        (f"Sweep over host counts and link rates: 1 trainer + N rollout hosts (network namespaces on one machine, "
         f"{first['cpus']} CPUs shared by all), each (rate, N) its own cluster, one after the other; model "
         f"{first['model_bytes'] / MiB:.0f} MiB of bf16 in {first['tensors']} tensors; medians of "
         f"{len(first['rounds'])} round(s) each. Ideal = model / the link rate measured in the same cluster (the "
         f"chain's first host reading the model alone from the trainer with raw Mooncake reads). Time to all: "
         f"paramstore's checkout of a fresh version (swarm: the verified relay) and the raw pipelined chain. "
         f"Egress: the trainer's eth0 `tx_bytes` over the model; received: each rollout host's `rx_bytes` over "
         f"the model (mean). CPU-s per host per GiB: a rollout host's user + system CPU seconds over the model's "
         f"GiB (swarm / chain). Others: the share of the machine used by processes not of this benchmark."),
        "",
        "| rate | hosts | swarm: time to all | / ideal | chain: time to all | / ideal | measured link | "
        "trainer egress / model: swarm / chain | received per host / model (swarm) | "
        "CPU-s per host per GiB: swarm / chain | CPU busy (others) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sweep:
        s, model = r["summary"], r["model_bytes"]
        sw, ch = s["swarm"], s["chain"]
        lines.append(
            f"| {r['rate']} | {r['hosts']} | {sw['time_all_s']:.2f} s | {sw['vs_ideal']:.2f}× | {ch['time_all_s']:.2f} s "
            f"| {ch['vs_ideal']:.2f}× | {r['link_s']:.2f} s ({model * 8 / r['link_s'] / 1e6:.0f} Mbit/s) | "
            f"{sw['egress_vs_model']:.2f}× / {ch['egress_vs_model']:.2f}× | {sw['rx_per_host'] / model:.2f}× | "
            f"{sw['cpu_per_gib']:.2f} / {ch['cpu_per_gib']:.2f} | {sw['busy_pct']:.0f}% ({sw['others_pct']:.0f}%) |")
    rows: list[Goal] = []
    for rate in rates:
        runs = [r for r in sweep if r["rate"] == rate]
        top = max(runs, key=lambda r: r["hosts"])
        mine = [g for g in goals(top) if not g[0].startswith("trainer egress")]
        one = next((r for r in runs if r["hosts"] == 1), None)
        if one is not None and top is not one:
            mine[1:1] = [g for g in goals(one) if g[0].startswith("one peer fetch")]
        rows += mine
    worst = max(((r, k, v["egress_max_vs_model"]) for r in sweep for k, v in _store_runs(r["summary"]).items()),
                key=lambda x: x[2])
    rows.append((f"trainer egress / model bytes, worst store run of the sweep ({worst[1]}, {worst[0]['hosts']} hosts "
                 f"at {worst[0]['rate']})", f"{worst[2]:.2f}×", f"≤ {EGRESS_GOAL}×",
                 f"{worst[0]['summary'][worst[1]]['cpu_per_gib']:.2f}", worst[2] <= EGRESS_GOAL))
    lines += ["", *_goal_table(rows)]
    others = [r["summary"]["swarm"]["others_pct"] for r in sweep]
    lines += ["", f"Other processes on the machine during the swarm checkouts: median {statistics.median(others):.0f}%, "
              f"at most {max(others):.0f}% of its CPU."]
    if svg:
        lines += ["", f"![time to all against host count]({svg['time']})", "",
                  f"![trainer egress against host count]({svg['bytes']})"]
    for rate in rates:
        top = max((r for r in sweep if r["rate"] == rate), key=lambda r: r["hosts"])
        lines += ["", f"**{top['hosts']} hosts at {rate}**, in detail:", "", report(top)]
    return "\n".join(lines)


def sweep_plots(sweep: list[dict[str, Any]]) -> tuple[str, str]:
    """Time to all over the measured ideal, and trainer egress over the model, against host count."""
    rates = list(dict.fromkeys(r["rate"] for r in sweep))
    hosts = sorted({r["hosts"] for r in sweep})
    first = sweep[0]
    time_series: dict[str, list[tuple[float, float]]] = {}
    byte_series: dict[str, list[tuple[float, float]]] = {}
    for rate in rates:
        runs = sorted((r for r in sweep if r["rate"] == rate), key=lambda r: r["hosts"])
        for k, label in (("swarm", "paramstore (relay)"), ("chain", "raw chain"), ("star", "raw star")):
            if all(k in r["summary"] for r in runs):
                if k != "star":  # star's floor is N× by construction: it would flatten the others
                    time_series[f"{label}, {rate}"] = [(r["hosts"], r["summary"][k]["vs_ideal"]) for r in runs]
                byte_series[f"{label}, {rate}"] = [(r["hosts"], r["summary"][k]["egress_vs_model"]) for r in runs]
    goals_h = {f"goal at {rate}": TIME_GOALS[_bits_per_s(rate)] for rate in rates if _bits_per_s(rate) in TIME_GOALS}
    note = (f"{first['model_bytes'] / MiB:.0f} MiB model; each point its own cluster; {first['cpus']} CPUs shared by "
            f"all hosts; ideal = model / measured raw link rate")
    time_svg = line_plot(time_series, title="Time to all hosts / ideal, against host count", xlabel="rollout hosts",
                         ylabel="time to all / ideal", xticks=hosts, hlines={"ideal": 1.0, **goals_h}, width=760,
                         note=note)
    bytes_svg = line_plot(byte_series, title="Trainer egress per version, against host count", xlabel="rollout hosts",
                          ylabel="trainer egress / model", xticks=hosts, logy=True,
                          hlines={f"goal ≤ {EGRESS_GOAL}×": EGRESS_GOAL}, width=760, note=note)
    return time_svg, bytes_svg


def measure(a: argparse.Namespace, hosts: int, rate: str, fractions: list[float], patches: bool,
            deadline: float) -> dict[str, Any]:
    """One cluster of 1 trainer + ``hosts`` at ``rate``: every round of every strategy, summarized."""
    rate_bits = _bits_per_s(rate)
    a.op_timeout = max(60.0, 40 * a.mib * MiB * 8 / rate_bits * max(1, hosts) / 4)
    res: dict[str, Any] = {"hosts": hosts, "rate": rate, "tensors": a.tensors, "fractions": fractions,
                           "patches_supported": patches, "cpus": os.cpu_count(), "quiet_wait": a.quiet_wait,
                           "fanout": a.fanout, "registry_host": a.registry_host,
                           "goal_fraction": min(fractions, key=lambda f: abs(f - 0.01)), "rounds": []}
    t0 = time.monotonic()
    log(f"cluster: 1 trainer + {hosts} hosts at {rate}, {a.mib:g} MiB model, fractions {fractions}"
        + (f", relay fan-out {a.fanout}" if a.fanout is not None else ""))
    with running_cluster(hosts, rate=rate, mib=a.mib, tensors=a.tensors, registry_host=a.registry_host,
                         timeout=max(30.0, deadline - time.monotonic())) as run:
        log(f"hosts up in {time.monotonic() - t0:.1f} s")
        for r in range(a.rounds):
            res["rounds"].append(one_round(run, r, a, patches, fractions))
    res["model_bytes"] = res["rounds"][0]["model_bytes"]
    res["objects"] = res["rounds"][0]["objects"]
    res["ideal_s"] = res["model_bytes"] * 8 / rate_bits
    # the measured link: the chain's first host read the model alone from the trainer (its own clock)
    res["link_s"] = statistics.median(row["chain"]["replies"][0]["s"] for row in res["rounds"])
    res["summary"] = summarize(res)
    res["seconds"] = time.monotonic() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", default=None,
                   help="rollout hosts (default 8; 3 with --quick); comma-separated: a sweep, e.g. 1,2,4,8")
    p.add_argument("--rate", default="1gbit", help="each link's rate, each direction (default 1gbit; 10gbit, 100mbit); "
                   "comma-separated: a sweep")
    p.add_argument("--mib", type=float, default=256, help="model size in MiB (default 256)")
    p.add_argument("--tensors", type=int, default=32, help="tensors in the model (default 32)")
    p.add_argument("--shard-mib", type=float, default=None, help="store shard size in MiB (default: the store's)")
    p.add_argument("--fraction", default="0.01",
                   help="fraction(s) of elements changed per update, comma-separated (default 0.01)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of every strategy (medians; default 1)")
    p.add_argument("--slice-mib", type=float, default=1,
                   help="chain/star raw read slice, MiB (default 1: a chain host lags its predecessor by about "
                   "--window slices)")
    p.add_argument("--window", type=int, default=4, help="chain/star raw slices in flight per host (default 4)")
    p.add_argument("--quiet-wait", type=float, default=None,
                   help="before each measurement, wait up to this many s for other processes to use < 10%% of the "
                   "machine (default 60; 2 with --quick; 0: don't wait)")
    p.add_argument("--kick-pool", action="store_true",
                   help="experiment: where the store's slab pool is not ready before a checkout, call its prepare() "
                   "again (SlabPool.take does not wake the fill thread after a patch rebuild)")
    p.add_argument("--check", action="store_true", help="compare every host's tensors with the trainer's after "
                   "each update (blake3 of each tensor; on by default with --quick)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds after which everything is torn down (default 1800; 120 with --quick)")
    p.add_argument("--quick", action="store_true", help="16 MiB, 8 tensors, 3 hosts, checks on: under a minute")
    p.add_argument("--no-star", action="store_true", help="skip the star baseline (N× ideal by construction; at "
                   "100mbit with 8 hosts it alone takes ~3 min)")
    p.add_argument("--plots", action="store_true", help="a sweep: write its plots under docs/ "
                   f"({', '.join(SWEEP_SVGS.values())}); on with --write")
    p.add_argument("--fanout", type=int, default=None,
                   help="the relay's fan-out in every host (PARAMSTORE_RELAY_FANOUT; 1: a chain; default: the "
                   "store's, paramstore.relay.relay_fanout: a chain or a tree, whichever reaches the last host first)")
    p.add_argument("--registry-host", action="store_true",
                   help="redis-server on a host of its own (default: in the trainer's namespace, so the "
                        "trainer's egress includes the registry's replies)")
    p.add_argument("--json", metavar="OUT", help="write every measurement as JSON")
    p.add_argument("--markdown", metavar="OUT", help="write the report as Markdown (for tools/docgen.py cluster)")
    p.add_argument("--write", action="store_true",
                   help=f"write the cluster block of docs/benchmarks.md and the plots docs/{TIME_SVG}, docs/{BYTES_SVG}")
    a = p.parse_args(argv)
    if a.quick:
        a.mib, a.tensors, a.check = 16, 8, True
    try:
        host_counts = [int(x) for x in (a.hosts or ("3" if a.quick else "8")).split(",") if x.strip()]
        rates = [x.strip() for x in a.rate.split(",") if x.strip()]
        for r in rates:
            _bits_per_s(r)
    except ValueError as e:
        p.error(f"--hosts, --rate: {e}")
    a.timeout = a.timeout or (120 * len(host_counts) * len(rates) if a.quick else 1800)
    if a.quiet_wait is None:
        a.quiet_wait = 2 if a.quick else 60
    fractions = [float(x) for x in a.fraction.split(",") if x.strip()]
    if not host_counts or min(host_counts) < 1 or not rates or a.rounds < 1 or not fractions \
            or not all(0 < f <= 1 for f in fractions) or (a.fanout is not None and a.fanout < 1):
        p.error("--hosts, --rounds, --fanout >= 1; fractions in (0, 1]")
    if a.fanout is not None:  # the hosts' processes inherit it
        os.environ["PARAMSTORE_RELAY_FANOUT"] = str(a.fanout)
    import netcluster

    why = netcluster.available()
    if why:
        print(f"bench_cluster: cannot run: {why}", file=sys.stderr)
        return 2
    patches = store_has_patches()
    if not patches:
        print("patches=True: not run: store has no patches option", flush=True)
    t0 = time.monotonic()
    deadline = t0 + a.timeout
    argv_ = ["tools/bench_cluster.py", *(argv if argv is not None else sys.argv[1:])]
    sweep = [measure(a, n, rate, fractions, patches, deadline) for rate in rates for n in host_counts]
    if len(sweep) == 1:
        res: dict[str, Any] = {"argv": argv_, "machine": machine(), **sweep[0]}
        res["total_seconds"] = time.monotonic() - t0
        if a.write:
            res["svg"] = {"time": TIME_SVG, "bytes": BYTES_SVG}
        md = report(res)
        svgs = list(zip((TIME_SVG, BYTES_SVG), plots(res))) if a.write else []
    else:
        svg = SWEEP_SVGS if a.plots or a.write else None
        res = {"argv": argv_, "machine": machine(), "sweep": sweep, "svg": svg,
               "total_seconds": time.monotonic() - t0}
        md = sweep_report(sweep, svg)
        svgs = list(zip(SWEEP_SVGS.values(), sweep_plots(sweep))) if svg else []
    print()
    print(md)
    print(f"\n(total {res['total_seconds']:.0f} s)")
    write_outputs(a.json, res, a.markdown, md)
    for name, text in svgs:
        path = os.path.join(DOCS, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
        log(f"wrote {path}")
    if a.write:
        write_docs(res, md, os.path.join(DOCS, "benchmarks.md"))
    return 0

if __name__ == "__main__":
    sys.exit(main())
