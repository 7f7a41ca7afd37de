"""Sharded (DTensor) commits, resharded loads and streaming commits, side by side with baselines.

Ranks are real processes: ``--world`` (default 4) gloo ranks spawned on this host (CPU), each
holding its ``Shard`` blocks of a ``--gib`` model of ``--tensors`` bf16 DTensors over a
``(world,)`` mesh (all ``Shard(0)`` but two ``Shard(1)`` and one ``Shard(0)`` with a row count no
rank count divides). Every rank opens ``ParamStore(root, retention=KeepLast(2))`` on a root under
``--shm-dir`` (default /dev/shm) and calls ``store.prepare(state_dict, wait=True)`` before
anything is measured. Every baseline is measured in the same run, by the same ranks, round by
round; a ratio is the median of the per-(round, rank) ratios, "best" is best / best.

Parts (``--only NAME``, repeatable or comma-separated; default all):

* ``commit`` (measures 1-3), on ``--world`` ranks. Per round: every tensor's block changed (one
  element, so nothing deduplicates), then on all ranks at once (a barrier before each):
  ``bare_copy`` of the rank's local blocks into preallocated, already-faulted tensors; a commit
  (call time, call -> ``handle.staged``, call -> ``handle.committed``), and
  ``torch.distributed.checkpoint.async_save`` of the same DTensors to a directory under
  ``--shm-dir`` (call time, staging completion, files written; a ``DefaultStager`` staging into
  shared memory on a background thread, reused across saves, its own gloo group), in alternating
  order; the bare copy again (ratios against the faster of the two, as bench_core does, and
  against their mean). Each commit is waited for, and so are the retention thread and the slab
  pool's next buffers (after ``SETTLE_S``: see :func:`_settle`), before anything else runs. Then (unless
  ``--no-stagger``) the same once more with the ranks taking turns (one rank copies or stages while
  the others wait, 0.3 s apart): staging without other ranks competing for the cores. After the
  last commit: bytes stored for the version (object file sizes, with and without their safetensors
  headers) against its logical bytes.
* ``load`` (measure 4), on ``--load-world`` (default 2) newly spawned ranks: a module whose
  parameters are DTensors ``Shard(0)`` over a ``(load_world,)`` mesh, same global shapes;
  ``snap.load_into(module)`` from a fresh checkout of the last commit, cold (the snapshot's pages
  not yet mapped in the process) and after ``snap.prefault()`` (untimed), against a bare copy of
  the same local blocks from plain private CPU tensors into preallocated faulted ones. Then a
  content check: a position-weighted checksum of every tensor, summed over the loading ranks,
  must equal the one the committing ranks computed on what they committed. Needs ``commit``
  (with ``--only load`` a store is committed once, unmeasured).
* ``stream`` (measure 5), in one spawned process: ``--stream-commits`` streaming commits
  ``store.commit(step, generator)`` of ``--stream-tensors`` freshly allocated and filled bf16
  tensors of ``--stream-mib`` MiB each. Each tensor's memory is a NumPy array (``torch.from_numpy``):
  a weak reference to the array dies exactly when the tensor's memory is freed, however many
  tensor objects (``detach()`` etc.) shared it; the most of them alive at once (counted as each
  new one is made) is the figure (weak references to the tensor objects themselves are also
  counted). A thread samples ``/proc/self/status`` every 0.5 ms: the peak of ``RssAnon`` (private
  memory: the generator's tensors and anything else the commit allocates) above its value before
  the commit, in tensors. ``RssShmem`` (the store's slabs, counted in RSS once touched by this
  process; prepared slabs are faulted ahead and count before the commit starts) and ``VmHWM``
  (peak of the whole RSS, reset through ``/proc/self/clear_refs``) are reported beside it.

Threads: each rank runs with ``--rank-threads`` intra-op threads (default 1: 4 ranks on 2 cores
already oversubscribe; a 2-thread OpenMP copy stalls whenever one of its threads is descheduled).

Every spawned process is bounded (``--timeout`` seconds per part; it also exits by itself when its
parent dies), and every directory created under ``--shm-dir`` is deleted at the end, also on error.

Example::

    .venv/bin/python tools/bench_sharded.py --gib 1 --json out/bench_sharded.json --markdown out/bench_sharded.md
    .venv/bin/python tools/docgen.py sharded out/bench_sharded.md --json out/bench_sharded.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from benchlib import CpuMeter, log, machine, module_over, stats, wait_quiet, write_outputs

GIB = 1 << 30
MIB = 1 << 20
PARTS = ("commit", "load", "stream")
SPAWN = mp.get_context("spawn")
COLS = 4096
STAGGER_GAP_S = 0.3


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------
def model_layout(gib: float, n: int) -> list[tuple[str, tuple[int, int], int]]:
    """(name, global shape, sharded dim) of each tensor: ``n`` bf16 tensors of ``COLS`` columns
    making ``gib`` GiB; tensors 5 and 21 (mod n) are ``Shard(1)``, tensor 13 (mod n) has 3 rows
    fewer (no rank count up to 8 divides it: an uneven ``Shard(0)``)."""
    rows = max(16, int(gib * GIB / n / (COLS * 2)) // 16 * 16)
    s1 = {5 % n, 21 % n} if n > 2 else set()
    uneven = 13 % n
    out = []
    for i in range(n):
        shape = (rows - 3 if i == uneven and i not in s1 else rows, COLS)
        out.append((f"layers.{i}.weight", shape, 1 if i in s1 else 0))
    return out


def _block(shape: tuple[int, ...], mesh: Any, dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, [Shard(dim)])
    return tuple(sizes), tuple(offsets)


def _dtensor(local: torch.Tensor, mesh: Any, dim: int, shape: tuple[int, ...]) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                              stride=(shape[1], 1))


def checksum(x: torch.Tensor, offsets: tuple[int, ...]) -> int:
    """A position-weighted sum of the bits of a block of a 2-D bf16 tensor: additive over any
    tiling of the tensor into blocks, so the sums of the blocks any set of ranks holds add up to
    the same total, and a block put in the wrong place changes it."""
    if x.numel() == 0:
        return 0
    b = x.view(torch.int16)
    r = torch.arange(offsets[0] + 1, offsets[0] + 1 + b.shape[0], dtype=torch.int64)
    c = torch.arange(offsets[1] + 1, offsets[1] + 1 + b.shape[1], dtype=torch.int64)
    return int((b.sum(dim=1, dtype=torch.int64) * r).sum()) + 7 * int((b.sum(dim=0, dtype=torch.int64) * c).sum())


def bare_copy(src: list[torch.Tensor], dst: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for s, d in zip(src, dst):
        d.copy_(s)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------
# spawned processes, bounded
# ------------------------------------------------------------------------------------------------
def _watchdog(parent: int, deadline: float) -> None:
    """Exit this process when its parent is gone or its time is up (whatever it is doing)."""
    def run() -> None:
        while True:
            if os.getppid() != parent or time.time() > deadline:
                os._exit(3)
            time.sleep(0.5)
    threading.Thread(target=run, name="bench-watchdog", daemon=True).start()


def _rank_main(fn: Callable, rank: int, world: int, init: str, results: Any, cfg: dict, parent: int,
               deadline: float) -> None:
    _watchdog(parent, deadline)
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        results.put((rank, "ok", fn(rank, world, cfg)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _solo_main(fn: Callable, results: Any, cfg: dict, parent: int, deadline: float) -> None:
    _watchdog(parent, deadline)
    warnings.filterwarnings("ignore")
    try:
        results.put((0, "ok", fn(cfg)))
    except BaseException:  # noqa: BLE001
        results.put((0, "error", traceback.format_exc()))


_LIVE: list[Any] = []  # processes started and not yet reaped (killed on the way out)


def _run_procs(procs: list[Any], results: Any, n: int, timeout: float) -> dict[int, Any]:
    """Start ``procs``, collect ``n`` results within ``timeout`` s, then reap them (killing stragglers)."""
    for p in procs:
        p.start()
        _LIVE.append(p)
    got: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) + len(errors) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    try:  # a result may have arrived just before the last one exited
                        rank, status, value = results.get(timeout=1.0)
                    except queue.Empty:
                        break
                else:
                    continue
            if status == "ok":
                got[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break  # the others will fail or hang on their collectives: stop them
        for p in procs:
            p.join(timeout=max(1.0, min(10.0, deadline - time.monotonic())))
    finally:
        _reap(procs)
    if errors:
        raise RuntimeError("\n".join(errors))
    if len(got) < n:
        raise RuntimeError(f"only ranks {sorted(got)} of {n} gave a result within {timeout:.0f} s "
                           f"(exit codes {[p.exitcode for p in procs]})")
    return got


def _reap(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
        if p in _LIVE:
            _LIVE.remove(p)


def run_ranks(world: int, fn: Callable, cfg: dict, timeout: float) -> dict[int, Any]:
    """``fn(rank, world, cfg)`` on ``world`` spawned gloo ranks; ``{rank: result}``."""
    init = os.path.join(cfg["base"], f"gloo-init-{world}-{time.monotonic_ns()}")
    results = SPAWN.Queue()
    deadline = time.time() + timeout + 15
    procs = [SPAWN.Process(target=_rank_main, args=(fn, r, world, init, results, cfg, os.getpid(), deadline),
                           daemon=True) for r in range(world)]
    try:
        return _run_procs(procs, results, world, timeout)
    finally:
        if os.path.exists(init):
            os.unlink(init)


def run_solo(fn: Callable, cfg: dict, timeout: float) -> Any:
    results = SPAWN.Queue()
    deadline = time.time() + timeout + 15
    proc = SPAWN.Process(target=_solo_main, args=(fn, results, cfg, os.getpid(), deadline), daemon=True)
    return _run_procs([proc], results, 1, timeout)[0]


# ------------------------------------------------------------------------------------------------
# part "commit": on every rank
# ------------------------------------------------------------------------------------------------
SETTLE_S = 0.25


def _settle(store: Any, timeout: float) -> None:
    """Wait until this rank's retention run and its pool's next buffers are done (private
    attributes of ParamStore: if they change, sleep instead).

    ``handle.committed`` completes *before* the publisher thread pokes retention and asks the
    pool for the next buffers, so waiting at once could find both idle and return while the
    buffers are about to be faulted in the background (competing with what is measured next):
    give the publisher ``SETTLE_S`` first."""
    time.sleep(SETTLE_S)
    maint, committer = getattr(store, "_maintainer", None), getattr(store, "_committer", None)
    if maint is None or committer is None or not hasattr(maint, "wait_idle"):
        time.sleep(2.0)
        return
    maint.wait_idle(timeout)
    committer.wait_prepared(timeout)
    maint.wait_idle(timeout)


def _timed_commit(store: Any, step: int, sd: dict, timeout: float) -> dict[str, float]:
    stamps: dict[str, float] = {}
    t0 = time.perf_counter()
    handle = store.commit(step, sd)
    call = time.perf_counter() - t0
    handle.staged.add_done_callback(lambda _f: stamps.setdefault("staged", time.perf_counter()))
    handle.committed.add_done_callback(lambda _f: stamps.setdefault("committed", time.perf_counter()))
    handle.staged.result(timeout)
    handle.result(timeout)
    return {"call_s": call, "staged_s": stamps["staged"] - t0, "visible_s": stamps["committed"] - t0}


def _timed_dcp(sd: dict, checkpoint_id: str, stager: Any, pg: Any, timeout: float) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    resp = dcp.async_save(sd, checkpoint_id=checkpoint_id, async_stager=stager, process_group=pg)
    times["call_s"] = time.perf_counter() - t0
    futs = ({"staged_s": resp.staging_completion, "done_s": resp.upload_completion}
            if hasattr(resp, "upload_completion") else {"done_s": resp})
    for name, fut in futs.items():
        fut.add_done_callback(lambda _f, name=name: times.setdefault(name, time.perf_counter() - t0))
    for fut in futs.values():
        fut.result(timeout)
    return times


def _pool_stats(store: Any) -> dict[str, int]:
    """The slab pool's counters (a private attribute: empty if it changes)."""
    return dict(getattr(getattr(store, "_pool", None), "stats", {}) or {})


