"""A DTensor on a one-rank mesh is its own single block: stored whole, like a plain tensor, with no
gather and the same digest (single-process gloo group). Several ranks: tests/test_sharded_commit.py."""

from __future__ import annotations

import torch

import paramstore


def test_a_dtensor_of_one_rank_is_stored_whole_like_a_plain_tensor(gloo_group, store_root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.randn(8, 4)
    with paramstore.ParamStore(store_root) as store:
        v1 = store.commit(1, {"sharded": distribute_tensor(full, mesh, [Shard(0)]), "plain": torch.ones(3)}).result()
        v2 = store.commit(2, {"sharded": full.clone(), "plain": torch.ones(3)}).result()
        assert v1.digest == v2.digest
        assert not store.manifest(1).chunked
        with store.checkout(1) as snap:
            assert type(snap["sharded"]) is torch.Tensor
            assert torch.equal(snap["sharded"], full)
