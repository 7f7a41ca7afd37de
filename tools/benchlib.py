"""Small helpers shared by the benchmarks: logging, summary statistics, the machine's CPU noise."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

__all__ = ["log", "stats", "CpuMeter", "wait_quiet", "machine", "module_over", "write_outputs"]


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


def machine() -> dict[str, Any]:
    """What a benchmark ran on: CPUs, memory, kernel, Python, library versions, /dev/shm, and the
    library's git commit (``(dirty)`` when tracked files differ from it)."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    for mod in ("torch", "blake3", "safetensors", "lmdb", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except (ImportError, AttributeError):
            pass
    if "torch" in sys.modules:
        info["torch_threads"] = sys.modules["torch"].get_num_threads()
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            info["shmem_thp"] = f.read().strip()
        with open("/proc/mounts") as f:
            info["shm_mount"] = next((line.split()[3] for line in f if line.split()[1] == "/dev/shm"), None)
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) / 2**20, 1)
        st = os.statvfs("/dev/shm")
        info["shm_gib"] = round(st.f_blocks * st.f_frsize / 2**30, 1)
        with open("/proc/loadavg") as f:
            info["loadavg_start"] = f.read().split()[:3]
    except (OSError, StopIteration):
        pass
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", repo, *a], check=False, capture_output=True, text=True).stdout.strip()

    try:
        info["git"] = git("rev-parse", "--short", "HEAD") + (" (dirty)" if git("status", "--porcelain", "-uno") else "")
    except OSError:
        pass
    return info


def module_over(params: dict[str, Any]) -> Any:
    """A ``torch.nn.Module`` tree whose parameters (by state-dict name) are the tensors of ``params``
    (no copy; ``requires_grad=False``)."""
    import torch

    root = torch.nn.Module()
    for name, t in params.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def write_outputs(json_path: str | None, result: Any, markdown_path: str | None, markdown: str) -> None:
    """Write a benchmark's JSON result and its Markdown table (each only if its path is given)."""
    import json

    for path, write in ((json_path, lambda f: json.dump(result, f, indent=1, default=str)),
                        (markdown_path, lambda f: f.write(markdown.rstrip("\n") + "\n"))):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                write(f)
