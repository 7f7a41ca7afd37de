"""Small helpers shared by the benchmarks: logging, summary statistics, the machine's CPU noise."""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable

__all__ = ["log", "stats", "CpuMeter", "wait_quiet"]


def log(msg: str) -> None:
    """Print ``msg`` to stderr with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stats(xs: list[float]) -> dict[str, Any]:
    """Median, best (smallest), count and every value of the measurements that are not None."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "best": None, "n": 0, "all": []}
    return {"median": statistics.median(xs), "best": min(xs), "n": len(xs), "all": xs}


def _proc_ticks(pid: int) -> int:
    """utime + stime (+ waited-for children) of a process, in clock ticks (0 if gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15])
    except (OSError, IndexError, ValueError):
        return 0


class CpuMeter:
    """Machine CPU use between start and stop, split into ours (the processes ``pids`` returns;
    default: this one) and foreign (everything else on the machine: the noise)."""

    def __init__(self, pids: Callable[[], list[int]] | None = None) -> None:
        self._pids = pids or (lambda: [os.getpid()])
        self.start()

    def _sample(self) -> tuple[int, int, int]:
        try:
            with open("/proc/stat") as f:
                s = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            s = [0] * 8
        return sum(s), sum(s) - s[3] - s[4], sum(_proc_ticks(p) for p in self._pids())

    def start(self) -> None:
        self._t0 = self._sample()

    def stop(self) -> dict[str, float]:
        t1 = self._sample()
        total = max(1, t1[0] - self._t0[0])
        busy, ours = t1[1] - self._t0[1], t1[2] - self._t0[2]
        return {"busy_pct": round(100.0 * busy / total, 1), "foreign_pct": round(100.0 * max(0, busy - ours) / total, 1)}


def wait_quiet(meter: CpuMeter, max_wait: float, threshold_pct: float = 10.0, *, window_s: float = 1.0,
               pause_s: float = 0.0) -> dict[str, float]:
    """Wait (up to ``max_wait`` s) for a ``window_s`` in which other processes use less than
    ``threshold_pct`` of the machine's CPU (one busy core of two is 50%); ``pause_s`` between tries."""
    t0 = time.perf_counter()
    while True:
        meter.start()
        time.sleep(window_s)
        u = meter.stop()
        if u["foreign_pct"] < threshold_pct or time.perf_counter() - t0 >= max_wait:
            return {"waited_s": round(time.perf_counter() - t0, 1), **u}
        time.sleep(pause_s)
