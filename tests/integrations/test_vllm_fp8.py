"""FP8 exports (``store.export(v, dir, recipe=...)``; issue 29 item 3) read by vLLM's own code.

Run in the vLLM environment (``make test-integrations`` builds it)::

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind \\
        .venv-vllm/bin/python -m pytest tests/integrations/test_vllm_fp8.py

A tiny bf16 Llama whose linear weights suit 128x128 blocks (hidden 256, intermediate 512, 4 query
heads and 2 KV heads of 64: q 256, k 128, v 128 rows) is committed and exported with
``"fp8-block128"`` and with ``"fp8-tensor"``. Each 128x128 block of a linear weight is scaled by its
own power of two (1/4 to 4), so a scale loaded into the wrong block, shard or orientation changes
the weights by up to 16x, not by a rounding error. No vLLM code is replaced or mocked; what runs:

1. **Config** (every host): the exported ``config.json``'s ``quantization_config`` through
   ``Fp8Config.from_config`` and through vLLM's own engine-config resolution
   (``EngineArgs.create_engine_config``: ``ModelConfig`` picks the method from the file,
   ``current_platform.verify_quantization``, ``VllmConfig._get_quantization_config``): ``fp8``,
   block ``[128, 128]`` (``None`` for ``fp8-tensor``), dynamic activations.
2. **Loader** (every host): vLLM's Llama linear layers, built as ``vllm/model_executor/models/llama.py``
   builds them (``QKVParallelLinear``, ``RowParallelLinear``, ``MergedColumnParallelLinear``, with the
   ``Fp8Config`` vLLM resolved: ``Fp8LinearMethod.create_weights`` makes their parameters), each
   exported tensor loaded by the parameter's own ``weight_loader`` with the shard id
   ``LlamaModel.load_weights`` passes (q/k/v, 0/1 for gate/up, from ``packed_modules_mapping``):
   every parameter is covered exactly once, shapes and dtypes match (vLLM's loaders assert them),
   and the weights vLLM holds, dequantized, equal the exported ones shard by shard and are within
   the recipe's error bound of the committed bf16 weights.
3. **End to end**: ``vllm.LLM(model=export_dir, dtype="bfloat16")``, the quant method and kernel its
   layers use, and its prompt logprobs against ``transformers`` holding the dequantized weights.
   Also **transformers**' own loader of the block export (``from_pretrained``; on CPU it
   dequantizes, which is what runs here).

**What vLLM 0.32.0's CPU build cannot run, and is skipped with vLLM's own message** (probed, not
assumed: where a later build or another host can, the test runs):

- ``fp8-block128`` end to end: ``Fp8LinearMethod.create_weights`` calls ``init_fp8_linear_kernel``,
  whose only CPU block-FP8 kernels (``_POSSIBLE_FP8_BLOCK_KERNELS[CPU]`` in
  ``vllm/model_executor/kernels/linear/__init__.py``) are ``CPUFp8W8A8BlockScaledMMKernel`` (needs
  AMX-FP8) and ``CPUFp8BlockScaledMMKernel`` (W8A16, needs AMX tiles: Sapphire Rapids or newer);
  on a host without AMX (this AMD EPYC, ``torch.cpu._is_amx_tile_supported()`` false) the model
  cannot be built: ``ValueError: Failed to find a kernel that can implement the ScaledMM linear
  layer``. The loader test (2) builds each layer up to that point -- the parameters are registered
  before the kernel is chosen -- and loads into them; the kernel's own weight packing
  (``convert_weight_packed``) and GEMM (``fp8_scaled_mm_cpu``) are not run.
- ``fp8-tensor`` end to end: the layers build (``PerTensorTorchFP8ScaledMMLinearKernel``) and load,
  but ``Fp8LinearMethod.process_weights_after_loading`` requantizes each layer's shards to one
  scale (``requantize_with_max_scale`` -> ``ops.scaled_fp8_quant``), and this build's
  ``torch.ops._C.static_scaled_fp8_quant`` is a stub (schema ``() -> ()``): ``RuntimeError:
  _C::static_scaled_fp8_quant() expected at most 0 argument(s)``.

Known gap, marked ``xfail(strict=True)``: transformers (5.x, ``FineGrainedFP8Config``) does not read the
``fp8-tensor`` export: it names its per-tensor scale ``weight_scale_inv`` and defaults
``weight_block_size`` to ``(128, 128)``, so ``weight_scale`` is dropped as unexpected and the raw
float8 values are loaded as the weights (off by up to 448x), with no error.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'paramstore[vllm]')")
transformers = pytest.importorskip("transformers")

import torch
from safetensors.torch import load_file

import paramstore
from paramstore import recipes

pytestmark = pytest.mark.slow

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PROMPT = [5, 17, 99, 3, 42, 7, 200, 13, 64, 128, 1, 250]
RECIPES = ["fp8-block128", "fp8-tensor"]
SCALE_SUFFIX = {"fp8-block128": "weight_scale_inv", "fp8-tensor": "weight_scale"}
KERNEL_REFUSED = "Failed to find a kernel that can implement the ScaledMM linear layer"


# -- the model and its exports -------------------------------------------------------------------
def tiny_llama_config():
    # Every linear dimension a multiple of 128 (vLLM's validate_fp8_block_shape wants each fused
    # shard's rows to be); head_dim 64: a head size vLLM's CPU attention backend supports.
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False)


def block_scaled_weights(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 weights; each 128x128 block of a linear weight times its own power of two in [1/4, 4]."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.state_dict().items():
        if t.dim() == 1:  # norms
            out[name] = 1 + 0.1 * torch.randn(t.shape, generator=g)
        elif "embed" in name:
            out[name] = torch.randn(t.shape, generator=g)
        else:
            n, k = t.shape
            factors = 2.0 ** torch.randint(-2, 3, (-(-n // 128), -(-k // 128)), generator=g).float()
            full = factors.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            out[name] = 0.05 * torch.randn(t.shape, generator=g) * full
    return {name: t.to(torch.bfloat16) for name, t in out.items()}


@pytest.fixture(scope="module")
def committed():
    """The bf16 model as committed: ``(model, weights)``."""
    model = transformers.LlamaForCausalLM(tiny_llama_config()).to(torch.bfloat16).eval()
    weights = block_scaled_weights(model)
    model.load_state_dict(weights)
    return model, weights


@pytest.fixture(scope="module")
def exports(committed):
    """``{recipe: export directory}``: one store, version 0, exported with each recipe."""
    d = tempfile.mkdtemp(prefix="paramstore-vllm-fp8-", dir=SHM)
    try:
        with paramstore.ParamStore(os.path.join(d, "store"), create=True) as s:
            s.commit(0, committed[0]).result()
            for r in RECIPES:
                s.export(0, os.path.join(d, r), recipe=r)
        yield {r: os.path.join(d, r) for r in RECIPES}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def exported_tensors(directory: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        out.update(load_file(f))
    return out


def dequantized(recipe: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The export as float32 weights, each FP8 weight times its scale (``recipes.dequantize_block``
    for blocks), the scales left out: what a loader computes."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX[recipe]):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[recipes.scale_name(name, SCALE_SUFFIX[recipe])]
            out[name] = recipes.dequantize_block(t, scale) if recipe == "fp8-block128" else t.float() * scale
        else:
            out[name] = t.float()
    return out


@contextlib.contextmanager
def vllm_config_of(directory: str):
    """vLLM's own resolution of the export's config (``EngineArgs.create_engine_config``), made current."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=directory, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
                        max_model_len=64).create_engine_config()
    with set_current_vllm_config(config):
        yield config


