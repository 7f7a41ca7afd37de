"""Real separate processes: one trainer and several readers at once, and commits killed with SIGKILL.

Every version's contents are a pure function of its step (:func:`state_for`), so a reader or the
test can check any version bit for bit without talking to the writer. Children are started with
the ``spawn`` method (a fresh interpreter; pytest's ``tests/`` path is passed on).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
import traceback

import pytest
import torch

import paramstore
from paramstore import ParamStore

from helpers import gather_and_join

SPAWN = mp.get_context("spawn")
NUM_TENSORS = 20
TRAINER_STEPS = 50
_DTYPES = [torch.float32, torch.bfloat16, torch.int32, torch.uint8, torch.float16]


def state_for(step: int) -> dict[str, torch.Tensor]:
    """The model committed at ``step``: 20 tensors of 1-4 KiB, mixed dtypes.

    Every fifth tensor never changes (so commits deduplicate part of each version); the others'
    bits are random, seeded by (step, index): NaNs and other odd patterns included.
    """
    out = {}
    for i in range(NUM_TENSORS):
        dtype = _DTYPES[i % len(_DTYPES)]
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = (1024 + 256 * (i % 4)) // itemsize
        seed = 1_000_003 * i + (0 if i % 5 == 0 else step)
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
        t = raw.view(dtype)
        out[f"layer{i:02d}.{'weight' if i % 2 else 'bias'}"] = t.reshape(-1, 4) if n % 4 == 0 else t
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


def check_version(store: ParamStore, step: int) -> None:
    """Raise AssertionError unless version ``step`` is complete and bit-exact."""
    want = state_for(step)
    man = store._root.registry.get_manifest(step)
    for obj in man.objects():
        assert store._root.tier.exists(obj), f"step {step}: object {obj} missing"
    with store.checkout(step) as snap:
        assert snap.digest == man.digest(), f"step {step}: digest"
        assert sorted(snap) == sorted(want), f"step {step}: names"
        for name, t in want.items():
            assert _same_bits(snap[name], t), f"step {step}: {name} differs"


# -- children (module level: spawn imports them by name) ---------------------------------------
def trainer_main(root: str, steps: int) -> None:
    with ParamStore(root, create=False) as store:
        for step in range(1, steps + 1):
            store.commit(step, state_for(step), metrics={"step": step})
            time.sleep(0.01)  # a trainer does other work between commits
        store.flush()


def reader_main(root: str, steps: int, results) -> None:
    seen: list[int] = []
    try:
        with ParamStore(root, create=False) as store:
            for v in store.subscribe(min_step=0, timeout=60):
                assert not seen or v.step > seen[-1], f"out of order: {v.step} after {seen[-1]}"
                check_version(store, v.step)
                assert v.metrics == {"step": float(v.step)}
                seen.append(v.step)
                if v.step == steps:
                    break
        results.put((os.getpid(), seen, None))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((os.getpid(), seen, traceback.format_exc()))
        raise


def committer_main(root: str, go) -> None:
    """Once ``go`` is set, commit versions latest+1, latest+2, ... until killed; at most two in flight."""
    go.wait()
    store = ParamStore(root, create=False, shard_size_bytes=8192)
    step = (store.latest().step if store.latest() else 0) + 1
    handles = []
    while True:
        handles.append(store.commit(step, state_for(step), tags=["newest"] if step % 3 == 0 else ()))
        if len(handles) > 2:
            handles.pop(0).result()
        step += 1


# -- tests -------------------------------------------------------------------------------------
def test_one_trainer_three_readers(store_root):
    ParamStore(store_root, create=True).close()
    results = SPAWN.Queue()
    readers = [SPAWN.Process(target=reader_main, args=(store_root, TRAINER_STEPS, results)) for _ in range(3)]
    for r in readers:
        r.start()
    trainer = SPAWN.Process(target=trainer_main, args=(store_root, TRAINER_STEPS))
    trainer.start()
    procs = [trainer, *readers]
    reports = gather_and_join(procs, lambda: [results.get(timeout=120) for _ in readers])
    for pid, seen, err in reports:
        assert err is None, f"reader {pid} failed:\n{err}"
        assert len(seen) > 0
        assert seen == sorted(set(seen)), f"reader {pid} saw versions out of order: {seen}"
        assert seen[-1] == TRAINER_STEPS
        assert seen == list(range(1, TRAINER_STEPS + 1))  # after=-1: every version
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    with ParamStore(store_root, create=False) as store:
        assert [v.step for v in store.versions()] == list(range(1, TRAINER_STEPS + 1))


def _verify_whole_store(root: str) -> int:
    """Reopen the store; check every version bit-exactly and every object's name. Returns the latest step."""
    from paramstore.format import object_digest, parse_header, tensor_digest

    with ParamStore(root, create=False) as store:
        reg, tier = store._root.registry, store._root.tier
        versions = store.versions()
        steps = [v.step for v in versions]
        assert steps == list(range(1, len(steps) + 1))  # in order, and no commit lost in the middle
        for v in versions:
            check_version(store, v.step)
            assert v.num_tensors == NUM_TENSORS
        # every registered object is complete: its bytes hash to its name
        for obj, size in reg.objects().items():
            with open(tier.object_path(obj), "rb") as f:
                data = f.read()
            assert len(data) == size, obj
            start, entries = parse_header(data)
            spans = sorted(tuple(e["data_offsets"]) for e in entries.values())
            assert object_digest(data[:start], [tensor_digest(data[start + b : start + e]) for b, e in spans]) == obj
        # tags point at existing versions
        for tag, step in reg.tags().items():
            assert step in steps, tag
        return steps[-1] if steps else 0


@pytest.mark.slow
def test_commits_survive_sigkill_at_random_moments(store_root):
    rounds = 5
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    ParamStore(store_root, create=True).close()
    # All children start (and import torch) at once; each waits for its round's signal.
    gos = [SPAWN.Event() for _ in range(rounds)]
    children = [SPAWN.Process(target=committer_main, args=(store_root, go)) for go in gos]
    for child in children:
        child.start()
    latest = 0
    history = []
    try:
        for round_, (child, go) in enumerate(zip(children, gos)):
            start = latest + 1
            go.set()
            with ParamStore(store_root, create=False) as watcher:  # wait until the loop is committing
                watcher.wait_for(start, timeout=120)
            delay = rng.uniform(0.05, 0.5)
            time.sleep(delay)
            os.kill(child.pid, signal.SIGKILL)
            child.join(timeout=30)
            where = f"(seed {seed}, round {round_}, killed after {delay:.3f} s)"
            assert child.exitcode == -signal.SIGKILL, where

            new_latest = _verify_whole_store(store_root)
            assert new_latest >= start, where
            history.append((round(delay, 3), new_latest - latest))
            # the store still takes commits, from another process, at the next step
            with ParamStore(store_root, create=False) as store:
                with pytest.raises(paramstore.StepOrderError):
                    store.commit(new_latest, state_for(new_latest))
                v = store.commit(new_latest + 1, state_for(new_latest + 1)).result(timeout=60)
                assert v.step == new_latest + 1, where
                check_version(store, v.step)
            latest = new_latest + 1
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
            child.join()
    assert _verify_whole_store(store_root) == latest
    assert sum(n for _, n in history) >= rounds, history
