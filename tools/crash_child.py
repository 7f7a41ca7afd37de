"""The processes of the SIGKILL campaign (tools/crash_campaign.py): trainers, pruners, readers,
fetchers, a peer host, and the checker that looks at a store after a kill.

Each role is a function ``role(cfg)`` run by :func:`run` in a child forked from a server that has
already imported torch and paramstore (so a child starts in milliseconds). A child reports through
its *journal*: a JSON-lines file, each line appended and fsynced before the child goes on, so what
a killed child said survives it. A trainer writes ``begin`` (step, sha256 of the tensors it
commits) before ``commit`` is called and ``done`` once ``handle.result()`` returned. The checker
only observes and writes one JSON result; the campaign judges.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
import traceback
import warnings
from collections.abc import Mapping
from typing import Any

import torch

import paramstore
from paramstore.remote import Remote
from paramstore.retention import KeepLast
from paramstore.store import ParamStore
from crash_campaign import read_journal  # one journal reader for both sides (its module imports only the stdlib)

try:  # imported here, once, in the fork server (a second each otherwise)
    import boto3
    import s3fs
except ImportError:
    boto3 = s3fs = None
try:  # tqdm's multiprocessing lock, made once here: else each killed child leaks a semaphore
    from tqdm import tqdm

    tqdm.get_lock()
except ImportError:
    pass

FROZEN = "frozen.bias"  # never changes: every version deduplicates it against the first


# -- the model -------------------------------------------------------------------------------
def base_state(seed: int, mib: int) -> dict[str, torch.Tensor]:
    """``mib`` MiB of float32 in 2 MiB tensors (random, fixed by ``seed``), plus a small frozen one."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, mib // 2)
    out = {f"layer{i:02d}.weight": torch.randn(512 * 1024, generator=g) for i in range(n)}
    out[FROZEN] = torch.arange(1024, dtype=torch.float32)
    return out


