"""Sizes and waits nobody bounded (issue 25, item 9), each against real parts.

* ``await_patches`` must not wait its full timeout on every checkout when the writer that makes
  patches is gone: a real writer process that exits (or is killed) after committing, its record
  left in the registry.
* A collective member that announces a huge message (a real process in a real gloo group sending
  a crafted frame) must not make the others allocate it.
* The source's ``bucket_bytes`` is bounded on the receivers.
* A sharded commit's lead checks every part it merges (a real rank sends a crafted part through
  the real commit group).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from paramstore import CommitGroupError, ParamStore
from paramstore.delta import await_patches

SPAWN = mp.get_context("spawn")


# -- await_patches ---------------------------------------------------------------------------
def _commit_then_die(root: str, how: str) -> None:
    """A trainer that makes patches: commits steps 1 and 2, then stops before step 2's patches."""
    store = ParamStore(root, create=True, run_id="trainer-1", patches=False)
    for step in (1, 2):
        store.commit(step, {"w": torch.full((256,), float(step))}).result(30)
    reg = store._root.registry
    reg.swap_meta("patches", reg.get_meta("patches"), "trainer-1")  # as its Patcher records it
    if how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    store.close()  # a clean exit releases the writer record


@pytest.mark.parametrize("how", ["killed", "closed"])
def test_await_patches_does_not_wait_for_a_writer_that_is_gone(store_root, how):
    p = SPAWN.Process(target=_commit_then_die, args=(store_root, how))
    p.start()
    p.join(60)
    assert p.exitcode == (-signal.SIGKILL if how == "killed" else 0)
    with ParamStore(store_root) as reader:
        for _ in range(3):  # every checkout: not 3 s each
            t0 = time.monotonic()
            assert not await_patches(reader._root, 2, 3.0)
            assert time.monotonic() - t0 < 1.0


def test_await_patches_waits_once_for_a_writer_it_cannot_check(store_root):
    """A writer on another host cannot be checked: one wait runs out; later ones do not wait."""
    p = SPAWN.Process(target=_commit_then_die, args=(store_root, "killed"))
    p.start()
    p.join(60)
    with ParamStore(store_root) as reader:
        reg = reader._root.registry
        raw = reg.get_meta("writer")
        assert reg.swap_meta("writer", raw, raw.replace('"host": "', '"host": "elsewhere-')) != raw
        t0 = time.monotonic()
        assert not await_patches(reader._root, 2, 1.0)
        assert time.monotonic() - t0 >= 1.0
        t0 = time.monotonic()
        assert not await_patches(reader._root, 2, 3.0)
        assert time.monotonic() - t0 < 0.5
