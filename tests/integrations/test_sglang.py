"""The SGLang loader (paramstore.integrations.sglang) with a real store and real worker processes.

SGLang itself has no CPU build: no engine runs here. Its contract with a custom loader is
``loader(model, named_tensors)`` (called in each tensor-parallel worker, after moving the tensors to
the worker's device) and its models' ``load_weights(iterable of (name, tensor))``; the model here is
a torch module that loads that way, so what runs is paramstore's side of that contract only.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

import paramstore
from paramstore import ParamStore
from paramstore.errors import InvalidArgumentError, WaitTimeoutError
from paramstore.integrations import sglang
from paramstore.integrations._stores import close_stores


@pytest.fixture(autouse=True)
def _close_stores(shm_dir):
    """The loader's stores (cached per process) and their prefetches end after each test, before its
    directory is removed."""
    yield
    close_stores()


class Policy(torch.nn.Module):
    """Loads weights as SGLang's models do: ``load_weights`` over (name, tensor) pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) for k, v in Policy().state_dict().items()}


def test_a_request_loads_the_version_and_leaves_no_lease(store_root):
    with ParamStore(store_root) as store:
        store.commit(1, weights(1)).result()
        store.commit(2, weights(2), tags=["best"]).result()
        model = Policy()
        for spec, seed in [({"version": 1}, 1), ({"version": "best"}, 2), ({}, 2), ({"min_step": 1}, 2)]:
            sglang.load_weights(model, sglang.request(store_root, **spec))
            for n, t in weights(seed).items():
                assert torch.equal(model.get_parameter(n), t), (spec, n)
            assert sglang.loaded_versions()[id(model)] == seed
        assert store.leases() == []


def test_bad_requests_are_refused(store_root):
    with pytest.raises(InvalidArgumentError, match="not both"):
        sglang.request(store_root, version=1, min_step=1)
    with pytest.raises(InvalidArgumentError, match="one 'paramstore.request' tensor"):
        sglang.load_weights(Policy(), [("proj.weight", torch.zeros(8, 8))])
    with ParamStore(store_root) as store:
        store.commit(1, weights(1)).result()
    with pytest.raises(WaitTimeoutError):
        sglang.load_weights(Policy(), sglang.request(store_root, min_step=5, timeout=0.3))


def _worker(root: str, min_step: int, out) -> None:
    model = Policy()
    sglang.load_weights(model, sglang.request(root, min_step=min_step, timeout=60))
    out.put({n: p.detach().numpy().tobytes() for n, p in model.named_parameters()}  # bytes: no tensor sharing
            | {"step": sglang.loaded_versions()[id(model)]})


def test_two_worker_processes_wait_for_the_step_then_load_it(store_root):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with ParamStore(store_root) as store:
        store.commit(1, weights(1)).result()
        procs = [ctx.Process(target=_worker, args=(store_root, 3, out)) for _ in range(2)]
        for p in procs:
            p.start()
        time.sleep(1.0)  # the workers wait: step 3 is not there yet
        store.commit(3, weights(3)).result()
        got = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        assert all(p.exitcode == 0 for p in procs)
        for g in got:
            assert g.pop("step") == 3
            for n, t in weights(3).items():
                assert g[n] == t.numpy().tobytes(), n
        assert store.leases() == []


# -- a request chooses nothing the engine did not allow (issue 25, item 6) ----------------------
def _raw(body: bytes) -> list[tuple[str, torch.Tensor]]:
    return [(sglang.REQUEST_NAME, torch.frombuffer(bytearray(body), dtype=torch.uint8))]


