"""Deriving a version's FP8 form on CPU, against a copy of the same bytes (issue 29: ≤ 2× a copy).

For each recipe (``paramstore.recipes``: ``fp8-block128``, ``fp8-tensor``), ``derive`` over a
Llama-like state dict of ``--gib`` GiB of bf16 (every weight eligible but the embedding, the norms
and the head), timed next to a plain copy of the same tensors into buffers made beforehand, in
the same run, alternating, medians over ``--repeats``. Also with one torch thread, since a
rollout host may give the derivation a single core.

    .venv/bin/python tools/bench_recipes.py --gib 1 --json out/bench_recipes.json --markdown out/bench_recipes.md
    .venv/bin/python tools/docgen.py recipes out/bench_recipes.md --json out/bench_recipes.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import machine, write_outputs  # noqa: E402


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
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    from paramstore import recipes

    t_start = time.monotonic()
    state = _state(args.gib)
    nbytes = sum(t.nbytes for t in state.values())
    scratch = {n: torch.empty_like(t) for n, t in state.items()}
    for t in scratch.values():
        t.fill_(0)  # faulted in: the copy baseline writes memory that is already there
    threads = torch.get_num_threads()
    rows = []
    for nthreads in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(nthreads)
        for name in recipes.names():
            recipe = recipes.get(name)
            copy_s, derive_s = [], []
            for r in range(args.repeats + 1):  # round 0 warms up (allocations, page faults)
                t = time.perf_counter()
                for n, x in state.items():
                    scratch[n].copy_(x)
                c = time.perf_counter() - t
                t = time.perf_counter()
                derived = recipes.derive(recipe, state)
                d = time.perf_counter() - t
                del derived
                if r:
                    copy_s.append(c), derive_s.append(d)
            row = {"recipe": name, "threads": nthreads, "copy_s": statistics.median(copy_s),
                   "derive_s": statistics.median(derive_s)}
            row["ratio"] = row["derive_s"] / row["copy_s"]
            rows.append(row)
            print(f"{name:14s} {nthreads} thread(s): derive {row['derive_s']:.3f} s, copy {row['copy_s']:.3f} s, "
                  f"{row['ratio']:.2f}x", flush=True)
    torch.set_num_threads(threads)
    res = {"argv": ["tools/bench_recipes.py", *sys.argv[1:]], "machine": machine(), "gib": round(nbytes / (1 << 30), 3),
           "tensors": len(state), "rows": rows, "total_seconds": time.monotonic() - t_start}
    md = [f"Deriving a {res['gib']} GiB bf16 Llama-shaped state dict ({len(state)} tensors), medians of "
          f"{args.repeats} rounds, each next to a copy of the same bytes:", "",
          "| recipe | torch threads | derive (s) | copy (s) | derive / copy | goal |", "|---|---:|---:|---:|---:|---|"]
    md += [f"| `{r['recipe']}` | {r['threads']} | {r['derive_s']:.3f} | {r['copy_s']:.3f} | {r['ratio']:.2f}× | ≤ 2× |"
           for r in rows]
    write_outputs(args.json, res, args.markdown, "\n".join(md))


if __name__ == "__main__":
    main()