def state_at(base: Mapping[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """Version ``step``: every weight changes with the step (new tensors: nothing is mutated)."""
    return {k: (v if k == FROZEN else v + float(step)) for k, v in base.items()}


def state_sha(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the sorted names, dtypes, shapes and raw bytes of a state dict (or a snapshot)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(memoryview(t.view(torch.uint8).numpy()))
    return h.hexdigest()


# -- the journal -----------------------------------------------------------------------------
class Journal:
    """Append-only JSON lines, each fsynced before ``write`` returns."""

    def __init__(self, path: str, tag: str) -> None:
        self.tag = tag
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def write(self, ev: str, **kw: Any) -> None:
        line = json.dumps({"ev": ev, "tag": self.tag, "pid": os.getpid(), "t": time.time(), **kw}) + "\n"
        os.write(self._fd, line.encode())
        os.fsync(self._fd)


def store_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ParamStore arguments every process of one store shares (remote, registry, shard size)."""
    kw: dict[str, Any] = {"shard_size_bytes": cfg["shard"]}
    if cfg.get("remote"):
        kw.update(remote=cfg["remote"], storage_options=cfg["storage_options"])
    if cfg.get("registry"):
        kw.update(registry=cfg["registry"], name=cfg["name"])
    return kw


# -- roles -----------------------------------------------------------------------------------
def trainer(cfg: dict[str, Any], j: Journal) -> None:
    """Resume after the latest version (the first commit is the resume check), say ready, then
    commit step after step with ``depth`` commits in flight, until killed (or ``steps`` more)."""
    keep = cfg.get("keep")
    store = ParamStore(cfg["root"], run_id=cfg["run_id"], retention=KeepLast(keep) if keep else None,
                       **store_kwargs(cfg))
    base = base_state(cfg["seed"], cfg["mib"])
    latest = store.latest() if os.path.exists(os.path.join(cfg["root"], "paramstore.json")) else None
    step = (latest.step if latest else 0) + 1
    j.write("opened", latest=latest.step if latest else None)
    inflight: list[tuple[int, Any]] = []

    def submit(s: int) -> None:
        sd = state_at(base, s)
        j.write("begin", step=s, sha=state_sha(sd))
        h = store.commit(s, sd)
        if cfg.get("remote"):
            h.persisted.add_done_callback(lambda f, s=s: j.write(
                "persisted" if f.exception() is None else "persist_failed", step=s,
                **({} if f.exception() is None else {"msg": str(f.exception())[:300]})))
        inflight.append((s, h))

    def finish_one() -> None:
        s, h = inflight.pop(0)
        h.result()
        j.write("done", step=s)

    submit(step)
    finish_one()
    j.write("resumed", step=step)
    j.write("ready")
    for _ in range(cfg.get("steps", 10**9)):
        step += 1
        submit(step)
        if len(inflight) >= cfg.get("depth", 2):
            finish_one()
        if cfg.get("pause"):
            time.sleep(random.uniform(0, cfg["pause"]))
    while inflight:
        finish_one()
    if cfg.get("remote"):
        store.wait_persisted(timeout=120)
    store.close()
    j.write("exit")


def pruner(cfg: dict[str, Any], j: Journal) -> None:
    """prune(KeepLast(keep)) + gc in a loop (another process than the trainer), until killed."""
    store = ParamStore(cfg["root"], **store_kwargs(cfg))
    n = 0
    while True:
        removed = store.prune(KeepLast(cfg["keep"])).removed
        store.gc()
        n += 1
        if n == 1:
            j.write("ready")
        if removed:
            j.write("pruned", steps=removed)
        time.sleep(random.uniform(0, 0.02))


def reader(cfg: dict[str, Any], j: Journal) -> None:
    """Hold leases: check out the latest version every 0.1-0.3 s, keeping the last 3 snapshots."""
    store = ParamStore(cfg["root"], **store_kwargs(cfg))
    held: list[Any] = []
    while True:
        snap = store.checkout(min_step=1, timeout=30)
        held.append(snap)
        j.write("leased", step=snap.step)
        if len(held) == 1:
            j.write("ready")
        if len(held) > 3:
            held.pop(0).close()
        time.sleep(random.uniform(0.1, 0.3))


def fetcher(cfg: dict[str, Any], j: Journal) -> None:
    """A reader host with an empty root: check out each version (from the remote or from peers)."""
    store = ParamStore(cfg["root"], create=True, **store_kwargs(cfg))
    j.write("ready")
    for s in cfg["steps"]:
        with store.checkout(s) as snap:
            j.write("fetched", step=s, sha=state_sha(snap), bytes=snap.fetch.bytes)
    j.write("idle")
    time.sleep(3600)


def seeder(cfg: dict[str, Any], j: Journal) -> None:
    """Commit versions 1..n (to a remote, or on a peer host that then serves them until killed)."""
    store = ParamStore(cfg["root"], run_id=cfg["run_id"], create=True, **store_kwargs(cfg))
    base = base_state(cfg["seed"], cfg["mib"])
    server = store.serve("127.0.0.1") if cfg.get("serve") else None
    for s in range(1, cfg["n"] + 1):
        sd = state_at(base, s)
        j.write("begin", step=s, sha=state_sha(sd))
        h = store.commit(s, sd)
        h.result()
        j.write("done", step=s)
        if cfg.get("remote"):
            h.persisted.result(timeout=300)  # one at a time: the upload backlog would skip versions
    if server is not None:
        server.sync()
        j.write("ready")
        time.sleep(10**6)
    store.close()
    j.write("ready")


def bucket(cfg: dict[str, Any], j: Journal) -> None:
    """Create or delete (with every key) an S3 bucket on the campaign's server."""
    s3 = boto3.client("s3", endpoint_url=cfg["endpoint"])
    if cfg["op"] == "create":
        s3.create_bucket(Bucket=cfg["bucket"])
    else:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=cfg["bucket"]):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=cfg["bucket"], Delete={"Objects": keys})
        s3.delete_bucket(Bucket=cfg["bucket"])
    j.write("ready")


# -- the checker -----------------------------------------------------------------------------
def _verify_summary(r: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("ok", "versions_checked", "corrupt", "missing", "unreadable_manifests", "damaged_versions",
            "orphans", "leftovers")
    return {k: r[k] for k in keys if k in r}


def _local_versions(store: ParamStore, root: str) -> list[int]:
    """Versions whose every object is on this host."""
    local = _local_objects(root)
    return [v.step for v in store.versions() if set(store.manifest(v.step).objects()) <= local]


def _verify_each(store: ParamStore, steps: list[int]) -> dict[str, Any]:
    """verify() of each version: for a reader host, where a whole-store verify would count the
    objects of versions it never fetched as missing."""
    bad = {}
    for s in steps:
        r = _verify_summary(store.verify(s))
        if not r["ok"]:
            bad[str(s)] = r
    return {"ok": not bad, "versions_checked": len(steps), "damaged": bad}


def _local_objects(root: str) -> set[str]:
    out = set()
    for dirpath, _, files in os.walk(os.path.join(root, "objects")):
        out.update(f.split(".")[0] for f in files)
    return out


def _files(root: str, sub: str) -> list[str]:
    d = os.path.join(root, sub)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _shas(store: ParamStore, steps: list[int]) -> dict[str, str]:
    out = {}
    for s in steps:
        try:
            with store.checkout(s) as snap:
                out[str(s)] = state_sha(snap)
        except Exception as e:  # noqa: BLE001 - reported, judged by the campaign
            out[str(s)] = f"error: {type(e).__name__}: {e}"[:500]
    return out


def checker(cfg: dict[str, Any], j: Journal) -> None:
    """Observe a store after a kill (no other process uses it): verify, gc, what is left, the
    bytes of every version; for a reader host, fetch every version again; for a remote, check
    the bucket. Writes the observations to ``cfg['out']``."""
    t0 = time.monotonic()
    res: dict[str, Any] = {}
    lap = _Laps(res)
    kw = store_kwargs(cfg)
    if cfg.get("check_bucket"):  # the trainer's store without its remote: no upload resumes here
        del kw["remote"], kw["storage_options"]
    if not os.path.exists(os.path.join(cfg["root"], "paramstore.json")) and not cfg.get("reader_host"):
        res.update(no_store=True, versions=[], files=sorted(os.listdir(cfg["root"])) if os.path.isdir(cfg["root"]) else [])
        _write(cfg["out"], res)  # killed before the store was created (or while creating it)
        j.write("ready")
        return
    store = ParamStore(cfg["root"], **kw)
    lap("open")
    steps = [v.step for v in store.versions()]
    res["versions"] = steps
    if cfg.get("reader_host"):  # a shared registry names versions this host never fetched
        res["local_versions"] = _local_versions(store, cfg["root"])
        res["verify_local"] = _verify_each(store, res["local_versions"])
    else:
        res["verify"] = _verify_summary(store.verify())
    lap("verify")
    res["sha"] = _shas(store, res.get("local_versions", steps))
    res["leases"] = [[lease.step, lease.pid, lease.holder] for lease in store.leases()]
    lap("sha")
    g = store.gc()
    res["gc"] = {"objects": len(g.objects), "temporary_files": len(g.temporary_files)}
    res["after_gc"] = _after_gc(store, cfg)
    lap("gc")
    if cfg.get("refetch"):  # the re-checkout after a killed fetch
        res["refetch_sha"] = _shas(store, cfg["refetch"])
        res["verify_after_refetch"] = (_verify_each(store, _local_versions(store, cfg["root"]))
                                       if cfg.get("reader_host") else _verify_summary(store.verify()))
        lap("refetch")
    if cfg.get("check_bucket"):
        res["bucket"] = _check_bucket(cfg, lap)
    if cfg.get("prune_after"):
        res["campaign_pruned"] = store.prune(KeepLast(cfg["prune_after"])).removed
        store.gc()
    store.close()
    lap("close")
    res["seconds"] = time.monotonic() - t0
    _write(cfg["out"], res)
    j.write("ready")


def _write(path: str, res: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(res, f)
    os.rename(path + ".tmp", path)


def _after_gc(store: ParamStore, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Objects no version references and temporary files, after gc (a reader host: only its own)."""
    root = cfg["root"]
    referenced: set[str] = set()
    for v in store.versions():
        referenced |= set(store.manifest(v.step).objects())
    local = _local_objects(root)
    return {"orphans": sorted(local - referenced), "tmp": _files(root, "tmp"),
            "quarantine": _files(root, "quarantine"), "objects": len(local)}


class _Laps:
    """Seconds spent in each part of a check, into ``res['laps']``."""

    def __init__(self, res: dict[str, Any]) -> None:
        self.laps: dict[str, float] = res.setdefault("laps", {})
        self.t = time.monotonic()

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = round(self.laps.get(name, 0) + now - self.t, 3)
        self.t = now


def _check_bucket(cfg: Mapping[str, Any], lap: _Laps) -> dict[str, Any]:
    """Every record in the bucket is complete, and each new one pulls bit-identical into a fresh
    root; then remote GC (grace 0: nothing else runs) must leave nothing unreferenced."""
    remote = Remote(cfg["remote"], cfg["storage_options"])
    out: dict[str, Any] = {}
    steps = remote.steps()
    objects = remote.tier.objects()
    out["records"] = steps
    out["incomplete"] = {}
    for s in steps:
        lacking = sorted(set(remote.get_manifest(s).objects()) - set(objects))
        if lacking:
            out["incomplete"][str(s)] = lacking
    lap("bucket-records")
    new = [s for s in steps if s not in set(cfg.get("checked_records", []))]
    with ParamStore(cfg["pull_root"], create=True, remote=remote, shard_size_bytes=cfg["shard"]) as fresh:
        pulled = {}
        for s in new:
            try:
                fresh.pull(s)
            except Exception as e:  # noqa: BLE001
                pulled[str(s)] = f"error: {type(e).__name__}: {e}"[:500]
        shas = _shas(fresh, [s for s in new if str(s) not in pulled])
        out["pull_sha"] = {**shas, **pulled}
        out["pull_verify"] = _verify_summary(fresh.verify())
        if cfg.get("pull_prune"):  # keep the fresh root small: the next check pulls only new records
            fresh.prune(KeepLast(1))
            fresh.gc()
        lap("bucket-pull")
        g = fresh.gc(tier="remote", grace=0)
    out["remote_gc"] = {"objects": len(g.objects), "records": len(g.temporary_files)}
    referenced = remote.referenced()
    left = set(remote.tier.objects()) - referenced
    manifests = [m for m in remote.tier.records("manifests")
                 if not (m.endswith(".json") and m[:-5].isdigit() and int(m[:-5]) in set(remote.steps()))]
    out["leaked"] = {"objects": sorted(left), "manifests": manifests, "locks": sorted(remote.tier.records("locks"))}
    lap("bucket-gc")
    return out


def lease_watch(cfg: dict[str, Any], j: Journal) -> None:
    """After a reader was killed (the trainer still commits): wait until its leases are gone and
    retention removed the versions it held (but the newest ``keep``). Writes what it saw."""
    store = ParamStore(cfg["root"], **store_kwargs(cfg))
    held, pid, deadline = set(cfg["held"]), cfg["pid"], time.monotonic() + cfg["timeout"]
    t0 = time.monotonic()
    res: dict[str, Any] = {}
    while True:
        leases = [lease for lease in store.leases() if lease.pid == pid]
        steps = [v.step for v in store.versions()]
        newest = set(sorted(steps)[-cfg["keep"]:])
        stuck = sorted((held & set(steps)) - newest)
        if not leases and not stuck:
            res.update(ok=True, waited=time.monotonic() - t0)
            break
        if time.monotonic() > deadline:
            res.update(ok=False, leases=[[lease.step, lease.pid] for lease in leases], stuck=stuck, versions=steps)
            break
        time.sleep(0.05)
    store.close()
    with open(cfg["out"], "w") as f:
        json.dump(res, f)
    j.write("ready")


ROLES = {f.__name__: f for f in (trainer, pruner, reader, fetcher, seeder, bucket, checker, lease_watch)}


def run(role: str, cfg: dict[str, Any]) -> None:
    """Entry point of every child: output to ``cfg['log']``, warnings and errors to the journal."""
    fd = os.open(cfg["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    random.seed(cfg.get("seed", 0) * 1000 + os.getpid())
    j = Journal(cfg["journal"], cfg.get("tag", role))
    warnings.simplefilter("always")
    warnings.showwarning = lambda msg, cat, *a, **k: j.write("warning", category=cat.__name__, msg=str(msg)[:500])
    j.write("start", role=role)
    try:
        ROLES[role](cfg, j)
    except BaseException as e:  # noqa: BLE001
        j.write("error", type=type(e).__name__, msg=str(e)[:1000], tb=traceback.format_exc()[-3000:])
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


_ = (paramstore, s3fs)  # imported for the fork server's preload
