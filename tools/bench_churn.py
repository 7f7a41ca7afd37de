"""Hosts joining late and dying mid-relay, on the simulated cluster (issue 27, item 3).

One cluster of 1 trainer + N rollout hosts (network namespaces, ``tc``-limited links; see
tools/bench_cluster.py and tools/netcluster.py), one store (``patches=False``), and five fresh
versions of the same model (every byte new), each checked out by every rollout host:

1. **all at once**: the baseline of this run;
2. **one joins late**: the last host starts its checkout ``--late-at`` × the baseline's time after
   the others (it goes to the end of the order and reads from the hosts ahead);
3. **one stopped**: all at once, and ``--kill-at`` × the baseline's time after the start one host
   is stopped (SIGSTOP, its whole process group: a hung host, its connections open): the one that
   had received the median number of bytes then, so a host in the middle of the relay, with hosts
   behind it; continued (SIGCONT) once the others are done, it must finish right too;
4. **one killed**: the same with SIGKILL (not restarted);
5. **after the kill**: the N − 1 survivors check out one more version while the dead host's
   announcements are still in the registry (until its lease lapses).

Per scenario: time to all (the survivors'), over the baseline's; the trainer's egress over the
model (its eth0 ``tx_bytes``); what each host received over the model (from its fetch report:
every byte once means 1.00); whether every host's tensors are the trainer's (blake3 of each
tensor, compared by the driver). For the late joiner: its own time from its start, and the share it
read from rollout hosts. For the kill: the hosts that had read from the victim (its children),
their finishing times against the baseline's, and the survivors' time to all minus the baseline's:
the delay the death cost (issue 27: about one piece's time, a relay block at the link rate), against the
baseline and against the survivors' own run after it (one host fewer: one hop shorter). Needs root.

    .venv/bin/python tools/bench_churn.py --hosts 8 --rate 100mbit --json out/bench_churn.json \
        --markdown out/bench_churn.md
    .venv/bin/python tools/docgen.py churn out/bench_churn.md --json out/bench_churn.json
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from collections import Counter
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_cluster import Meter  # noqa: E402
from benchlib import log, machine, write_outputs  # noqa: E402
from cluster_host import ClusterHost, ClusterRun, MiB, running_cluster  # noqa: E402
from netcluster import _bits_per_s  # noqa: E402
from paramstore.relay import BLOCK_BYTES  # noqa: E402


def _started(step: int, check: Any, hosts: list[ClusterHost]) -> None:
    for h in hosts:
        h.send("checkout", step=step, check=check)


def _answers(hosts: list[ClusterHost], t0: float, timeout: float) -> list[dict[str, Any]]:
    reps = [h.expect(timeout) for h in hosts]
    for h, r in zip(hosts, reps):
        r["done_s"], r["host"], r["session"] = r["end"] - t0, h.index, h.session
    return reps


def late(run: ClusterRun, step: int, check: Any, after_s: float, timeout: float) -> list[dict[str, Any]]:
    """Every rollout host but the last checks ``step`` out at once; the last starts ``after_s`` later."""
    rs = run.rollouts
    t0 = time.time()
    _started(step, check, rs[:-1])
    time.sleep(after_s)
    _started(step, check, rs[-1:])
    return _answers(rs, t0, timeout)


def _victim(run: ClusterRun, step: int, check: Any, after_s: float, t0: float) -> tuple[ClusterHost, float]:
    """Every rollout host checks ``step`` out at once (from ``t0``); ``after_s`` later, the one that
    has received the median number of bytes so far (a host in the middle of the relay)."""
    rs = list(run.rollouts)
    def rx() -> dict[int, int]:  # each rollout host's received bytes, by its index in the cluster
        return {h.index: c["rx"] for h, c in zip(run.hosts, run.counters()) if h in rs}

    before = rx()
    _started(step, check, rs)
    time.sleep(max(0.0, t0 + after_s - time.time()))
    now = rx()
    got = [now[h.index] - before[h.index] for h in rs]
    i = sorted(range(len(rs)), key=lambda k: got[k])[len(rs) // 2]
    return rs[i], got[i]


def killed(run: ClusterRun, step: int, check: Any, after_s: float, timeout: float,
           out: dict[str, Any]) -> list[dict[str, Any]]:
    """All check ``step`` out at once; ``after_s`` later one in the middle of the relay is killed
    (SIGKILL, its process group) and dropped from ``run``; the others' answers."""
    t0 = time.time()
    victim, got = _victim(run, step, check, after_s, t0)
    os.killpg(victim.proc.pid, signal.SIGKILL)
    out.update(victim=victim.index, victim_session=victim.session, at_s=time.time() - t0, victim_rx_mib=got / MiB)
    victim.proc.wait(30)
    run.rollouts.remove(victim)
    log(f"  killed host {victim.index} at {out['at_s']:.2f} s ({got / MiB:.0f} MiB received)")
    return _answers(run.rollouts, t0, timeout)