def _mutate(locals_: list[torch.Tensor], step: int) -> None:
    """New content for every block (one element; its digest changes, so nothing deduplicates)."""
    for t in locals_:
        if t.numel():
            t.view(-1).view(torch.int16)[0] = step % 30000


def _rank_commit(rank: int, world: int, cfg: dict) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from paramstore import ParamStore
    from paramstore.retention import KeepLast

    torch.set_num_threads(cfg["threads"])
    timeout = cfg["op_timeout"]
    mesh = init_device_mesh("cpu", (world,))
    sd, locals_, offsets = {}, [], []
    for i, (name, shape, dim) in enumerate(cfg["layout"]):
        sizes, offs = _block(shape, mesh, dim)
        g = torch.Generator().manual_seed(1000 * i + rank)
        local = torch.empty(sizes, dtype=torch.bfloat16).uniform_(-1, 1, generator=g)
        sd[name] = _dtensor(local, mesh, dim, shape)
        locals_.append(local)
        offsets.append(offs)
    dst = [torch.zeros_like(t) for t in locals_]
    bare_copy(locals_, dst)  # throw-away: every page of both sides touched once
    out: dict[str, Any] = {"rank": rank, "local_bytes": sum(t.nbytes for t in locals_), "rounds": [],
                           "stagger": [], "threads": torch.get_num_threads()}
    store = ParamStore(cfg["root"], retention=KeepLast(2))
    stager = None
    try:
        dist.barrier()
        t0 = time.perf_counter()
        store.prepare(sd, wait=True, timeout=timeout)
        out["prepare_s"] = time.perf_counter() - t0
        use_dcp = cfg["dcp"] and cfg["repeats"] > 0
        if use_dcp:
            from torch.distributed.checkpoint.staging import (
                DefaultStager,
                StagingOptions,
            )

            dcp_pg = dist.new_group(backend="gloo")  # DCP's collectives run on its upload thread
            stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                  use_async_staging=True, use_non_blocking_copy=False))
        step = 1
        _mutate(locals_, step)
        dist.barrier()
        out["first_commit"] = _timed_commit(store, step, sd, timeout)  # also makes the commit group
        _settle(store, timeout)
        out["pool_before"] = _pool_stats(store)
        dcp_dir = os.path.join(cfg["base"], "dcp")

        def dcp_round(tag: str) -> dict[str, float]:
            ckpt = os.path.join(dcp_dir, tag)
            dist.barrier()
            r = _timed_dcp(sd, ckpt, stager, dcp_pg, timeout)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(ckpt, ignore_errors=True)
            return r

        if use_dcp:
            out["dcp_first"] = dcp_round("first")  # the stager allocates its buffers
        for i in range(cfg["repeats"]):
            step += 1
            _mutate(locals_, step)
            rr: dict[str, Any] = {"step": step}
            dist.barrier()
            rr["bare_s"] = [bare_copy(locals_, dst)]
            for what in (("ps", "dcp") if i % 2 == 0 else ("dcp", "ps")):
                if what == "ps":
                    dist.barrier()
                    rr["ps"] = _timed_commit(store, step, sd, timeout)
                    _settle(store, timeout)
                    rr["ps"]["pool"] = _pool_stats(store)
                elif use_dcp:
                    rr["dcp"] = dcp_round(f"step_{i}")
            dist.barrier()
            rr["bare_s"].append(bare_copy(locals_, dst))
            out["rounds"].append(rr)
            if not cfg["stagger"]:
                continue
            # The same with the ranks taking turns: nobody else copies while a rank stages.
            step += 1
            _mutate(locals_, step)
            st: dict[str, Any] = {"step": step}
            for r in range(world):
                dist.barrier()
                if r == rank:
                    st["bare_s"] = bare_copy(locals_, dst)
            handle = None
            for r in range(world):
                dist.barrier()
                if r == rank:
                    stamps: dict[str, float] = {}
                    t0 = time.perf_counter()
                    handle = store.commit(step, sd)
                    st["call_s"] = time.perf_counter() - t0
                    handle.staged.add_done_callback(lambda _f, s=stamps: s.setdefault("staged", time.perf_counter()))
                    handle.staged.result(timeout)
                    st["staged_s"] = stamps["staged"] - t0
                dist.barrier()
                time.sleep(STAGGER_GAP_S)  # rank r hashes its blocks meanwhile, alone
            assert handle is not None
            handle.result(timeout)
            _settle(store, timeout)
            st["pool"] = _pool_stats(store)
            dist.barrier()
            out["stagger"].append(st)
        out["last_step"] = step
        out["pool_after"] = _pool_stats(store)
        out["checksums"] = {name: checksum(t, o) for (name, _, _), t, o in zip(cfg["layout"], locals_, offsets)}
        if rank == 0:
            out["stored"] = _stored_bytes(store, step)
            out["du"] = store.du()
        dist.barrier()
    finally:
        if stager is not None:
            stager.close()
        store.close()
    return out