def test_a_request_never_creates_a_store_nor_reaches_an_unlisted_registry(shm_dir, monkeypatch):
    import socket

    monkeypatch.delenv("PARAMSTORE_ENGINE_ROOTS", raising=False)
    monkeypatch.delenv("PARAMSTORE_ENGINE_REGISTRIES", raising=False)
    elsewhere = os.path.join(shm_dir, "made", "by", "a", "caller")
    with pytest.raises(paramstore.NotAStoreError):
        sglang.load_weights(Policy(), sglang.request(elsewhere))
    assert not os.path.exists(os.path.join(shm_dir, "made"))  # no directory tree, no store skeleton
    with socket.create_server(("127.0.0.1", 0)) as listener:  # a "registry" that records connections
        listener.settimeout(0.3)
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        with pytest.raises(InvalidArgumentError, match="PARAMSTORE_ENGINE_REGISTRIES"):
            sglang.load_weights(Policy(), sglang.request(elsewhere, registry=url, name="x"))
        with pytest.raises(socket.timeout):
            listener.accept()  # nobody connected
    assert not os.path.exists(os.path.join(shm_dir, "made"))


def test_the_engines_roots_bound_what_a_request_opens(shm_dir, monkeypatch):
    allowed, other = os.path.join(shm_dir, "allowed"), os.path.join(shm_dir, "other")
    for root in (os.path.join(allowed, "run"), os.path.join(other, "run")):
        with ParamStore(root) as store:
            store.commit(1, weights(1)).result()
    monkeypatch.setenv("PARAMSTORE_ENGINE_ROOTS", allowed)
    model = Policy()
    sglang.load_weights(model, sglang.request(os.path.join(allowed, "run"), version=1))
    assert sglang.loaded_versions()[id(model)] == 1
    for root in (os.path.join(other, "run"), os.path.join(allowed, "..", "other", "run")):
        with pytest.raises(InvalidArgumentError, match="only under PARAMSTORE_ENGINE_ROOTS"):
            sglang.load_weights(model, sglang.request(root, version=1))


@pytest.mark.parametrize("body", [
    b'{"root": ["/x"], "version": 1, "min_step": null, "timeout": null, "registry": null, "name": null}',
    b'{"root": "/x", "version": {"a": 1}, "min_step": null, "timeout": null, "registry": null, "name": null}',
    b'{"root": "/x", "version": 1, "min_step": "3", "timeout": null, "registry": null, "name": null}',
    b'{"root": "/x", "version": 1, "min_step": null, "timeout": -1, "registry": null, "name": null}',
    b'{"root": "/x", "version": 1, "min_step": null, "timeout": null, "registry": 5, "name": null}',
    b'{"root": "/x"}',
    b'{"root": "/x", "version": 1, "min_step": null, "timeout": null, "registry": null, "name": null, "check": "yes",'
    b' "recipe": null}',
    b'{"root": "/x", "version": null, "min_step": 1, "timeout": null, "registry": null, "name": null, "check": true,'
    b' "recipe": null}',
    b'{"root": "/x", "version": 1, "min_step": null, "timeout": null, "registry": null, "name": null, "check": false}',
    b'{"root": "/x", "version": 1, "min_step": null, "timeout": null, "registry": null, "name": null, "check": false,'
    b' "recipe": ""}',
    b'{"root": "/x", "version": 1, "min_step": null, "timeout": null, "registry": null, "name": null, "check": false,'
    b' "recipe": 8}',
    b"[" * 100_000,
    b"\xff\xfe",
    b" " * (128 << 10),
])
def test_malformed_requests_are_refused(body):
    with pytest.raises(InvalidArgumentError):
        sglang.load_weights(Policy(), _raw(body))


