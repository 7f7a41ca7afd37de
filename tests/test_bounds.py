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

from paramstore import ParamStore
from paramstore.errors import CommitGroupError
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


# -- collective messages and buckets ---------------------------------------------------------
HUGE = 512 << 20  # announced, never sent: under the transport's absolute cap of 1 GiB


def _victim_or_liar(rank: int, world: int, base: str, lie: str) -> dict:
    """Rank 0 sends version 1 (a real collective checkout); rank 1 speaks the protocol by hand
    through the real group and lies: announces a huge status message, or offers a huge bucket."""
    import json
    import resource

    from paramstore.backends.transports.collective import FRAME_BYTES, TorchCollective
    from paramstore.collective import broadcast_version
    from paramstore.errors import BroadcastError

    coll = TorchCollective(timeout=20)
    if rank == 1:
        if lie == "bucket":  # the source: offers its real version with a bucket of 1 TiB
            store = ParamStore(f"{base}/liar", create=True)
            store.commit(1, {"w": torch.ones(1000)}).result(30)
            from paramstore.collective import _Broadcast

            try:  # past broadcast_version's own argument check: a source that lies
                _Broadcast(store._root, store._pool, coll, 1, 1 << 40).run(1, store._read.resolve, time.monotonic())
            except BroadcastError as e:
                return {"raised": str(e)}
            return {"raised": None}
        from paramstore.collective import PROTOCOL

        coll.all_gather_bytes(json.dumps({"protocol": PROTOCOL, "src": 0}, separators=(",", ":"),
                                         sort_keys=True).encode())
        coll.broadcast_bytes(None, 0)  # the offer
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        frame[:8] = torch.frombuffer(bytearray(HUGE.to_bytes(8, "little")), dtype=torch.uint8)
        frames = [torch.empty(FRAME_BYTES, dtype=torch.uint8) for _ in range(world)]
        coll._all_gather(frames, frame)  # the status round's first frame: "my message is 512 MiB"
        time.sleep(3)
        return {}
    store = ParamStore(f"{base}/victim", create=True)
    if lie == "status":
        store.commit(1, {"w": torch.ones(1000)}).result(30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    t0 = time.monotonic()
    try:
        src = 0 if lie == "status" else 1
        broadcast_version(store._root, store._pool, coll, src, 1, resolve=store._read.resolve)
        raised = None
    except BroadcastError as e:
        raised = str(e)
    return {"raised": raised, "grew": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before,
            "seconds": time.monotonic() - t0, "tmp": os.listdir(store._root.tier.tmp_dir)}


def test_a_member_announcing_a_huge_message_makes_nobody_allocate_it(shm_dir):
    from test_collective import run_members

    got, _ = run_members(2, _victim_or_liar, shm_dir, "status", timeout=60)
    victim = got[0]
    assert victim["raised"] and f"announced a message of {HUGE} bytes" in victim["raised"], victim
    assert victim["grew"] < 64 << 20, victim  # not 512 MiB (nor 2 x 512 MiB)


def test_a_source_offering_a_huge_bucket_is_refused(shm_dir):
    from test_collective import run_members

    got, _ = run_members(2, _victim_or_liar, shm_dir, "bucket", timeout=60)
    victim = got[0]
    assert victim["raised"] and "bucket" in victim["raised"] and "1099511627776" in victim["raised"], victim
    assert victim["grew"] < 64 << 20, victim  # no 1 TiB (nor min(1 TiB, stream)) bounce buffers
    assert got[1]["raised"], got[1]  # every member fails alike


# -- a sharded commit's parts ----------------------------------------------------------------
def _lying_rank(rank: int, world: int, root: str) -> dict:
    """Two ranks commit steps 1-3 together; rank 1 lies in its part of steps 1 and 2 (sent through
    the real commit group): a chunk's length, then the size of the objects it stored."""
    import paramstore.commit as commit_mod
    from paramstore.sharded import encode
    from ranks import sharded_model

    lies = {1: "nbytes", 2: "object size"}

    def lying_encode(obj):
        lie = lies.get(obj.get("step")) if isinstance(obj, dict) and "blocks" in obj else None
        if lie == "nbytes":
            chunk = next(iter(obj["blocks"].values()))[0]
            chunk["nbytes"] *= 2
        elif lie == "object size":
            for info in obj["objects"].values():
                info[0] = 64
        return encode(obj)

    if rank == 1:
        commit_mod.encode = lying_encode
    out = {}
    with ParamStore(root) as store:
        for step in (1, 2, 3):
            try:
                store.commit(step, sharded_model(world, step)).result(timeout=60)
                out[step] = "published"
            except CommitGroupError as e:
                out[step] = str(e)
        out["versions"] = [v.step for v in store.versions()]
    return out


def test_a_sharded_commit_refuses_parts_that_lie(shm_dir):
    from ranks import run_ranks

    got = run_ranks(2, _lying_rank, os.path.join(shm_dir, "store"))
    for rank in (0, 1):
        r = got[rank]
        assert "do not make a valid version" in r[1] and "says" in r[1], r[1]  # a chunk's length
        assert "do not make a valid version" in r[2] and "does not lie in object" in r[2], r[2]
        assert r[3] == "published" and r["versions"] == [3], r


@pytest.mark.parametrize("outcome", [{"version": 3, "tags": []}, {"version": {}, "tags": [1]}, {"tags": None},
                                     {"version": {"step": "x"}, "tags": []}, {}])
def test_a_malformed_outcome_from_the_lead_is_a_group_error(outcome):
    """What a sharded commit's lead broadcasts is checked like any message from another member."""
    from paramstore.commit import _outcome_version

    with pytest.raises(CommitGroupError, match="outcome of a sharded commit is malformed"):
        _outcome_version(outcome, None)
