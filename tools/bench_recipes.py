"""Deriving a version's FP8 form on CPU, against a copy of the same bytes (issue 29: ≤ 2× a copy).

For each recipe (``paramstore.recipes``: ``fp8-block128``, ``fp8-tensor``), ``derive`` over a
Llama-like state dict of ``--gib`` GiB of bf16 (every weight eligible but the embedding, the norms
and the head), timed next to a plain copy of the same tensors into buffers made beforehand, in
the same run, alternating, medians over ``--repeats``. Also with one torch thread, since a
rollout host may give the derivation a single core. ``--baseline DIR`` times another checkout's
``paramstore/recipes.py`` in the same rounds (``git worktree add /tmp/old COMMIT``: before/after on
the same machine state). ``--breakdown`` times each step of the quantizers alone on the largest
weight, per element, next to the copy of that weight: what bounds the derivation.

    .venv/bin/python tools/bench_recipes.py --gib 1 --json out/bench_recipes.json --markdown out/bench_recipes.md
    .venv/bin/python tools/docgen.py recipes out/bench_recipes.md --json out/bench_recipes.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import CpuMeter, machine, wait_quiet, write_outputs  # noqa: E402


def _baseline(checkout: str) -> Any:
    """``paramstore/recipes.py`` of another checkout, imported beside this one (as ``baseline_paramstore``)."""
    spec = importlib.machinery.ModuleSpec("baseline_paramstore", None, is_package=True)
    spec.submodule_search_locations = [os.path.join(os.path.abspath(checkout), "paramstore")]
    sys.modules["baseline_paramstore"] = importlib.util.module_from_spec(spec)  # its __init__ is not run
    return importlib.import_module("baseline_paramstore.recipes")


def _median_s(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _breakdown(w: torch.Tensor, repeats: int) -> list[dict]:
    """Each step of the quantizers alone over ``w`` (one weight), in stripes of
    ``recipes.STRIPE_BYTES`` of float32 as the recipes take them, in ns per element."""
    from paramstore import kernels, recipes

    n, k = w.shape
    rows = max(1, recipes.STRIPE_BYTES // (4 * k))
    f32 = torch.zeros((rows, k))
    mags = torch.zeros((rows, k), dtype=torch.int16)
    q = torch.zeros((n, k), dtype=torch.float8_e4m3fn)
    scale = torch.rand(k // 128) + 0.5
    dst = torch.zeros_like(w)

    def striped(op):
        def run():
            for r0 in range(0, n, rows):
                op(r0, min(rows, n - r0))
        return run

    fp8 = kernels.fp8()

    def kernel():
        recipes._block_kernel(fp8.block["bf16"], w, (128, 128), recipes.AMAX_FLOOR, q, scale2)

    scale2 = torch.empty((-(-n // 128), -(-k // 128)))

    def fresh():
        torch.empty((n, k), dtype=torch.float8_e4m3fn).view(torch.uint8).fill_(0)

    steps = {
        "copy of the weight (the baseline)": lambda: dst.copy_(w),
        "bf16 -> float32 (into a stripe)": striped(lambda r0, r: f32[:r].copy_(w[r0:r0 + r])),
        "block maxima (sign-cleared int16 bits)": striped(lambda r0, r: torch.bitwise_and(
            w[r0:r0 + r].view(torch.int16), 0x7FFF, out=mags[:r]).view(r, -1, 128).amax(dim=2)),
        "division by the block scales": striped(lambda r0, r: f32[:r].view(r, -1, 128).div_(scale[:, None])),
        "float32 -> float8_e4m3fn (torch's cast)": striped(lambda r0, r: q[r0:r0 + r].copy_(f32[:r])),
        "the compiled kernel, whole (output faulted in already)": kernel,
        "a fresh output, filled (page faults)": fresh,
        "the same fill of an output faulted in already": lambda: q.view(torch.uint8).fill_(0),
    }
    if fp8 is None:
        del steps["the compiled kernel, whole (output faulted in already)"]
    out = []
    copy_s = None
    for name, f in steps.items():
        t = _median_s(f, repeats)
        copy_s = copy_s or t
        out.append({"step": name, "ns_per_element": t / w.numel() * 1e9, "x_copy": t / copy_s})
    return out


def _in_store(state: dict[str, torch.Tensor], recipe: str, repeats: int, copy_s: float) -> dict:
    """A derivation as a store does it: ``checkout(1, recipe=...)`` of a version committed from
    ``state`` (on /dev/shm), its records dropped and its derived objects collected between rounds so
    that every round derives (convert into the object's slab, hash it, record it). Between rounds the
    pool faults the slabs the next derivation takes, as it does between versions on a rollout host;
    round 0 (slabs made on the spot) is shown apart. Medians."""
    import shutil
    import tempfile

    import paramstore

    root = tempfile.mkdtemp(prefix="bench-recipes-", dir="/dev/shm")
    try:
        with paramstore.ParamStore(root) as store:
            store.commit(1, state).result()
            times, nbytes, first = [], 0, 0.0
            for r in range(repeats + 1):
                t = time.perf_counter()
                with store.checkout(1, recipe=recipe) as snap:
                    took = time.perf_counter() - t
                    nbytes = snap.derived.bytes
                if r:
                    times.append(took)
                else:
                    first = took
                store._root.registry.drop_derived(store._root.registry.derived_keys())
                store.gc()
                store._pool.wait_prepared(60)  # the next version's slabs, faulted meanwhile (a rollout host's steady state)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"recipe": recipe, "threads": torch.get_num_threads(), "store_s": statistics.median(times),
            "first_s": first, "derived_bytes": nbytes, "ratio": statistics.median(times) / copy_s}


def _state(gib: float) -> dict[str, torch.Tensor]:
    """Llama-shaped layers (hidden 4096, MLP 11008) of bf16 until ``gib`` GiB, plus embedding,
    norms and head (which the recipes leave as they are)."""
    g = torch.Generator().manual_seed(0)
    h, f, vocab = 4096, 11008, 8192
    out = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g).to(torch.bfloat16)}
    layer, total = 0, 0
    while total < gib * (1 << 30):
        p = f"model.layers.{layer}."
        shapes = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (h // 4, h),
                  "self_attn.v_proj.weight": (h // 4, h), "self_attn.o_proj.weight": (h, h),
                  "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
                  "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        for name, shape in shapes.items():
            out[p + name] = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
            total += out[p + name].nbytes
        layer += 1
    out["lm_head.weight"] = torch.randn(vocab, h, generator=g).to(torch.bfloat16)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", metavar="DIR", help="another checkout whose recipes are timed in the same rounds")
    ap.add_argument("--wait-quiet", type=float, default=30.0, metavar="S",
                    help="before each row, wait up to S s for other processes to use under 10%% of the CPUs")
    ap.add_argument("--breakdown", action="store_true", help="also time each step alone on the largest weight")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    from paramstore import recipes

    before = _baseline(args.baseline) if args.baseline else None
    from paramstore import kernels

    fp8 = kernels.fp8()
    conversion = f"the compiled kernel (`paramstore.kernels`, {fp8.path.rsplit('/', 1)[-1]})" if fp8 else \
        "torch's (no compiled kernel)"
    t_start = time.monotonic()
    state = _state(args.gib)
    nbytes = sum(t.nbytes for t in state.values())
    scratch = {n: torch.empty_like(t) for n, t in state.items()}
    for t in scratch.values():
        t.fill_(0)  # faulted in: the copy baseline writes memory that is already there
    threads = torch.get_num_threads()
    rows, breakdown = [], {}
    meter = CpuMeter()
    for nthreads in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(nthreads)
        for name in ("fp8-block128", "fp8-tensor"):
            timed = {"copy_s": None, "clone_s": lambda: {n: x.clone() for n, x in state.items()},
                     "derive_s": lambda: recipes.derive(name, state)}
            if before is not None:
                timed["before_s"] = lambda: before.derive(name, state)
            got: dict[str, list[float]] = {key: [] for key in timed}
            quiet = wait_quiet(meter, args.wait_quiet) if args.wait_quiet > 0 else {}
            meter.start()
            for r in range(args.repeats + 1):  # round 0 warms up (allocations, page faults)
                for key, f in timed.items():
                    t = time.perf_counter()
                    if f is None:
                        for n, x in state.items():
                            scratch[n].copy_(x)
                    else:
                        derived = f()
                    took = time.perf_counter() - t
                    derived = None
                    if r:
                        got[key].append(took)
            row = {"recipe": name, "threads": nthreads, **{key: statistics.median(v) for key, v in got.items()}}
            row["ratio"] = row["derive_s"] / row["copy_s"]
            row["clone_ratio"] = row["derive_s"] / row["clone_s"]
            if before is not None:
                row["before_ratio"] = row["before_s"] / row["copy_s"]
            row["foreign_cpu_pct"] = meter.stop()["foreign_pct"]  # the machine's other work meanwhile
            row["waited_quiet_s"] = quiet.get("waited_s")
            rows.append(row)
            print(f"{name:14s} {nthreads} thread(s): derive {row['derive_s']:.3f} s, copy {row['copy_s']:.3f} s, "
                  f"{row['ratio']:.2f}x, clone {row['clone_s']:.3f} s, {row['clone_ratio']:.2f}x, others' CPU {row['foreign_cpu_pct']}%" + (f" (before: {row['before_s']:.3f} s, {row['before_ratio']:.2f}x)"
                                            if before is not None else ""), flush=True)
        if args.breakdown:
            largest = max((t for n, t in state.items() if recipes.default_eligible(n, t)), key=lambda t: t.numel())
            breakdown[nthreads] = _breakdown(largest, max(3, args.repeats))
            for b in breakdown[nthreads]:
                print(f"  {nthreads} thread(s) {b['step']:42s} {b['ns_per_element']:6.3f} ns/element "
                      f"{b['x_copy']:5.2f}x the copy", flush=True)
    torch.set_num_threads(threads)
    copy2 = next(r["copy_s"] for r in rows if r["threads"] == threads and r["recipe"] == "fp8-block128")
    stored = [_in_store(state, name, args.repeats, copy2) for name in ("fp8-block128", "fp8-tensor")]
    for r in stored:
        print(f"{r['recipe']:14s} in a store: checkout with the recipe {r['store_s']:.3f} s, {r['ratio']:.2f}x the copy",
              flush=True)
    res = {"argv": ["tools/bench_recipes.py", *sys.argv[1:]], "machine": machine(), "gib": round(nbytes / (1 << 30), 3),
           "tensors": len(state), "rows": rows, "store": stored, "breakdown": breakdown, "total_seconds": time.monotonic() - t_start}
    res["conversion"] = conversion
    md = [f"Deriving a {res['gib']} GiB bf16 Llama-shaped state dict ({len(state)} tensors), medians of "
          f"{args.repeats} rounds, each next to a copy of the same bytes into fresh memory (`clone`, as a "
          f"derivation makes its outputs) and into buffers faulted in beforehand (`copy`); the FP8 "
          f"conversion: {conversion}:", ""]
    was = " before (s) |" if before is not None else ""
    md += [f"| recipe | torch threads | derive (s) |{was} clone (s) | copy (s) | derive / clone | derive / copy |"
           + (" before / copy |" if before is not None else "") + " goal |",
           "|---|---:|---:|" + "---:|" * (4 + 2 * (before is not None)) + "---|"]
    for r in rows:
        old = (f" {r['before_s']:.3f} |", f" {r['before_ratio']:.2f}× |") if before is not None else ("", "")
        md.append(f"| `{r['recipe']}` | {r['threads']} | {r['derive_s']:.3f} |{old[0]} {r['clone_s']:.3f} | "
                  f"{r['copy_s']:.3f} | {r['clone_ratio']:.2f}× | {r['ratio']:.2f}× |{old[1]} ≤ 2× |")
    md += ["", f"In a store (`checkout(1, recipe=...)` of the committed version, on /dev/shm, {threads} torch "
           "threads; every round derives: converts into the objects' slabs, hashes and records them; between rounds the "
           "pool faults the next round's slabs, as between versions on a rollout host), against the copy above:", "", "| recipe | checkout with the recipe (s) | / copy | the first (slabs made on the spot) (s) "
           "| derived bytes |", "|---|---:|---:|---:|---:|"]
    md += [f"| `{r['recipe']}` | {r['store_s']:.3f} | {r['ratio']:.2f}× | {r['first_s']:.3f} | "
           f"{r['derived_bytes'] / (1 << 20):.0f} MiB |" for r in stored]
    if breakdown:
        md += ["", "Each step alone on the largest weight, in ns per element and against a copy of that weight:", "",
               "| step | " + " | ".join(f"{t} thread(s): ns/element | × copy" for t in breakdown) + " |",
               "|---|" + "---:|---:|" * len(breakdown)]
        for i, b in enumerate(next(iter(breakdown.values()))):
            md.append(f"| {b['step']} | " + " | ".join(f"{v[i]['ns_per_element']:.3f} | {v[i]['x_copy']:.2f}×"
                                                      for v in breakdown.values()) + " |")
    write_outputs(args.json, res, args.markdown, "\n".join(md))


if __name__ == "__main__":
    main()