# -- a version in the form the engine runs (issue 29) ---------------------------------------------
def test_a_request_with_a_recipe_loads_and_checks_that_form(store_root):
    """``request(..., recipe=...)``: the worker loads the version as the recipe derives it (here one
    that rounds weights to bfloat16: the model widens them back on load), and a check compares with
    that form by default."""
    from paramstore import recipes

    rounded = recipes.register(recipes.Recipe(
        "bf16-rounded-sglang", 1, lambda n, t: t.dim() == 2, lambda n, t: {n: t.to(torch.bfloat16)}), replace=True)
    w = weights(5)
    with ParamStore(store_root) as trainer:
        trainer.commit(1, w).result()
    model = Policy()
    sglang.load_weights(model, sglang.request(store_root, version=1, recipe=rounded.name))
    assert torch.equal(model.proj.weight, w["proj.weight"].to(torch.bfloat16).float())  # the recipe's form
    assert not torch.equal(model.proj.weight, w["proj.weight"])
    assert torch.equal(model.proj.bias, w["proj.bias"])  # not eligible: as committed
    assert sglang.check_installed(model)["ok"]  # compared with the form it loaded
    with pytest.raises(InvalidArgumentError, match="recipe"):
        sglang.request(store_root, recipe="")


# -- prefetch (issue 28): the next version comes while the engine generates ---------------------
def test_the_next_version_is_prefetched_and_the_next_load_moves_nothing(redis_url, shm_dir, tmp_path, monkeypatch):
    """The trainer's store and the worker's on two "hosts" (two roots, a shared Redis registry, a
    remote): the first load fetches its bytes; the worker then prefetches the next step, and the
    next load's checkout moves nothing."""
    name = f"sglang-prefetch-{os.getpid()}-{time.time()}"
    common = dict(registry=redis_url, name=name, remote=f"file://{tmp_path}/bucket",
                  storage_options={"auto_mkdir": True})
    worker_root = os.path.join(shm_dir, "h2")
    with ParamStore(os.path.join(shm_dir, "h1"), **common) as trainer, ParamStore(worker_root, **common) as host:
        # The worker's host store knows the remote (a request names root, registry and name only).
        monkeypatch.setattr(sglang, "request_store", lambda root, registry, name: host)
        trainer.commit(1, weights(1)).persisted.result(60)
        model = Policy()
        sglang.load_weights(model, sglang.request(worker_root, min_step=1, timeout=60, registry=redis_url, name=name))
        assert sglang.loaded_versions()[id(model)] == 1 and sglang.last_fetches()[id(model)].moved

        trainer.commit(2, weights(2)).result()  # published before it reaches the remote: the prefetch retries
        deadline = time.monotonic() + 60
        while not all(host._root.tier.exists(o) for o in trainer.manifest(2).objects()):
            assert time.monotonic() < deadline, "step 2 was not prefetched"
            time.sleep(0.05)
        sglang.load_weights(model, sglang.request(worker_root, min_step=2, timeout=60, registry=redis_url, name=name))
        fetch = sglang.last_fetches()[id(model)]
        assert sglang.loaded_versions()[id(model)] == 2 and fetch.step == 2 and not fetch.moved, fetch
        for n, t in weights(2).items():
            assert torch.equal(model.get_parameter(n), t), n
        assert host.leases() == []


# -- installed equals committed (issue 28, item 3) ---------------------------------------------
SHARDS = {"q": slice(0, 8), "k": slice(8, 16), "v": slice(16, 24)}


class FusedPolicy(torch.nn.Module):
    """Loads as SGLang's models with fused parameters do: the version's ``attn.{q,k,v}_proj`` go into
    one ``qkv`` parameter at their offsets (a stacked-params mapping and a shard's weight loader),
    ``lm_head.*`` is renamed ``head.*``, and the engine holds bfloat16 (the loader's ``copy_`` casts).
    ``fail_after``: raise after that many tensors were loaded (an install stopped part way)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.head = torch.nn.Linear(8, 4)
        self.to(torch.bfloat16)
        self.fail_after: int | None = None

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for i, (name, tensor) in enumerate(weights):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError(f"stopped at {name}")
            module, _, kind = name.rpartition(".")
            if module == "lm_head":
                params[f"head.{kind}"].data.copy_(tensor)
            else:
                shard = module.removeprefix("attn.").removesuffix("_proj")
                params[f"qkv.{kind}"].data[SHARDS[shard]].copy_(tensor)


def version(seed: int) -> dict[str, torch.Tensor]:
    """A version in the trainer's names (float32): what FusedPolicy loads."""
    g = torch.Generator().manual_seed(seed)
    out = {f"attn.{s}_proj.{k}": torch.randn(*shape, generator=g)
           for s in SHARDS for k, shape in (("weight", (8, 8)), ("bias", (8,)))}
    return out | {"lm_head.weight": torch.randn(4, 8, generator=g), "lm_head.bias": torch.randn(4, generator=g)}


