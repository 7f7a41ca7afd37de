"""LoRA adapter versions in vLLM (paramstore.integrations.vllm_lora; issue 29 item 4) with real
vLLM, real PEFT, real processes.

Run in the vLLM environment (``make test-integrations`` builds it with peft)::

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind \\
        .venv-vllm/bin/python -m pytest tests/integrations/test_vllm_lora.py

Skipped where vLLM or PEFT is not installed. One ``LLM`` with LoRA (a tiny fp32 Llama, no
download, started from ``paramstore export`` of the base version) serves the whole module. A PEFT
model of the same base (LoRA r=4 on q_proj and v_proj, random non-zero lora_B) is committed as
adapter versions; the prompt logprobs vLLM computes under each registered adapter are compared
with the PEFT model's (transformers, fp32) and with vLLM serving the directory PEFT's own
``save_pretrained`` wrote. The two-host test needs ``paramstore[redis,mooncake]`` and redis-server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'paramstore[vllm]')")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="PEFT is not installed (pip install 'paramstore[peft]')")

import torch
from vllm.lora.request import LoRARequest

import paramstore
from paramstore.errors import InvalidArgumentError
from paramstore.integrations.vllm_lora import LoRAVersions

pytestmark = pytest.mark.slow

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PROMPT = [5, 17, 99, 3, 42, 7, 200, 13, 64, 128, 1, 250]
TOLERANCE = 1e-4  # fp32 on both sides
BASE = 1  # the base version's step
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def tiny_llama_config():
    # head_dim 64: one of the head sizes vLLM's CPU attention backend supports
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False)


def logprobs_of(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    return logits[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


def randomize_lora(model, seed: int) -> None:
    """lora_B starts at zero: random A and B, so every adapter changes the outputs its own way."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture(scope="module")
def shm():
    d = tempfile.mkdtemp(prefix="paramstore-vllm-lora-", dir=SHM)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def base_model():
    """The base: a tiny Llama with random weights far from the initial ones."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.3 if p.dim() > 1 else 1 + 0.1 * noise)
    return model


@pytest.fixture(scope="module")
def peft_model(base_model):
    """The trainer's PEFT model (on a copy of the base): its adapter is re-randomized per step."""
    import copy

    return peft.get_peft_model(copy.deepcopy(base_model), peft.LoraConfig(**LORA)).eval()


@pytest.fixture(scope="module")
def store(shm, base_model):
    """The trainer's store, the base committed as step 1."""
    s = paramstore.ParamStore(os.path.join(shm, "store"), create=True)
    try:
        s.commit(BASE, base_model).result()
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def llm(store, shm):
    """One LLM with LoRA for the module, started from the export of the base version."""
    store.export(BASE, os.path.join(shm, "hf"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"))
        engine = vllm.LLM(model=os.path.join(shm, "hf"), skip_tokenizer_init=True, dtype="float32",
                          enforce_eager=True, seed=0, max_model_len=64, max_num_seqs=2, enable_prefix_caching=False,
                          enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=8)
    try:
        yield engine
    finally:
        engine.llm_engine.engine_core.shutdown()


def vllm_logprobs(llm, request=None) -> torch.Tensor:
    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False, lora_request=request)[0]
    return torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], PROMPT[1:])])


def close(got, want) -> bool:
    return (got - want).abs().max().item() < TOLERANCE


def commit_adapter(store, peft_model, step: int, seed: int) -> torch.Tensor:
    """Commit the PEFT model's adapter (seeded) as version ``step`` on the base; its PEFT logprobs."""
    randomize_lora(peft_model, seed)
    store.commit(step, peft_model, base=BASE).result()
    return logprobs_of(peft_model)


def next_step(store) -> int:
    return store.latest().step + 1


