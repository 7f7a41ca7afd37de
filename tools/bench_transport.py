"""MooncakeTransport.read vs a raw Mooncake TransferEngine read of the same bytes, side by side.

A server process (this script with ``--serve``) maps a /dev/shm file of ``--mib`` MiB and registers
it; the client reads it whole into a registered, pre-faulted buffer, every round in each way, in
alternating order:

* ``raw``: the fastest pattern measured on the raw Python API: the buffer cut in 8 one-task async
  batches, all submitted at once, polled with ``transfer_check_status`` and 1 ms sleeps.
* ``sync``: one ``transfer_sync_read`` (the simple blocking call; it spins a core while waiting).
* ``transport SxW``: ``MooncakeTransport.read`` with ``slice_bytes=S`` MiB and ``window=W``.

Each transport config is timed next to a raw read of its own (the host is shared and noisy): a ratio
is the median over rounds of that pair's throughput ratio (transport / raw; sync is paired with
the first config's raw read). Bytes are verified in
the first round. ``raw`` and ``sync`` run on the first transport's engine (its connections); each
further config has its own engine. TCP unless ``--rdma DEVICE``; ``MC_FORCE_TCP`` is honoured.

Example::

    .venv/bin/python tools/bench_transport.py --mib 1024 --rounds 9 --configs 32x4,16x8,64x4
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

from paramstore.backends.transports import MooncakeTransport
from paramstore.backends.transports.mooncake import DEFAULT_SLICE_BYTES, DEFAULT_WINDOW

MiB = 1 << 20


def serve(path: str, protocol: str, device: str) -> None:
    """Server process: map ``path`` read-only, register it, print session and address, wait for EOF."""
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(fd)
    t = MooncakeTransport("127.0.0.1", protocol=protocol, device=device)
    print(json.dumps({"session": t.session, "addr": t.register(m)}), flush=True)
    sys.stdin.read()


def raw_read(engine: Any, peer: str, local: int, remote: int, nbytes: int, parts: int = 8) -> None:
    step = -(-nbytes // parts)
    pending = [engine.batch_transfer_async_read(peer, [local + o], [remote + o], [min(step, nbytes - o)])
               for o in range(0, nbytes, step)]
    assert all(pending), "submission refused"
    while pending:
        rcs = [engine.transfer_check_status(b) for b in pending]
        assert all(rc >= 0 for rc in rcs), rcs
        pending = [b for b, rc in zip(pending, rcs) if rc == 0]
        if pending:
            time.sleep(0.001)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512, help="bytes read per round, MiB (default 512)")
    p.add_argument("--rounds", type=int, default=7, help="measured rounds (default 7)")
    default = f"{DEFAULT_SLICE_BYTES >> 20}x{DEFAULT_WINDOW}"
    p.add_argument("--configs", default=default, help=f"transport SLICE_MiBxWINDOW,... (default {default}: the defaults)")
    p.add_argument("--rdma", metavar="DEVICE", help="use RDMA on DEVICE instead of TCP")
    p.add_argument("--json", metavar="OUT", help="write every measurement as JSON")
    p.add_argument("--serve", metavar="PATH", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    protocol, device = ("rdma", a.rdma) if a.rdma else ("tcp", "")
    if a.serve:
        serve(a.serve, protocol, device)
        return 0

    n = a.mib * MiB
    path = f"/dev/shm/ps-bench-transport-{os.getpid()}"
    want = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    want.tofile(path)
    srv = subprocess.Popen([sys.executable, __file__, "--serve", path] + (["--rdma", a.rdma] if a.rdma else []),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(srv.stdout.readline())  # type: ignore[union-attr]
    finally:
        os.unlink(path)
    peer, remote = info["session"], info["addr"]

    modes: dict[str, tuple[MooncakeTransport, Callable[[MooncakeTransport, int], None]]] = {}
    for c in a.configs.split(","):
        s, w = (int(x) for x in c.split("x"))
        t = MooncakeTransport("127.0.0.1", protocol=protocol, device=device, slice_bytes=s * MiB, window=w)
        modes[f"transport {c}"] = (t, lambda t, dst: t.read(peer, [(dst, remote, n)]))
    first = next(iter(modes.values()))[0]  # raw and sync share the first transport's engine
    modes["raw"] = (first, lambda t, dst: raw_read(t._engine, peer, dst, remote, n))
    modes["sync"] = (first, lambda t, dst: t._engine.transfer_sync_read(peer, dst, remote, n))

    dst_map = mmap.mmap(-1, n)
    got = np.frombuffer(dst_map, np.uint8)
    got[:] = 0  # fault every page before timing
    dst = {id(t): t.register(dst_map) for t, _ in modes.values()}
    def timed(name: str, verify: bool) -> dict[str, float]:
        t, fn = modes[name]
        if verify:
            got[:] = 0
        c0, t0 = cpu_s(), time.perf_counter()
        fn(t, dst[id(t)])
        dt = time.perf_counter() - t0
        if verify:
            assert np.array_equal(got, want), f"{name}: bytes differ"
        return {"gbps": n / dt / 1e9, "cpu_cores": (cpu_s() - c0) / dt}

    configs = [k for k in modes if k not in ("raw", "sync")]
    rows: list[dict[str, Any]] = []
    for r in range(a.rounds + 1):  # round 0 warms connections up and verifies bytes
        row: dict[str, Any] = {"round": r, "sync": timed("sync", r == 0)}
        for name in configs:  # each config next to its own raw read, in alternating order
            pair = ("raw", name) if r % 2 else (name, "raw")
            row.update({f"{k}|{name}" if k == "raw" else k: timed(k, r == 0) for k in pair})
        if r:
            rows.append(row)
            print(f"round {r}: " + "  ".join(f"{k.split('|')[0]} {v['gbps']:.2f} ({v['cpu_cores']:.2f} cpu)"
                                            for k, v in row.items() if k != "round"), flush=True)
    summary = {}
    for name in configs + ["sync"]:
        base = f"raw|{name}" if name != "sync" else f"raw|{configs[0]}"
        gb = [row[name]["gbps"] for row in rows]
        ratio = statistics.median(row[name]["gbps"] / row[base]["gbps"] for row in rows)
        raw = statistics.median(row[base]["gbps"] for row in rows)
        cpu = statistics.median(row[name]["cpu_cores"] for row in rows)
        summary[name] = {"median_gbps": statistics.median(gb), "best_gbps": max(gb), "raw_median_gbps": raw,
                         "median_ratio_vs_raw": ratio, "cpu_cores": cpu}
        print(f"{name:>18}: median {statistics.median(gb):.2f} GB/s (raw beside it {raw:.2f}), "
              f"best {max(gb):.2f}, median ratio vs raw {ratio:.2f}, cpu {cpu:.2f} cores")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mib": a.mib, "protocol": protocol, "rounds": rows, "summary": summary,
                       "cpus": os.cpu_count()}, f, indent=1)
    srv.stdin.close()  # type: ignore[union-attr]
    srv.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
