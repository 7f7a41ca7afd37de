"""Baseline measurements that paramstore's benchmarks are compared against.

Every function here measures one way of getting a trainer's state dict somewhere else, on the
same synthetic state dict, so that paramstore's numbers can be put side by side with them:

* ``bare_copy``: ``dst[k].copy_(v)`` into preallocated, already faulted-in tensors. The floor
  for any scheme that must copy every byte once in memory.
* ``dcp_async_save``: PyTorch DCP ``async_save`` with a ``DefaultStager`` that stages into shared
  memory on a background thread, writing a checkpoint with the default ``FileSystemWriter`` (one
  file, fsync'd). Reports when the call returns (the trainer is blocked until then), when staging
  completes (the trainer may modify its weights again) and when the files are on disk. The stager
  is reused across saves, as a trainer would reuse it, so the first save pays for allocating the
  staging buffers and the later ones do not.
* ``safetensors_roundtrip``: ``safetensors.torch.save_file`` then ``load_file`` of one file, and
  copying what was loaded into preallocated tensors: the plain "write a file, read it back"
  hand-off.

``make_state_dict`` builds the synthetic state dict: the tensors of a decoder-only transformer
(Llama-style, grouped-query attention, gated MLP, untied lm_head) sized to a byte budget.

Run ``python tools/baselines.py [--mib N]`` for a self-check that runs all of them at N MiB
(default 128) and prints the results as JSON. All times are in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

__all__ = [
    "make_state_dict",
    "preallocate_like",
    "bare_copy",
    "dcp_async_save",
    "safetensors_roundtrip",
]

_BASE_VOCAB = 32_000


def _transformer_dims(n_params: int) -> tuple[int, int, int, int, int]:
    """(hidden, kv_dim, intermediate, layers, vocab) of a transformer with about ``n_params``.

    The hidden size grows with the cube root of the parameter count (1024 at 512 Mi parameters,
    i.e. 1 GiB of bf16), the layer count fills the budget and the vocabulary, near 32k, absorbs
    the remainder so the total lands within a few hundred kilobytes of the target.
    """
    hidden = max(256, 128 * round(8 * (n_params / 2**29) ** (1 / 3)))
    kv_dim = hidden // 4
    intermediate = 128 * round(2.75 * hidden / 128)
    per_layer = 2 * hidden * hidden + 2 * kv_dim * hidden + 3 * intermediate * hidden + 2 * hidden
    layers = max(1, round((n_params - 2 * _BASE_VOCAB * hidden - hidden) / per_layer))
    vocab = max(64, 64 * round((n_params - hidden - layers * per_layer) / (2 * hidden * 64)))
    return hidden, kv_dim, intermediate, layers, vocab


def make_state_dict(
    total_bytes: int = 1 << 30, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A random decoder-only transformer state dict of about ``total_bytes``, seeded.

    Hugging Face Llama names and shapes; 9 tensors per layer plus embedding, final norm and
    lm_head (381 tensors at 1 GiB of bf16). Budgets below a few MiB overshoot: there is always
    at least one layer of hidden size 256.
    """
    hidden, kv_dim, intermediate, layers, vocab = _transformer_dims(total_bytes // dtype.itemsize)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (hidden, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, hidden)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (intermediate, hidden)
        shapes[p + "mlp.up_proj.weight"] = (intermediate, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, intermediate)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, dtype=dtype, generator=gen) for k, s in shapes.items()}


