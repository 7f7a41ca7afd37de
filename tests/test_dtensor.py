"""A DTensor is gathered with full_tensor() and a one-time warning (single-process gloo group)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import paramstore
import paramstore.tensors


@pytest.fixture
def gloo_group(tmp_path):
    if not dist.is_available():
        pytest.skip("torch built without distributed")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_gathered_with_one_warning(gloo_group, store_root, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    monkeypatch.setattr(paramstore.tensors, "_dtensor_warned", False)
    mesh = init_device_mesh("cpu", (1,))
    full = torch.randn(8, 4)
    sd = {"sharded": distribute_tensor(full, mesh, [Shard(0)]), "plain": torch.ones(3)}
    with paramstore.ParamStore(store_root) as store:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store.commit(1, sd).result()
            store.commit(2, sd).result()
        dtensor_warnings = [w for w in caught if "DTensor" in str(w.message)]
        assert len(dtensor_warnings) == 1
        with store.checkout(2) as snap:
            assert type(snap["sharded"]) is torch.Tensor
            assert torch.equal(snap["sharded"], full)
