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

    .venv/bin/python tools/bench_patch.py --json out/bench_patch.json --markdown out/bench_patch.md
    .venv/bin/python tools/docgen.py patch out/bench_patch.md --json out/bench_patch.json
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

from paramstore.patch import apply_patch, decode_into, make_patch, patch_info



def _digest(a: np.ndarray) -> str:
    """The tensor digest a manifest records for these bytes (blake3, over pieces above 8 MiB)."""
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
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    res = {"argv": ["tools/bench_patch.py", *sys.argv[1:]], "machine": machine()}
    t0 = time.monotonic()
    rows = [r for lr in (float(x) for x in args.lrs.split(",")) for r in run(lr, args)]
    big = run_tensor(args) if args.tensor_mib else None
    res.update(rows=rows, tensor=big, total_seconds=time.monotonic() - t0)
    md = [f"GPT-2 ({args.layers} layers, width {args.width}, vocab {args.vocab}), fp32 master weights, AdamW, "
          f"{args.steps} steps per learning rate, committed as bf16; medians over the steps (min–max):", "",
          "| lr | elements changed | patches / model bytes | patch time / bare copy |", "|---|---|---|---|"]
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

        md += ["", f"One {big['mib']} MiB bf16 tensor, {big['changed_frac'] * 100:.2f}% of its elements changed by one or "
               f"two units in the last place; {len(r)} rounds, medians (per-round min–max); other processes used "
               f"{big['foreign_pct']}% of the machine's CPU meanwhile:", "",
               "| patch / tensor bytes | make_patch | decode_into | bare copy (`np.copyto` into `np.empty_like`) | "
               "bare copy (`torch.empty_like(x).copy_(x)`) | make_patch / np copy | make_patch / torch copy | "
               "decode_into / np copy |", "|---|---|---|---|---|---|---|---|",
               f"| {big['patch_bytes'] / (big['mib'] << 20) * 100:.2f}% | {m['make_s'] * 1e3:.0f} ms | "
               f"{m['decode_s'] * 1e3:.0f} ms | {m['np_copy_s'] * 1e3:.0f} ms | {m['torch_copy_s'] * 1e3:.0f} ms | "
               f"{ratio('make_s', 'np_copy_s')} | {ratio('make_s', 'torch_copy_s')} | {ratio('decode_s', 'np_copy_s')} |"]
    write_outputs(args.json, res, args.markdown, "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