# -- the window of eta + 1, each adapter served as PEFT computes it ---------------------------------
def test_updates_serve_each_adapter_and_keep_the_newest_eta_plus_one(llm, store, base_model, peft_model, tmp_path):
    base_lp = vllm_logprobs(llm)
    assert close(base_lp, logprobs_of(base_model))  # the engine's weights are the base version
    first = next_step(store)
    steps = [first, first + 1, first + 2]
    want = {s: commit_adapter(store, peft_model, s, seed=s) for s in steps}
    own = tmp_path / "peft-own"
    peft_model.save_pretrained(str(own))  # PEFT's own directory of the last adapter

    with LoRAVersions(llm, store, eta=1, base=BASE) as loras:
        paths, ids = {}, {}
        for s in steps:
            req = loras.update(s if s != steps[-1] else "latest")
            info = loras.info(s)
            paths[s], ids[s] = info.path, req.lora_int_id
            assert req == loras.request(s) and req.lora_name == f"paramstore-{s}"
            got = vllm_logprobs(llm, req)
            assert (got - base_lp).abs().max().item() > 100 * TOLERANCE  # the adapter changes the outputs
            assert close(got, want[s]), f"vLLM {got.tolist()}\nPEFT {want[s].tolist()}"
            assert sorted(os.listdir(info.path)) == ["adapter_config.json", "adapter_model.safetensors"]
            assert info.base_step == BASE and info.base_digest == store.get(BASE).digest
            assert info.bytes_moved == 0 and not info.moved  # one host: the objects were here already
            assert info.adapter_bytes == store.manifest(s).nbytes and info.changed_bytes == info.adapter_bytes
        # (b) eta=1: only the last two stay; the oldest is gone from the engine and the disk
        assert loras.registered() == steps[1:]
        assert not os.path.exists(paths[steps[0]])
        with pytest.raises(KeyError, match="not registered"):
            loras.request(steps[0])
        listed = llm.llm_engine.list_loras()
        assert ids[steps[1]] in listed and ids[steps[2]] in listed and ids[steps[0]] not in listed
        # a rollout that started under the previous step finishes under it
        assert close(vllm_logprobs(llm, loras.request(steps[1])), want[steps[1]])
        # (a) the same adapter from the directory PEFT itself wrote: the same outputs
        own_lp = vllm_logprobs(llm, LoRARequest("peft-own", 77, str(own)))
        assert (own_lp - vllm_logprobs(llm, loras.request(steps[2]))).abs().max().item() < 1e-6
        # a step registered already: the same request; an older one than the window: refused
        assert loras.update(steps[2]).lora_int_id == ids[steps[2]]
        with pytest.raises(InvalidArgumentError, match="older than the 2 newest"):
            loras.update(steps[0])
        assert loras.registered() == steps[1:]
        workdir = loras.workdir
    # close: nothing of ours left in the engine or on disk
    assert not set(ids.values()) & set(llm.llm_engine.list_loras())
    assert not os.path.exists(workdir)
    assert store.leases() == []


# -- refusals ------------------------------------------------------------------------------------
def test_what_the_engine_cannot_serve_is_refused_and_changes_nothing(llm, store, base_model, peft_model, tmp_path):
    with pytest.raises(InvalidArgumentError, match="max_cpu_loras"):
        LoRAVersions(llm, store, eta=3)  # 4 do not fit in the engine's cache of 3
    good = next_step(store)
    want = commit_adapter(store, peft_model, good, seed=100)
    work = tmp_path / "work"
    work.mkdir()  # given and already there: not ours to remove
    with LoRAVersions(llm, store.root, eta=0, base=BASE, workdir=work) as loras:  # the store by its root
        req = loras.update(good)
        # (c) a full version is not an adapter version
        with pytest.raises(InvalidArgumentError, match=f"version {BASE} is not an adapter version"):
            loras.update(BASE)
        # an adapter on another base than the engine's weights
        other = next_step(store)
        store.commit(other, {k: v * 2 for k, v in base_model.state_dict().items()}).result()
        randomize_lora(peft_model, 101)
        store.commit(other + 1, peft_model, base=other).result()
        with pytest.raises(InvalidArgumentError, match=f"adapter on base step {other}, but the engine's weights "
                                                       f"are step {BASE}"):
            loras.update(other + 1)
        # a rank above the engine's max_lora_rank (8)
        big = {k: torch.randn(16, v.shape[1]) if "lora_A" in k else torch.randn(v.shape[0], 16)
               for k, v in peft.utils.get_peft_model_state_dict(peft_model).items()}
        store.commit(other + 2, big, base=BASE, adapter_config={"peft_type": "LORA", "r": 16, "lora_alpha": 32,
                                                                 "target_modules": ["q_proj", "v_proj"]}).result()
        with pytest.raises(InvalidArgumentError, match="rank 16, above the engine's max_lora_rank 8"):
            loras.update(other + 2)
        assert loras.registered() == [good] and loras.request(good) == req
        assert sorted(os.listdir(work)) == [f"step-{good}"]  # nothing half-written left
        assert close(vllm_logprobs(llm, req), want)
    assert os.path.isdir(work) and os.listdir(work) == []  # a given workdir stays, emptied
    assert store.leases() == []