def engine_bytes(model: FusedPolicy) -> dict[str, bytes]:
    return {n: p.detach().reshape(-1).view(torch.uint8).numpy().tobytes() for n, p in model.named_parameters()}


def expected_bytes(v: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """What the engine holds after installing ``v``, worked out apart from the loader: q, k, v
    concatenated in order, cast to bfloat16."""
    def b(t):
        return t.to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy().tobytes()
    return {f"qkv.{k}": b(torch.cat([v[f"attn.{s}_proj.{k}"] for s in SHARDS])) for k in ("weight", "bias")} \
        | {f"head.{k}": b(v[f"lm_head.{k}"]) for k in ("weight", "bias")}


def test_corrupted_weights_are_the_version_again_after_one_update(store_root):
    with ParamStore(store_root) as store:
        store.commit(1, version(1)).result()
        model = FusedPolicy()
        sglang.load_weights(model, sglang.request(store_root, version=1))
        assert engine_bytes(model) == expected_bytes(version(1))
        assert sglang.check_installed(model) == {"step": 1, "ok": True, "tensors": 4, "mismatched": {},
                                                 "not_loaded": []}

        with torch.no_grad():  # the rollout's weights corrupted
            for p in model.parameters():
                p.add_(1)
        report = sglang.check_installed(model)
        assert not report["ok"] and sorted(report["mismatched"]) == ["head.bias", "head.weight", "qkv.bias",
                                                                     "qkv.weight"], report

        sglang.load_weights(model, sglang.request(store_root))  # one update
        assert engine_bytes(model) == expected_bytes(version(1))  # bit-identical to the committed version
        assert sglang.check_installed(model)["ok"]

        with torch.no_grad():  # one element of the fused parameter (k's rows), the check names it
            model.qkv.weight[10, 3] += 1
        corrupted, ptr = model.qkv.weight[10, 3].item(), model.qkv.weight.data_ptr()
        report = sglang.check_installed(model, device="cpu")
        assert report["mismatched"] == {"qkv.weight": "1 of 192 elements differ"} and not report["ok"], report
        assert model.qkv.weight[10, 3].item() == corrupted and model.qkv.weight.data_ptr() == ptr  # nothing written
        assert store.leases() == []


def test_a_check_request_through_the_loader_compares_and_loads_nothing(store_root):
    with ParamStore(store_root) as store:
        store.commit(1, version(1)).result()
        store.commit(2, version(2), tags=["best"]).result()
        model = FusedPolicy()
        sglang.load_weights(model, sglang.request(store_root, version=2))
        sglang.load_weights(model, sglang.request(store_root, check=True))  # the step loaded
        assert sglang.last_checks()[id(model)] == {"step": 2, "ok": True, "tensors": 4, "mismatched": {},
                                                   "not_loaded": []}
        sglang.load_weights(model, sglang.request(store_root, version=1, check=True))  # another version
        report = sglang.last_checks()[id(model)]
        assert report["step"] == 1 and not report["ok"] and len(report["mismatched"]) == 4, report
        assert engine_bytes(model) == expected_bytes(version(2)) and sglang.loaded_versions()[id(model)] == 2
        with torch.no_grad():
            model.head.bias[1] = 7.0
        sglang.load_weights(model, sglang.request(store_root, version="best", check=True))  # a mismatch: no raise
        report = sglang.last_checks()[id(model)]
        assert report["step"] == 2 and report["mismatched"] == {"head.bias": "1 of 4 elements differ"}, report
        assert model.head.bias[1].item() == 7.0
        assert store.leases() == []


def test_an_install_that_fails_part_way_leaves_the_reported_step(store_root):
    with ParamStore(store_root) as store:
        store.commit(1, version(1)).result()
        store.commit(2, version(2)).result()
        model = FusedPolicy()
        sglang.load_weights(model, sglang.request(store_root, version=1))
        model.fail_after = 3
        with pytest.raises(RuntimeError, match="stopped at"):
            sglang.load_weights(model, sglang.request(store_root, version=2))
        assert sglang.loaded_versions()[id(model)] == 1  # not the step that was not installed whole
        held = engine_bytes(model)
        assert held != expected_bytes(version(1)) and held != expected_bytes(version(2))  # it did stop part way
        model.fail_after = None
        assert not sglang.check_installed(model)["ok"]  # compared with step 1: the model holds a mix
        assert not sglang.check_installed(model, step=2)["ok"]
        sglang.load_weights(model, sglang.request(store_root, version=2))
        assert sglang.loaded_versions()[id(model)] == 2 and engine_bytes(model) == expected_bytes(version(2))
        assert sglang.check_installed(model)["ok"]
        assert store.leases() == []


def test_the_check_names_what_the_version_does_not_reach(store_root):
    class Wider(FusedPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.extra = torch.nn.Parameter(torch.zeros(3))

    with ParamStore(store_root) as store:
        store.commit(1, version(1)).result()
        store.commit(2, {n: t for n, t in version(2).items() if n != "attn.v_proj.weight"}).result()
        model = Wider()
        sglang.load_weights(model, sglang.request(store_root, version=1))
        report = sglang.check_installed(model)
        assert report["not_loaded"] == ["extra"] and report["mismatched"] == {} and not report["ok"], report
        sglang.load_weights(model, sglang.request(store_root, version=2))  # v's rows keep step 1's weights
        report = sglang.check_installed(model)
        assert report["mismatched"] == {"qkv.weight": "64 of 192 elements differ"}, report  # filled in part


def test_a_collected_models_entries_go_with_it(store_root):
    """What a worker keeps per model (keyed by ``id(model)``) goes when the model is collected:
    a model made later may get the same id, and must not find the old one's source or step (it
    did: a fresh model's check named a store of an earlier test instead of asking for one)."""
    import gc

    with ParamStore(store_root) as store:
        store.commit(1, version(1)).result()
    model = FusedPolicy()
    sglang.load_weights(model, sglang.request(store_root, version=1))
    key = id(model)
    assert sglang.loaded_versions()[key] == 1 and key in sglang.last_fetches()
    del model
    gc.collect()
    assert key not in sglang.loaded_versions() and key not in sglang.last_fetches()


def test_the_check_refuses_what_it_cannot_compare_and_leaves_the_model_as_it_was(store_root):
    model = FusedPolicy()
    with pytest.raises(InvalidArgumentError, match="loaded no version"):
        sglang.check_installed(model)
    with pytest.raises(InvalidArgumentError, match="not min_step"):
        sglang.request(store_root, min_step=1, check=True)
    with ParamStore(store_root) as store:
        store.commit(1, version(1)).result()
        store.commit(2, version(2) | {"unknown.weight": torch.zeros(2)}).result()
        sglang.load_weights(model, sglang.request(store_root, version=1))
        ptrs = [p.data_ptr() for p in model.parameters()]
        with pytest.raises(KeyError):  # the model's loader refuses the version midway
            sglang.check_installed(model, step=2)
        assert [p.data_ptr() for p in model.parameters()] == ptrs  # its own tensors back
        assert engine_bytes(model) == expected_bytes(version(1)) and sglang.check_installed(model)["ok"]
        assert store.leases() == []
