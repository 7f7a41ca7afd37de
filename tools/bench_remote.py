"""Remote tier benchmarks: paramstore push and pull vs raw s3fs, side by side, on a real S3 API.

An S3 API is served in this process by moto (``ThreadedMotoServer`` on 127.0.0.1, dummy
credentials, one bucket, bodies kept in memory). moto is a Python server: it moves ~100-400 MiB/s
on a small machine and shares this process's GIL and CPUs, so absolute throughputs say little
about S3. Both sides of every comparison pay
the same server cost in the same round, which is what the ratios measure: what paramstore adds
on top of the bytes s3fs moves (HEAD checks, records, locks, verification, registry).

Figures (each round runs both sides, alternating which goes first, after ``--warmup`` unmeasured
rounds; a ratio is the median of the per-round ratios, "best" is best / best; before each round
the benchmark waits up to ``--wait-quiet`` s for other processes to leave the CPUs alone, and it
reports their CPU use during the measurements):

1. push: ``store.push(step)`` of a fresh version (``--mib``, several objects of ``--shard-mib``)
   into an empty prefix, vs ``s3fs.put_file`` of the same object files (same keys, same part size,
   same ``max_concurrency``, files in parallel on the same number of threads) into another empty
   prefix. Ratio = raw time / paramstore time; goal >= 0.9.
2. pull: ``ParamStore(fresh_root, remote=...).pull(step)`` (download, blake3 re-hash, rename,
   registry) vs ``s3fs.get_file`` of the same objects into files under /dev/shm. Goal >= 0.9.
   Info: a push and a pull of a version already there (the fixed cost: records and locks), and
   the time to blake3 the pulled objects on one thread.
3. bytes: the push of a version with ~10% of tensors (by bytes) changed uploads <= 1.1x the
   changed bytes (``TransferReport.bytes``, cross-checked by listing the bucket before and after);
   the push of an unchanged re-commit uploads no object.

Example::

    .venv/bin/python tools/bench_remote.py --mib 256 --rounds 5 --json out/bench_remote.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# Dummy credentials for the local S3 API (never real ones: nothing leaves this machine).
os.environ["AWS_ACCESS_KEY_ID"] = "paramstore-bench"
os.environ["AWS_SECRET_ACCESS_KEY"] = "paramstore-bench"
os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
# moto spools object bodies over 5 MB to files in $TMPDIR (a disk here): keep them in memory so
# both sides see a server that does not stall on disk writeback.
os.environ.setdefault("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(1 << 30))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from baselines import make_state_dict
from benchlib import CpuMeter, log, stats, wait_quiet  # noqa: E402

MIB = 1 << 20
BUCKET = "paramstore-bench"
SUFFIX = ".safetensors"


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def speedup(ps: list[float], raw: list[float]) -> dict[str, Any]:
    """Throughput ratio paramstore / raw = raw time / paramstore time: the median of the
    per-round ratios, and best raw / best paramstore."""
    pairs = [(a, b) for a, b in zip(ps, raw) if a and b]
    if not pairs:
        return {"median": None, "best": None, "all": []}
    rs = [b / a for a, b in pairs]
    return {"median": statistics.median(rs), "best": min(b for _, b in pairs) / min(a for a, _ in pairs),
            "all": rs}


def object_files(root: str) -> dict[str, str]:
    """Object digest -> file path, for every object of a local store (its documented layout)."""
    out = {}
    for d, _, files in os.walk(os.path.join(root, "objects")):
        for f in files:
            if f.endswith(SUFFIX) and len(f) == 64 + len(SUFFIX):
                out[f[: -len(SUFFIX)]] = os.path.join(d, f)
    return out


def object_key(digest: str) -> str:
    return f"objects/{digest[:2]}/{digest}{SUFFIX}"


def pick_tenth(sd: dict[str, torch.Tensor], seed: int) -> list[str]:
    """Tensors holding ~10% of the bytes: taken in a seeded random order, skipping any that would
    overshoot 10.5%, until at least 9.5%."""
    total = sum(t.nbytes for t in sd.values())
    names = list(sd)
    random.Random(seed).shuffle(names)
    out, got = [], 0
    for k in names:
        if got + sd[k].nbytes <= 0.105 * total:
            out.append(k)
            got += sd[k].nbytes
        if got >= 0.095 * total:
            break
    return out


def mutate(sd: dict[str, torch.Tensor], names: list[str]) -> None:
    with torch.no_grad():
        for k in names:
            sd[k].add_(1)


class S3:
    """The moto server, the bucket, and raw s3fs with the settings paramstore's remote uses."""

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        import boto3
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=BUCKET)
        self.options = {"endpoint_url": self.endpoint}

    def raw_fs(self, concurrency: int) -> Any:
        """A fresh s3fs filesystem, as ``RemoteTier`` opens one (no listing cache, no instance
        cache, the same ``max_concurrency``), with one request made so its client is connected."""
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, max_concurrency=concurrency,
                               use_listings_cache=False, skip_instance_cache=True)
        fs.ls(BUCKET)
        return fs

    def listing(self, fs: Any, prefix: str) -> dict[str, int]:
        fs.invalidate_cache()
        try:
            return {p: int(i["size"]) for p, i in fs.find(f"{BUCKET}/{prefix}", detail=True).items()}
        except FileNotFoundError:
            return {}

    def remove(self, fs: Any, prefix: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(f"{BUCKET}/{prefix}", recursive=True)

    def close(self) -> None:
        self.server.stop()


# ------------------------------------------------------------------------------------------------
# the parts
# ------------------------------------------------------------------------------------------------
def transfer_settings(store: Any) -> dict[str, int]:
    """Objects moved at once, parts per object, part size: read from the store's remote (private
    attributes, with paramstore's defaults as fallback) so the raw side always matches."""
    from paramstore.backends.tiers import remote as tier_mod

    r = store.remote
    return {"objects": getattr(r, "_concurrency", 4), "parts": getattr(r.tier, "_concurrency", 8),
            "part_bytes": getattr(tier_mod, "_PART_BYTES", 64 * MIB)}


def raw_put(fs: Any, files: dict[str, str], prefix: str, cfg: dict[str, int]) -> float:
    """Upload the object files under ``prefix`` like ``Remote.push`` does; returns seconds."""
    order = sorted(files, key=lambda o: -os.path.getsize(files[o]))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(cfg["objects"]) as pool:
        list(pool.map(lambda o: fs.put_file(files[o], f"{BUCKET}/{prefix}/{object_key(o)}",
                                            chunksize=cfg["part_bytes"], max_concurrency=cfg["parts"]), order))
    return time.perf_counter() - t0


def raw_get(fs: Any, sizes: dict[str, int], prefix: str, dest: str, cfg: dict[str, int]) -> float:
    """Download the objects under ``prefix`` into files of ``dest`` like ``Remote.pull``; seconds."""
    order = sorted(sizes, key=lambda o: -sizes[o])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(cfg["objects"]) as pool:
        list(pool.map(lambda o: fs.get_file(f"{BUCKET}/{prefix}/{object_key(o)}", os.path.join(dest, o),
                                            chunksize=cfg["part_bytes"], max_concurrency=cfg["parts"]), order))
    return time.perf_counter() - t0


def transfer_round(i: int, s3: S3, src: str, step: int, files: dict[str, str], shm: str,
                   wait: float) -> dict[str, Any]:
    """One round: push then pull, each side by side (paramstore first in even rounds)."""
    from paramstore import ParamStore

    sizes = {o: os.path.getsize(p) for o, p in files.items()}
    total = sum(sizes.values())
    ps_prefix, raw_prefix = f"r{i}/ps", f"r{i}/raw"
    url = f"s3://{BUCKET}/{ps_prefix}"
    r: dict[str, Any] = {"first": "paramstore" if i % 2 == 0 else "raw"}
    pull_root = tempfile.mkdtemp(prefix="psbench-remote-pull-", dir=shm)
    raw_dir = tempfile.mkdtemp(prefix="psbench-remote-get-", dir=shm)
    meter = CpuMeter()
    pusher = puller = None
    try:
        t0 = time.perf_counter()
        pusher = ParamStore(src, remote=url, storage_options=s3.options, prepare_buffers=False)
        r["ps_open_s"] = time.perf_counter() - t0
        cfg = transfer_settings(pusher)
        fs = s3.raw_fs(cfg["parts"])
        r["quiet"] = wait_quiet(CpuMeter(), wait, window_s=0.5) if wait > 0 else None

        # -- push ------------------------------------------------------------------------------
        def ps_push() -> None:
            t = time.perf_counter()
            rep = pusher.push(step, show_progress=False)
            r["ps_push_s"] = time.perf_counter() - t
            r["ps_push_report"] = rep.as_dict()

        def raw_push() -> None:
            r["raw_push_s"] = raw_put(fs, files, raw_prefix, cfg)

        meter.start()
        for f in ((ps_push, raw_push) if i % 2 == 0 else (raw_push, ps_push)):
            f()
        r["push_cpu"] = meter.stop()
        t = time.perf_counter()
        again = pusher.push(step, show_progress=False)  # already there: locks and record check only
        r["ps_push_again_s"] = time.perf_counter() - t
        pusher.close()
        listed = s3.listing(fs, f"{ps_prefix}/objects")
        r["push_ok"] = (r["ps_push_report"]["bytes"] == total and r["ps_push_report"]["objects"] == len(files)
                        and sum(listed.values()) == total and again.objects == 0
                        and sum(s3.listing(fs, f"{raw_prefix}/objects").values()) == total)

        # -- pull ------------------------------------------------------------------------------
        t0 = time.perf_counter()
        puller = ParamStore(pull_root, remote=url, storage_options=s3.options, prepare_buffers=False)
        r["ps_open_fresh_s"] = time.perf_counter() - t0

        def ps_pull() -> None:
            t = time.perf_counter()
            rep = puller.pull(step, show_progress=False)
            r["ps_pull_s"] = time.perf_counter() - t
            r["ps_pull_report"] = rep.as_dict()

        def raw_pull() -> None:  # the very objects paramstore pulls
            r["raw_pull_s"] = raw_get(fs, sizes, ps_prefix, raw_dir, cfg)

        meter.start()
        for f in ((ps_pull, raw_pull) if i % 2 == 0 else (raw_pull, ps_pull)):
            f()
        r["pull_cpu"] = meter.stop()
        t = time.perf_counter()
        again = puller.pull(step, show_progress=False)  # already here: records, locks, registry only
        r["ps_pull_again_s"] = time.perf_counter() - t
        got = object_files(pull_root)
        r["pull_ok"] = (set(got) == set(files) and r["ps_pull_report"]["bytes"] == total and again.objects == 0
                        and sum(os.path.getsize(os.path.join(raw_dir, o)) for o in sizes) == total
                        and [v.step for v in puller.versions()] == [step])
        r["verify_s"] = verify_time(got)
        s3.remove(fs, f"r{i}")
    finally:
        for st in (pusher, puller):
            if st is not None:
                st.close()
        shutil.rmtree(pull_root, ignore_errors=True)
        shutil.rmtree(raw_dir, ignore_errors=True)
    r["settings"] = cfg
    return r


def verify_time(files: dict[str, str]) -> float | None:
    """Seconds to re-hash these object files on one thread, as a pull verifies each download."""
    try:
        from paramstore.remote import rehash_file
    except ImportError:
        return None
    t = time.perf_counter()
    for o, p in files.items():
        if rehash_file(p) != o:
            raise AssertionError(f"pulled object {o} does not verify")
    return time.perf_counter() - t


def part_transfer(a: argparse.Namespace, s3: S3, sd: dict[str, torch.Tensor], shm: str) -> dict[str, Any]:
    """Figures 1 and 2: push and pull, paramstore vs raw s3fs: ``a.warmup`` + ``a.rounds`` rounds."""
    from paramstore import ParamStore

    src = tempfile.mkdtemp(prefix="psbench-remote-src-", dir=shm)
    step = 1
    with ParamStore(src, shard_size_bytes=a.shard_mib * MIB, prepare_buffers=False) as store:
        store.commit(step, sd).result()
    files = object_files(src)
    sizes = sorted(os.path.getsize(p) for p in files.values())
    total = sum(sizes)
    out: dict[str, Any] = {"objects": len(files), "object_bytes": total,
                           "object_mib": [round(x / MIB, 1) for x in sizes], "warmup": [], "rounds": []}
    log(f"transfer: {len(files)} objects, {total / MIB:.1f} MiB: {out['object_mib']} MiB")
    mib = total / MIB
    try:
        for i in range(a.warmup + a.rounds):
            r = transfer_round(i, s3, src, step, files, shm, a.wait_quiet)
            (out["warmup"] if i < a.warmup else out["rounds"]).append(r)
            out["settings"] = r.pop("settings")
            log(f"{'warm-up' if i < a.warmup else f'round {i - a.warmup + 1}'} ({r['first']} first): push ps "
                f"{mib / r['ps_push_s']:.0f} MiB/s, raw {mib / r['raw_push_s']:.0f} MiB/s "
                f"({r['raw_push_s'] / r['ps_push_s']:.2f}x); pull ps {mib / r['ps_pull_s']:.0f} MiB/s, raw "
                f"{mib / r['raw_pull_s']:.0f} MiB/s ({r['raw_pull_s'] / r['ps_pull_s']:.2f}x); "
                f"other processes' CPU {r['push_cpu']['foreign_pct']}% / {r['pull_cpu']['foreign_pct']}%; "
                f"ok {r['push_ok'] and r['pull_ok']}")
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return out


def part_bytes(a: argparse.Namespace, s3: S3, sd: dict[str, torch.Tensor], shm: str) -> dict[str, Any]:
    """Figure 3: bytes a push uploads after an unchanged re-commit and after ~10% changed."""
    from paramstore import ParamStore

    root = tempfile.mkdtemp(prefix="psbench-remote-dedup-", dir=shm)
    prefix = "dedup"
    url = f"s3://{BUCKET}/{prefix}"
    total = sum(t.nbytes for t in sd.values())
    out: dict[str, Any] = {"total_bytes": total, "tensors": len(sd), "unchanged": [], "partial": []}
    fs = s3.raw_fs(8)
    # Commits go through a store without a remote (no write-through push racing ours); pushes
    # through a second store object on the same root, with the remote.
    committer = ParamStore(root, shard_size_bytes=a.shard_mib * MIB, prepare_buffers=False)
    pusher = None
    try:
        pusher = ParamStore(root, remote=url, storage_options=s3.options, prepare_buffers=False)

        def measured_push(step: int) -> dict[str, Any]:
            before = s3.listing(fs, f"{prefix}/objects")
            rep = pusher.push(step, show_progress=False)
            after = s3.listing(fs, f"{prefix}/objects")
            new = {k: v for k, v in after.items() if k not in before}
            return {"report": rep.as_dict(), "listed_new_objects": len(new), "listed_new_bytes": sum(new.values())}

        step = 1
        committer.commit(step, sd).result()
        out["first"] = measured_push(step)
        for i in range(min(a.rounds, 3)):
            step += 1
            committer.commit(step, sd).result()
            out["unchanged"].append(measured_push(step))
            sub = pick_tenth(sd, i)
            mutate(sd, sub)
            step += 1
            committer.commit(step, sd).result()
            changed = sum(sd[k].nbytes for k in sub)
            out["partial"].append({"changed_tensors": len(sub), "changed_bytes": changed, **measured_push(step)})
            p = out["partial"][-1]
            log(f"bytes: unchanged -> {out['unchanged'][-1]['report']['objects']} objects; "
                f"{len(sub)}/{len(sd)} tensors changed ({changed / MIB:.1f} MiB) -> "
                f"{p['report']['bytes'] / MIB:.2f} MiB in {p['report']['objects']} objects "
                f"(listed {p['listed_new_bytes'] / MIB:.2f} MiB)")
    finally:
        if pusher is not None:
            pusher.close()
        committer.close()
        s3.remove(fs, prefix)
        shutil.rmtree(root, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def rows(res: dict[str, Any]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []

    def rate(times: list[float], nbytes: int) -> str:
        s = stats(times)
        if s["median"] is None:
            return "-"
        return f"{nbytes / MIB / s['median']:.0f} MiB/s (best {nbytes / MIB / s['best']:.0f}, n={s['n']})"

    def ge(x: float | None, goal: float) -> str:
        return "n/a" if x is None else ("PASS" if x >= goal else f"MISS (-{100 * (1 - x / goal):.0f}%)")

    def le(x: float | None, goal: float) -> str:
        return "n/a" if x is None else ("PASS" if x <= goal else f"MISS (+{100 * (x / goal - 1):.0f}%)")

    t = res.get("transfer")
    if t:
        rr, nb = t["rounds"], t["object_bytes"]
        for what, label in (("push", "1. push"), ("pull", "2. pull")):
            ps, raw = [r[f"ps_{what}_s"] for r in rr], [r[f"raw_{what}_s"] for r in rr]
            ra = speedup(ps, raw)
            ok = all(r[f"{what}_ok"] for r in rr)
            noise = stats([r[f"{what}_cpu"]["foreign_pct"] for r in rr])["median"]
            out.append({"benchmark": f"{label} {nb / MIB:.0f} MiB, {t['objects']} objects", "goal": ">= 0.9x",
                        "paramstore": rate(ps, nb), "raw s3fs": rate(raw, nb),
                        "ratio": f"{ra['median']:.2f}x (best {ra['best']:.2f}x; "
                                 f"{' '.join(f'{x:.2f}' for x in ra['all'])})",
                        "verdict": ge(ra["median"], 0.9) if ok else "FAIL (bytes)",
                        "note": f"other processes' CPU {noise}% (median)"})
        ms = lambda key: f"{1e3 * stats([r[key] for r in rr])['median']:.0f} ms"
        out.append({"benchmark": "(info) fixed cost: push / pull of a version already there", "goal": "info",
                    "paramstore": f"{ms('ps_push_again_s')} / {ms('ps_pull_again_s')}", "raw s3fs": "-",
                    "ratio": "-", "verdict": "info", "note": "record and manifest reads, lock put + probe + delete"})
        if all(r.get("verify_s") for r in rr):
            out.append({"benchmark": "(info) blake3 re-hash of the pulled objects, one thread", "goal": "info",
                        "paramstore": f"{ms('verify_s')} ({nb / MIB / stats([r['verify_s'] for r in rr])['median']:.0f}"
                                      f" MiB/s)", "raw s3fs": "-", "ratio": "-", "verdict": "info",
                        "note": "what a pull verifies, per object, after its download"})
        out.append({"benchmark": "(info) ParamStore(root, remote=...) open (not timed above)", "goal": "info",
                    "paramstore": f"{ms('ps_open_fresh_s')} fresh root, {ms('ps_open_s')} existing",
                    "raw s3fs": "-", "ratio": "-", "verdict": "info", "note": ""})
    b = res.get("bytes")
    if b:
        un = [x["report"]["objects"] for x in b["unchanged"]]
        unl = [x["listed_new_objects"] for x in b["unchanged"]]
        out.append({"benchmark": "3. unchanged re-commit: objects uploaded", "goal": "0",
                    "paramstore": f"{un} (listed {unl})", "raw s3fs": "-", "ratio": "-",
                    "verdict": "PASS" if not any(un) and not any(unl) else "MISS", "note": ""})
        ratios = [x["report"]["bytes"] / x["changed_bytes"] for x in b["partial"]]
        listed = [x["listed_new_bytes"] / x["changed_bytes"] for x in b["partial"]]
        p0 = b["partial"][0]
        m = statistics.median(ratios)
        agree = all(x["report"]["bytes"] == x["listed_new_bytes"] for x in b["partial"])
        out.append({"benchmark": f"3. ~10% changed ({p0['changed_tensors']}/{b['tensors']} tensors, "
                                 f"{100 * p0['changed_bytes'] / b['total_bytes']:.1f}% of bytes): uploaded / changed",
                    "goal": "<= 1.1x", "paramstore": f"{p0['report']['bytes'] / MIB:.2f} MiB in "
                                                     f"{p0['report']['objects']} objects",
                    "raw s3fs": f"changed {p0['changed_bytes'] / MIB:.2f} MiB",
                    "ratio": f"{m:.4f}x (listed {statistics.median(listed):.4f}x)",
                    "verdict": le(m, 1.1) if agree else "FAIL (report != listing)",
                    "note": "TransferReport.bytes (bucket listing before/after)"})
    return out


def table(rs: list[dict[str, str]]) -> str:
    cols = ["benchmark", "goal", "paramstore", "raw s3fs", "ratio", "verdict", "note"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c].replace("|", "\\|") for c in cols) + " |" for r in rs]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="state dict size in MiB (default 256)")
    p.add_argument("--shard-mib", type=int, default=64, help="shard_size_bytes in MiB (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    p.add_argument("--wait-quiet", type=float, default=5.0, metavar="S",
                   help="before each round wait up to S seconds for other processes to use < 10%% CPU "
                        "(default 5; 0: never wait)")
    p.add_argument("--shm-dir", default="/dev/shm", help="where local stores live (default /dev/shm)")
    p.add_argument("--json", metavar="OUT", help="write every measurement as JSON")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.mib < 1 or a.shard_mib < 1 or a.warmup < 0:
        p.error("--rounds, --mib and --shard-mib must be >= 1, --warmup >= 0")

    t_start = time.perf_counter()
    sd = make_state_dict(a.mib * MIB)
    res: dict[str, Any] = {"argv": [os.path.relpath(sys.argv[0])] + sys.argv[1:], "cpus": os.cpu_count(),
                           "tensors": len(sd), "state_dict_bytes": sum(t.nbytes for t in sd.values())}
    s3 = S3()
    res["endpoint"] = s3.endpoint
    log(f"moto S3 at {s3.endpoint}; {len(sd)} tensors, {res['state_dict_bytes'] / MIB:.0f} MiB")
    failed = []
    parts: dict[str, Callable[..., dict[str, Any]]] = {"transfer": part_transfer, "bytes": part_bytes}
    try:
        for name, fn in parts.items():
            t0 = time.perf_counter()
            try:
                res[name] = fn(a, s3, sd, a.shm_dir)
            except Exception:  # noqa: BLE001 - report and go on with the other part
                failed.append(name)
                res.setdefault("errors", {})[name] = traceback.format_exc()
                log(f"{name} FAILED:\n{traceback.format_exc()}")
            res.setdefault("part_seconds", {})[name] = time.perf_counter() - t0
    finally:
        s3.close()
    res["total_seconds"] = time.perf_counter() - t_start
    rs = rows(res)
    res["table"] = rs
    print(table(rs))
    t = res.get("transfer")
    print("\nmoto (in-process Python S3 server) is slow and shares the GIL: absolute MiB/s are moto's, "
          "not S3's. Both sides pay the same server cost in the same round, so the ratios (raw time / "
          "paramstore time, median of per-round ratios) are what counts."
          + (f" Settings: {t['settings']['objects']} objects at once, {t['settings']['parts']} parts each, "
             f"{t['settings']['part_bytes'] // MIB} MiB parts." if t and "settings" in t else "")
          + f" Total {res['total_seconds']:.0f} s.")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