# -- 1. config.json ------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
def test_vllm_reads_the_quantization_config(exports, recipe):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    with open(os.path.join(exports[recipe], "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    block = [128, 128] if recipe == "fp8-block128" else None
    parsed = Fp8Config.from_config(qc)
    assert (parsed.is_checkpoint_fp8_serialized, parsed.activation_scheme, parsed.weight_block_size,
            parsed.ignored_layers) == (True, "dynamic", block, [])

    with vllm_config_of(exports[recipe]) as config:  # as vllm.LLM(model=dir) resolves it
        assert config.model_config.quantization == "fp8"
        assert isinstance(config.quant_config, Fp8Config)
        assert config.quant_config.weight_block_size == block
        assert config.model_config.dtype == torch.bfloat16


# -- 2. vLLM's layers and weight loaders ---------------------------------------------------------
@pytest.fixture
def vllm_distributed():
    """vLLM's tensor-parallel state for one rank (gloo), as its CPU worker sets it up; torn down after
    each test (none is left in this process when an LLM starts its engine processes)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)

    d = tempfile.mkdtemp(prefix="paramstore-vllm-fp8-dist-")
    with set_current_vllm_config(VllmConfig()):  # vLLM's defaults: one rank, no parallelism
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{d}/init", backend="gloo")
        initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
        shutil.rmtree(d, ignore_errors=True)


def build_layer(cls, **kwargs):
    """``cls(**kwargs)``, a vLLM linear layer; ``(layer, refusal)``. Where vLLM finds no FP8 kernel for
    this host, ``Fp8LinearMethod.create_weights`` raises after registering the layer's parameters: the
    layer is kept as built so far (its ``weight_loader_v2`` needs only what is set before) and vLLM's
    message is returned as ``refusal``. Any other error is raised."""
    layer = cls.__new__(cls, **kwargs)
    try:
        layer.__init__(**kwargs)
    except ValueError as e:
        if KERNEL_REFUSED not in str(e):
            raise
        return layer, str(e)
    return layer, None


def llama_linear_layers(config, layer_index: int):
    """The linear layers of one decoder layer, as vLLM's llama.py builds them: ``{prefix: (layer, refusal)}``."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    hf = config.model_config.hf_config
    q = config.quant_config
    p = f"model.layers.{layer_index}"
    return {
        f"{p}.self_attn.qkv_proj": build_layer(
            QKVParallelLinear, hidden_size=hf.hidden_size, head_size=hf.head_dim,
            total_num_heads=hf.num_attention_heads, total_num_kv_heads=hf.num_key_value_heads, bias=False,
            quant_config=q, prefix=f"{p}.self_attn.qkv_proj"),
        f"{p}.self_attn.o_proj": build_layer(
            RowParallelLinear, input_size=hf.num_attention_heads * hf.head_dim, output_size=hf.hidden_size,
            bias=False, quant_config=q, prefix=f"{p}.self_attn.o_proj"),
        f"{p}.mlp.gate_up_proj": build_layer(
            MergedColumnParallelLinear, input_size=hf.hidden_size, output_sizes=[hf.intermediate_size] * 2,
            bias=False, quant_config=q, prefix=f"{p}.mlp.gate_up_proj"),
        f"{p}.mlp.down_proj": build_layer(
            RowParallelLinear, input_size=hf.intermediate_size, output_size=hf.hidden_size, bias=False,
            quant_config=q, prefix=f"{p}.mlp.down_proj"),
    }


def vllm_target(name: str):
    """Where ``LlamaModel.load_weights`` puts checkpoint tensor ``name``: ``(layer prefix, parameter,
    shard id)``, from ``LlamaForCausalLM.packed_modules_mapping`` (q/k/v by letter, gate/up by index)."""
    from vllm.model_executor.models.llama import LlamaForCausalLM

    module, _, param = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for packed, parts in LlamaForCausalLM.packed_modules_mapping.items():
        if leaf in parts:
            shard = leaf[0] if packed == "qkv_proj" else parts.index(leaf)
            return f"{parent}.{packed}", param, shard
    return module, param, None


@pytest.mark.parametrize("recipe", RECIPES)
def test_vllm_layers_load_every_exported_tensor(exports, committed, vllm_distributed, recipe):
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    tensors = exported_tensors(exports[recipe])
    suffix = SCALE_SUFFIX[recipe]
    hf_layers = tiny_llama_config().num_hidden_layers
    with vllm_config_of(exports[recipe]) as config:
        layers = {}
        for i in range(hf_layers):
            layers.update(llama_linear_layers(config, i))
    refusals = {r for _, r in layers.values()}
    if recipe == "fp8-block128":
        # The parameters vLLM made, whether or not this host has a kernel for them.
        for prefix, (layer, refusal) in layers.items():
            assert isinstance(layer.quant_method, Fp8LinearMethod) and layer.quant_method.block_quant, prefix
            assert layer.weight_block_size == [128, 128]
            assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.dtype == torch.float32
            n, k = layer.weight.shape
            assert tuple(layer.weight_scale_inv.shape) == (-(-n // 128), -(-k // 128))
    else:
        assert refusals == {None}, refusals  # per-tensor FP8 layers build on every CPU
        for prefix, (layer, _) in layers.items():
            assert isinstance(layer.quant_method, Fp8LinearMethod) and not layer.quant_method.block_quant
            assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (len(layer.logical_widths),)

    # Every vLLM parameter starts as NaN; each exported tensor is loaded as LlamaModel.load_weights does.
    params = {f"{prefix}.{n}": p for prefix, (layer, _) in layers.items() for n, p in layer.named_parameters()}
    for p in params.values():
        p.data.fill_(float("nan"))
    loaded = set()
    for name, t in tensors.items():
        prefix, param, shard = vllm_target(name)
        if prefix not in layers:  # embeddings, norms, lm_head: not quantized by the recipe
            assert t.dtype == torch.bfloat16 and not name.endswith(suffix), name
            assert "embed" in name or "norm" in name or "lm_head" in name, name
            continue
        p = getattr(layers[prefix][0], param)
        assert p.dtype == t.dtype, (name, p.dtype, t.dtype)
        p.weight_loader(p, t) if shard is None else p.weight_loader(p, t, shard)
        loaded.add(name)
    for name, p in params.items():
        assert not torch.isnan(p.data.float()).any(), f"{name}: not every element was loaded"
    quantized = {n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    assert len(quantized) == 7 * hf_layers and loaded == quantized | {recipes.scale_name(n, suffix) for n in quantized}

    # What vLLM holds, dequantized, shard by shard: the export's own values, near the committed bf16.
    _, weights = committed
    want = dequantized(recipe, tensors)
    for prefix, (layer, _) in layers.items():
        parts = checkpoint_parts(prefix)
        if recipe == "fp8-block128":
            held = recipes.dequantize_block(layer.weight.data, layer.weight_scale_inv.data)
        else:
            rows = torch.tensor(layer.logical_widths)
            held = layer.weight.data.float() * layer.weight_scale.data.repeat_interleave(rows)[:, None]
        exported = torch.cat([want[f"{part}.weight"] for part in parts])
        assert torch.equal(held, exported), prefix
        original = torch.cat([weights[f"{part}.weight"].float() for part in parts])
        n, k = original.shape
        if recipe == "fp8-block128":
            scale = layer.weight_scale_inv.data.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        else:
            scale = layer.weight_scale.data.repeat_interleave(rows)[:, None]
        rel, absolute, slack = recipes.ERROR_BOUND
        assert ((held - original).abs() <= torch.maximum(rel * original.abs(), absolute * scale) * (1 + slack)).all()


def checkpoint_parts(prefix: str) -> list[str]:
    """The checkpoint modules a vLLM layer holds, in its shard order."""
    from vllm.model_executor.models.llama import LlamaForCausalLM

    parent, _, leaf = prefix.rpartition(".")
    return [f"{parent}.{part}" for part in LlamaForCausalLM.packed_modules_mapping.get(leaf, [leaf])]


# -- 3. end to end -------------------------------------------------------------------------------
def why_vllm_cannot_serve(directory: str) -> str | None:
    """vLLM's own refusal, on this host, of what ``vllm.LLM(model=directory)`` would run first; None
    where nothing is refused. Block FP8: ``init_fp8_linear_kernel`` called as
    ``Fp8LinearMethod.create_weights`` calls it. Per-tensor FP8: also ``ops.scaled_fp8_quant`` with a
    static scale, as ``process_weights_after_loading`` calls it (``requantize_with_max_scale``)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    with vllm_config_of(directory) as config:
        method = Fp8LinearMethod(config.quant_config)
        try:
            init_fp8_linear_kernel(activation_quant_key=method.activation_quant_key,
                                   weight_quant_key=method.weight_quant_key, weight_shape=(512, 256),
                                   input_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
        except ValueError as e:
            return (f"vLLM {vllm.__version__} has no {'block-' if method.block_quant else ''}FP8 linear kernel for "
                    f"this host (Fp8LinearMethod.create_weights -> init_fp8_linear_kernel): {e}")
        if not method.block_quant:
            try:
                ops.scaled_fp8_quant(torch.ones(32, 256, dtype=torch.bfloat16), torch.ones(1))
            except RuntimeError as e:
                return (f"vLLM {vllm.__version__}'s per-tensor FP8 loading requantizes each layer "
                        "(Fp8LinearMethod.process_weights_after_loading -> requantize_with_max_scale -> "
                        f"ops.scaled_fp8_quant), and this build cannot: {e}")
    return None


def reference_logprobs(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The prompt logprobs of ``transformers``' Llama holding ``weights``, computed in ``dtype``."""
    model = transformers.LlamaForCausalLM(tiny_llama_config()).to(dtype).eval()
    model.load_state_dict({n: t.to(dtype) for n, t in weights.items()})
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    return logits[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


def misplaced(recipe: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The export dequantized with every scale one block (or, per tensor, one weight) off: what a
    loader that put scales in the wrong place would compute."""
    moved = dict(tensors)
    names = sorted(n for n in tensors if n.endswith(SCALE_SUFFIX[recipe]))
    for i, n in enumerate(names):
        moved[n] = tensors[n].roll(1, 0) if recipe == "fp8-block128" else tensors[names[i - 1]]
    return dequantized(recipe, moved)


def linear_methods(model: torch.nn.Module) -> list[tuple[str, bool, str]]:
    """(quant method, block?, kernel) of each linear layer of vLLM's model: run in its worker, which
    imports this module by name (``test_vllm_serves_the_export`` puts its folder on PYTHONPATH)."""
    from vllm.model_executor.layers.linear import LinearBase

    return sorted({(type(m.quant_method).__name__, bool(getattr(m.quant_method, "block_quant", False)),
                    type(getattr(m.quant_method, "fp8_linear", None)).__name__)
                   for m in model.modules() if isinstance(m, LinearBase)})


#: The kernels of vLLM 0.32's CPU build that keep activations in bf16 (weight-only FP8, "W8A16");
#: every other FP8 kernel quantizes activations to FP8 too.
W8A16_KERNELS = {"CPUFp8BlockScaledMMKernel", "CPUFp8PerTensorScaledMMLinearKernel"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_vllm_serves_the_export(exports, committed, recipe):
    """The export in ``vllm.LLM``: its layers use vLLM's FP8 method (block or per tensor as the
    recipe says), and its prompt logprobs match ``transformers`` holding the dequantized weights.

    Tolerance. The reference runs in float32 on the dequantized weights; vLLM runs in bf16
    (``Fp8Config`` takes bf16 or fp16 activations only). With a weight-only kernel (W8A16) the gap
    is bf16's activation rounding: 4x the gap between the reference run in bf16 and in float32,
    floored at 0.1 nats (0.1 here: that gap is 0.015-0.023). A W8A8 kernel also rounds every
    activation to e4m3, the format the weights were rounded to, so it may move the logprobs about
    as much as quantizing the weights did: 2x the gap between the reference on the committed bf16
    weights and on the dequantized ones (0.2-0.23 here) is added. Either way a loader that put every
    scale one block (per tensor: one weight) off misses the reference by over 2x the tolerance
    (asserted: 2.2-2.3 nats here, from the per-block factors), so passing means the scales were
    applied where they belong."""
    reason = why_vllm_cannot_serve(exports[recipe])
    if reason is not None:
        pytest.skip(reason)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends a function to the worker
        here = os.path.dirname(os.path.abspath(__file__))  # ... where it is imported by name
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"))
        llm = vllm.LLM(model=exports[recipe], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, seed=0,
                       max_model_len=64, max_num_seqs=2, enable_prefix_caching=False)
        try:
            assert llm.llm_engine.model_config.quantization == "fp8"
            methods = llm.apply_model(linear_methods)[0]
            assert {(m, block) for m, block, _ in methods} == {("Fp8LinearMethod", recipe == "fp8-block128")}, methods
            params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
            out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
            got = torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], PROMPT[1:])])
        finally:
            llm.llm_engine.engine_core.shutdown()

    tensors = exported_tensors(exports[recipe])
    weights = dequantized(recipe, tensors)
    want = reference_logprobs(weights, torch.float32)
    tolerance = max(0.1, 4 * (reference_logprobs(weights, torch.bfloat16) - want).abs().max().item())
    if not {kernel for _, _, kernel in methods} <= W8A16_KERNELS:
        tolerance += 2 * (reference_logprobs(committed[1], torch.float32) - want).abs().max().item()
    assert (reference_logprobs(misplaced(recipe, tensors), torch.float32) - want).abs().max() > 2 * tolerance
    assert (got - want).abs().max().item() < tolerance, \
        f"vLLM {got.tolist()}\nHF   {want.tolist()}\n{methods}, tolerance {tolerance}"


# -- transformers' loader ------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", [
    "fp8-block128",
    pytest.param("fp8-tensor", marks=pytest.mark.xfail(strict=True, reason=(
        "transformers' FineGrainedFP8Config reads per-tensor scales as weight_scale_inv and defaults "
        "weight_block_size to (128, 128): the export's weight_scale is dropped as unexpected and the raw "
        "float8 values are loaded as weights"))),
])
def test_transformers_loads_the_export(exports, recipe):
    """``from_pretrained(export_dir)``: on CPU transformers dequantizes FP8 checkpoints to bf16 (its
    kernels need a GPU or XPU); each weight must be the export's dequantized value, bf16-rounded."""
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(exports[recipe])
    want = dequantized(recipe, exported_tensors(exports[recipe]))
    got = model.state_dict()
    assert set(got) == set(want)
    for name, w in want.items():
        error = (got[name].float() - w).abs()
        assert bool((error <= w.abs() * 2.0 ** -8).all()), f"{name}: off by up to {error.max().item()}"

