"""Issue 24: what a new user hits silently. Each test here failed before its fix.

- A tensor changed in place while its commit copies it (no ``guard()``) fails that commit with
  TornCommitError on every rank, instead of publishing a version that mixes two steps.
- A trainer's own calls before its first commit (``wait_for_readers``, ``latest``) answer instead of
  raising a reader's "no store" error.
- Smaller edges: ``load_into`` of a plain dict, a ``~`` root, the verl hint.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import paramstore
from paramstore import ParamStore
from paramstore.errors import CommitGroupError, TornCommitError

from ranks import run_ranks

BIG = 1 << 26  # 256 MiB of fp32: a commit the stager is busy with for a while (fresh pages)


def _busy_then(store: ParamStore, step: int, model: dict[str, torch.Tensor]
               ) -> tuple[paramstore.CommitHandle, paramstore.CommitHandle]:
    """Commit ``step`` as a large tensor, then ``step + 1`` as ``model``: the second commit's copy
    starts only once the first is staged, so a change made right after ``commit()`` returns lands
    before its copy (the commits run in order on one stager thread)."""
    return store.commit(step, {"big": torch.zeros(BIG // 4)}), store.commit(step + 1, model)


def test_an_in_place_change_before_the_copy_fails_the_commit_and_publishes_nothing(store_root):
    w = {"w": torch.zeros(1024), "b": torch.zeros(16)}
    with ParamStore(store_root) as store:
        first, handle = _busy_then(store, 1, w)
        w["w"].add_(1.0)  # the trainer's next update, without guard() or handle.staged
        with pytest.raises(TornCommitError, match=r"step 2: 1 tensor changed in place .*'w'.*store.guard\(optimizer\)"):
            handle.result(timeout=120)
        assert handle.staged.exception() is not None  # staged fails too: the copy is not the caller's
        first.result(timeout=120)
        assert [v.step for v in store.versions()] == [1]  # nothing of step 2 was published
        # The failed step is not used up: committed again (now unchanged while copied), it is the new bytes.
        assert store.commit(2, w).result(timeout=60).step == 2
        with store.checkout(2) as snap:
            assert torch.equal(snap["w"], torch.ones(1024))


def test_changes_after_the_copy_and_guarded_optimizer_steps_are_not_flagged(store_root):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ParamStore(store_root) as store:
        h = store.commit(1, model)
        h.staged.result(timeout=60)  # waited for: changing the weights now is fine
        with torch.no_grad():
            model.weight.add_(1.0)
        assert h.result(timeout=60).step == 1
        store.guard(opt)
        for step in range(2, 8):  # optimizer.step() right after each commit: the guard holds it
            model(torch.ones(1, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            store.commit(step, model)
        assert store.flush(timeout=60).step == 7
        with store.checkout(7) as snap:
            assert torch.equal(snap["weight"], model.weight.detach())


def test_the_watch_orders_device_changes_by_the_fence():
    """The rule for accelerator tensors (whose copies run on the device after ``commit()``
    returns), on CPU tensors standing in for them: a change made before the copies ran, or before
    the caller fenced the commit, tears it; one made after the fence (its kernels wait for the
    copies on the device) does not."""
    from paramstore.commit import _Watch
    from paramstore.format import TensorSpec
    from paramstore.tensors import Collected

    def watch(t: torch.Tensor) -> _Watch:
        w = _Watch(Collected([TensorSpec("w", "F32", (4,))], [t], {}))
        w._device = {"w": t}  # as if t lived on a device
        return w

    t = torch.zeros(4)
    fenced = watch(t)
    fenced.fence()
    t.add_(1)  # the optimizer step, queued after the fence
    fenced.synchronized()
    fenced.check(1)  # not torn

    t = torch.zeros(4)
    early = watch(t)
    t.add_(1)  # before the fence: not ordered after the copies
    early.fence()
    early.synchronized()
    with pytest.raises(TornCommitError):
        early.check(1)

    t = torch.zeros(4)
    unfenced = watch(t)
    t.add_(1)
    unfenced.synchronized()
    with pytest.raises(TornCommitError):
        unfenced.check(1)
    assert unfenced._device == {}  # the references to the caller's tensors are dropped


def _torn_sharded(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    busy = {"big": distribute_tensor(torch.zeros(world, BIG // 4 // world), mesh, [Shard(0)])}
    small = {"w": distribute_tensor(torch.zeros(world, 256), mesh, [Shard(0)])}
    store = ParamStore(root)
    try:
        first = store.commit(1, busy)
        second = store.commit(2, small)
        if rank == 1:
            small["w"].to_local().add_(1.0)  # one rank changes its block before its copy
        first.result(timeout=120)
        try:
            second.result(timeout=120)
        except CommitGroupError as e:
            return {"error": str(e), "steps": [v.step for v in store.versions()]}
        return {"error": None}
    finally:
        store.close()


@pytest.mark.slow
def test_a_sharded_commit_torn_on_one_rank_fails_on_every_rank(store_root):
    got = run_ranks(2, _torn_sharded, store_root, timeout=180)
    for rank in (0, 1):
        assert got[rank]["error"] is not None, got
        assert "TornCommitError" in got[rank]["error"] and "changed in place" in got[rank]["error"], got[rank]
        assert got[rank]["steps"] == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_an_unguarded_change_tears_and_a_guarded_one_does_not(store_root):
    dev = torch.device("cuda", 0)
    w = torch.nn.Parameter(torch.zeros(1 << 24, device=dev))
    opt = torch.optim.SGD([w], lr=1.0)
    with ParamStore(store_root, create=True) as store:
        torch.cuda._sleep(50_000_000)  # the copy is queued behind this
        handle = store.commit(1, {"w": w.detach()})
        with torch.no_grad():
            w.add_(1.0)  # queued on the caller's stream, not ordered after the copy
        with pytest.raises(TornCommitError):
            handle.result(timeout=120)
        store.guard(opt)
        for step in (1, 2):
            handle = store.commit(step, {"w": w.detach()})
            w.grad = torch.ones_like(w)
            opt.step()  # the guard fences the commit first
            handle.result(timeout=120)


# -- 4. a trainer's own calls before its first commit ------------------------------------------
def test_a_trainers_calls_before_its_first_commit_answer_and_create_nothing(shm_dir):
    root = os.path.join(shm_dir, "run")
    store = ParamStore(root)  # a trainer's start: nothing committed yet
    try:
        assert store.latest() is None  # resume logic: start from scratch
        store.wait_for_readers(1, timeout=0.1)  # "before step t": nobody can hold anything yet
        assert store.leases() == [] and store.oldest_leased_step() is None
        assert not os.path.exists(root)  # none of it created the store
        with pytest.raises(paramstore.NotAStoreError):  # a reader's read still refuses a wrong path
            store.checkout("latest")
        assert store.commit(1, {"w": torch.ones(3)}).result(timeout=60).step == 1
        assert store.latest().step == 1
    finally:
        store.close()


# -- 7. smaller edges --------------------------------------------------------------------------
def test_load_into_a_mapping_writes_in_place_and_other_things_are_refused(store):
    store.commit(1, {"a": torch.arange(4.0), "b": torch.ones(2, 2)}).result(timeout=60)
    dest = {"a": torch.zeros(4), "b": torch.zeros(2, 2)}
    with store.checkout(1) as snap:
        result = snap.load_into(dest)
        assert result.missing_keys == [] and result.unexpected_keys == []
        assert torch.equal(dest["a"], torch.arange(4.0)) and torch.equal(dest["b"], torch.ones(2, 2))
        with pytest.raises(paramstore.InvalidArgumentError, match="torch.nn.Module or a mapping"):
            snap.load_into([torch.zeros(4)])


def test_a_root_under_home_is_expanded(shm_dir, monkeypatch):
    monkeypatch.setenv("HOME", shm_dir)
    monkeypatch.chdir(shm_dir)
    with ParamStore("~/run") as store:
        assert store.root == os.path.join(shm_dir, "run")
        store.commit(1, {"w": torch.ones(1)}).result(timeout=60)
    assert os.path.isdir(os.path.join(shm_dir, "run")) and not os.path.exists(os.path.join(shm_dir, "~"))


def test_the_verl_integration_without_verl_says_how_to_install_it():
    import importlib.util

    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed here")
    out = subprocess.run([sys.executable, "-c", "import paramstore.integrations.verl"], capture_output=True, text=True)
    assert out.returncode != 0 and "pip install 'paramstore[verl]'" in out.stderr