def stopped(run: ClusterRun, step: int, check: Any, after_s: float, timeout: float,
            out: dict[str, Any]) -> list[dict[str, Any]]:
    """All check ``step`` out at once; ``after_s`` later one in the middle of the relay is stopped
    (SIGSTOP: it hangs, its connections stay open) until the others are done; their answers. The
    stopped host is continued then (:func:`resumed`)."""
    t0 = time.time()
    victim, got = _victim(run, step, check, after_s, t0)
    os.killpg(victim.proc.pid, signal.SIGSTOP)
    out.update(victim=victim.index, victim_session=victim.session, at_s=time.time() - t0, victim_rx_mib=got / MiB,
               t0=t0)
    log(f"  stopped host {victim.index} at {out['at_s']:.2f} s ({got / MiB:.0f} MiB received)")
    return _answers([h for h in run.rollouts if h is not victim], t0, timeout)


def resumed(run: ClusterRun, out: dict[str, Any], timeout: float) -> None:
    """Continue the host :func:`stopped` stopped; its checkout's answer goes into ``out``."""
    victim = next(h for h in run.rollouts if h.index == out["victim"])
    os.killpg(victim.proc.pid, signal.SIGCONT)
    t = time.time()
    rep = _answers([victim], out["t0"], timeout)[0]
    out.update(victim_ok=rep.get("ok"), victim_after_cont_s=rep["end"] - t,
               victim_received=sum(rep["fetch"]["bytes_from"].values()))


def _row(name: str, m: dict[str, Any], model: int, base: float | None) -> dict[str, Any]:
    reps = m["replies"]
    received = [sum(r["fetch"]["bytes_from"].values()) / model for r in reps]
    return {"scenario": name, "time_all_s": m["time_all_s"], "vs_baseline": None if base is None else m["time_all_s"] / base,
            "egress": m["trainer_tx"] / model, "received": (min(received), max(received)),
            "ok": all(r.get("ok") for r in reps), "hosts": len(reps), "busy_pct": m["busy_pct"],
            "done_s": sorted(r["done_s"] for r in reps),
            "failed": dict(sum((Counter(r["fetch"].get("failed") or {}) for r in reps), Counter()))}


