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
    b"[" * 100_000,
    b"\xff\xfe",
    b" " * (128 << 10),
])
def test_malformed_requests_are_refused(body):
    with pytest.raises(InvalidArgumentError):
        sglang.load_weights(Policy(), _raw(body))


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