def _stored_bytes(store: Any, step: int) -> dict[str, int]:
    """Bytes of the objects version ``step`` references: whole files, and their data sections
    (file size minus the 8-byte length and the safetensors header)."""
    import struct

    manifest = store.manifest(step)
    files = data = 0
    objects = sorted(manifest.objects())
    for o in objects:
        path = os.path.join(store.root, "objects", o[:2], f"{o}.safetensors")
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        files += size
        data += size - 8 - n
    return {"objects": len(objects), "file_bytes": files, "data_bytes": data, "logical_bytes": manifest.nbytes,
            "chunked_tensors": sum(1 for e in manifest.tensors.values() if e.chunks)}


# ------------------------------------------------------------------------------------------------
# part "load": on the loading ranks
# ------------------------------------------------------------------------------------------------
def _rank_load(rank: int, world: int, cfg: dict) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from paramstore import ParamStore

    torch.set_num_threads(cfg["threads"])
    timeout = cfg["op_timeout"]
    mesh = init_device_mesh("cpu", (world,))
    params, locals_, offsets, src = {}, [], [], []
    for i, (name, shape, _dim) in enumerate(cfg["layout"]):
        sizes, offs = _block(shape, mesh, 0)  # every tensor Shard(0) here, whatever it was committed as
        local = torch.zeros(sizes, dtype=torch.bfloat16)  # faulted
        params[name] = _dtensor(local, mesh, 0, shape)
        locals_.append(local)
        offsets.append(offs)
        src.append(torch.empty(sizes, dtype=torch.bfloat16).uniform_(-1, 1, generator=torch.Generator().manual_seed(i)))
    module = module_over(params)
    dst = [torch.zeros_like(t) for t in locals_]
    bare_copy(src, dst)  # throw-away
    step = cfg["step"]
    out: dict[str, Any] = {"rank": rank, "local_bytes": sum(t.nbytes for t in locals_), "rounds": []}
    with ParamStore(cfg["root"], create=False) as store:
        dist.barrier()
        t0 = time.perf_counter()
        with store.checkout(step) as snap:
            t1 = time.perf_counter()
            res = snap.load_into(module)
            out["first"] = {"checkout_s": t1 - t0, "load_s": time.perf_counter() - t1,
                            "result": [list(res[0]), list(res[1])]}
        for i in range(cfg["repeats"]):
            rr: dict[str, Any] = {}
            dist.barrier()
            rr["bare_s"] = [bare_copy(src, dst)]
            for what in (("cold", "prefaulted") if i % 2 == 0 else ("prefaulted", "cold")):
                t0 = time.perf_counter()
                snap = store.checkout(step)
                rr[f"{what}_checkout_s"] = time.perf_counter() - t0
                try:
                    if what == "prefaulted":
                        t0 = time.perf_counter()
                        snap.prefault()
                        rr["prefault_s"] = time.perf_counter() - t0
                    dist.barrier()
                    t0 = time.perf_counter()
                    snap.load_into(module)
                    rr[f"{what}_s"] = time.perf_counter() - t0
                finally:
                    snap.close()
            dist.barrier()
            rr["bare_s"].append(bare_copy(src, dst))
            out["rounds"].append(rr)
        out["checksums"] = {name: checksum(t, o) for (name, _, _), t, o in zip(cfg["layout"], locals_, offsets)}
        dist.barrier()
    del timeout
    return out