def measure(a: argparse.Namespace) -> dict[str, Any]:
    rate_bits = _bits_per_s(a.rate)
    timeout = max(120.0, 40 * a.mib * MiB * 8 / rate_bits * max(1, a.hosts) / 4)
    res: dict[str, Any] = {"hosts": a.hosts, "rate": a.rate, "mib": a.mib, "tensors": a.tensors, "rows": []}
    with running_cluster(a.hosts, rate=a.rate, mib=a.mib, tensors=a.tensors, timeout=a.timeout) as run:
        meter = Meter(run, a.quiet_wait)
        run.open_all("churn", patches=False)
        trainer = run.trainer.address + ":"

        def version(step: int) -> Any:
            v = run.commit(step, 9000 + step, digests=True)
            res["model_bytes"] = v["model_bytes"]
            return v["tensor_digests"]

        check = version(0)
        base = meter(lambda: run.checkout_all(0, check=check, timeout=timeout, settle=0), settle=False)
        model = res["model_bytes"]
        b = base["time_all_s"]
        res["rows"].append(_row("all at once (baseline)", base, model, None))
        log(f"baseline: all {a.hosts} in {b:.2f} s")

        check = version(1)
        after = a.late_at * b
        m = meter(lambda: late(run, 1, check, after, timeout), settle=False)
        row = _row(f"one joins {after:.1f} s late", m, model, b)
        last = m["replies"][-1]
        own = last["end"] - last["start"]
        from_rollouts = sum(n for p, n in last["fetch"]["bytes_from"].items() if not p.startswith(trainer))
        median_own = statistics.median(r["end"] - r["start"] for r in base["replies"])
        row.update(late_at_s=after, late_own_s=own, late_vs_baseline_host=own / median_own,
                   late_from_rollouts=from_rollouts / model)
        res["rows"].append(row)
        log(f"late joiner: all in {m['time_all_s']:.2f} s; the late host took {own:.2f} s, "
            f"{from_rollouts / model:.2f} of the model from rollout hosts")

        for step, (name, fn) in enumerate((("one stopped mid-relay (SIGSTOP)", stopped),
                                           ("one killed mid-relay (SIGKILL)", killed)), 2):
            check = version(step)
            info: dict[str, Any] = {}
            m = meter(lambda: fn(run, step, check, a.kill_at * b, timeout, info), settle=False)
            if fn is stopped:
                resumed(run, info, timeout)
                info["victim_received"] /= model
            row = _row(name, m, model, b)
            children = [r for r in m["replies"] if r["fetch"]["bytes_from"].get(info["victim_session"], 0) > 0]
            row.update({k: v for k, v in info.items() if k != "t0"}, delay_s=m["time_all_s"] - b,
                       children=len(children), children_done_s=sorted(r["done_s"] for r in children),
                       from_victim_mib=sum(r["fetch"]["bytes_from"].get(info["victim_session"], 0)
                                           for r in children) / MiB)
            res["rows"].append(row)
            log(f"{name}: the others all in {m['time_all_s']:.2f} s ({m['time_all_s'] - b:+.2f} s against the "
                f"baseline), {len(children)} of them had read from it")

        check = version(4)
        m = meter(lambda: run.checkout_all(4, check=check, timeout=timeout, settle=0), settle=False)
        res["rows"].append(_row(f"after the kill ({len(run.rollouts)} hosts)", m, model, b))
        log(f"after the kill: all {len(run.rollouts)} in {m['time_all_s']:.2f} s")
    res["block_s"] = BLOCK_BYTES * 8 / rate_bits
    return res


