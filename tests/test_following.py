"""Following a commit in progress from the same host (``store.follow_commit``, :mod:`paramstore.following`).

The writer runs in a child process (a real second process, as a trainer and a rollout are) or on a
thread of this one; the reader gets every tensor of the version bit for bit, the ones staged
before the version is visible from the trainer's own shared memory, and a failed commit raises.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import assert_state_equal, bits_equal, random_tensor

import paramstore
from paramstore.errors import VersionNotFoundError, WaitTimeoutError
from paramstore.following import SEAL_WAIT_S

HERE = os.path.dirname(os.path.abspath(__file__))

#: The child: commits step 1 whole, then step 2 as a stream of SLOW-second steps (raising after
#: FAIL_AT tensors when FAIL_AT >= 0), and prints "done" or the error.
CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[4])
import paramstore
from helpers import random_tensor
from test_following import weights
root, slow, fail_at = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
store = paramstore.ParamStore(root, create=True)
store.commit(1, weights(1)).result()
print("step 1", flush=True)
def stream():
    for i, item in enumerate(weights(2).items()):
        if i == fail_at:
            raise RuntimeError("the trainer's gather failed")
        time.sleep(slow)
        yield item
try:
    store.commit(2, stream()).result()
    print("done", flush=True)
except Exception as e:
    print(f"failed: {e}", flush=True)
store.close()
"""


def weights(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    return {f"layers.{i}.weight": random_tensor(dtypes[i % len(dtypes)], (64, 16 + i), seed * 100 + i)
            for i in range(n)}


def _writer(root: str, *, slow: float, fail_at: int = -1) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", CHILD, root, str(slow), str(fail_at), HERE],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "step 1"
    return child


def _journals(root: str) -> list[str]:
    return [n for n in os.listdir(os.path.join(root, "tmp")) if n.startswith("journal-")]


def test_follows_a_streaming_commit_of_another_process(shm_dir):
    root = os.path.join(shm_dir, "store")
    child = _writer(root, slow=0.1)
    with paramstore.ParamStore(root) as store:
        with store.follow_commit(2, timeout=60, holder="follower") as followed:
            got, visible_at = {}, []
            for name, tensor in followed:
                got[name] = tensor.clone()
                visible_at.append(store.latest().step)
            assert followed.version.step == 2 and followed.snapshot is not None
            assert [lease.holder for lease in store.leases()] == ["follower"]
        assert child.wait(60) == 0 and child.stdout.read().strip() == "done"
        assert_state_equal(got, weights(2))
        # Every tensor came from the trainer's staging, the first ones while the version was not visible yet.
        assert followed.early == len(got) == 6 and followed.served == list(weights(2))
        assert visible_at[0] == 1
        assert store.leases() == [] and _journals(root) == []


def test_a_failed_commit_raises_and_says_what_was_served(shm_dir):
    root = os.path.join(shm_dir, "store")
    child = _writer(root, slow=0.05, fail_at=3)
    with paramstore.ParamStore(root) as store:
        followed = store.follow_commit(2, timeout=60)
        got = {}
        with pytest.raises(VersionNotFoundError, match="commit failed .*the trainer's gather failed"):
            for name, tensor in followed:
                got[name] = tensor.clone()
        assert child.wait(60) == 0 and child.stdout.read().startswith("failed")
        # What the caller installed before the failure (up to the 3 tensors staged; one that came
        # with the failure is not served): it may restore those names from step 1.
        assert 1 <= len(followed.served) <= 3 and followed.version is None
        assert followed.served == list(got) == list(weights(2))[:len(got)]
        assert_state_equal(got, {n: weights(2)[n] for n in followed.served})
        assert store.latest().step == 1 and _journals(root) == []


def test_the_commit_waits_for_a_reader_before_changing_what_it_reads(shm_dir, store):
    """Step 2 repeats step 1's tensors: its slabs are deduplicated away (handed back to the pool for
    the next commit), which the publisher does only once the reader is off the tensor it holds;
    the rest of the version then comes from the published version."""
    w = weights(1)
    store.commit(1, iter(w.items())).result()

    def slow():
        for item in w.items():
            time.sleep(0.05)
            yield item

    handle = {}
    trainer = threading.Thread(target=lambda: handle.setdefault("h", store.commit(2, slow())))
    trainer.start()
    followed = store.follow_commit(2, timeout=60)
    it = iter(followed)
    name, held = next(it)  # staged, announced: the reader holds it (as an engine copying it would)
    before = held.clone()
    trainer.join()
    time.sleep(0.5)  # staged, hashed: the publisher now waits to hand the deduplicated slab back
    assert not handle["h"].done()
    assert bits_equal(held, before)
    got = {name: before, **{n: t.clone() for n, t in it}}
    assert handle["h"].result(timeout=60).step == 2 and followed.version.step == 2
    assert_state_equal(got, w)
    assert 1 <= followed.early < len(w)  # after the seal the tensors came from the version
    followed.close()
    assert SEAL_WAIT_S >= 10  # a reader gets a while to take the next tensor


def test_a_commit_that_keeps_no_journal_is_read_from_its_version(shm_dir, store):
    """A state dict (not a stream) is staged on the committer's thread: nothing to follow; the
    version is read once published. Waiting for a step nobody commits times out."""
    w = weights(3)
    threading.Timer(0.2, lambda: store.commit(1, w)).start()
    with store.follow_commit(1, timeout=60) as followed:
        got = {n: t.clone() for n, t in followed}
    assert_state_equal(got, w)
    assert followed.early == 0 and followed.version.step == 1
    with pytest.raises(WaitTimeoutError, match="step 2 was neither committed nor being committed"):
        list(store.follow_commit(2, timeout=0.2))


def test_gc_deletes_the_journal_of_a_writer_that_died(shm_dir, store):
    store.commit(1, weights(1)).result()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = os.path.join(store.root, "tmp", f"journal-{int(dead.stdout)}-1-7")
    open(stale, "w").close()
    report = store.gc()
    assert os.path.basename(stale) in report.temporary_files and not os.path.exists(stale)


def test_async_iteration_leaves_the_event_loop_running(shm_dir, store):
    """``async for`` waits with asyncio.sleep: a ticker on the same loop keeps running while the
    trainer stages slowly."""
    import asyncio

    w = weights(4)

    def slow():
        for item in w.items():
            time.sleep(0.05)
            yield item
        time.sleep(0.05)  # the last tensor stays staged a while: the follower is never raced by the publish

    trainer = threading.Thread(target=lambda: store.commit(1, slow()).result())

    async def follow():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        trainer.start()
        with store.follow_commit(1, timeout=60) as followed:
            got = {n: t.clone() async for n, t in followed}
        tick.cancel()
        return got, followed, ticks

    got, followed, ticks = asyncio.run(follow())
    trainer.join()
    assert_state_equal(got, w)
    assert followed.early == len(w) and ticks >= 10  # ~0.3 s of staging: the loop ran throughout