def preallocate_like(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Destination tensors shaped like ``sd``, zero-filled so their pages are already faulted in."""
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def bare_copy(sd: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> float:
    """Seconds to ``dst[k].copy_(v)`` every tensor of ``sd`` into preallocated ``dst``."""
    t0 = time.perf_counter()
    for k, v in sd.items():
        dst[k].copy_(v)
    return time.perf_counter() - t0


def _timed_async_save(
    sd: dict[str, torch.Tensor], checkpoint_id: str, stager: DefaultStager
) -> dict[str, float]:
    """One DCP async save: seconds from the call until it returns, staging ends and files exist."""
    t0 = time.perf_counter()
    resp = dcp.async_save(sd, checkpoint_id=checkpoint_id, async_stager=stager, no_dist=True)
    times = {"call_s": time.perf_counter() - t0}
    futures = {"staged_s": resp.staging_completion, "done_s": resp.upload_completion}

    def stamp(name: str) -> Callable[[Future], None]:
        # Runs in the thread that completes the future, whichever one we wait on first.
        return lambda _f: times.update({name: time.perf_counter() - t0})

    for name, fut in futures.items():
        fut.add_done_callback(stamp(name))
    for fut in futures.values():
        fut.result()
    return times


def dcp_async_save(
    sd: dict[str, torch.Tensor], directory: str, *, repeats: int = 3
) -> dict:
    """Time ``repeats`` (>= 2) DCP async saves of ``sd`` to fresh checkpoints under ``directory``.

    One ``DefaultStager`` (shared-memory staging on a background thread) serves every save, so the
    first save allocates the staging buffers and the later ones reuse them. Each checkpoint is
    deleted once timed. Returns ``first`` (the cold save), ``best`` and ``median`` (per metric, over
    the later saves) and ``all`` (every save in order), each a dict of ``call_s``, ``staged_s``
    and ``done_s``, seconds from the start of the ``async_save`` call.

    On a CPU-only host the warm ``call_s`` is close to ``staged_s``: staging into cached buffers
    uses ``UntypedStorage.copy_``, which holds the GIL, so the caller cannot return until the
    background copy is nearly done.
    """
    if repeats < 2:
        raise ValueError("repeats must be >= 2: the first save is cold, the later ones warm")
    cuda = torch.cuda.is_available()
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=True,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
    )
    runs = []
    try:
        with warnings.catch_warnings():
            # no_dist=True still warns, from the upload thread, that it saves in one process.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            for i in range(repeats):
                checkpoint_id = os.path.join(directory, f"step_{i}")
                runs.append(_timed_async_save(sd, checkpoint_id, stager))
                shutil.rmtree(checkpoint_id)
    finally:
        stager.close()
    later = runs[1:]
    return {
        "first": runs[0],
        "best": {m: min(r[m] for r in later) for m in runs[0]},
        "median": {m: statistics.median(r[m] for r in later) for m in runs[0]},
        "all": runs,
    }


def safetensors_roundtrip(sd: dict[str, torch.Tensor], directory: str) -> dict[str, float]:
    """Seconds to ``save_file`` ``sd`` as one file in ``directory`` and to load it back.

    ``load_s`` is ``load_file`` alone, which only memory-maps the file (the bytes are read on
    first touch); ``load_copy_s`` adds copying every loaded tensor into preallocated tensors, as
    a rollout worker updating its weights would. ``save_file`` rejects tensors that share memory
    (e.g. tied embeddings); ``make_state_dict`` has none. The file is deleted afterwards.
    """
    path = os.path.join(directory, "model.safetensors")
    dst = preallocate_like(sd)
    t0 = time.perf_counter()
    save_file(sd, path)
    t1 = time.perf_counter()
    loaded = load_file(path)
    t2 = time.perf_counter()
    for k, v in loaded.items():
        dst[k].copy_(v)
    t3 = time.perf_counter()
    del loaded
    os.remove(path)
    return {"save_s": t1 - t0, "load_s": t2 - t1, "load_copy_s": t3 - t1}


def _self_check(mib: int, repeats: int) -> dict:
    """Run every baseline on ``mib`` MiB; DCP writes under /tmp, safetensors in /dev/shm."""
    sd = make_state_dict(mib << 20)
    dst = preallocate_like(sd)
    result: dict = {
        "total_bytes": sum(v.nbytes for v in sd.values()),
        "n_tensors": len(sd),
        "bare_copy_s": bare_copy(sd, dst),
    }
    if not all(torch.equal(dst[k], v) for k, v in sd.items()):
        raise AssertionError("bare_copy left dst different from sd")
    del dst
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="baselines-dcp-") as d:
        result["dcp_async_save"] = dcp_async_save(sd, d, repeats=repeats)
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="baselines-st-") as d:
        result["safetensors"] = safetensors_roundtrip(sd, d)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="state dict size in MiB")
    parser.add_argument("--repeats", type=int, default=3, help="DCP saves (>= 2)")
    args = parser.parse_args()
    print(json.dumps(_self_check(args.mib, args.repeats), indent=2))
