"""How sparse real RL-style updates are, and what a patch of one costs: ``paramstore.patch`` on a
small transformer trained with AdamW, committed as bf16 at every step as rollout engines receive it.

A GPT-2 built here (no download; ``--layers``/``--width``) keeps fp32 master weights and takes
``--steps`` AdamW steps on random tokens at each learning rate of ``--lrs``; after each step its
weights are cast to bf16 and compared with the previous step's bf16 weights. Per step it reports
the fraction of elements whose bf16 bits changed, the bytes of the patches of every tensor
(:func:`paramstore.patch.make_patch`, digests given as a commit has them) against the model's, the
time to make them against a bare copy of the same bytes, and checks every patch applies back bit
for bit. Goals (issue 16): patches ≤ ~2% of the model when ~1% of elements change; patch time ≤ 1×
a bare copy.

Then one large bf16 tensor (``--tensor-mib``, 0 to skip) of which a fraction (``--tensor-changed``)
of the elements moved by one or two units in the last place, as the GPT-2's do: ``--repeats``
rounds, each timing side by side :func:`~paramstore.patch.make_patch` (digests given),
:func:`~paramstore.patch.decode_into` into a buffer of the tensor's size, and the bare copies of
the same bytes (``np.copyto`` into a new ``np.empty_like``, as above, and
``torch.empty_like(x).copy_(x)``); also the share of the machine's CPU other processes used.

Then a patch rebuild (``--rebuild-mib``, 0 to skip): a store on /dev/shm commits a model of that
many MiB of bf16 in 8 MiB tensors (one object), then the same with a fraction
(``--rebuild-changed``) of the elements moved by a unit or two in the last place, and makes the
patch; each round removes the new object and times :func:`paramstore.delta.rebuild` into a
pre-faulted slab (as a rollout host's pool has one; plus the CPU of faulting the slab it took
anew) and into a new file (``pool=None``, where the revision has it), next to its two passes as
separate calls (``decode_into`` of every tensor, then ``format.rehash`` of the object: what rebuild
did before it decoded and hashed each piece in one pass) and a bare copy of the object's bytes
(``np.copyto`` into a buffer already faulted); then the whole path, ``checkout(2)`` with the object
missing, by the store (``prepare_buffers`` on) and by a reader with ``prepare_buffers=False``,
until the process is idle again. Each runs in a child process on 1 core, then on 2 (``taskset``);
with ``--baseline DIR`` (a checkout of another revision: ``git worktree add build/old <rev>``) the
same children run that revision's code too (``PYTHONPATH=DIR``), interleaved with this tree's, so
the two are compared in one run on one machine load.

    .venv/bin/python tools/bench_patch.py --json out/bench_patch.json --markdown out/bench_patch.md
    .venv/bin/python tools/docgen.py patch out/bench_patch.md --json out/bench_patch.json
    git worktree add build/old <rev>   # the rebuild rows alone, against <rev>:
    .venv/bin/python tools/bench_patch.py --steps 0 --tensor-mib 0 --baseline build/old \
        --json out/bench_rebuild.json --markdown out/bench_rebuild.md
    .venv/bin/python tools/docgen.py patch-rebuild out/bench_rebuild.md --json out/bench_rebuild.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import CpuMeter, machine, write_outputs


def _pin_backends(tree: str) -> None:
    """Import ``paramstore.backends`` from ``tree``'s ``backends/`` (with ``PYTHONPATH=tree``,
    ``paramstore`` comes from the tree, but the editable install maps ``paramstore.backends`` to
    this checkout's): a rebuild child of ``--baseline`` then runs that revision's code only."""
    import importlib.abc
    import importlib.util

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: object = None, target: object = None) -> object:
            if name != "paramstore.backends":
                return None
            where = os.path.join(tree, "backends")
            return importlib.util.spec_from_file_location(name, os.path.join(where, "__init__.py"),
                                                          submodule_search_locations=[where])

    sys.meta_path.insert(0, _Finder())


if os.environ.get("BENCH_PATCH_TREE"):
    _pin_backends(os.environ["BENCH_PATCH_TREE"])

from paramstore.patch import apply_patch, decode_into, make_patch, patch_info  # noqa: E402



def _digest(a: np.ndarray) -> str:
    """The tensor digest a manifest records for these bytes (blake3, over pieces above a piece)."""
    from paramstore.format import tensor_digest

    return tensor_digest(memoryview(np.ascontiguousarray(a)).cast("B"))

def _bf16(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().to(torch.bfloat16).contiguous().view(torch.uint8).numpy().copy()
            for n, p in model.named_parameters()}


def run(lr: float, args: argparse.Namespace) -> list[dict]:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                                  vocab_size=args.vocab, n_positions=args.seq)
    model = transformers.GPT2LMHeadModel(cfg)
    for p in model.parameters():  # weights of a trained model's scale, not of an init
        p.data.normal_(0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    prev = _bf16(model)
    rows = []
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cur = _bf16(model)
        total = sum(a.nbytes for a in cur.values())
        changed = sum(int((prev[n].view(np.uint16) != cur[n].view(np.uint16)).sum()) for n in cur)
        digests = {n: (_digest(prev[n]), _digest(cur[n])) for n in cur}  # as a commit has them (pieces)
        t0 = time.perf_counter()  # the digests are known at commit time: not part of a patch's cost
        patches = {n: make_patch(prev[n], cur[n], "BF16", base_digest=digests[n][0], target_digest=digests[n][1])
                   for n in cur}
        made = time.perf_counter() - t0
        copies = {n: np.empty_like(a) for n, a in cur.items()}
        t0 = time.perf_counter()
        for n, a in cur.items():
            np.copyto(copies[n], a)
        copy_s = time.perf_counter() - t0
        patch_bytes = sum(len(p) if p is not None else cur[n].nbytes for n, p in patches.items())
        for n, p in patches.items():  # every patch applies back bit for bit (apply checks the digest)
            if p is not None:
                assert apply_patch(prev[n], p, base_digest=digests[n][0]) == cur[n].tobytes(), n
        rows.append({"lr": lr, "step": step, "loss": float(loss), "changed_frac": changed / (total // 2),
                     "patch_frac": patch_bytes / total, "patched_tensors": sum(p is not None for p in patches.values()),
                     "tensors": len(cur), "make_s": made, "copy_s": copy_s})
        print(f"lr {lr:g} step {step:2d}: loss {float(loss):.3f}  changed {changed / (total // 2) * 100:6.2f}%  "
              f"patches {patch_bytes / total * 100:6.2f}% of {total / 2**20:.1f} MiB "
              f"({rows[-1]['patched_tensors']}/{len(cur)} tensors)  make {made * 1e3:.0f} ms vs copy {copy_s * 1e3:.0f} ms",
              flush=True)
        prev = cur
    return rows


def run_tensor(args: argparse.Namespace) -> dict:
    """One large bf16 tensor: make_patch and decode_into against bare copies, round by round."""
    rng = np.random.default_rng(0)
    n = args.tensor_mib << 19  # bf16 elements
    base = (torch.from_numpy(rng.standard_normal(n, dtype=np.float32)) * 0.02).to(torch.bfloat16)
    k = int(n * args.tensor_changed)
    where = torch.from_numpy(np.sort(rng.choice(n, size=k, replace=False)))
    step = torch.from_numpy(rng.choice(np.array([-2, -1, 1, 2], dtype=np.int16), size=k))
    target = base.clone()
    target.view(torch.int16)[where] += step  # a unit or two in the last place
    a, b = base.view(torch.uint8).numpy(), target.view(torch.uint8).numpy()
    digests = _digest(a), _digest(b)
    changed = int((base.view(torch.int16) != target.view(torch.int16)).sum())
    out = np.empty_like(b)
    rounds = []
    meter = CpuMeter()
    for _ in range(args.repeats):
        row = {}
        t0 = time.perf_counter()
        patch = make_patch(a, b, "BF16", base_digest=digests[0], target_digest=digests[1])
        row["make_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        copy = np.empty_like(b)
        np.copyto(copy, b)
        row["np_copy_s"] = time.perf_counter() - t0
        del copy
        t0 = time.perf_counter()
        copy = torch.empty_like(target).copy_(target)
        row["torch_copy_s"] = time.perf_counter() - t0
        del copy
        frame, width = _frame(patch)
        t0 = time.perf_counter()
        decode_into(out, a, frame, "BF16", patch_info(patch)["changed"], width)
        row["decode_s"] = time.perf_counter() - t0
        rounds.append(row)
    noise = meter.stop()
    assert np.array_equal(out, b) and apply_patch(a, patch, base_digest=digests[0]) == b.tobytes()
    res = {"mib": args.tensor_mib, "changed_frac": changed / n, "patch_bytes": len(patch), "rounds": rounds, **noise}
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    res["median"] = med
    print(f"{args.tensor_mib} MiB bf16, {changed / n * 100:.2f}% changed: patch {len(patch) / 2**20:.2f} MiB "
          f"({len(patch) / b.nbytes * 100:.2f}%); medians of {args.repeats}: make_patch {med['make_s'] * 1e3:.0f} ms, "
          f"decode_into {med['decode_s'] * 1e3:.0f} ms, np copy {med['np_copy_s'] * 1e3:.0f} ms, "
          f"torch copy {med['torch_copy_s'] * 1e3:.0f} ms; other processes used {noise['foreign_pct']}% of the CPU",
          flush=True)
    return res


def rebuild_child(args: argparse.Namespace) -> dict:
    """In a child process (pinned by its parent with taskset; its paramstore maybe another
    revision's): time rebuild and its parts, round by round (see the module docstring)."""
    import inspect
    import shutil
    import tempfile

    import blake3

    import paramstore
    from paramstore import ParamStore
    from paramstore.delta import rebuild
    from paramstore.format import rehash, tensor_spans

    rng = np.random.default_rng(0)
    tensors, per = args.rebuild_mib // 8, 8 << 20  # 8 MiB tensors (4 pieces each)
    base = {f"layer{i}.weight": (torch.from_numpy(rng.standard_normal(per // 2, dtype=np.float32)) * 0.02)
            .to(torch.bfloat16) for i in range(tensors)}
    target = {}
    for name, t in base.items():
        k = int(t.numel() * args.rebuild_changed)
        where = torch.from_numpy(rng.choice(t.numel(), size=k, replace=False))
        step = torch.from_numpy(rng.choice(np.array([-2, -1, 1, 2], dtype=np.int16), size=k))
        target[name] = t.clone()
        target[name].view(torch.int16)[where] += step
    root = tempfile.mkdtemp(prefix="bench-rebuild-", dir="/dev/shm")
    try:
        with ParamStore(root, patches=True, shard_size_bytes=(args.rebuild_mib << 20) + (1 << 20)) as store, \
                ParamStore(root, patches=True, prepare_buffers=False) as lean:
            store.commit(1, base).result()
            store.commit(2, target).result()
            store.flush()
            reg, tier, pool = store._root.registry, store._root.tier, store._pool
            [pairs] = reg.patches().values()
            [obj] = [o for o in store.manifest(2).objects() if o in pairs]
            [bobj] = store.manifest(1).objects()
            patch, size = pairs[obj], reg.object_sizes([obj])[obj]
            with open(tier.object_path(obj), "rb") as f:
                want = blake3.blake3(f.read()).hexdigest()  # to check each rebuild's bytes
            spans = _patch_spans(tier.object_path(patch))
            into_file = "None" in str(inspect.signature(rebuild).parameters["pool"].annotation)
            dest = np.empty(size, dtype=np.uint8)
            dest.fill(1)  # faulted
            rounds = []
            meter = CpuMeter()
            for r in range(args.repeats + 1):  # (the first round warms up: not counted)
                os.unlink(tier.object_path(obj))
                row = {}
                pool.prepare([size], purpose="fetch")  # a slab ready, as a rollout host has one
                pool.wait_prepared(60)
                c0, t0 = time.process_time(), time.perf_counter()  # (CPU: every thread of this process)
                rebuild(store._root, pool, patch, obj, size)
                row["rebuild_s"] = time.perf_counter() - t0
                row["rebuild_cpu_s"] = time.process_time() - c0
                c0 = time.process_time()
                pool.prepare([size], purpose="fetch")  # the slab the rebuild took (if it took one), faulted anew
                pool.wait_prepared(60)
                row["prepare_cpu_s"] = time.process_time() - c0
                if into_file:  # (a revision whose rebuild can write a new file instead of a slab)
                    os.unlink(tier.object_path(obj))
                    c0, t0 = time.process_time(), time.perf_counter()
                    rebuild(store._root, None, patch, obj, size)
                    row["rebuild_file_s"] = time.perf_counter() - t0
                    row["rebuild_file_cpu_s"] = time.process_time() - c0
                with open(tier.object_path(obj), "rb") as f:
                    data = f.read()
                assert blake3.blake3(data).hexdigest() == want
                mv = memoryview(data)
                bmap = np.fromfile(tier.object_path(bobj), dtype=np.uint8)
                t0 = time.perf_counter()
                dest[: spans[0][0][0]] = np.frombuffer(mv[: spans[0][0][0]], dtype=np.uint8)  # the header
                for (begin, end, dtype, _, boff, changed, width), frame in spans:
                    if frame is None:
                        dest[begin:end] = np.frombuffer(mv[begin:end], dtype=np.uint8)
                    else:
                        decode_into(dest[begin:end], bmap[boff : boff + end - begin], frame, dtype, changed, width)
                row["decode_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                rehash(memoryview(dest))
                row["rehash_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                np.copyto(dest, np.frombuffer(mv, dtype=np.uint8))
                row["copy_s"] = time.perf_counter() - t0
                assert tensor_spans(memoryview(dest))[0] > 0
                del mv, data, bmap
                # the whole path: a checkout that finds the object missing (Fetcher: patches first),
                # then whatever it leaves running in the background (slabs faulted for the next one);
                # by the store (prepare_buffers on), then by a reader of the same root with it off
                for key, reader in (("checkout", store), ("checkout_noprep", lean)):
                    os.unlink(tier.object_path(obj))
                    pool.wait_prepared(60)
                    c0, t0 = time.process_time(), time.perf_counter()
                    with reader.checkout(2) as snap:
                        row[f"{key}_s"] = time.perf_counter() - t0
                        assert snap.fetch.from_patches == [obj], snap.fetch
                    pool.wait_prepared(60)
                    row[f"{key}_cpu_s"] = time.process_time() - c0
                if r:
                    rounds.append(row)
            noise = meter.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    import paramstore.backends

    return {"paramstore": os.path.dirname(paramstore.__file__), "backends": os.path.dirname(paramstore.backends.__file__),
            "cores": len(os.sched_getaffinity(0)),
            "size": size, "patch_bytes": sum(len(f) for _, f in spans if f is not None), "rounds": rounds,
            "median": {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}, **noise}


def _patch_spans(path: str) -> list[tuple[list, memoryview | None]]:
    """A patch object's spans (``[begin, end, dtype, base, base offset, changed, width]``) with each
    patched tensor's frame (None for one stored whole)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    spans = json.loads(header["__metadata__"]["spans"])
    out = []
    for i, s in enumerate(spans):
        begin, end = header[f"t{i}"]["data_offsets"]
        out.append((s, memoryview(data)[8 + n + begin : 8 + n + end] if s[3] else None))
    return out


def run_rebuild(args: argparse.Namespace) -> list[dict]:
    """Rebuild children for this tree (and ``--baseline``) on 1 core and on 2, interleaved."""
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("this tree", here)] + ([("baseline", os.path.abspath(args.baseline))] if args.baseline else [])
    out = []
    for cpus in ("0", "0-1"):
        for label, tree in trees:
            cmd = ["taskset", "-c", cpus, sys.executable, os.path.abspath(__file__), "--rebuild-child",
                   "--rebuild-mib", str(args.rebuild_mib), "--rebuild-changed", str(args.rebuild_changed),
                   "--repeats", str(args.repeats)]
            env = {**os.environ, "PYTHONPATH": tree, "BENCH_PATCH_TREE": tree}
            got = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, text=True)
            res = json.loads(got.stdout.strip().splitlines()[-1])
            for key in ("paramstore", "backends"):  # the code measured is the tree's
                assert os.path.realpath(res[key]).startswith(os.path.realpath(tree) + os.sep), (key, res[key])
            res.update(code=label, tree=tree, rev=_rev(tree))
            m = res["median"]
            print(f"rebuild {args.rebuild_mib} MiB, {args.rebuild_changed * 100:g}% changed, {label} ({res['rev']}), "
                  f"{res['cores']} core(s): rebuild {m['rebuild_s'] * 1e3:.0f} ms (CPU {m['rebuild_cpu_s'] * 1e3:.0f} "
                  f"+ slab {m['prepare_cpu_s'] * 1e3:.0f} ms); into a file {m.get('rebuild_file_s', 0) * 1e3:.0f} ms; "
                  f"checkout {m['checkout_s'] * 1e3:.0f} ms (CPU {m['checkout_cpu_s'] * 1e3:.0f} ms), without "
                  f"prepared buffers {m['checkout_noprep_s'] * 1e3:.0f} ms (CPU {m['checkout_noprep_cpu_s'] * 1e3:.0f} "
                  "ms); decode_into "
                  f"{m['decode_s'] * 1e3:.0f} + rehash {m['rehash_s'] * 1e3:.0f} ms; bare copy {m['copy_s'] * 1e3:.0f} ms;"
                  f" other processes {res['foreign_pct']}%", flush=True)
            out.append(res)
    return out


def _rebuild_table(results: list[dict], args: argparse.Namespace) -> list[str]:
    """The rebuild rows: per tree and core count, medians (per-round min–max of the ratios)."""
    first = results[0]
    busy = ", ".join(f"{r['foreign_pct']}%" for r in results)
    md = [f"Rebuilding one {first['size'] / 2**20:.0f} MiB object (32 bf16 tensors of 8 MiB) from its patch "
          f"({first['patch_bytes'] / first['size'] * 100:.2f}% of it), {args.rebuild_changed * 100:g}% of the "
          f"elements changed; {args.repeats} rounds each, medians; each row a child process pinned with "
          "`taskset`; CPU: the process's CPU time, every thread. *Into a slab*: `delta.rebuild` called alone, a "
          "pre-faulted slab ready; its CPU + faulting anew the slab it took (`SlabPool.prepare`: in the "
          "background on a rollout host, CPU all the same). *Into a file*: the same into a new file (`pool=None`: "
          "`pwrite`, no slab; this tree only). *Checkout*: `checkout(2)` with the object missing (the Fetcher "
          "rebuilds it from the patch), by the store (`prepare_buffers` on: slabs) and by a reader of the same "
          "root with `prepare_buffers=False`: wall time to the snapshot / CPU until the process is idle again "
          "(slabs faulted for the next version included). Other processes used "
          f"{busy} of the machine's CPU during the rows:", "",
          "| code | cores | into a slab: wall | its CPU + slab faulted | into a file: wall / CPU | `decode_into` + "
          "`rehash` (two passes, in memory) | bare copy | checkout, prepare on: wall / CPU | checkout, "
          "prepare off: wall / CPU | into a slab, wall / baseline's | checkout CPU / baseline's: on, off |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["median"]
        base = next((b for b in results if b["code"] == "baseline" and b["cores"] == r["cores"]), None)
        cpu = m["rebuild_cpu_s"] + m["prepare_cpu_s"]
        ms = lambda key: f"{m[key] * 1e3:.0f} ms"  # noqa: E731
        into_file = f"{ms('rebuild_file_s')} / {ms('rebuild_file_cpu_s')}" if "rebuild_file_s" in m else "—"
        if base is not None and base is not r:
            bm = base["median"]
            vs = (f"{m['rebuild_s'] / bm['rebuild_s']:.2f}× | {m['checkout_cpu_s'] / bm['checkout_cpu_s']:.2f}×, "
                  f"{m['checkout_noprep_cpu_s'] / bm['checkout_noprep_cpu_s']:.2f}×")
        else:
            vs = "— | —"
        md.append(f"| {r['code']} (`{r['rev']}`) | {r['cores']} | {ms('rebuild_s')} | "
                  f"{m['rebuild_cpu_s'] * 1e3:.0f} + {m['prepare_cpu_s'] * 1e3:.0f} = {cpu * 1e3:.0f} ms | "
                  f"{into_file} | {m['decode_s'] * 1e3:.0f} + {m['rehash_s'] * 1e3:.0f} ms | {ms('copy_s')} | "
                  f"{ms('checkout_s')} / {ms('checkout_cpu_s')} | {ms('checkout_noprep_s')} / "
                  f"{ms('checkout_noprep_cpu_s')} | {vs} |")
    return md


def _rev(tree: str) -> str:
    import subprocess

    try:
        rev = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + (" (dirty)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _frame(patch: bytes) -> tuple[memoryview, int]:
    """The frame a patch carries (its one tensor's bytes) and its gap width."""
    (n,) = struct.unpack_from("<Q", patch, 0)
    header = json.loads(patch[8 : 8 + n])
    begin, end = header["data"]["data_offsets"]
    return memoryview(patch)[8 + n + begin : 8 + n + end], int(header["__metadata__"]["gap_width"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tensor-mib", type=int, default=128, help="the large tensor's size (0: skip it)")
    ap.add_argument("--tensor-changed", type=float, default=0.02, help="the fraction of its elements that change")
    ap.add_argument("--repeats", type=int, default=7, help="rounds of the large tensor's timings")
    ap.add_argument("--rebuild-mib", type=int, default=256, help="the rebuilt object's size (0: skip the rebuild)")
    ap.add_argument("--rebuild-changed", type=float, default=0.01,
                    help="the fraction of the rebuilt object's elements that change")
    ap.add_argument("--baseline", metavar="DIR",
                    help="also time the rebuild with the code of this checkout (git worktree add build/old <rev>)")
    ap.add_argument("--rebuild-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    if args.rebuild_child:
        print(json.dumps(rebuild_child(args)))
        return 0
    res = {"argv": ["tools/bench_patch.py", *sys.argv[1:]], "machine": machine()}
    t0 = time.monotonic()
    rows = [r for lr in (float(x) for x in args.lrs.split(",")) for r in run(lr, args)] if args.steps else []
    big = run_tensor(args) if args.tensor_mib else None
    rebuilt = run_rebuild(args) if args.rebuild_mib else []
    res.update(rows=rows, tensor=big, rebuild=rebuilt, total_seconds=time.monotonic() - t0)
    md = [f"GPT-2 ({args.layers} layers, width {args.width}, vocab {args.vocab}), fp32 master weights, AdamW, "
          f"{args.steps} steps per learning rate, committed as bf16; medians over the steps (min–max):", "",
          "| lr | elements changed | patches / model bytes | patch time / bare copy |", "|---|---|---|---|"] if rows else []
    for lr in sorted({r["lr"] for r in rows}):
        rs = [r for r in rows if r["lr"] == lr]

        def span(key: str, scale: float = 100, unit: str = "%") -> str:
            xs = [r[key] * scale for r in rs]
            return f"{statistics.median(xs):.2f}{unit} ({min(xs):.2f}–{max(xs):.2f})"

        ratio = [r["make_s"] / r["copy_s"] for r in rs]
        md.append(f"| {lr:g} | {span('changed_frac')} | {span('patch_frac')} | "
                  f"{statistics.median(ratio):.1f}× ({min(ratio):.1f}–{max(ratio):.1f}) |")
    if big:
        m, r = big["median"], big["rounds"]

        def ratio(key: str, copy: str) -> str:
            xs = [x[key] / x[copy] for x in r]
            return f"{m[key] / m[copy]:.2f}× ({min(xs):.2f}–{max(xs):.2f})"

        md += [*([""] if md else []), f"One {big['mib']} MiB bf16 tensor, {big['changed_frac'] * 100:.2f}% of its elements changed by one or "
               f"two units in the last place; {len(r)} rounds, medians (per-round min–max); other processes used "
               f"{big['foreign_pct']}% of the machine's CPU meanwhile:", "",
               "| patch / tensor bytes | make_patch | decode_into | bare copy (`np.copyto` into `np.empty_like`) | "
               "bare copy (`torch.empty_like(x).copy_(x)`) | make_patch / np copy | make_patch / torch copy | "
               "decode_into / np copy |", "|---|---|---|---|---|---|---|---|",
               f"| {big['patch_bytes'] / (big['mib'] << 20) * 100:.2f}% | {m['make_s'] * 1e3:.0f} ms | "
               f"{m['decode_s'] * 1e3:.0f} ms | {m['np_copy_s'] * 1e3:.0f} ms | {m['torch_copy_s'] * 1e3:.0f} ms | "
               f"{ratio('make_s', 'np_copy_s')} | {ratio('make_s', 'torch_copy_s')} | {ratio('decode_s', 'np_copy_s')} |"]
    if rebuilt:
        md += [*([""] if md else []), *_rebuild_table(rebuilt, args)]
    write_outputs(args.json, res, args.markdown, "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
