"""store.prefetch: a version's objects come to this host ahead of the checkout, which then moves nothing.

Across hosts through peers: tests/test_peers.py::test_a_rollout_prefetches_the_next_version_and_its_checkout_moves_nothing.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from paramstore import InvalidArgumentError, ParamStore
from paramstore.errors import StoreClosedError


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(256, 256, generator=g) for i in range(4)}


def test_a_prefetch_from_the_remote_leaves_the_checkout_nothing_to_move(shm_dir, tmp_path):
    url = f"file://{tmp_path}/bucket"
    opts = {"remote": url, "storage_options": {"auto_mkdir": True}}
    with ParamStore(os.path.join(shm_dir, "trainer"), **opts) as trainer:
        trainer.commit(1, weights(1)).persisted.result(60)
    with ParamStore(os.path.join(shm_dir, "rollout"), **opts) as rollout:
        version = rollout.prefetch(1).result(60)
        assert version.step == 1 and rollout._root.tier.sizes(rollout.manifest(1).objects())
        assert rollout.leases() == []  # a done prefetch holds nothing
        with rollout.checkout(1) as snap:
            assert not snap.fetch.moved and snap.fetch.bytes == 0
            assert all(torch.equal(snap[k], v) for k, v in weights(1).items())


def test_prefetches_wait_for_a_version_and_end_when_the_store_closes(shm_dir):
    root = os.path.join(shm_dir, "s")
    store = ParamStore(root)
    store.commit(1, weights(1)).result()
    later = store.prefetch(min_step=2, timeout=60)
    never = store.prefetch(min_step=99)  # no timeout: only close() ends it
    time.sleep(0.2)
    assert not later.done()
    store.commit(2, weights(2)).result()
    assert later.result(30).step == 2
    t0 = time.monotonic()
    store.close()
    with pytest.raises(StoreClosedError):
        never.result(0)
    assert time.monotonic() - t0 < 5


def test_bad_prefetch_arguments_are_refused_at_once(shm_dir):
    with ParamStore(os.path.join(shm_dir, "s")) as store:
        store.commit(1, weights(1)).result()
        with pytest.raises(InvalidArgumentError):
            store.prefetch(1, min_step=1)
        with pytest.raises(InvalidArgumentError):
            store.prefetch(min_step=2, timeout=-1)
        with pytest.raises(Exception) as e:
            store.prefetch(7).result(10)
        assert "7" in str(e.value)


def test_a_prefetch_still_waiting_does_not_hold_the_process_at_exit(shm_dir):
    """A script that asks for a version that never comes and exits without close(): the prefetch
    thread does not keep the interpreter alive (the store's exit hook closes it)."""
    import subprocess
    import sys

    code = ("import sys, torch; from paramstore import ParamStore; s = ParamStore(sys.argv[1]); "
            "s.commit(1, {'w': torch.ones(2)}).result(); f = s.prefetch(min_step=5); print('asked', flush=True)")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code, os.path.join(shm_dir, "s")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "asked" in done.stdout, done.stderr
    assert time.monotonic() - t0 < 30