# ------------------------------------------------------------------------------------------------
# part "stream": one process
# ------------------------------------------------------------------------------------------------
_STATUS_KEYS = ("RssAnon", "RssShmem", "RssFile", "VmRSS", "VmHWM")


def _status() -> dict[str, int]:
    """Memory fields of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in _STATUS_KEYS:
                out[k] = int(v.split()[0]) * 1024
    return out


class _Sampler:
    """A thread reading /proc/self/status every ``period`` s: the peak of each field."""

    def __init__(self, period: float = 0.0005) -> None:
        self.period, self.peak, self.samples = period, {}, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            s = _status()
            for k, v in s.items():
                if v > self.peak.get(k, -1):
                    self.peak[k] = v
            self.samples += 1
            time.sleep(self.period)

    def __enter__(self) -> _Sampler:
        self.peak = _status()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for k, v in _status().items():
            self.peak[k] = max(self.peak.get(k, v), v)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


def _stream_child(cfg: dict) -> dict[str, Any]:
    import numpy as np

    from paramstore import ParamStore
    from paramstore.retention import KeepLast

    n, nbytes = cfg["stream_tensors"], cfg["stream_mib"] * MIB
    elems = nbytes // 2
    out: dict[str, Any] = {"tensor_bytes": nbytes, "tensors": n, "commits": []}
    store = ParamStore(cfg["root"], retention=KeepLast(2))
    try:
        for k in range(cfg["stream_commits"]):
            step = k + 1
            arrays: list[weakref.ref] = []
            objs: list[weakref.ref] = []
            rec: dict[str, Any] = {"step": step, "alive_max": 0, "alive_obj_max": 0, "anon_at_make": []}

            def weights(k: int = k, arrays: list = arrays, objs: list = objs, rec: dict = rec):
                for i in range(n):
                    arr = np.empty(elems, dtype=np.int16)
                    t = torch.from_numpy(arr).view(torch.bfloat16)
                    t.view(torch.int16).fill_(1 + (k * n + i) % 30000)  # touches every page; distinct content
                    arrays.append(weakref.ref(arr))
                    objs.append(weakref.ref(t))
                    rec["alive_max"] = max(rec["alive_max"], sum(r() is not None for r in arrays))
                    rec["alive_obj_max"] = max(rec["alive_obj_max"], sum(r() is not None for r in objs))
                    rec["anon_at_make"].append(_status()["RssAnon"])
                    del arr
                    yield f"layers.{i}.weight", t
                    del t

            before = _status()
            rec["hwm_reset"] = _reset_hwm()
            before_hwm = _status()
            with _Sampler() as sampler:
                t0 = time.perf_counter()
                handle = store.commit(step, weights())
                rec["call_s"] = time.perf_counter() - t0
                version = handle.result(cfg["op_timeout"])
                rec["visible_s"] = time.perf_counter() - t0
            after = _status()
            rec["anon_before"] = before["RssAnon"]
            rec["anon_at_make"] = [a - before["RssAnon"] for a in rec["anon_at_make"]]
            rec["peak_extra_anon"] = sampler.peak["RssAnon"] - before["RssAnon"]
            rec["shmem_before"], rec["shmem_peak"], rec["shmem_after"] = (
                before["RssShmem"], sampler.peak["RssShmem"], after["RssShmem"])
            rec["vmrss_before"] = before_hwm["VmRSS"]
            rec["hwm_extra"] = after["VmHWM"] - before_hwm["VmRSS"] if rec["hwm_reset"] else None
            rec["samples"] = sampler.samples
            rec["nbytes"] = version.nbytes
            rec["alive_after"] = sum(r() is not None for r in arrays)
            out["commits"].append(rec)
            _settle(store, cfg["op_timeout"])
            rec["pool"] = _pool_stats(store)
        out["pool"] = _pool_stats(store)
    finally:
        store.close()
    return out


# ------------------------------------------------------------------------------------------------
# the parent
# ------------------------------------------------------------------------------------------------
def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _tree_pids() -> list[int]:
    """This process and its descendants (the spawned ranks)."""
    me, parent_of = os.getpid(), {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent_of[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [me], [me]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        out += kids
        frontier += kids
    return out


def paired(ps: list[float], base: list[float]) -> dict[str, Any]:
    """Median of per-pair ratios, and best / best."""
    pairs = [(a, b) for a, b in zip(ps, base) if a is not None and b]
    if not pairs:
        return {"median": None, "best": None, "n": 0}
    return {"median": statistics.median(a / b for a, b in pairs),
            "best": min(a for a, _ in pairs) / min(b for _, b in pairs), "n": len(pairs)}


def _t(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.2f} ms" if x < 0.01 else f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.1f} s"


def _cell(s: dict[str, Any] | None) -> str:
    if not s or s.get("median") is None:
        return "-"
    return f"{_t(s['median'])} / {_t(s['best'])} ({s['n']})"


def _ratio(r: dict[str, Any] | None) -> str:
    if not r or r.get("median") is None:
        return "-"
    return f"{r['median']:.2f}x (best {r['best']:.2f}x)"


def _ratio2(r: dict[str, Any], alt: dict[str, Any]) -> str:
    """The ratio against the faster bare copy of each round, then against their mean."""
    if r.get("median") is None:
        return "-"
    return f"{_ratio(r)}; vs mean of the two: {alt['median']:.2f}x"


def _met(value: float | None, limit: float) -> str:
    return "-" if value is None else ("yes" if value <= limit else "**no**")


def rows(res: dict[str, Any]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []

    def row(measure: str, ps: str, base: str, ratio: str, goal: str, met: str) -> None:
        out.append({"measure": measure, "paramstore": ps, "baseline": base, "ratio": ratio, "goal": goal, "met": met})

    cm = res.get("commit")
    if cm and cm.get("measured", True):
        world = cm["world"]
        ranks = cm["ranks"]
        ps_staged, bare, bare_mean, ps_call, dcp_call, dcp_staged, ps_staged_d = [], [], [], [], [], [], []
        per_rank = {}
        for r in ranks:
            rs, bs = [], []
            for rr in r["rounds"]:
                rs.append(rr["ps"]["staged_s"])
                bs.append(min(rr["bare_s"]))
                bare_mean.append(statistics.mean(rr["bare_s"]))
                ps_call.append(rr["ps"]["call_s"])
                if "dcp" in rr:
                    dcp_call.append(rr["dcp"]["call_s"])
                    dcp_staged.append(rr["dcp"].get("staged_s"))
                    ps_staged_d.append(rr["ps"]["staged_s"])
            per_rank[r["rank"]] = paired(rs, bs)
            ps_staged += rs
            bare += bs
        mb = ranks[0]["local_bytes"] / MIB
        ra = paired(ps_staged, bare)
        worst = max(per_rank.items(), key=lambda kv: kv[1]["median"])
        row(f"1. staged per rank: commit -> `handle.staged`, {world} ranks at once ({mb:.0f} MiB each) "
            f"vs bare `copy_` of the rank's blocks, {world} ranks at once (the faster of the round's two)",
            _cell(stats(ps_staged)), _cell(stats(bare)), _ratio2(ra, paired(ps_staged, bare_mean)), "<= 1.5x",
            _met(ra["median"], 1.5))
        n = len(ranks[0]["rounds"])
        last = [max(r["rounds"][i]["ps"]["staged_s"] for r in ranks) for i in range(n)]
        last_bare = [min(max(r["rounds"][i]["bare_s"][k] for r in ranks) for k in (0, 1)) for i in range(n)]
        row(f"1. (info) every rank staged (the last of the {world}) vs every rank copied (the last; faster of two)",
            _cell(stats(last)), _cell(stats(last_bare)), _ratio(paired(last, last_bare)), "info", "")
        row(f"1. (info) per rank median ratio; worst rank {worst[0]}",
            ", ".join(f"r{k} {v['median']:.2f}x" for k, v in sorted(per_rank.items())), "", "", "info", "")
        if all(r["stagger"] for r in ranks):
            st = [s["staged_s"] for r in ranks for s in r["stagger"]]
            sb = [s["bare_s"] for r in ranks for s in r["stagger"]]
            rs = paired(st, sb)
            row("1. (info) staged per rank, ranks taking turns (no other rank copying) vs bare `copy_`, same",
                _cell(stats(st)), _cell(stats(sb)), _ratio(rs), "info", "")
        if dcp_call:
            rc = paired(ps_call, dcp_call)
            row(f"2. commit stall: `store.commit()` call vs DCP `async_save()` call, {world} ranks",
                _cell(stats(ps_call)), _cell(stats(dcp_call)), _ratio(rc), "<= 0.2x", _met(rc["median"], 0.2))
            if all(x is not None for x in dcp_staged):
                rsd = paired(ps_staged_d, dcp_staged)
                row("2. (info) staging complete: commit -> `staged` vs DCP `staging_completion`",
                    _cell(stats(ps_staged_d)), _cell(stats(dcp_staged)), _ratio(rsd), "info", "")
            if all(r["stagger"] for r in ranks):
                row("2. (info) `store.commit()` call, ranks taking turns (one rank on the cores)",
                    _cell(stats([s["call_s"] for r in ranks for s in r["stagger"]])), "", "", "info", "")
            first = [r["dcp_first"] for r in ranks if "dcp_first" in r]
            if first:
                row("2. (info) first commit / first DCP save (cold stager) call",
                    _t(statistics.median(r["first_commit"]["call_s"] for r in ranks)),
                    _t(statistics.median(f["call_s"] for f in first)), "", "info", "")
        else:
            row("2. commit stall: `store.commit()` call (no DCP baseline: --skip-dcp)", _cell(stats(ps_call)), "-",
                "-", "<= 0.2x", "-")
        lead = next(r for r in ranks if r["rank"] == 0)
        sb = lead.get("stored")
        if sb:
            ratio = sb["data_bytes"] / sb["logical_bytes"]
            row(f"3. stored bytes / model bytes, version {cm['last_step']} ({sb['objects']} objects, "
                f"{sb['chunked_tensors']} chunked tensors; data sections, without safetensors headers)",
                f"{sb['data_bytes'] / MIB:.2f} MiB", f"{sb['logical_bytes'] / MIB:.2f} MiB", f"{ratio:.4f}",
                "1.00", "yes" if round(ratio, 2) == 1.00 else "**no**")
            row("3. (info) with headers (whole object files) / model bytes", f"{sb['file_bytes'] / MIB:.2f} MiB",
                f"{sb['logical_bytes'] / MIB:.2f} MiB", f"{sb['file_bytes'] / sb['logical_bytes']:.4f}", "info", "")
        vis = [rr["ps"]["visible_s"] for rr in lead["rounds"]]
        vis_all = [max(r["rounds"][i]["ps"]["visible_s"] for r in ranks) for i in range(len(lead["rounds"]))]
        done = [rr["dcp"]["done_s"] for rr in lead["rounds"] if "dcp" in rr]
        rv = paired(vis, done) if len(done) == len(vis) else None
        row("3. commit -> visible (`committed` on rank 0, which publishes) vs DCP `async_save` done on rank 0",
            _cell(stats(vis)), _cell(stats(done)) if done else "-", _ratio(rv), "info", "")
        row("3. (info) commit -> `committed` on the last rank / vs its bare copy", _cell(stats(vis_all)),
            _cell(stats([min(rr["bare_s"]) for rr in lead["rounds"]])),
            _ratio(paired(vis_all, [min(rr["bare_s"]) for rr in lead["rounds"]])), "info", "")
    ld = res.get("load")
    if ld:
        ranks = ld["ranks"]
        bare = [min(rr["bare_s"]) for r in ranks for rr in r["rounds"]]
        bare_mean = [statistics.mean(rr["bare_s"]) for r in ranks for rr in r["rounds"]]
        mb = ranks[0]["local_bytes"] / MIB
        for key, label in (("cold", "cold: fresh checkout, pages not yet mapped"),
                           ("prefaulted", "after `snap.prefault()` (not timed)")):
            xs = [rr[f"{key}_s"] for r in ranks for rr in r["rounds"]]
            ra = paired(xs, bare)
            row(f"4. resharded load {ld['from_world']} -> {ld['world']} ranks ({mb:.0f} MiB each), `snap.load_into(module)`, "
                f"{label}, vs bare `copy_` of the same blocks (the faster of the round's two)", _cell(stats(xs)),
                _cell(stats(bare)), _ratio2(ra, paired(xs, bare_mean)),
                "<= 1.5x", _met(ra["median"], 1.5))
        row("4. (info) first `checkout` + `load_into` in a freshly spawned rank (lazy imports, first mappings)",
            ", ".join(f"r{r['rank']} {_t(r['first']['checkout_s'])} + {_t(r['first']['load_s'])}" for r in ranks),
            "", "", "info", "")
        pf = [rr["prefault_s"] for r in ranks for rr in r["rounds"]]
        ck = [rr["cold_checkout_s"] for r in ranks for rr in r["rounds"]]
        row("4. (info) `snap.prefault()` / `store.checkout()`", _cell(stats(pf)), _cell(stats(ck)), "", "info", "")
        row("4. content: per-tensor checksums after the load = as committed",
            f"{ld['checksums_equal']}/{ld['checksums_total']} tensors", "", "", "all", "yes"
            if ld["checksums_equal"] == ld["checksums_total"] else "**no**")
    sm = res.get("stream")
    if sm:
        cs = sm["commits"]
        mib = sm["tensor_bytes"] / MIB
        alive = max(c["alive_max"] for c in cs)
        row(f"5. streaming commit, {sm['tensors']} fresh tensors of {mib:.0f} MiB from a generator: most alive at once "
            f"(weak refs to their memory; {len(cs)} commits)", str(alive), f"{sm['tensors']} (a state dict)",
            "", "<= 2 tensors", _met(alive, 2))
        peaks = [c["peak_extra_anon"] / sm["tensor_bytes"] for c in cs]
        row("5. peak extra private memory (RssAnon) during the commit, in tensors (first commit; worst of the others)",
            f"{peaks[0]:.2f} ({peaks[0] * mib:.0f} MiB); {max(peaks[1:] or [peaks[0]]):.2f}",
            f"1 tensor = {mib:.0f} MiB", "", "<= 2 tensors", _met(max(peaks), 2))
        if all(c["hwm_extra"] is not None for c in cs):
            hw = [c["hwm_extra"] / MIB for c in cs]
            sh = [(c["shmem_peak"] - c["shmem_before"]) / MIB for c in cs]
            row("5. (info) peak RSS (VmHWM) above RSS before, MiB (first commit; others); of it shared memory "
                "(RssShmem growth)", f"{hw[0]:.0f}; {', '.join(f'{x:.0f}' for x in hw[1:])}",
                f"{sh[0]:.0f}; {', '.join(f'{x:.0f}' for x in sh[1:])}", "", "info", "")
    return out


def table(rs: list[dict[str, str]]) -> str:
    cols = ["measure", "paramstore", "baseline", "ratio", "goal", "met"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c].replace("|", "\\|") for c in cols) + " |" for r in rs]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="model size in GiB (default 1)")
    p.add_argument("--tensors", type=int, default=32, help="tensors of the model (default 32)")
    p.add_argument("--world", type=int, default=4, help="committing ranks (default 4)")
    p.add_argument("--load-world", type=int, default=2, help="loading ranks (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds per part (default 5)")
    p.add_argument("--no-stagger", dest="stagger", action="store_false",
                   help="skip the rounds in which the ranks take turns")
    p.add_argument("--skip-dcp", action="store_true", help="no DCP baseline")
    p.add_argument("--rank-threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    p.add_argument("--stream-tensors", type=int, default=16)
    p.add_argument("--stream-mib", type=int, default=64)
    p.add_argument("--stream-commits", type=int, default=4)
    p.add_argument("--only", action="append", default=[], help=f"run only these parts: {', '.join(PARTS)}")
    p.add_argument("--shm-dir", default="/dev/shm", help="where stores and DCP checkpoints go (default /dev/shm)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each part's processes may run (default 300)")
    p.add_argument("--wait-quiet", type=float, default=30.0, metavar="S",
                   help="before each part wait up to S s for other processes to use < 10%% CPU (0: never)")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--markdown", metavar="OUT")
    args = p.parse_args(argv)
    only = [x for o in args.only for x in o.split(",") if x] or list(PARTS)
    bad = [x for x in only if x not in PARTS]
    if bad:
        p.error(f"unknown part(s) {bad}; choose from {PARTS}")
    if args.repeats < 1 or args.world < 2 or args.load_world < 1:
        p.error("--repeats >= 1, --world >= 2, --load-world >= 1")

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # so that the finally below kills the ranks and deletes the dirs

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    t_start = time.perf_counter()
    res: dict[str, Any] = {"argv": [os.path.relpath(sys.argv[0])] + sys.argv[1:], "machine": machine()}
    layout = model_layout(args.gib, args.tensors)
    model_bytes = sum(s[0] * s[1] * 2 for _, s, _ in layout)
    res["model"] = {"tensors": len(layout), "bytes": model_bytes, "dtype": "bfloat16",
                    "layout": [[n, list(s), f"Shard({d})"] for n, s, d in layout]}
    base = tempfile.mkdtemp(prefix="psbench-sharded-", dir=args.shm_dir)
    res["base"] = base
    common = {"base": base, "layout": layout, "threads": args.rank_threads, "op_timeout": max(30.0, args.timeout / 2)}
    meter = CpuMeter(_tree_pids)
    failed: list[str] = []

    def part(name: str, fn: Callable[[], dict]) -> None:
        q = wait_quiet(meter, args.wait_quiet, pause_s=1.0) if args.wait_quiet > 0 else {}
        log(f"--- {name} (machine before: {q})")
        t0 = time.perf_counter()
        meter.start()
        try:
            res[name] = fn()
        except Exception:  # noqa: BLE001 - report and go on
            failed.append(name)
            res.setdefault("errors", {})[name] = traceback.format_exc()
            log(f"{name} FAILED:\n{traceback.format_exc()}")
        use = meter.stop()
        res.setdefault("part_seconds", {})[name] = time.perf_counter() - t0
        res.setdefault("part_cpu", {})[name] = {"before": q, "during": use}
        log(f"--- {name} done in {time.perf_counter() - t0:.0f} s, machine CPU during: {use}")

    root = os.path.join(base, "store")
    try:
        if "commit" in only or "load" in only:
            measured = "commit" in only

            def commit_part() -> dict:
                cfg = dict(common, root=root, repeats=args.repeats if measured else 0,
                           dcp=not args.skip_dcp and measured, stagger=args.stagger and measured)
                got = run_ranks(args.world, _rank_commit, cfg, args.timeout)
                ranks = [got[r] for r in sorted(got)]
                return {"world": args.world, "ranks": ranks, "last_step": ranks[0]["last_step"],
                        "checksums": {n: sum(r["checksums"][n] for r in ranks) for n, _, _ in layout}}

            part("commit", commit_part)
            cm = res.get("commit")
            if not measured and cm is not None:
                res["commit"] = {**cm, "measured": False}  # committed for the load part only: not reported
            if "load" in only and cm is not None:
                def load_part() -> dict:
                    cfg = dict(common, root=root, repeats=args.repeats, step=cm["last_step"])
                    got = run_ranks(args.load_world, _rank_load, cfg, args.timeout)
                    ranks = [got[r] for r in sorted(got)]
                    sums = {n: sum(r["checksums"][n] for r in ranks) for n, _, _ in layout}
                    equal = sum(sums[n] == cm["checksums"][n] for n in sums)
                    return {"world": args.load_world, "from_world": args.world, "step": cm["last_step"],
                            "ranks": ranks, "checksums_equal": equal, "checksums_total": len(sums)}

                part("load", load_part)
        if os.path.exists(root):
            shutil.rmtree(root, ignore_errors=True)
        if "stream" in only:
            def stream_part() -> dict:
                cfg = dict(common, root=os.path.join(base, "stream"), stream_tensors=args.stream_tensors,
                           stream_mib=args.stream_mib, stream_commits=args.stream_commits)
                return run_solo(_stream_child, cfg, args.timeout)

            part("stream", stream_part)
    finally:
        _reap(list(_LIVE))
        shutil.rmtree(base, ignore_errors=True)
    res["total_seconds"] = time.perf_counter() - t_start
    try:
        res["machine"]["loadavg_end"] = _read("/proc/loadavg").split()[:3]
    except OSError:
        pass
    rs = rows(res)
    res["table"] = rs
    print(table(rs))
    print(f"\ntotal {res['total_seconds']:.0f} s; loadavg {res['machine'].get('loadavg_start')} -> "
          f"{res['machine'].get('loadavg_end')}")
    for name, u in res.get("part_cpu", {}).items():
        print(f"  {name:8s} {res['part_seconds'][name]:6.0f} s   CPU of other processes: before "
              f"{u['before'].get('foreign_pct', '-')}%, during {u['during']['foreign_pct']}% "
              f"(machine busy {u['during']['busy_pct']}%)")
    write_outputs(args.json, res, args.markdown, table(rs))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
