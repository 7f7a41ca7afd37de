"""Core paramstore benchmarks, side by side with the baselines of ``tools/baselines.py``.

Every paramstore figure is measured in the same run as the baseline it is compared with, round by
round (the machines this runs on are shared and noisy): a ratio is the median of the per-round
ratios (paramstore / baseline of the same round), and "best" is best paramstore / best baseline.

Parts (``--only NAME``, repeatable or comma-separated; default: all):

* ``commit``  (goals 1-3) ``store.commit`` call time vs DCP ``async_save`` call time; commit ->
  ``handle.staged`` vs ``bare_copy``; commit -> visible in another process (a spawned reader
  blocked in ``wait_for``) vs ``bare_copy`` (and vs DCP ``done_s``). Content changes every
  round (``add_(1)`` on every tensor) so nothing is deduplicated. Also the longest time any Python
  thread of the trainer process was held off the GIL during a commit (a 1 ms heartbeat thread).
* ``staging`` (issue 11, item 6) commit -> staged and commit -> visible vs ``bare_copy`` on a
  ``--gib`` model of ``--staging-tensors`` bf16 tensors (64), store with ``retention=KeepLast(2)``,
  every tensor changed between commits, in three cases: (a) the first commit after
  ``store.prepare(model, wait=True)``; (c) ``--b2b`` commits back to back (each one issued the
  moment the previous one is visible: the training step's ``add_`` runs while the previous commit
  is hashed and published); (b) ``--paused`` commits ``--pause`` seconds apart. A fresh store per
  round, buffer recycling on (and, as info, off: ``--staging-off``). Ratios: each commit over the
  median bare copy of its round; the row gives the median and the worst commit.
* ``checkout`` (goal 4) ``store.checkout`` in another process that has the store open, at
  ``--gib`` and at each ``--checkout-gib``; and reading every byte of the checked-out tensors.
* ``load``    (goal 5) checkout + copy into preallocated tensors in another process, vs
  ``bare_copy`` in that same process; first load of a version, again, from a hot snapshot, and
  ``snap.load_into(module)``.
* ``dedup``   (goal 6) bytes of new objects after an unchanged re-commit and after changing ~10%
  of the tensors.
* ``ls``      (goal 7) ``paramstore --root R ls`` on a store of ``--ls-versions`` versions of a
  ``--ls-tensors``-tensor model (falls back to ``ParamStore(root).versions()`` in a fresh process
  if the CLI does not work).
* ``safetensors`` (reference) ``save_file`` and ``load_file`` + copy, vs ``bare_copy``.

Stores live under ``--shm-dir`` (default /dev/shm) and are deleted at the end of each part.

Example::

    .venv/bin/python tools/bench_core.py --gib 1 --repeats 5 --json out/bench_core.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from baselines import bare_copy, make_state_dict, preallocate_like  # noqa: E402
from benchlib import CpuMeter, log, machine, module_over, stats, wait_quiet  # noqa: E402

GIB = 1 << 30
PARTS = ("commit", "staging", "checkout", "load", "dedup", "ls", "safetensors")


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------
def paired(ps: list[float], base: list[float]) -> dict[str, Any]:
    """Median of per-round ratios, and best / best."""
    pairs = [(a, b) for a, b in zip(ps, base) if a is not None and b]
    if not pairs:
        return {"median": None, "best": None}
    return {"median": statistics.median(a / b for a, b in pairs),
            "best": min(a for a, _ in pairs) / min(b for _, b in pairs)}


def mutate(sd: dict[str, torch.Tensor], names: list[str] | None = None) -> None:
    """New content for every tensor (or for ``names``): defeats deduplication."""
    with torch.no_grad():
        for k in (sd if names is None else names):
            sd[k].add_(1)


def fingerprint(t: torch.Tensor) -> float:
    """A cheap content check: the sum of a few thousand elements, as float."""
    flat = t.reshape(-1)
    return float(flat[:: max(1, flat.numel() // 4096)].float().sum())


def new_root(base: str, name: str) -> str:
    return tempfile.mkdtemp(prefix=f"psbench-{name}-", dir=base)


def dir_bytes(path: str) -> int:
    """Allocated bytes (st_blocks) of every file under ``path``."""
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(d, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def pool_ready(store: Any) -> bool | None:
    """Whether the store's slab pool holds every slab it was asked to prepare (None: unknown).

    Reads private attributes of ``SlabPool``; if they change, callers fall back to sleeping.
    """
    pool = getattr(store, "_pool", None)
    lock, missing = getattr(pool, "_lock", None), getattr(pool, "_missing", None)
    if lock is None or not callable(missing):
        return None
    with lock:
        return not missing()


def wait_pool(store: Any, timeout: float = 30.0) -> float:
    """Wait until the slab pool is prepared; returns the seconds waited."""
    t0 = time.perf_counter()
    while True:
        ready = pool_ready(store)
        if ready is None:
            time.sleep(2.0)
            break
        if ready or time.perf_counter() - t0 > timeout:
            break
        time.sleep(0.005)
    return time.perf_counter() - t0


class Heartbeat:
    """A thread that wakes every millisecond; its longest gap is how long a Python thread of this
    process (the trainer's) could not run: GIL held by another thread, or no CPU."""

    def __init__(self) -> None:
        self._stamps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._stamps.append(time.perf_counter())
            time.sleep(0.001)

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        time.sleep(0.005)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def max_gap(self) -> float:
        s = self._stamps
        return max((b - a for a, b in zip(s, s[1:])), default=0.0)

    def blocked(self, over: float = 0.005) -> float:
        """Total time lost in gaps longer than ``over`` seconds."""
        s = self._stamps
        return sum(b - a - 0.001 for a, b in zip(s, s[1:]) if b - a > over)


class CpuSteal:
    """Steal and total CPU time of the machine between two points (from /proc/stat)."""

    @staticmethod
    def read() -> list[int] | None:
        try:
            with open("/proc/stat") as f:
                return [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return None

    def __init__(self) -> None:
        self.start = self.read()

    def summary(self) -> dict[str, float] | None:
        end = self.read()
        if not self.start or not end:
            return None
        d = [b - a for a, b in zip(self.start, end)]
        total = sum(d[:8]) or 1
        return {"busy_pct": 100.0 * (total - d[3] - d[4]) / total, "steal_pct": 100.0 * d[7] / total}


# ------------------------------------------------------------------------------------------------
# the reader process (spawned): has the store open, waits, checks out, loads
# ------------------------------------------------------------------------------------------------
def _read_all(tensors: list[torch.Tensor]) -> int:
    """Read every byte (as int64 where aligned): a memory-bound reduction."""
    acc = 0
    for t in tensors:
        b = t.reshape(-1).view(torch.uint8)
        if b.numel() % 8 == 0 and b.data_ptr() % 8 == 0:
            acc += int(b.view(torch.int64).sum())
        else:
            acc += int(b.sum(dtype=torch.int64))
    return acc


def reader_main(conn: Any) -> None:
    from paramstore import ParamStore

    stores: dict[str, Any] = {}
    store = None
    dst: dict[str, torch.Tensor] = {}
    src: dict[str, torch.Tensor] = {}
    module = None
    hot = None
    while True:
        msg = conn.recv()
        cmd, args = msg[0], msg[1:]
        try:
            if cmd == "exit":
                for st in stores.values():
                    st.close()
                conn.send(("ok",))
                return
            if cmd == "open":  # open (or switch to) a store; stores stay open until "free"
                t0 = time.perf_counter()
                if args[0] not in stores:
                    stores[args[0]] = ParamStore(args[0], create=False)
                store = stores[args[0]]
                conn.send(("ok", time.perf_counter() - t0))
            elif cmd == "wait":
                (step,) = args
                conn.send(("armed",))
                v = store.wait_for(step, timeout=120)
                seen = time.time()
                conn.send(("seen", seen, v.step))
            elif cmd == "watch":  # note when each of these steps becomes visible, without a round trip each
                (steps,) = args
                conn.send(("armed",))
                seen: dict[int, float] = {}
                for s in steps:
                    if s in seen:
                        continue
                    v = store.wait_for(s, timeout=300)
                    now = time.time()
                    seen.update({k: now for k in steps if k <= v.step and k not in seen})
                conn.send(("seen_many", seen))
            elif cmd == "checkout":
                step, n = args
                times, views = [], []
                for _ in range(n):
                    t0 = time.perf_counter()
                    snap = store.checkout(step)
                    t1 = time.perf_counter()
                    for k in snap:  # build every tensor view (no byte touched)
                        snap[k]
                    t2 = time.perf_counter()
                    snap.close()
                    times.append(t1 - t0)
                    views.append(t2 - t0)
                conn.send(("ok", times, views))
            elif cmd == "touch":
                (step,) = args
                t0 = time.perf_counter()
                snap = store.checkout(step)
                tensors = [snap[k] for k in snap]
                t1 = time.perf_counter()
                _read_all(tensors)  # first read: maps every page into this process
                t2 = time.perf_counter()
                _read_all(tensors)  # second read: pages already mapped
                t3 = time.perf_counter()
                # the same reduction over private, faulted-in memory of the same size
                priv = [torch.ones_like(t) for t in tensors]
                t4 = time.perf_counter()
                _read_all(priv)
                t5 = time.perf_counter()
                del priv, tensors
                snap.close()
                conn.send(("ok", {"checkout_s": t1 - t0, "touch_first_s": t2 - t1, "touch_again_s": t3 - t2,
                                  "private_read_s": t5 - t4}))
            elif cmd == "load_setup":
                (step,) = args
                with store.checkout(step) as snap:
                    src = {k: snap[k].clone() for k in snap}  # private copy: the bare-copy source
                dst = preallocate_like(src)
                module = module_over(dst)
                conn.send(("ok", sum(t.nbytes for t in dst.values())))
            elif cmd == "load":
                kind, step, check = args
                if kind == "bare":
                    conn.send(("ok", bare_copy(src, dst)))
                    continue
                if kind == "hot":  # copy again from an open snapshot whose pages are mapped
                    if hot is None or hot.step != step:
                        if hot is not None:
                            hot.close()
                        hot = store.checkout(step)
                        for k, t in hot.items():
                            dst[k].copy_(t)
                    t0 = time.perf_counter()
                    for k, t in hot.items():
                        dst[k].copy_(t)
                    dt = time.perf_counter() - t0
                elif kind == "load_into":
                    t0 = time.perf_counter()
                    with store.checkout(step) as snap:
                        snap.load_into(module)
                    dt = time.perf_counter() - t0
                else:  # "first" / "repeat": checkout + copy every tensor
                    t0 = time.perf_counter()
                    with store.checkout(step) as snap:
                        for k, t in snap.items():
                            dst[k].copy_(t)
                    dt = time.perf_counter() - t0
                ok = all(abs(fingerprint(dst[k]) - v) <= 1e-3 * max(1.0, abs(v)) for k, v in check.items())
                conn.send(("ok", dt, ok))
            elif cmd == "free":
                if hot is not None:
                    hot.close()
                dst, src, module, hot = {}, {}, None, None
                for st in stores.values():
                    st.close()
                stores, store = {}, None
                conn.send(("ok",))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except Exception:  # noqa: BLE001 - reported to the parent
            conn.send(("error", traceback.format_exc()))


class Reader:
    """The parent's handle on a spawned reader process."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=reader_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def call(self, *msg: Any, timeout: float = 300) -> tuple:
        self.conn.send(msg)
        return self.recv(timeout)

    def recv(self, timeout: float = 300) -> tuple:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"reader did not answer within {timeout} s")
        r = self.conn.recv()
        if r[0] == "error":
            raise RuntimeError(f"reader failed:\n{r[1]}")
        return r

    def close(self) -> None:
        try:
            self.call("exit", timeout=30)
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# ------------------------------------------------------------------------------------------------
# DCP (same stager configuration as baselines.dcp_async_save, but one save per call so that the
# saves can be interleaved with paramstore commits round by round)
# ------------------------------------------------------------------------------------------------
class Dcp:
    def __init__(self, directory: str) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        self.dir = directory
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                   use_async_staging=True, use_non_blocking_copy=cuda))
        self.n = 0

    def save(self, sd: dict[str, torch.Tensor]) -> dict[str, float]:
        from baselines import _timed_async_save

        ckpt = os.path.join(self.dir, f"step_{self.n}")
        self.n += 1
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            with Heartbeat() as hb:
                times = _timed_async_save(sd, ckpt, self.stager)
        times["gil_gap_s"] = hb.max_gap()
        times["gil_blocked_s"] = hb.blocked()
        shutil.rmtree(ckpt, ignore_errors=True)
        return times

    def close(self) -> None:
        self.stager.close()


# ------------------------------------------------------------------------------------------------
# parts
# ------------------------------------------------------------------------------------------------
class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self._sd: dict[str, torch.Tensor] | None = None
        self.reader: Reader | None = None
        self.results: dict[str, Any] = {}
        self.meter: Any = None
        self.quiet_budget = 2 * args.wait_quiet  # seconds of waiting left for quiet rounds

    def quiet_round(self) -> None:
        """Before a measured round: wait (up to 10 s, within the run's budget) for the machine to be quiet."""
        if self.quiet_budget <= 0 or self.meter is None:
            return
        q = wait_quiet(CpuMeter(lambda: [os.getpid()] + ([self.reader.proc.pid] if self.reader else [])),
                       min(10.0, self.quiet_budget), pause_s=1.0)
        self.quiet_budget -= q["waited_s"]

    @property
    def sd(self) -> dict[str, torch.Tensor]:
        if self._sd is None:
            t0 = time.perf_counter()
            self._sd = make_state_dict(int(self.args.gib * GIB))
            log(f"state dict: {len(self._sd)} tensors, {self.nbytes / GIB:.3f} GiB in {time.perf_counter() - t0:.1f} s")
        return self._sd

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.sd.values())

    def get_reader(self) -> Reader:
        if self.reader is None:
            self.reader = Reader()
        return self.reader


def one_commit(store: Any, reader: Reader | None, step: int, sd: dict) -> dict[str, float]:
    """Commit ``step``; times from just before the call (parent clocks; the reader's wall clock)."""
    if reader is not None:
        reader.conn.send(("wait", step))
        reader.recv()  # "armed"
        time.sleep(0.05)  # let it block in wait_for
    with Heartbeat() as hb:
        wall0 = time.time()
        t0 = time.perf_counter()
        h = store.commit(step, sd)
        t1 = time.perf_counter()
        h.staged.result()
        t2 = time.perf_counter()
        h.result()
        t3 = time.perf_counter()
        prep = wait_pool(store)  # the next commit's slabs, faulted in the background
    r = {"call_s": t1 - t0, "staged_s": t2 - t0, "committed_s": t3 - t0, "pool_ready_s": t3 - t0 + prep,
         "gil_gap_s": hb.max_gap(), "gil_blocked_s": hb.blocked()}
    if reader is not None:
        _, seen, vstep = reader.recv()
        assert vstep >= step, (vstep, step)
        r["visible_s"] = seen - wall0
    return r


def part_commit(ctx: Ctx) -> dict[str, Any]:
    from paramstore import ParamStore

    a, sd = ctx.args, ctx.sd
    dst = preallocate_like(sd)
    root = new_root(a.shm_dir, "commit")
    dcp = None if a.skip_dcp else Dcp(new_root(a.dcp_dir, "dcp"))
    reader = ctx.get_reader()
    out: dict[str, Any] = {}
    try:
        store = ParamStore(root, create=True)
        reader.call("open", root)
        t0 = time.perf_counter()
        store.prepare(sd)
        wait_pool(store)
        out["prepare_s"] = time.perf_counter() - t0
        time.sleep(0.5)
        bare_copy(sd, dst)  # first touch of dst
        bare_first = bare_copy(sd, dst)
        out["first"] = one_commit(store, reader, 1, sd)
        out["first"]["bare_s"] = bare_first
        log(f"commit: first commit {out['first']}")
        if dcp is not None:
            out["dcp_first"] = dcp.save(sd)
            log(f"commit: first DCP save {out['dcp_first']}")
        rounds = []
        for i in range(a.repeats):
            mutate(sd)
            wait_pool(store)
            ctx.quiet_round()
            r: dict[str, Any] = {}
            ctx.meter.start()
            steps = ["ps", "dcp"] if i % 2 == 0 else ["dcp", "ps"]
            for what in steps:
                if what == "ps":
                    r["ps"] = one_commit(store, reader, 2 + i, sd)
                elif dcp is not None:
                    r["dcp"] = dcp.save(sd)
            r["bare_s"] = bare_copy(sd, dst)
            r["foreign_cpu_pct"] = ctx.meter.stop()["foreign_pct"]
            rounds.append(r)
            log(f"commit: round {i + 1}/{a.repeats}: {json.dumps(r, default=lambda x: round(x, 4))}")
        out["rounds"] = rounds
        store.close()
    finally:
        if dcp is not None:
            dcp.close()
            shutil.rmtree(dcp.dir, ignore_errors=True)
        reader.call("free")
        shutil.rmtree(root, ignore_errors=True)
    del dst
    return out


def _commit_versions(root: str, sd: dict, n: int, *, prepare: bool = True,
                     change: list[str] | None = None) -> dict[int, dict[str, float]]:
    """Commit ``n`` versions of ``sd`` (new content in every tensor, or in ``change``, each time);
    returns each step's fingerprints."""
    from paramstore import ParamStore

    checks = {}
    names = list(sd)
    probe = [names[0], names[len(names) // 2], names[-1]]
    with ParamStore(root, create=True, prepare_buffers=prepare) as store:
        if prepare:
            store.prepare(sd)
            wait_pool(store)
        for step in range(1, n + 1):
            if step > 1:
                mutate(sd, change)
            store.commit(step, sd).result()
            checks[step] = {k: fingerprint(sd[k]) for k in probe}
            if prepare:
                wait_pool(store)
    return checks


def flat_state_dict(nbytes: int, n: int) -> dict[str, torch.Tensor]:
    """``n`` bf16 tensors of equal size, ``nbytes`` in all, random."""
    g = torch.Generator().manual_seed(0)
    per = max(1, nbytes // (2 * n))
    return {f"layers.{i}.weight": torch.randn(per, generator=g).to(torch.bfloat16) for i in range(n)}


def hash_all_cores(sd: dict[str, torch.Tensor]) -> float:
    """Seconds to blake3 every tensor of ``sd`` on one thread per core, whole tensors each, as a
    commit hashes a model of such tensors: the floor of commit -> visible beyond the copy."""
    from concurrent.futures import ThreadPoolExecutor

    from paramstore.format import tensor_digest

    views = [memoryview(t.view(torch.uint8).numpy()) for t in sd.values()]
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda v: tensor_digest(v, parallel=False), views))
        return time.perf_counter() - t0


def _staging_round(ctx: Ctx, sd: dict, dst: dict, *, recycle: bool) -> dict[str, Any]:
    """One store: prepare, (a) first commit, (c) back to back, (b) paused; see the module docstring."""
    from paramstore import ParamStore
    from paramstore.retention import KeepLast

    a = ctx.args
    reader = ctx.get_reader()
    root = new_root(a.shm_dir, "staging")
    n_b2b, n_paused = a.b2b, a.paused
    steps = list(range(1, 2 + n_b2b + n_paused))
    out: dict[str, Any] = {"recycle": recycle, "commits": []}
    store = ParamStore(root, create=True, retention=KeepLast(2), recycle_buffers=recycle)
    try:
        reader.call("open", root)
        reader.conn.send(("watch", steps))
        reader.recv()  # armed
        bare = [bare_copy(sd, dst)]
        t0 = time.perf_counter()
        store.prepare(sd, wait=True)
        out["prepare_s"] = time.perf_counter() - t0
        bare.append(bare_copy(sd, dst))
        prev = None
        for step in steps:
            case = "a" if step == 1 else "c" if step <= 1 + n_b2b else "b"
            if case == "b":
                if prev is not None:
                    prev.result()
                time.sleep(a.pause / 2)
                bare.append(bare_copy(sd, dst))  # in the pause: no commit work is running
                time.sleep(a.pause / 2)
            elif prev is not None:
                prev.result()  # back to back: the next commit the moment the previous is visible
            wall0 = time.time()
            t0 = time.perf_counter()
            h = store.commit(step, sd)
            h.staged.result()
            staged = time.perf_counter() - t0
            out["commits"].append({"step": step, "case": case, "staged_s": staged, "wall0": wall0})
            mutate(sd)  # the training step (while the commit is hashed and published)
            prev = h
        prev.result()
        t_end = {c["step"]: c for c in out["commits"]}
        _, seen = reader.recv(timeout=120)
        for step, t in seen.items():
            t_end[int(step)]["visible_s"] = t - t_end[int(step)]["wall0"]
        bare.append(bare_copy(sd, dst))
        out["hash_s"] = hash_all_cores(sd)
        store._write.maintainer.wait_idle(30)
        out["pool"] = dict(store._pool.stats)
        out["bare_s"] = bare
    finally:
        store.close()
        reader.call("free")
        shutil.rmtree(root, ignore_errors=True)
    return out


def part_staging(ctx: Ctx) -> dict[str, Any]:
    a = ctx.args
    sd = flat_state_dict(int(a.gib * GIB), a.staging_tensors)
    dst = preallocate_like(sd)
    bare_copy(sd, dst)
    log(f"staging: {len(sd)} tensors, {sum(t.nbytes for t in sd.values()) / GIB:.3f} GiB")
    out: dict[str, Any] = {"on": [], "off": [], "tensors": len(sd), "pause_s": a.pause, "hash_threads": os.cpu_count()}
    modes = [True] + ([False] if a.staging_off else [])
    for i in range(a.repeats):
        for recycle in (modes if i % 2 == 0 else modes[::-1]):
            ctx.quiet_round()
            ctx.meter.start()
            r = _staging_round(ctx, sd, dst, recycle=recycle)
            r["foreign_cpu_pct"] = ctx.meter.stop()["foreign_pct"]
            out["on" if recycle else "off"].append(r)
            med = statistics.median(r["bare_s"])
            log(f"staging: round {i + 1}/{a.repeats} recycle={recycle}: bare {med * 1e3:.0f} ms, prepare "
                f"{r['prepare_s']:.2f} s, staged x bare " + " ".join(
                    f"{c['case']}{c['step']}={c['staged_s'] / med:.2f}/{c.get('visible_s', 0) / med:.2f}"
                    for c in r["commits"]) + f", pool {r['pool']}")
    return out


def part_checkout(ctx: Ctx) -> dict[str, Any]:
    """Stores of every size exist side by side, so that their checkouts can be interleaved."""
    a = ctx.args
    reader = ctx.get_reader()
    out: dict[str, Any] = {}
    sizes = [a.gib] + [g for g in a.checkout_gib if g != a.gib]
    roots: dict[float, str] = {}
    try:
        for gib in sizes:
            root = roots[gib] = new_root(a.shm_dir, f"checkout{gib:g}")
            t0 = time.perf_counter()
            if gib == a.gib:
                sd = ctx.sd
                _commit_versions(root, sd, 2)
            else:  # version 2 changes one tensor: the store holds about one model size
                sd = make_state_dict(int(gib * GIB))
                log(f"checkout: {gib:g} GiB state dict made in {time.perf_counter() - t0:.1f} s")
                _commit_versions(root, sd, 2, prepare=False, change=[next(iter(sd))])
            out[f"{gib:g}"] = {"nbytes": sum(t.nbytes for t in sd.values()), "tensors": len(sd),
                               "checkout_s": [], "with_views_s": [], "touch": []}
            del sd
            log(f"checkout: {gib:g} GiB store built in {time.perf_counter() - t0:.1f} s")
            reader.call("open", root)
        for gib, root in roots.items():  # first checkout of a version in the reader
            reader.call("open", root)
            _, first, firstv = reader.call("checkout", 1, 1)
            out[f"{gib:g}"].update(first_checkout_s=first[0], first_with_views_s=firstv[0])
        for _ in range(max(30, a.repeats)):  # then the sizes in turn, one checkout each
            for gib, root in roots.items():
                reader.call("open", root)
                _, t, v = reader.call("checkout", 2, 1)
                out[f"{gib:g}"]["checkout_s"] += t
                out[f"{gib:g}"]["with_views_s"] += v
        for _ in range(max(3, min(a.repeats, 5))):
            ctx.quiet_round()
            for gib, root in roots.items():
                reader.call("open", root)
                out[f"{gib:g}"]["touch"].append(reader.call("touch", 2)[1])
        for g, d in out.items():
            log(f"checkout: {g} GiB: checkout median {statistics.median(d['checkout_s']) * 1e3:.2f} ms, "
                f"touch {json.dumps(d['touch'][-1], default=lambda x: round(x, 4))}")
    finally:
        reader.call("free")
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    return out


def part_load(ctx: Ctx) -> dict[str, Any]:
    a, sd = ctx.args, ctx.sd
    reader = ctx.get_reader()
    root = new_root(a.shm_dir, "load")
    n = a.repeats
    try:
        t0 = time.perf_counter()
        checks = _commit_versions(root, sd, n + 1)
        log(f"load: {n + 1} versions committed in {time.perf_counter() - t0:.1f} s")
        reader.call("open", root)
        reader.call("load_setup", 1)
        rounds = []
        for i in range(n):
            step = 2 + i  # never loaded in the reader before
            ctx.quiet_round()
            r = {}
            ctx.meter.start()
            r["bare_s"] = reader.call("load", "bare", step, {})[1]
            _, r["first_s"], ok1 = reader.call("load", "first", step, checks[step])
            _, r["repeat_s"], ok2 = reader.call("load", "repeat", step, checks[step])
            _, r["hot_s"], ok3 = reader.call("load", "hot", step, checks[step])
            _, r["load_into_s"], ok4 = reader.call("load", "load_into", step, checks[step])
            r["bare2_s"] = reader.call("load", "bare", step, {})[1]
            r["content_ok"] = ok1 and ok2 and ok3 and ok4
            r["foreign_cpu_pct"] = ctx.meter.stop()["foreign_pct"]
            rounds.append(r)
            log(f"load: round {i + 1}/{n}: {json.dumps(r, default=lambda x: round(x, 4))}")
        return {"rounds": rounds}
    finally:
        reader.call("free")
        shutil.rmtree(root, ignore_errors=True)


def part_dedup(ctx: Ctx) -> dict[str, Any]:
    from paramstore import ParamStore

    a, sd = ctx.args, ctx.sd
    root = new_root(a.shm_dir, "dedup")
    names = list(sd)
    total = sum(t.nbytes for t in sd.values())
    # every 10th tensor from an offset: ~10% by count; pick the offsets closest to 10% of bytes
    subsets = []
    for off in range(10):
        sub = names[off::10]
        subsets.append((abs(sum(sd[k].nbytes for k in sub) / total - 0.10), off, sub))
    subsets.sort()
    out: dict[str, Any] = {"total_bytes": total, "unchanged": [], "partial": []}
    try:
        with ParamStore(root, create=True) as store:
            reg = store._root.registry

            def measured_commit(step: int) -> dict[str, Any]:
                """Commit ``sd`` as ``step``; the objects and bytes it added, and its time."""
                before, du0 = reg.objects(), dir_bytes(os.path.join(root, "objects"))
                t0 = time.perf_counter()
                store.commit(step, sd).result()
                dt = time.perf_counter() - t0
                after, du1 = reg.objects(), dir_bytes(os.path.join(root, "objects"))
                new = {k: v for k, v in after.items() if k not in before}
                return {"new_bytes": sum(new.values()), "new_objects": len(new),
                        "objects_dir_growth": du1 - du0, "committed_s": dt}

            store.prepare(sd)
            wait_pool(store)
            mutate(sd)
            step = 1
            store.commit(step, sd).result()
            wait_pool(store)
            for i in range(min(a.repeats, 3)):
                step += 1
                out["unchanged"].append(measured_commit(step))
                wait_pool(store)

                _, off, sub = subsets[i]
                changed = sum(sd[k].nbytes for k in sub)
                mutate(sd, sub)
                step += 1
                out["partial"].append({"offset": off, "changed_tensors": len(sub), "tensors": len(names),
                                       "changed_bytes": changed, **measured_commit(step)})
                wait_pool(store)
                log(f"dedup: {out['unchanged'][-1]} / {out['partial'][-1]}")
            out["tmp_leftovers"] = len(store._root.tier.leftovers())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _run_timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, int, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    dt = time.perf_counter() - t0
    return dt, p.returncode, p.stdout.count(b"\n"), p.stderr.decode(errors="replace")[-500:]


def part_ls(ctx: Ctx) -> dict[str, Any]:
    from paramstore import ParamStore

    a = ctx.args
    root = new_root(a.shm_dir, "ls")
    out: dict[str, Any] = {"versions": a.ls_versions, "tensors": a.ls_tensors}
    try:
        sd = {f"model.layers.{i}.weight": torch.full((8,), float(i), dtype=torch.bfloat16)
              for i in range(a.ls_tensors)}  # 16 bytes each
        t0 = time.perf_counter()
        with ParamStore(root, create=True) as store:
            for step in range(1, a.ls_versions + 1):
                store.commit(step, sd, metrics={"reward": step * 1e-3}).result()
                if step % 2000 == 0:
                    log(f"ls: {step} versions, {(time.perf_counter() - t0) / step * 1e3:.2f} ms per commit")
        out["build_s"] = time.perf_counter() - t0
        out["meta_bytes"] = dir_bytes(os.path.join(root, "meta"))
        bindir = os.path.dirname(sys.executable)
        cli = os.path.join(bindir, "paramstore")
        cli_cmd = [cli] if os.path.exists(cli) else [sys.executable, "-c", "import sys; from paramstore.cli import main; sys.exit(main())"]
        cmds = {
            "python_startup": [sys.executable, "-c", "pass"],
            "cli_ls": cli_cmd + ["--root", root, "ls"],
            "cli_ls_json": cli_cmd + ["--root", root, "ls", "--json"],
            "api_versions": [sys.executable, "-c",
                             f"from paramstore import ParamStore; print(len(ParamStore({root!r}, create=False).versions()))"],
        }
        res: dict[str, Any] = {k: [] for k in cmds}
        errors: dict[str, str] = {}
        for _ in range(a.repeats):
            for k, cmd in cmds.items():
                dt, rc, lines, err = _run_timed(cmd)
                if rc == 0:
                    res[k].append(dt)
                else:
                    errors[k] = f"rc={rc}: {err}"
        out["times"] = res
        out["cli_lines"] = _run_timed(cmds["cli_ls"])[2]
        out["errors"] = errors
        log(f"ls: {json.dumps({k: stats(v)['median'] for k, v in res.items()})} errors={errors}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def part_safetensors(ctx: Ctx) -> dict[str, Any]:
    from baselines import safetensors_roundtrip

    a, sd = ctx.args, ctx.sd
    d = new_root(a.shm_dir, "st")
    dst = preallocate_like(sd)
    rounds = []
    try:
        for i in range(a.repeats):
            ctx.quiet_round()
            r = dict(safetensors_roundtrip(sd, d))
            r["bare_s"] = bare_copy(sd, dst)
            rounds.append(r)
            log(f"safetensors: round {i + 1}: {json.dumps(r, default=lambda x: round(x, 4))}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {"rounds": rounds}


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None else (f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s")


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def rows(res: dict[str, Any]) -> list[dict[str, str]]:
    """The summary table: one row per figure."""
    out: list[dict[str, str]] = []

    def row(name: str, goal: str, ps: dict | None, base: dict | None, ratio: dict | None, verdict: str,
            note: str = "", base_name: str = "") -> None:
        def fmt(s: dict | None) -> str:
            if not s or s.get("median") is None:
                return "-"
            return f"{_ms(s['median'])} / {_ms(s['best'])} (n={s['n']})"

        out.append({"benchmark": name, "goal": goal, "paramstore": fmt(ps),
                    "baseline": (f"{base_name}: " if base_name and base else "") + fmt(base),
                    "ratio": "-" if not ratio or ratio.get("median") is None else
                    f"{_r(ratio['median'])} (best {_r(ratio['best'])})",
                    "verdict": verdict, "note": note})

    def verdict(x: float | None, limit: float) -> str:
        if x is None:
            return "n/a"
        return "PASS" if x <= limit else f"MISS (+{100 * (x / limit - 1):.0f}%)"

    c = res.get("commit")
    if c:
        rr = c["rounds"]
        ps = lambda m: [r["ps"][m] for r in rr]  # noqa: E731
        bare = [r["bare_s"] for r in rr]
        have_dcp = all("dcp" in r for r in rr)
        dcp = (lambda m: [r["dcp"][m] for r in rr]) if have_dcp else None
        if dcp:
            ra = paired(ps("call_s"), dcp("call_s"))
            row("1. commit stall (steady)", "<= 0.5x DCP call", stats(ps("call_s")), stats(dcp("call_s")), ra,
                verdict(ra["median"], 0.5), base_name="DCP async_save call")
        else:
            row("1. commit stall (steady)", "<= 0.5x DCP call", stats(ps("call_s")), None, None, "n/a")
        f = c["first"]
        df = c.get("dcp_first")
        row("1. commit stall (first commit)", "info", stats([f["call_s"]]),
            stats([df["call_s"]]) if df else None,
            {"median": f["call_s"] / df["call_s"], "best": f["call_s"] / df["call_s"]} if df else None,
            "info", base_name="DCP first call")
        if dcp:
            row("1. longest GIL hold-off of a trainer thread during commit", "info", stats(ps("gil_gap_s")),
                stats(dcp("gil_gap_s")), paired(ps("gil_gap_s"), dcp("gil_gap_s")), "info",
                note="1 ms heartbeat thread, commit call -> next slabs ready", base_name="DCP save")
            row("1. total time trainer threads were held off (gaps > 5 ms)", "info", stats(ps("gil_blocked_s")),
                stats(dcp("gil_blocked_s")), paired(ps("gil_blocked_s"), dcp("gil_blocked_s")), "info",
                note="same window", base_name="DCP save")
        ra = paired(ps("staged_s"), bare)
        row("2. commit -> staged", "<= 1.3x bare copy", stats(ps("staged_s")), stats(bare), ra,
            verdict(ra["median"], 1.3), base_name="bare_copy")
        row("2. commit -> staged (first commit)", "info", stats([f["staged_s"]]), stats([f["bare_s"]]),
            paired([f["staged_s"]], [f["bare_s"]]), "info", base_name="bare_copy")
        ra = paired(ps("visible_s"), bare)
        row("3. commit -> visible in another process", "<= 3x bare copy", stats(ps("visible_s")), stats(bare), ra,
            verdict(ra["median"], 3.0), base_name="bare_copy")
        if dcp:
            row("3. commit -> visible vs DCP files written", "info", stats(ps("visible_s")), stats(dcp("done_s")),
                paired(ps("visible_s"), dcp("done_s")), "info", base_name="DCP done_s")
            row("3. (ref) DCP staged", "info", stats(dcp("staged_s")), stats(bare),
                paired(dcp("staged_s"), bare), "info", base_name="bare_copy")
        row("3. commit -> visible (first commit)", "info", stats([f["visible_s"]]), stats([f["bare_s"]]),
            paired([f["visible_s"]], [f["bare_s"]]), "info", base_name="bare_copy")
        row("(info) commit -> next commit's slabs faulted", "info", stats(ps("pool_ready_s")), None, None, "info")
    sg = res.get("staging")
    if sg:
        names = {"a": "(a) first commit after prepare()", "c": "(c) back to back",
                 "b": f"(b) steady, {sg['pause_s']:g} s pause"}
        for mode in ("on", "off"):
            rr = sg.get(mode) or []
            if not rr:
                continue
            label = "" if mode == "on" else " [recycle_buffers=False]"
            for metric, goal_x in (("staged_s", 1.3), ("visible_s", 1.5)):
                what = "staged" if metric == "staged_s" else "visible (other process)"
                for case in ("a", "c", "b"):
                    xs, bs, ratios = [], [], []
                    for r in rr:
                        med = statistics.median(r["bare_s"])
                        for c in r["commits"]:
                            if c["case"] == case and c.get(metric) is not None:
                                xs.append(c[metric])
                                bs.append(med)
                                ratios.append(c[metric] / med)
                    if not ratios:
                        continue
                    ra = {"median": statistics.median(ratios), "best": min(x for x in xs) / min(bs)}
                    worst = max(ratios)
                    goal = f"<= {goal_x:g}x bare copy"
                    row(f"item 6. commit -> {what}, {names[case]}{label}", goal if mode == "on" else "info",
                        stats(xs), stats(bs), ra,
                        (verdict(ra["median"], goal_x) + (f"; worst {worst:.2f}x" if worst > goal_x else ""))
                        if mode == "on" else "info",
                        note=f"worst commit {worst:.2f}x; {len(sg[mode])} stores x {len(xs) // len(rr)} commits",
                        base_name="bare_copy (median of its round)")
            if mode == "on":
                hs = [r["hash_s"] for r in rr]
                bs = [statistics.median(r["bare_s"]) for r in rr]
                row(f"item 6. (floor) blake3 of the model's bytes, {sg.get('hash_threads')} threads", "info", stats(hs),
                    stats(bs), paired(hs, bs), "info", base_name="bare_copy (median of its round)",
                    note="what commit -> visible costs beyond the copy, unless hashing overlaps it on spare cores")
            pools = [r["pool"] for r in rr]
            row(f"item 6. (info) buffers per store{label}", "info", stats([r["prepare_s"] for r in rr]), None, None,
                "info", note="prepare(wait=True) time; pool: " + ", ".join(
                    f"{k} {statistics.median(p[k] for p in pools):g}" for k in pools[0]))
    ck = res.get("checkout")
    if ck:
        meds = {}
        for g, d in ck.items():
            s = stats(d["checkout_s"])
            meds[g] = s["median"]
            row(f"4. checkout, other process, {g} GiB ({d['tensors']} tensors)", "<= 10 ms", s, None, None,
                verdict(s["median"], 0.010), note=f"first checkout {_ms(d['first_checkout_s'])}")
            row(f"4. checkout + build all views, {g} GiB", "info", stats(d["with_views_s"]), None, None, "info")
            t = d["touch"]
            row(f"4. read every byte after checkout, {g} GiB", "info", stats([x["touch_first_s"] for x in t]),
                stats([x["private_read_s"] for x in t]),
                paired([x["touch_first_s"] for x in t], [x["private_read_s"] for x in t]), "info",
                note=f"again (pages mapped): {_ms(stats([x['touch_again_s'] for x in t])['median'])}",
                base_name="same read, private memory")
        keys = list(ck)
        if len(keys) > 1:
            big = keys[-1]
            ra = paired(ck[big]["checkout_s"], ck[keys[0]]["checkout_s"])  # interleaved, one pair per turn
            row(f"4. checkout {big} GiB / {keys[0]} GiB", "<= 2x", None, None, ra, verdict(ra["median"], 2.0),
                note=f"ratio of medians {meds[big] / meds[keys[0]]:.2f}x; {ck[big]['tensors']} vs "
                     f"{ck[keys[0]]['tensors']} tensors")
    ld = res.get("load")
    if ld:
        rr = ld["rounds"]
        bare = [min(r["bare_s"], r["bare2_s"]) for r in rr]
        for key, label, goal in (("first_s", "5. checkout + copy, first load of a version", "<= 1.2x bare copy"),
                                 ("repeat_s", "5. checkout + copy, same version again", "<= 1.2x bare copy"),
                                 ("hot_s", "5. copy from an open snapshot (pages mapped)", "info"),
                                 ("load_into_s", "5. checkout + snap.load_into(module)", "info")):
            xs = [r[key] for r in rr]
            ra = paired(xs, bare)
            row(label, goal, stats(xs), stats(bare), ra,
                verdict(ra["median"], 1.2) if goal != "info" else "info", base_name="bare_copy (reader)")
        if not all(r["content_ok"] for r in rr):
            row("5. content check", "loaded bytes = committed", None, None, None, "FAIL")
    dd = res.get("dedup")
    if dd:
        un = [x["new_bytes"] for x in dd["unchanged"]]
        row("6. unchanged re-commit: new bytes", "0", None, None, None,
            "PASS" if all(x == 0 for x in un) else "MISS", note=f"new bytes {un}; "
            f"commit->visible {_ms(stats([x['committed_s'] for x in dd['unchanged']])['median'])}")
        ratios = [x["new_bytes"] / x["changed_bytes"] for x in dd["partial"]]
        p0 = dd["partial"][0]
        s = stats(ratios)
        row("6. ~10% of tensors changed: new bytes / changed bytes", "<= 1.1x", None, None, s,
            verdict(s["median"], 1.1),
            note=f"{p0['changed_tensors']}/{p0['tensors']} tensors, "
                 f"{100 * p0['changed_bytes'] / dd['total_bytes']:.1f}% of bytes; new objects {p0['new_objects']}")
    ls = res.get("ls")
    if ls:
        t = ls["times"]
        cli = stats(t["cli_ls"])
        if cli["n"]:
            row(f"7. `paramstore ls`, {ls['versions']} versions x {ls['tensors']} tensors", "< 1 s", cli,
                stats(t["python_startup"]), None, verdict(cli["median"], 1.0), base_name="python -c pass",
                note=f"--json {_ms(stats(t['cli_ls_json'])['median'])}")
        else:
            api = stats(t["api_versions"])
            row(f"7. ParamStore(root).versions() in a fresh process (CLI failed), {ls['versions']} versions",
                "< 1 s", api, stats(t["python_startup"]), None, verdict(api["median"], 1.0),
                base_name="python -c pass", note=str(ls["errors"])[:200])
        row("7. (info) ParamStore(root).versions() in a fresh process", "info", stats(t["api_versions"]), None,
            None, "info")
        row(f"7. (info) building the store: {ls['versions']} commits", "info",
            stats([ls["build_s"]]), None, None, "info",
            note=f"{ls['build_s'] / ls['versions'] * 1e3:.1f} ms per commit")
    st = res.get("safetensors")
    if st:
        rr = st["rounds"]
        bare = [r["bare_s"] for r in rr]
        for key, label in (("save_s", "(ref) safetensors save_file"), ("load_copy_s", "(ref) safetensors load_file + copy")):
            xs = [r[key] for r in rr]
            row(label, "info", stats(xs), stats(bare), paired(xs, bare), "info", base_name="bare_copy")
    return out


def table(rs: list[dict[str, str]], markdown: bool) -> str:
    cols = ["benchmark", "goal", "paramstore", "baseline", "ratio", "verdict", "note"]
    if markdown:
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(r[c].replace("|", "\\|") for c in cols) + " |" for r in rs]
        return "\n".join(lines)
    w = {c: max(len(c), *(len(r[c]) for r in rs)) for c in cols}
    lines = ["  ".join(c.ljust(w[c]) for c in cols), "  ".join("-" * w[c] for c in cols)]
    lines += ["  ".join(r[c].ljust(w[c]) for c in cols) for r in rs]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="state dict size in GiB (default 1)")
    p.add_argument("--checkout-gib", type=float, nargs="*", default=[4.0],
                   help="extra sizes for the checkout benchmark (default 4)")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds per benchmark (default 5)")
    p.add_argument("--skip-dcp", action="store_true", help="no DCP baseline")
    p.add_argument("--staging-tensors", type=int, default=64, help="tensors of the staging part's model (default 64)")
    p.add_argument("--b2b", type=int, default=6, help="staging: back-to-back commits per store (default 6)")
    p.add_argument("--paused", type=int, default=4, help="staging: paused commits per store (default 4)")
    p.add_argument("--pause", type=float, default=1.5, help="staging: seconds between paused commits (default 1.5)")
    p.add_argument("--staging-off", action="store_true",
                   help="staging: also run each round with recycle_buffers=False (info rows)")
    p.add_argument("--only", action="append", default=[], help=f"run only these parts: {', '.join(PARTS)}")
    p.add_argument("--ls-versions", type=int, default=10_000)
    p.add_argument("--ls-tensors", type=int, default=300)
    p.add_argument("--shm-dir", default="/dev/shm", help="where stores are created (default /dev/shm)")
    p.add_argument("--dcp-dir", default="/dev/shm", help="where DCP writes its checkpoints (default /dev/shm)")
    p.add_argument("--wait-quiet", type=float, default=30.0, metavar="S",
                   help="before each part wait up to S seconds for other processes to use < 10%% CPU, and "
                        "before each measured round up to 10 s, 2*S in all (default 30; 0: never wait)")
    p.add_argument("--json", metavar="OUT", help="write every measurement as JSON")
    p.add_argument("--markdown", metavar="OUT", help="write the summary table as Markdown")
    args = p.parse_args(argv)
    only = [x for o in args.only for x in o.split(",") if x] or list(PARTS)
    bad = [x for x in only if x not in PARTS]
    if bad:
        p.error(f"unknown part(s) {bad}; choose from {PARTS}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")

    ctx = Ctx(args)
    cpu = CpuSteal()
    t_start = time.perf_counter()
    res: dict[str, Any] = {"argv": [os.path.relpath(sys.argv[0])] + sys.argv[1:], "machine": machine()}
    parts: dict[str, Callable[[Ctx], dict]] = {
        "commit": part_commit, "staging": part_staging, "checkout": part_checkout, "load": part_load, "dedup": part_dedup,
        "ls": part_ls, "safetensors": part_safetensors,
    }
    failed = []
    meter = CpuMeter(lambda: [os.getpid()] + ([ctx.reader.proc.pid] if ctx.reader is not None else []))
    ctx.meter = CpuMeter(lambda: [os.getpid()] + ([ctx.reader.proc.pid] if ctx.reader is not None else []))
    try:
        if any(x in only for x in ("commit", "staging", "checkout", "load")):
            ctx.get_reader()  # start the spawned reader early (importing torch takes a while)
        for name in PARTS:
            if name not in only:
                continue
            q = wait_quiet(meter, args.wait_quiet, pause_s=1.0) if args.wait_quiet > 0 else {}
            log(f"--- {name} (machine before: {q})")
            t0 = time.perf_counter()
            meter.start()
            try:
                res[name] = parts[name](ctx)
            except Exception:  # noqa: BLE001 - report and go on with the other parts
                failed.append(name)
                res.setdefault("errors", {})[name] = traceback.format_exc()
                log(f"{name} FAILED:\n{traceback.format_exc()}")
            cpu_use = meter.stop()
            res.setdefault("part_seconds", {})[name] = time.perf_counter() - t0
            res.setdefault("part_cpu", {})[name] = {"before": q, "during": cpu_use}
            log(f"--- {name} done in {time.perf_counter() - t0:.0f} s, machine CPU during: {cpu_use}")
    finally:
        if ctx.reader is not None:
            ctx.reader.close()
    res["total_seconds"] = time.perf_counter() - t_start
    res["cpu"] = cpu.summary()
    try:
        res["machine"]["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    except OSError:
        pass
    rs = rows(res)
    res["table"] = rs
    print(table(rs, markdown=False))
    print(f"\ntotal {res['total_seconds']:.0f} s; machine CPU {res['cpu']}; "
          f"loadavg {res['machine'].get('loadavg_start')} -> {res['machine'].get('loadavg_end')}")
    for name, u in res.get("part_cpu", {}).items():
        print(f"  {name:12s} {res['part_seconds'][name]:6.0f} s   CPU of other processes: before "
              f"{u['before'].get('foreign_pct', '-')}%, during {u['during']['foreign_pct']}% "
              f"(machine busy {u['during']['busy_pct']}%)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table(rs, markdown=True) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
