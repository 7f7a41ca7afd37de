"""Regression tests for latent bugs: the retention thread losing a poke, a pulled version's object
index with an empty tensor, and one timer thread per retired peer buffer."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch

from helpers import random_tensor
from paramstore import ParamStore
from paramstore import retire
from paramstore.backends.registries.lmdb import _STEP
from paramstore.maintenance import Maintainer
from paramstore.retention import KeepLast


# -- Maintainer: a poke racing the loop is never lost, and only close() stops the thread ----------
def test_maintainer_survives_racing_pokes(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[str] = []
    monkeypatch.setattr(Maintainer, "_run", lambda self, tier: runs.append(tier))  # fast: races often
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the pokers and the loop finely
    m = Maintainer(None, {})  # type: ignore[arg-type] - _run is replaced: the root is never used
    try:
        # Bursts of pokes from 4 threads while the loop runs; before the fix the thread ended within
        # ~1 s (tens of bursts) when a poke landed between its wake-up and its taking the pokes.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            pokers = [threading.Thread(target=lambda: [m.poke() for _ in range(50)]) for _ in range(4)]
            for t in pokers:
                t.start()
            for t in pokers:
                t.join()
            assert m._thread.is_alive(), "the retention thread ended without close()"
            assert m.wait_idle(10), "the last poke never ran"
    finally:
        sys.setswitchinterval(switch)
    before = m.runs
    m.poke()  # after the storm, a poke still runs
    assert m.wait_idle(10) and m.runs == before + 1 and m._thread.is_alive()
    m.close()
    assert not m._thread.is_alive()


def test_maintainer_close_runs_what_was_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def run(self: Maintainer, tier: str) -> None:
        started.set()
        release.wait(10)
        runs.append(tier)

    monkeypatch.setattr(Maintainer, "_run", run)
    m = Maintainer(None, {})  # type: ignore[arg-type]
    m.poke()
    assert started.wait(10)
    m.poke()  # asked for during a run: runs before the thread stops
    closer = threading.Thread(target=m.close)
    closer.start()
    release.set()
    closer.join(10)
    assert not closer.is_alive() and runs == ["local", "local"] and m.runs == 2
    m.poke()  # after close: ignored, and nobody waits for it
    assert m.wait_idle(0) and m.runs == 2


# -- remote._index: an empty tensor shares its offset with the next one ---------------------------
def _object_tensors(store: ParamStore) -> dict[str, tuple[str, ...]]:
    """Every registered object's ObjectInfo.tensors, read from the LMDB registry."""
    reg = store._root.registry
    with reg.env.begin(db=reg._dbs["objects"]) as txn:
        return {bytes(k).hex(): tuple(bytes(v[i:i + 32]).hex() for i in range(_STEP.size, len(v), 32))
                for k, v in txn.cursor()}


def test_pull_indexes_an_empty_tensor_and_the_next_one(shm_dir: str, tmp_path) -> None:
    url = f"file://{tmp_path}/remote"
    sd = {"a.empty": torch.empty(0, dtype=torch.float32),
          "b.weight": random_tensor(torch.float32, (64,), 1),
          "c.bias": random_tensor(torch.float32, (8,), 2)}
    with ParamStore(os.path.join(shm_dir, "a"), remote=url) as a:
        a.commit(1, sd).persisted.result(timeout=30)
        committed = _object_tensors(a)
        man = a.manifest(1)
    empty, weight = man.tensors["a.empty"], man.tensors["b.weight"]
    assert empty.object == weight.object and empty.offset == weight.offset  # the case under test
    assert len(committed[empty.object]) == 3

    with ParamStore(os.path.join(shm_dir, "b"), remote=url) as b:
        b.pull(1)
        assert _object_tensors(b) == committed  # the same tensors, in file order
        assert b.verify(1)["ok"]
        objects = set(b._root.tier.list())
        b.commit(2, sd).result(timeout=30)  # deduplicates against the pulled object entirely
        assert set(b._root.tier.list()) == objects and b.manifest(2).objects() == man.objects()
        b.commit(3, {"other": random_tensor(torch.float32, (16,), 3)}).result(timeout=30)
        b.wait_persisted(timeout=30)  # a push holds a lease on its version
        assert b.prune(KeepLast(1)).removed == [1, 2]
        b.gc()  # drops the pulled object and every index entry into it
        assert empty.object not in set(b._root.tier.list())
        assert b._root.registry.locate_tensors([empty.digest, weight.digest]) == {}


# -- retire.retire: one thread per process, not one per retired buffer ------------------------------
class _FakeTransport:
    def __init__(self) -> None:
        self.unregistered: dict[int, float] = {}

    def unregister(self, addr: int) -> None:
        self.unregistered[addr] = time.monotonic()


def _retire_many(n: int, delay: float) -> tuple[_FakeTransport, dict[int, float], dict[int, float]]:
    transport, asked, closed = _FakeTransport(), {}, {}
    for addr in range(n):
        asked[addr] = time.monotonic()
        retire.retire(transport, addr, lambda addr=addr: closed.__setitem__(addr, time.monotonic()))  # type: ignore[arg-type]
    return transport, asked, closed


def _wait_all(closed: dict[int, float], n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(closed) < n:
        assert time.monotonic() < deadline, f"{n - len(closed)} retirements never ran"
        time.sleep(0.01)


def test_retire_uses_one_thread_and_keeps_the_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    delay, n = 0.3, 200
    monkeypatch.setattr(retire, "RETIRE_AFTER_S", delay)
    threads = threading.active_count()
    transport, asked, closed = _retire_many(n, delay)
    assert threading.active_count() <= threads + 1
    # nothing before its delay (on a loaded 2-core host the loop itself may take longer than the
    # delay, so the first retirements may already have run: each must have waited its delay)
    assert all(closed[a] >= asked[a] + delay for a in list(closed))
    _wait_all(closed, n, 10)
    for addr in range(n):
        assert asked[addr] + delay <= transport.unregistered[addr] <= closed[addr]
    transport, asked, closed = _retire_many(5, delay)  # later retirements: the same thread
    _wait_all(closed, 5, 10)
    assert threading.active_count() <= threads + 1
    assert all(closed[a] >= asked[a] + delay for a in range(5))


def test_retire_after_fork_uses_the_childs_own_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    delay = 0.2
    monkeypatch.setattr(retire, "RETIRE_AFTER_S", delay)
    _, _, closed = _retire_many(3, delay)  # the parent's thread is running (and its heap not empty)
    pid = os.fork()
    if pid == 0:  # the child: its own thread runs its own retirements, after the delay
        code = 1
        try:
            _, asked, mine = _retire_many(2, delay)
            _wait_all(mine, 2, 10)
            code = 0 if all(mine[a] >= asked[a] + delay for a in mine) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung retiring its buffers")
        time.sleep(0.01)
    assert done[1] == 0, "the forked child's retirements did not run after the delay"
    _wait_all(closed, 3, 10)