def report(res: dict[str, Any]) -> str:
    block = res["block_s"]
    lines = [f"1 trainer + {res['hosts']} rollout hosts, links {res['rate']} each direction (`tc tbf`), model "
             f"{res['model_bytes'] / MiB:.0f} MiB of bf16 in {res['tensors']} tensors, a fresh version per scenario "
             f"(every byte new), one store (`patches=False`); one relay block ({BLOCK_BYTES / MiB:g} MiB) takes {block:.2f} s at the nominal rate. "
             "Time to all: the last host's end (the survivors'), from the driver's first command. Egress: the "
             "trainer's eth0 `tx_bytes` over the model. Received: each host's fetch report, over the model "
             "(min–max; 1.00: every byte once). Tensors: every host's blake3 of each tensor equals the trainer's. "
             "Reads failed: the hosts' `snap.fetch.failed` (transport errors, once per stall and object), all hosts, "
             "and of them those of the stopped or killed host.",
             "",
             "| scenario | hosts | time to all | / baseline | trainer egress / model | received per host / model "
             "| tensors right | reads failed: all / of the host stopped or killed | CPU busy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        vs = "—" if r["vs_baseline"] is None else f"{r['vs_baseline']:.3f}×"
        failed = r.get("failed", {})
        victim = f"{failed.get(r['victim_session'], 0)}" if "victim_session" in r else "—"
        lines.append(f"| {r['scenario']} | {r['hosts']} | {r['time_all_s']:.2f} s | {vs} | {r['egress']:.2f}× | "
                     f"{r['received'][0]:.2f}–{r['received'][1]:.2f} | {'yes' if r['ok'] else 'NO'} | "
                     f"{sum(failed.values())} / {victim} | {r['busy_pct']:.0f}% |")
    late_row = next(r for r in res["rows"] if "late_own_s" in r)
    base, after = res["rows"][0], res["rows"][-1]
    lines += ["",
              f"The late joiner started {late_row['late_at_s']:.1f} s after the others and took {late_row['late_own_s']:.2f} s "
              f"from its start ({late_row['late_vs_baseline_host']:.2f}× a baseline host's median), reading "
              f"{late_row['late_from_rollouts']:.2f} of the model from rollout hosts."]
    for r in (r for r in res["rows"] if "victim" in r):
        how = "stopped" if "victim_ok" in r else "killed"
        lines += ["",
                  f"**{how.capitalize()}.** Host {r['victim']} was {how} {r['at_s']:.2f} s after the start, having received "
                  f"{r['victim_rx_mib']:.0f} MiB (the median of the hosts then). {r['children']} of the others had read "
                  f"from it ({r['from_victim_mib']:.0f} MiB in all), finishing at "
                  f"{', '.join(f'{t:.2f}' for t in r['children_done_s']) or '—'} s; the others' time to all was "
                  f"{r['delay_s']:+.2f} s against the baseline's ({base['time_all_s']:.2f} s, {res['hosts']} hosts) and "
                  f"{r['time_all_s'] - after['time_all_s']:+.2f} s against the last run ({after['time_all_s']:.2f} s, "
                  f"{after['hosts']} hosts, one hop fewer): {(r['time_all_s'] - after['time_all_s']) / block:+.1f} "
                  f"pieces' time. Finishing times, baseline: {', '.join(f'{t:.2f}' for t in base['done_s'])} s; "
                  f"with the host {how}: {', '.join(f'{t:.2f}' for t in r['done_s'])} s."]
        if how == "stopped":
            lines[-1] += (f" Continued once the others were done, it finished {r['victim_after_cont_s']:.2f} s later "
                          f"with its tensors {'right' if r['victim_ok'] else 'WRONG'}, having received "
                          f"{r['victim_received']:.2f}× the model in all (what it read after it was continued "
                          "is not in the row's egress).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=8, help="rollout hosts (default 8)")
    p.add_argument("--rate", default="100mbit", help="each link's rate, each direction (default 100mbit)")
    p.add_argument("--mib", type=float, default=256, help="model size in MiB (default 256)")
    p.add_argument("--tensors", type=int, default=32, help="tensors in the model (default 32)")
    p.add_argument("--late-at", type=float, default=0.5, help="the late host starts this × the baseline's time late")
    p.add_argument("--kill-at", type=float, default=0.4, help="a host is killed this × the baseline's time in")
    p.add_argument("--quiet-wait", type=float, default=30, help="wait up to this many s for a quiet machine (default 30)")
    p.add_argument("--timeout", type=float, default=1200, help="tear everything down after this many s (default 1200)")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--markdown", metavar="OUT")
    a = p.parse_args(argv)
    if a.hosts < 3 or not 0 < a.late_at < 1 or not 0 < a.kill_at < 1:
        p.error("--hosts >= 3; --late-at and --kill-at in (0, 1)")
    import netcluster

    why = netcluster.available()
    if why:
        print(f"bench_churn: cannot run: {why}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    res = {"argv": ["tools/bench_churn.py", *(argv if argv is not None else sys.argv[1:])], "machine": machine(),
           **measure(a)}
    res["total_seconds"] = time.monotonic() - t0
    md = report(res)
    print()
    print(md)
    write_outputs(a.json, res, a.markdown, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