def test_an_engine_whose_base_is_unknown_records_the_adapters_base(llm, store, peft_model):
    step = next_step(store)
    commit_adapter(store, peft_model, step, seed=200)
    with LoRAVersions(llm, store, eta=0) as loras:  # base="engine": started from a directory, "default"
        assert loras.engine_base is None
        loras.update(step)
        assert loras.info(step).base_step == BASE


def test_an_update_waits_for_the_trainers_next_adapter_without_holding_up_requests(llm, store, peft_model):
    import threading
    import time

    step = next_step(store)
    commit_adapter(store, peft_model, step, seed=400)
    with LoRAVersions(llm, store, eta=1, base=BASE) as loras:
        first = loras.update(step)
        timer = threading.Timer(1.5, commit_adapter, (store, peft_model, step + 1, 401))
        timer.start()
        done = []
        waiter = threading.Thread(target=lambda: done.append(loras.update(min_step=step + 1, timeout=60)))
        t0 = time.monotonic()
        waiter.start()
        time.sleep(0.2)
        assert loras.request(step) == first and loras.registered() == [step]  # answered while it waits
        assert time.monotonic() - t0 < 1.0
        waiter.join(120)
        timer.join()
        assert done and done[0] == loras.request(step + 1) and loras.registered() == [step, step + 1]
        with pytest.raises(Exception, match=str(step + 100)):  # nothing comes: the wait ends, nothing changes
            loras.update(min_step=step + 100, timeout=0.5)
        assert loras.registered() == [step, step + 1]
    assert store.leases() == []


# -- two hosts: an update moves the adapter's changed bytes only ---------------------------------
@pytest.fixture(scope="module")
def registry():
    try:
        import mooncake.engine  # noqa: F401
        import redis  # noqa: F401
        import redis_server
    except ImportError:
        pytest.skip("the peer transport is not installed (pip install 'paramstore[redis,mooncake]'; redis-server)")
    if not os.path.exists(redis_server.BINARY):
        pytest.skip("redis-server is not installed")
    with redis_server.running() as url:
        yield url


def test_on_another_host_an_update_moves_only_the_adapters_changed_bytes(llm, shm, base_model, peft_model,
                                                                         registry, monkeypatch):
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    name = "vllm-lora"
    with contextlib.ExitStack() as stack:
        trainer = stack.enter_context(paramstore.ParamStore(os.path.join(shm, "lora-trainer"), registry=registry,
                                                            name=name))
        trainer.serve("127.0.0.1")
        trainer.commit(BASE, base_model).result()
        rollout = stack.enter_context(paramstore.ParamStore(os.path.join(shm, "lora-rollout"), registry=registry,
                                                            name=name))
        loras = stack.enter_context(LoRAVersions(llm, rollout, eta=1, base=BASE))
        want = commit_adapter(trainer, peft_model, 2, seed=300)
        trainer.commit(3, peft.utils.get_peft_model_state_dict(peft_model), base=BASE,
                       adapter_config=peft_model.peft_config["default"]).result()  # the same adapter again
        base_bytes = trainer.manifest(BASE).nbytes

        loras.update(2)
        first = loras.info(2)
        assert first.moved and 0 < first.bytes_moved <= 2 * first.adapter_bytes < base_bytes / 10, first.as_dict()
        assert close(vllm_logprobs(llm, first.request), want)
        loras.update(3)
        same = loras.info(3)
        assert same.bytes_moved == 0 and not same.moved and same.changed_bytes == 0, same.as_dict()

        want4 = commit_adapter(trainer, peft_model, 4, seed=301)
        loras.update(4)
        new = loras.info(4)
        assert new.moved and 0 < new.bytes_moved <= 2 * new.adapter_bytes, new.as_dict()
        assert new.changed_bytes == new.adapter_bytes
        assert close(vllm_logprobs(llm, new.request), want4)
        assert loras.registered() == [3, 4]
        # the base never moved: three adapter updates moved less than a tenth of it
        assert first.bytes_moved + same.bytes_moved + new.bytes_moved < base_bytes / 10
