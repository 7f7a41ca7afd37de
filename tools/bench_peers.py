"""Peer-to-peer benchmarks: paramstore checkout between "hosts" vs raw Mooncake reads, swarm, delta.

Every "host" is a process of its own (this script with ``--host-role``): its own store root under
/dev/shm, ``ParamStore(root, registry=redis, name=..., shard_size_bytes=--shard-mib)`` and
``store.serve("127.0.0.1")``, so its own Mooncake transfer engine (TCP: ``MC_FORCE_TCP=1``). The
registry is a redis-server this script starts (tests/redis_server.py). One trainer host commits a
model of ``--mib`` MiB (40 tensors, bf16 and fp32 alternating) as version 1, and version 2 with 10%
of its tensors changed; ``--hosts`` rollout hosts check them out. Each round:

1. one fetch: rollout 0 (every rollout emptied first, so the trainer is the only holder) runs
   ``store.checkout(1)`` (fetch in slices, blake3, rename, announce), next to raw reads of the same
   bytes (the trainer's object memory, the same addresses) on the same engine: ``raw``
   (TransferEngine one-task async batches, slices and window of MooncakeTransport's defaults,
   polled with 1 ms sleeps, as tools/bench_transport.py) into pre-faulted memory; ``transport``
   (``MooncakeTransport.read`` of the whole objects) into pre-faulted memory; and, for information,
   ``raw`` into a new /dev/shm file whose pages are not mapped yet, as a fetch's destination. The
   four run in a rotating order. Ratio = raw time / checkout time (median of per-round ratios);
   goal >= 0.8. For information, the pre-faulted raw read is followed by a blake3 of the bytes it
   read (all cores): "raw then hash" is what a verified fetch costs without overlap (its CPU is
   reported apart from the read's). Inside the host the checkout is split by timing the calls it makes: transport reads,
   registry calls, blake3 verification, posix_fallocate, publish (fsync + rename) and serve (map,
   register, announce); "busy" is the wall time during which at least one fetch thread was in
   that part.
2. swarm: every rollout emptied, then all check out version 1 at once. Trainer egress (bytes each
   host's ``snap.fetch.bytes_from`` says it read from the trainer's session) over model
   bytes, goal <= 1.5; wall (first start to last end, clocks of one machine) over the one fetch of
   the same round, goal <= 2. For information: every rollout reading the model raw from the trainer
   at once, over one raw read (on a small machine all "hosts" share the CPUs; this is their limit).
3. delta: rollout 0, holding version 1, checks out version 2; bytes moved over the bytes of the
   changed tensors, goal <= 1.1.

CPU seconds of every process (rollouts, trainer, redis-server; from /proc) are reported per phase.
Round 0 warms connections up and checks the raw reads' bytes against the fetched objects; it is
not counted. ``--tune`` overrides paramstore.peer's and paramstore.relay's knobs in the hosts, for experiments. Everything
is removed at the end (processes, /dev/shm roots, the redis-server), also on errors and SIGTERM.

Example::

    .venv/bin/python tools/bench_peers.py --mib 1024 --rounds 3 --json out/bench_peers.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

MiB = 1 << 20
TENSORS = 40  # 10 per 256 MiB shard at 1 GiB: 4 objects, as many as a fetch runs at once
CHANGED = 4  # 10% of the tensors (and of the bytes) change in version 2
HERE = os.path.dirname(os.path.abspath(__file__))


# -- host processes ----------------------------------------------------------------------------

def _model(mib: int, seed: int, only: int = TENSORS) -> dict[str, Any]:
    """The first ``only`` of the model's ``TENSORS`` tensors (~mib/TENSORS MiB each), drawn from ``seed``."""
    import torch

    per = (mib * MiB // TENSORS) // 4096 * 4096  # bytes per tensor
    out = {}
    for i in range(only):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        n = per // (4 if dtype == torch.float32 else 2)
        g = torch.Generator().manual_seed(seed * 1000 + i)
        out[f"layer{i:02d}.weight"] = torch.empty(n // 1024, 1024, dtype=dtype).uniform_(-1, 1, generator=g)
    return out


class _Prof:
    """Intervals of the calls a checkout makes, per part (wrappers on instances and modules)."""

    def __init__(self) -> None:
        self.iv: dict[str, list[tuple[float, float]]] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, obj: Any, name: str, part: str) -> None:
        f = getattr(obj, name)

        @functools.wraps(f)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.iv.setdefault(part, []).append((t0, time.perf_counter()))
                self.calls[name] = self.calls.get(name, 0) + 1

        setattr(obj, name, timed)

    def reset(self) -> None:
        self.iv, self.calls = {}, {}

    def summary(self, t0: float, t1: float) -> dict[str, Any]:
        out: dict[str, Any] = {"calls": dict(self.calls)}
        every: list[tuple[float, float]] = []
        for part, ivs in self.iv.items():
            ivs = sorted((max(a, t0), min(b, t1)) for a, b in ivs if b > t0 and a < t1)
            if not ivs:
                continue
            every += ivs
            out[part] = {"busy_s": _union(ivs), "thread_s": sum(b - a for a, b in ivs), "n": len(ivs),
                         "first_s": ivs[0][0] - t0, "last_s": max(b for _, b in ivs) - t0}
        out["none_s"] = (t1 - t0) - _union(sorted(every))  # in none of the parts timed
        return out


def _union(ivs: list[tuple[float, float]]) -> float:
    """Total length of sorted intervals' union."""
    busy, end = 0.0, float("-inf")
    for a, b in ivs:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def host(role: str, root: str, registry: str, name: str, shard_mib: int, tune: str) -> None:
    """A host: reads one JSON command per stdin line, answers one JSON line on stdout."""
    import blake3
    import numpy as np
    from paramstore.backends.transports.mooncake import (
        DEFAULT_SLICE_BYTES,
        DEFAULT_WINDOW,
    )

    import paramstore.format
    import paramstore.peer
    import paramstore.relay
    import paramstore.remote
    import paramstore.retire
    import paramstore.store
    from paramstore import ParamStore

    for kv in filter(None, tune.split(",")):  # experiments: peer.py's, relay.py's and retire.py's knobs overridden in this host
        k, v = kv.split("=")
        k = {"concurrency": "FETCH_CONCURRENCY"}.get(k, k)
        mod = next((m for m in (paramstore.peer, paramstore.relay, paramstore.retire) if hasattr(m, k)), None)
        assert mod is not None, k
        setattr(mod, k, int(v))

    def say(**kw: Any) -> None:
        print(json.dumps(kw), flush=True)

    with ParamStore(root, registry=registry, name=name, shard_size_bytes=shard_mib * MiB,
                    prepare_buffers=role == "rollout", pin_memory=False) as store:
        server = store.serve("127.0.0.1")
        transport = store._read.get_transport()
        reg, tier = store._root.registry, store._root.tier
        prof = _Prof()
        for m in ("holders", "announce_objects", "withdraw_objects"):
            prof.wrap(reg, m, f"registry {m.split('_')[0]}")
        for m in ("peers", "objects", "acquire_lease", "get_manifest", "get_version"):
            prof.wrap(reg, m, "registry (checkout)")
        prof.wrap(transport, "read", "transfer")
        prof.wrap(paramstore.format.ObjectHasher, "arrived", "verify (as slices arrive)")
        prof.wrap(paramstore.format.ObjectHasher, "digest", "verify (final)")
        prof.wrap(store._pool, "take", "allocate")
        prof.wrap(tier, "put", "publish")
        prof.wrap(server, "serve", "serve")
        model: dict[str, Any] | None = None
        say(ready=True, session=server.peer.session)
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            # the last fetch's destinations for the next one are prepared in the background (a
            # rollout host's idle time); let that finish before measuring anything
            store._pool.wait_prepared(120)
            if op == "quit":
                break
            if op == "commit":  # trainer
                # the first commit draws every tensor; a later one redraws the first `changed`
                model = {**(model or {}), **_model(cmd["mib"], cmd["seed"], cmd["changed"] if model else TENSORS)}
                t0 = time.perf_counter()
                store.commit(cmd["step"], model).result()
                server.sync()
                objs = reg.get_manifest(cmd["step"]).objects()
                sizes = reg.objects()
                served = dict(server._served)
                say(commit_s=time.perf_counter() - t0, objects=[[d, served[d][1], sizes[d]] for d in objs],
                    tensor_bytes={k: v.numel() * v.element_size() for k, v in model.items()})
            elif op == "checkout":
                prof.reset()
                w0, t0 = time.time(), time.perf_counter()
                snap = store.checkout(cmd["step"])
                t1 = time.perf_counter()
                snap.close()
                f = snap.fetch
                say(s=t1 - t0, start=w0, end=w0 + (t1 - t0), bytes_from=dict(f.bytes_from),
                    fetched=len(f.from_peers), missing=0, prof=prof.summary(t0, t1))
            elif op == "alloc":  # a registered destination for the next raw read
                total = sum(n for _, _, n in cmd["objects"])
                if cmd.get("cold"):  # as a fetch's: a new /dev/shm file, space reserved, pages not mapped yet
                    path = os.path.join(root, "bench-cold")
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.posix_fallocate(fd, 0, total)
                    dst = mmap.mmap(fd, total)
                    os.close(fd)
                    os.unlink(path)  # freed with the mapping
                else:  # pre-faulted anonymous memory, as tools/bench_transport.py
                    dst = mmap.mmap(-1, total)
                    np.frombuffer(dst, np.uint8)[:] = 1
                dst_addr = transport.register(dst)
                say(ok=True)
            elif op in ("raw", "raw_cold", "transport"):
                objs = cmd["objects"]
                reads, off = [], 0
                for _, remote, n in objs:
                    reads.append((dst_addr + off, remote, n))
                    off += n
                t0 = time.perf_counter()
                if op in ("raw", "raw_cold"):
                    _raw_read(transport._engine, cmd["peer"], reads, DEFAULT_SLICE_BYTES, DEFAULT_WINDOW)
                else:
                    transport.read(cmd["peer"], reads)
                w1 = time.time()
                dt = time.perf_counter() - t0
                hash_s = hash_cpu_s = None
                if cmd.get("hash"):  # for information: what verifying the bytes costs after a plain read
                    t1, c1 = time.perf_counter(), time.process_time()
                    blake3.blake3(dst, max_threads=blake3.blake3.AUTO)
                    hash_s, hash_cpu_s = time.perf_counter() - t1, time.process_time() - c1
                ok = None
                if cmd.get("check"):  # the buffer holds the objects fetched by a checkout (same bytes)
                    got, off, ok = np.frombuffer(dst, np.uint8), 0, True
                    for d, _, n in objs:
                        with open(tier.object_path(d), "rb") as fh:
                            ok = ok and bool(np.array_equal(got[off:off + n], np.fromfile(fh, np.uint8)))
                        off += n
                    del got
                transport.unregister(dst_addr)
                dst.close()
                say(s=dt, start=w1 - dt, end=w1, ok=ok, hash_s=hash_s, hash_cpu_s=hash_cpu_s)
            elif op == "drop":  # forget every object but those of step `keep`
                keep = set(reg.get_manifest(cmd["keep"]).objects()) if cmd.get("keep") is not None else set()
                gone = [d for d in tier.list() if d not in keep]
                for d in gone:
                    tier.delete(d)
                # The server's own rescan (every second) may run sync() at the same moment: two
                # sync() calls race (KeyError in PeerServer._drop); wait until the objects are withdrawn.
                races = 0
                while set(gone) & set(server.served):
                    try:
                        server.sync()
                    except KeyError:
                        races += 1
                        time.sleep(0.05)
                served_addrs = {a for _, a in server._served.values()}
                t_end = time.monotonic() + paramstore.retire.RETIRE_AFTER_S + 2
                while True:  # memory of dropped objects stays registered RETIRE_AFTER_S
                    stray = [a for a in transport._regions if a not in served_addrs]
                    if not stray or time.monotonic() > t_end:
                        break
                    time.sleep(0.1)
                say(dropped=len(gone), races=races, served=len(server.served), registered=len(transport._regions),
                    stray=[_mapped_file(a) for a in stray])


def _mapped_file(addr: int) -> str:
    """What /proc/self/maps says is mapped at ``addr`` (a registration no served object accounts for)."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return f"{hi - lo >> 20} MiB {rest[-1].strip() if len(rest) == 5 else '(anonymous)'}"
    return "unmapped"


def _raw_read(engine: Any, peer: str, reads: list[tuple[int, int, int]], slice_bytes: int, window: int) -> None:
    """The ranges cut in slices, at most ``window`` one-task async batches in flight, 1 ms polls."""
    todo = [(lo + o, re + o, min(slice_bytes, n - o)) for lo, re, n in reads for o in range(0, n, slice_bytes)][::-1]
    pending: list[int] = []
    while todo or pending:
        while todo and len(pending) < window:
            lo, re, n = todo.pop()
            b = engine.batch_transfer_async_read(peer, [lo], [re], [n])
            assert b, "submission refused"
            pending.append(b)
        rcs = [engine.transfer_check_status(b) for b in pending]
        assert all(rc >= 0 for rc in rcs), rcs
        if all(rc == 0 for rc in rcs):
            time.sleep(0.001)
        pending = [b for b, rc in zip(pending, rcs) if rc == 0]


# -- the driver --------------------------------------------------------------------------------

class Host:
    def __init__(self, role: str, root: str, registry: str, name: str, shard_mib: int, tune: str) -> None:
        env = dict(os.environ, MC_FORCE_TCP="1", PYTHONPATH=os.pathsep.join(
            [os.path.dirname(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--host-role", role, "--root", root,
             "--registry", registry, "--name", name, "--shard-mib", str(shard_mib), "--tune", tune],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.session = ""

    def send(self, op: str, **kw: Any) -> None:
        self.proc.stdin.write(json.dumps(dict(op=op, **kw)) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def expect(self, timeout: float = 300) -> dict[str, Any]:
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        if not out or not out[0]:
            raise RuntimeError(f"{self.role} host {self.proc.pid} said nothing within {timeout} s "
                               f"(exit {self.proc.poll()})")
        return json.loads(out[0])

    def ask(self, op: str, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.expect()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(20)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _children_cpu() -> dict[int, float]:
    """CPU seconds (user + system, every thread) of each of this process's live children."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
            for pid in f.read().split():
                with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as st:
                    fields = st.read().rsplit(")", 1)[1].split()
                    out[int(pid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(a: argparse.Namespace, url: str, base: str) -> dict[str, Any]:
    name = f"bench-peers-{uuid.uuid4().hex[:8]}"
    hosts: list[Host] = []
    try:
        for i in range(a.hosts + 1):
            hosts.append(Host("trainer" if i == 0 else "rollout", os.path.join(base, f"host{i}"), url, name,
                              a.shard_mib, a.tune))
        for h in hosts:
            h.session = h.expect(120)["session"]
        trainer, rollouts = hosts[0], hosts[1:]
        n = len(rollouts)
        one = rollouts[0]
        v1 = trainer.ask("commit", step=1, mib=a.mib, seed=1, changed=TENSORS)
        v2 = trainer.ask("commit", step=2, mib=a.mib, seed=2, changed=CHANGED)
        model_bytes = sum(nb for _, _, nb in v1["objects"])
        new2 = [o for o in v2["objects"] if o[0] not in {d for d, _, _ in v1["objects"]}]
        changed_bytes = sum(nb for _, nb in sorted(v2["tensor_bytes"].items())[:CHANGED])
        print(f"model: {model_bytes / MiB:.0f} MiB in {len(v1['objects'])} objects (commit {v1['commit_s']:.1f} s); "
              f"version 2: {CHANGED}/{TENSORS} tensors changed = {changed_bytes / MiB:.1f} MiB "
              f"in {len(new2)} new objects", flush=True)

        notes: list[dict[str, Any]] = []

        def drop(hs: list[Host], keep: int | None = None) -> None:
            for h in hs:
                h.send("drop", keep=keep)
            for h in hs:
                rep = h.expect()
                if rep["races"] or rep["registered"] != rep["served"]:
                    notes.append(rep)
                    print(f"  note: host {h.proc.pid} after drop: {rep}", flush=True)

        pids = {h.proc.pid: ("trainer" if h is trainer else "rollouts") for h in hosts}

        def phase(fn: Any) -> tuple[Any, float]:
            """fn()'s result, and the CPU seconds every process of the benchmark (hosts, redis) spent in it
            (by kind in ``cpu_by``)."""
            c0 = _children_cpu()
            out = fn()
            c1 = _children_cpu()
            by: dict[str, float] = {}
            for pid, c in c1.items():
                kind = pids.get(pid, "redis")
                by[kind] = by.get(kind, 0.0) + c - c0.get(pid, 0.0)
            cpu_by.update(by)
            return out, sum(by.values())

        cpu_by: dict[str, float] = {}

        def at_once(hs: list[Host], op: str, **kw: Any) -> list[dict[str, Any]]:
            for h in hs:
                h.send(op, **kw)
            return [h.expect() for h in hs]

        rounds: list[dict[str, Any]] = []
        for r in range(a.rounds + 1):
            row: dict[str, Any] = {"round": r}
            # 1. one fetch from the trainer, next to raw reads of the same bytes
            drop(rollouts)
            order = ["paramstore", "raw", "transport", "raw_cold"]
            order = order[r % 4:] + order[:r % 4]
            for mode in order:
                if mode == "paramstore":
                    row["paramstore"], cpu = phase(lambda: one.ask("checkout", step=1))
                    row["paramstore_cpu_by"] = dict(cpu_by)
                    assert row["paramstore"]["missing"] == 0 and row["paramstore"]["fetched"], row["paramstore"]
                else:
                    check = r == 0 and "paramstore" in row  # round 0: the raw bytes are the fetched objects
                    one.ask("alloc", objects=v1["objects"], cold=mode == "raw_cold")
                    rep, cpu = phase(functools.partial(one.ask, mode, peer=trainer.session, objects=v1["objects"],
                                                       check=check, hash=mode == "raw"))
                    assert rep["ok"] is not False, f"{mode} read: bytes differ from the fetched objects"
                    row[mode] = rep["s"]
                    if rep.get("hash_s") is not None:  # the read's CPU is reported without the hash's
                        row["raw_then_hash"] = rep["s"] + rep["hash_s"]
                        row["hash_cpu"] = rep["hash_cpu_s"]
                        cpu -= rep["hash_cpu_s"]
                        cpu_by["rollouts"] -= rep["hash_cpu_s"]
                    row[f"{mode}_cpu_by"] = dict(cpu_by)
                row[f"{mode}_cpu"] = cpu
            # info: every rollout reads the model raw from the trainer at once (what the CPUs allow)
            drop([one])
            at_once(rollouts, "alloc", objects=v1["objects"])
            reps, cpu = phase(lambda: at_once(rollouts, "raw", peer=trainer.session, objects=v1["objects"]))
            row["raw_all"] = {"wall_s": max(x["end"] for x in reps) - min(x["start"] for x in reps), "cpu_s": cpu}
            # 2. every rollout checks out at once
            replies, cpu = phase(lambda: at_once(rollouts, "checkout", step=1))
            row["swarm_cpu_by"] = dict(cpu_by)
            assert all(x["missing"] == 0 for x in replies), replies
            egress = sum(x["bytes_from"].get(trainer.session, 0) for x in replies)
            row["swarm"] = {"wall_s": max(x["end"] for x in replies) - min(x["start"] for x in replies),
                            "egress_bytes": egress, "total_bytes": sum(sum(x["bytes_from"].values()) for x in replies),
                            "per_host_s": [x["s"] for x in replies], "cpu_s": cpu, "prof": [x["prof"] for x in replies]}
            # 3. delta: version 2 on a host holding version 1
            d = one.ask("checkout", step=2)
            row["delta"] = {"s": d["s"], "moved_bytes": sum(d["bytes_from"].values())}
            drop([one], keep=1)
            ps = row["paramstore"]["s"]
            print(f"round {r}{' (warm-up)' if r == 0 else ''}: checkout {ps:.2f} s ({row['paramstore_cpu']:.1f} cpu-s), "
                  f"raw {row['raw']:.2f} s ({row['raw_cpu']:.1f}), transport {row['transport']:.2f} s, "
                  f"raw into new pages {row['raw_cold']:.2f} s; "
                  f"{n} at once: swarm {row['swarm']['wall_s']:.2f} s ({cpu:.1f} cpu-s), raw "
                  f"{row['raw_all']['wall_s']:.2f} s ({row['raw_all']['cpu_s']:.1f}); trainer egress "
                  f"{egress / model_bytes:.2f}x; delta moved {row['delta']['moved_bytes'] / MiB:.1f} MiB", flush=True)
            if r:
                rounds.append(row)

        ratio_raw = _med([x["raw"] / x["paramstore"]["s"] for x in rounds])
        ratio_tr = _med([x["transport"] / x["paramstore"]["s"] for x in rounds])
        egress = _med([x["swarm"]["egress_bytes"] / model_bytes for x in rounds])
        wall = _med([x["swarm"]["wall_s"] / x["paramstore"]["s"] for x in rounds])
        delta = _med([x["delta"]["moved_bytes"] / changed_bytes for x in rounds])
        summary = {
            "fetch_vs_raw": ratio_raw, "fetch_vs_transport": ratio_tr, "swarm_egress": egress,
            "swarm_wall_vs_one": wall, "delta_moved_vs_changed": delta,
            "checkout_s": _med([x["paramstore"]["s"] for x in rounds]), "raw_s": _med([x["raw"] for x in rounds]),
            "transport_s": _med([x["transport"] for x in rounds]),
            "fetch_vs_raw_cold": _med([x["raw_cold"] / x["paramstore"]["s"] for x in rounds]),
            "fetch_vs_raw_then_hash": _med([x["raw_then_hash"] / x["paramstore"]["s"] for x in rounds]),
            "raw_then_hash_s": _med([x["raw_then_hash"] for x in rounds]),
            "swarm_vs_raw_all": _med([x["swarm"]["wall_s"] / x["raw_all"]["wall_s"] for x in rounds]),
            "raw_cold_s": _med([x["raw_cold"] for x in rounds]),
            "swarm_s": _med([x["swarm"]["wall_s"] for x in rounds]),
            "raw_all_vs_one": _med([x["raw_all"]["wall_s"] / x["raw"] for x in rounds]),
            "raw_all_s": _med([x["raw_all"]["wall_s"] for x in rounds]),
            "cpu_s": {k: _med([x[k] for x in rounds])
                      for k in ("paramstore_cpu", "raw_cpu", "transport_cpu", "raw_cold_cpu", "hash_cpu")}
            | {"swarm": _med([x["swarm"]["cpu_s"] for x in rounds]),
               "raw_all": _med([x["raw_all"]["cpu_s"] for x in rounds])},
        }
        return {"mib": a.mib, "model_bytes": model_bytes, "changed_bytes": changed_bytes, "hosts": a.hosts,
                "objects": len(v1["objects"]), "shard_mib": a.shard_mib, "cpus": os.cpu_count(),
                "rounds": rounds, "summary": summary, "drop_notes": notes}
    finally:
        for h in hosts:
            with contextlib.suppress(Exception):
                h.close()


def report(res: dict[str, Any]) -> str:
    s, n = res["summary"], res["hosts"]
    gb = res["model_bytes"] / 1e9

    def row(what: str, value: str, goal: str, ok: bool | None) -> str:
        return f"| {what} | {value} | {goal} | {'' if ok is None else 'PASS' if ok else 'MISS'} |"

    lines = [
        (f"{res['model_bytes'] / MiB:.0f} MiB model in {res['objects']} objects, {n} rollout hosts, "
         f"{len(res['rounds'])} rounds (medians), TCP on 127.0.0.1, {res['cpus']} CPUs"),
        "",
        "| measure | value | goal | |",
        "|---|---|---|---|",
        row("fetch: raw TransferEngine time / checkout time", f"{s['fetch_vs_raw']:.2f}x "
            f"({s['raw_s']:.2f} s vs {s['checkout_s']:.2f} s, {gb / s['checkout_s']:.2f} GB/s)", ">= 0.8x",
            s["fetch_vs_raw"] >= 0.8),
        row("fetch: MooncakeTransport.read time / checkout time", f"{s['fetch_vs_transport']:.2f}x "
            f"({s['transport_s']:.2f} s)", "(info)", None),
        row("fetch: raw time into new /dev/shm pages (as a fetch's) / checkout time", f"{s['fetch_vs_raw_cold']:.2f}x "
            f"({s['raw_cold_s']:.2f} s)", "(info)", None),
        row("fetch: (raw read, then blake3 of its bytes on every core) / checkout time",
            f"{s['fetch_vs_raw_then_hash']:.2f}x ({s['raw_then_hash_s']:.2f} s)", "(info)", None),
        row(f"swarm: trainer egress, {n} hosts at once", f"{s['swarm_egress']:.2f}x model bytes", "<= 1.5x",
            s["swarm_egress"] <= 1.5),
        row(f"swarm: wall of {n} fetches / one fetch", f"{s['swarm_wall_vs_one']:.2f}x ({s['swarm_s']:.2f} s)",
            "<= 2x", s["swarm_wall_vs_one"] <= 2),
        row(f"info: {n} raw reads at once from the trainer / one raw read", f"{s['raw_all_vs_one']:.2f}x "
            f"({s['raw_all_s']:.2f} s)", "(the CPUs' limit)", None),
        row(f"info: swarm wall / {n} raw reads at once", f"{s['swarm_vs_raw_all']:.2f}x", "(info)", None),
        row("delta: bytes moved / changed bytes (10% of tensors)", f"{s['delta_moved_vs_changed']:.3f}x",
            "<= 1.1x", s["delta_moved_vs_changed"] <= 1.1),
    ]
    c = s["cpu_s"]

    def by(key: str) -> str:
        kinds = ("rollouts", "trainer", "redis")
        return "/".join(f"{_med([x[key].get(k, 0.0) for x in res['rounds']]):.2f}" for k in kinds)

    lines += ["", (f"CPU seconds, all processes (rollouts/trainer/redis): one checkout {c['paramstore_cpu']:.2f} "
                   f"({by('paramstore_cpu_by')}), raw {c['raw_cpu']:.2f} ({by('raw_cpu_by')}), transport "
                   f"{c['transport_cpu']:.2f}, raw into new pages {c['raw_cold_cpu']:.2f} ({by('raw_cold_cpu_by')}); "
                   f"{n} checkouts at once {c['swarm']:.2f} ({by('swarm_cpu_by')}), {n} raw reads at once "
                   f"{c['raw_all']:.2f}; blake3 of the model's bytes {c['hash_cpu']:.2f}")]
    p = [x["paramstore"] for x in res["rounds"]]
    parts = sorted({k for x in p for k in x["prof"] if k not in ("calls", "none_s")})
    lines += ["", "one checkout, split (median busy wall s: at least one fetch thread in it; thread-s summed):"]
    for k in parts:
        busy = _med([x["prof"].get(k, {}).get("busy_s", 0.0) for x in p])
        th = _med([x["prof"].get(k, {}).get("thread_s", 0.0) for x in p])
        calls = _med([x["prof"].get(k, {}).get("n", 0) for x in p])
        first = _med([x["prof"].get(k, {}).get("first_s", 0.0) for x in p])
        last = _med([x["prof"].get(k, {}).get("last_s", 0.0) for x in p])
        lines.append(f"  {k:<20} busy {busy:6.3f} s  thread {th:6.3f} s  calls {calls:4.0f}  "
                     f"from {first:5.2f} to {last:5.2f} s")
    lines.append(f"  {'in none of these':<20} {_med([x['prof']['none_s'] for x in p]):6.3f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="model size, MiB (default 1024)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds after a warm-up (default 3)")
    p.add_argument("--hosts", type=int, default=4, help="rollout hosts (default 4)")
    p.add_argument("--shard-mib", type=int, default=256, help="shard_size_bytes in MiB (default 256)")
    p.add_argument("--json", nargs="?", const="-", metavar="OUT",
                   help="write every measurement as JSON (to OUT; to stdout without OUT)")
    p.add_argument("--tune", default="", metavar="K=V,...",
                   help="experiment: override paramstore.peer knobs in the hosts (SLICE_BYTES, BURST_SLICES, "
                   "RETIRE_AFTER_S; concurrency: objects fetched at once)")
    p.add_argument("--host-role", choices=("trainer", "rollout"), help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--registry", help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.host_role:
        os.environ.setdefault("MC_FORCE_TCP", "1")
        host(a.host_role, a.root, a.registry, a.name, a.shard_mib, a.tune)
        return 0
    if a.hosts < 1 or a.rounds < 1 or a.mib < 64:
        p.error("--hosts and --rounds must be >= 1, --mib >= 64")

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from redis_server import running

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup below runs on a kill too
    base = f"/dev/shm/ps-bench-peers-{os.getpid()}"
    os.makedirs(base)
    t0 = time.perf_counter()
    try:
        with running() as url:
            res = run(a, url, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    res["total_s"] = time.perf_counter() - t0
    print()
    print(report(res))
    print(f"\n(total {res['total_s']:.0f} s)")
    if a.json == "-":
        print(json.dumps(res, indent=1))
    elif a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
