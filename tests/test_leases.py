"""Leases and the staleness contract, with real reader and trainer processes.

A checkout holds a lease on its version until the snapshot is closed, garbage collected, or its
process dies; a leased version is never pruned and its objects are never collected.
``wait_for_readers`` and ``checkout(min_step=)`` are measured against real processes: a helper
process started with ``spawn`` takes commands over a pipe (open a store, check out, close after a
delay, commit after a delay) and answers with ``time.monotonic()`` stamps (CLOCK_MONOTONIC is
system-wide on Linux, so stamps compare across processes). Every version's contents are a pure
function of its step (:func:`state_for`), so any process can check any version bit for bit.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import pytest
import torch

from helpers import assert_bits_equal, assert_checkout_equal, random_tensor

import paramstore
from paramstore import InvalidArgumentError, ParamStore, WaitTimeoutError
from paramstore.errors import TagNotFoundError
from paramstore.retention import KeepLast

SPAWN = mp.get_context("spawn")


def state_for(step: int) -> dict[str, torch.Tensor]:
    """The model committed at ``step``: three small tensors, every one different at every step."""
    return {
        "w": random_tensor(torch.bfloat16, (32, 16), seed=3 * step),
        "b": random_tensor(torch.int32, (100,), seed=3 * step + 1),
        "x": random_tensor(torch.float32, (7, 9), seed=3 * step + 2),
    }


def matches(snap, step: int) -> bool:
    want = state_for(step)
    return sorted(snap) == sorted(want) and all(
        snap[n].dtype == t.dtype and snap[n].shape == t.shape
        and torch.equal(snap[n].contiguous().view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8))
        for n, t in want.items())


def assert_version(store: ParamStore, step: int) -> None:
    assert_checkout_equal(store, step, state_for(step))


def commit_steps(store: ParamStore, steps) -> None:
    for s in steps:
        store.commit(s, state_for(s)).result(timeout=60)


def objects_of(store: ParamStore, step: int) -> set[str]:
    return set(store._root.registry.get_manifest(step).objects())


# -- the helper process -------------------------------------------------------------------------
def helper_main(conn) -> None:
    """Serve commands from the test until "exit" (or until killed)."""
    stores: dict[str, ParamStore] = {}
    snaps: dict[int, object] = {}

    def store(root: str) -> ParamStore:
        if root not in stores:
            stores[root] = ParamStore(root, create=False, takeover=True)  # commits as a second trainer
        return stores[root]

    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "exit":
                conn.send(("ok", None))
                return
            if cmd == "checkout":  # root, spec, holder -> (key, step, pid, bits ok)
                root, spec, holder = args
                snap = store(root).checkout(spec, holder=holder)
                key = len(snaps) + 1
                while key in snaps:
                    key += 1
                snaps[key] = snap
                result = (key, snap.step, os.getpid(), matches(snap, snap.step))
            elif cmd == "close":  # key, delay -> (t before close, t after close)
                key, delay = args
                time.sleep(delay)
                snap = snaps.pop(key)
                t0 = time.monotonic()
                snap.close()
                result = (t0, time.monotonic())
            elif cmd == "commit":  # root, step, delay -> (t before commit, t when visible)
                root, step, delay = args
                st = store(root)
                time.sleep(delay)
                t0 = time.monotonic()
                st.commit(step, state_for(step)).result(timeout=60)
                result = (t0, time.monotonic())
            elif cmd == "reset":  # close every snapshot and store
                for snap in snaps.values():
                    snap.close()
                snaps.clear()
                for st in stores.values():
                    st.close()
                stores.clear()
                result = None
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - reported to the test
            conn.send(("err", traceback.format_exc()))


class Helper:
    """A spawned helper process and its command pipe."""

    def __init__(self) -> None:
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=helper_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, *msg) -> None:
        self.conn.send(msg)

    def recv(self, timeout: float = 60):
        if not self.conn.poll(timeout):
            raise AssertionError(f"helper process gave no answer within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"helper process failed:\n{value}")
        return value

    def call(self, *msg, timeout: float = 60):
        self.send(*msg)
        return self.recv(timeout)

    def kill(self) -> float:
        """SIGKILL the helper; returns the monotonic time just before the signal."""
        t = time.monotonic()
        os.kill(self.pid, signal.SIGKILL)
        return t

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()


@pytest.fixture(scope="module")
def _shared_helper():
    h = Helper()
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture
def reader(_shared_helper):
    """Another live process that can check out, close and commit; reset after each test."""
    try:
        yield _shared_helper
    finally:
        if _shared_helper.proc.is_alive():
            _shared_helper.call("reset")


@pytest.fixture
def store5(store_root):
    """A store with versions 1..5 (every tensor different at every step)."""
    with ParamStore(store_root) as store:
        commit_steps(store, range(1, 6))
        yield store


# -- a lease per checkout ---------------------------------------------------------------------
def test_checkout_holds_a_lease_and_close_releases_it(store5):
    store = store5
    assert store.leases() == []
    t0 = time.time()
    snap = store.checkout(3, holder="rollout-0")
    t1 = time.time()
    [lease] = store.leases()
    assert (lease.step, lease.holder, lease.pid, lease.host) == (3, "rollout-0", os.getpid(), socket.gethostname())
    assert t0 <= lease.acquired_at <= t1
    default = store.checkout("latest")
    held = sorted((x.step, x.holder) for x in store.leases())
    assert held == [(3, "rollout-0"), (5, f"pid {os.getpid()}")]
    assert len({x.id for x in store.leases()}) == 2
    snap.close()
    assert [(x.step, x.holder) for x in store.leases()] == [(5, f"pid {os.getpid()}")]
    snap.close()  # idempotent: releases nothing else
    assert [x.step for x in store.leases()] == [5]
    with default:
        pass
    assert store.leases() == []


def test_two_checkouts_of_one_version_are_two_leases(store5):
    store = store5
    a, b = store.checkout(2), store.checkout(2)
    assert [x.step for x in store.leases()] == [2, 2]
    a.close()
    assert [x.step for x in store.leases()] == [2]  # b still holds version 2
    r = store.prune(KeepLast(1))
    assert r.removed == [1, 3, 4] and r.kept[2] == ["leased"]
    b.close()
    assert store.prune(KeepLast(1)).removed == [2]


def test_unclosed_snapshot_releases_its_lease_when_collected(store5):
    store = store5
    snap = store.checkout(4)
    w = snap["w"]  # a tensor taken from the snapshot outlives it
    assert [x.step for x in store.leases()] == [4]
    del snap
    gc.collect()
    assert store.leases() == []
    assert_bits_equal(w, state_for(4)["w"], "tensor kept after the snapshot was collected")
    assert store.prune(KeepLast(1)).removed == [1, 2, 3, 4]


def test_oldest_leased_step(store5, reader):
    store = store5
    assert store.oldest_leased_step() is None
    s4 = store.checkout(4)
    s2 = store.checkout(2)
    assert store.oldest_leased_step() == 2
    s2.close()
    assert store.oldest_leased_step() == 4
    key, step, pid, ok = reader.call("checkout", store.root, 1, "slow reader")
    assert (step, pid, ok) == (1, reader.pid, True)
    assert store.oldest_leased_step() == 1
    reader.call("close", key, 0)
    assert store.oldest_leased_step() == 4
    s4.close()
    assert store.oldest_leased_step() is None


def test_lease_of_another_process_is_visible(store5, reader):
    store = store5
    _, _, pid, ok = reader.call("checkout", store.root, "latest", None)
    assert ok
    [lease] = store.leases()
    assert (lease.step, lease.pid, lease.holder) == (5, reader.pid, f"pid {reader.pid}")
    assert pid == reader.pid != os.getpid()


# -- leases against prune and gc --------------------------------------------------------------
def test_leased_version_survives_prune_and_gc_bit_exact(store5):
    store = store5
    tier = store._root.tier
    only1 = objects_of(store, 1) - set().union(*(objects_of(store, s) for s in range(2, 6)))
    assert only1, "version 1 should have objects of its own"
    snap = store.checkout(1)
    report = store.prune(KeepLast(1))
    assert report.removed == [2, 3, 4]
    assert report.kept[1] == ["leased"] and "latest" in report.kept[5]
    freed = store.gc()
    assert not only1 & set(freed.objects), "gc collected objects of a leased version"
    assert freed.objects, "the objects of versions 2-4 should have been collected"
    assert all(tier.exists(o) for o in only1)
    assert [v.step for v in store.versions()] == [1, 5]
    assert_version(store, 1)  # fresh mappings: the files themselves are intact
    assert matches(snap, 1)  # and the open snapshot still reads the right bits
    snap.close()
    assert store.prune(KeepLast(1)).removed == [1]
    freed = store.gc()
    assert only1 <= set(freed.objects)
    assert not any(tier.exists(o) for o in only1)
    assert_version(store, 5)


def test_no_lease_on_a_pruned_version(store5):
    """The registry takes a lease only on a version that exists, in the same transaction: a checkout
    racing a prune either holds the version before the prune's removal or sees it gone (and a
    checkout of "latest" or a tag then resolves again)."""
    store = store5
    reg = store._root.registry
    assert store.prune(KeepLast(1)).removed == [1, 2, 3, 4]
    for step in (1, 3, 6):
        with pytest.raises(paramstore.VersionNotFoundError):
            reg.acquire_lease(step, "late reader")
        with pytest.raises(paramstore.VersionNotFoundError):
            store.checkout(step)
    assert store.leases() == []


def test_tensors_taken_stay_valid_after_close_prune_and_gc(store5):
    store = store5
    with store.checkout(2) as snap:
        w, b = snap["w"], snap["b"]
    assert store.leases() == []
    assert 2 in store.prune(KeepLast(1)).removed
    assert objects_of(store, 5).isdisjoint(store.gc().objects)
    assert not any(store._root.tier.exists(o) for o in [snap.manifest.tensors["w"].object])
    assert_bits_equal(w, state_for(2)["w"], "w after its object was collected")
    assert_bits_equal(b, state_for(2)["b"], "b after its object was collected")


def test_snapshot_closed_after_its_store_still_releases_its_lease(store_root):
    with ParamStore(store_root) as store:
        commit_steps(store, [1, 2])
        snap = store.checkout(1)
    assert matches(snap, 1)  # the snapshot outlives the store (its tensors stay valid)
    snap.close()
    with ParamStore(store_root) as store:
        try:
            assert store.leases() == [], "the closed snapshot still holds its lease"
            store.wait_for_readers(2, timeout=0.2)
            assert store.prune(KeepLast(1)).removed == [1]
        finally:
            for lease in store.leases():  # do not leave it to the rest of this process
                store._root.registry.release_lease(lease.id)


def test_killed_reader_loses_its_lease_and_the_version_becomes_prunable(store5):
    store = store5
    tier = store._root.tier
    only1 = objects_of(store, 1) - set().union(*(objects_of(store, s) for s in range(2, 6)))
    assert only1
    victim = Helper()
    try:
        _, step, pid, ok = victim.call("checkout", store.root, 1, "victim")
        assert (step, pid, ok) == (1, victim.pid, True)
        [lease] = store.leases()
        assert (lease.step, lease.holder, lease.pid) == (1, "victim", victim.pid)
        assert store.oldest_leased_step() == 1
        r = store.prune(KeepLast(1))
        assert r.removed == [2, 3, 4] and r.kept[1] == ["leased"]
        store.gc()
        assert all(tier.exists(o) for o in only1)
        victim.kill()
        victim.proc.join(10)
        assert victim.proc.exitcode == -signal.SIGKILL
    finally:
        victim.stop()
    assert store.leases() == []  # dead pid: its lease no longer counts
    assert store.oldest_leased_step() is None
    r = store.prune(KeepLast(1))
    assert r.removed == [1] and list(r.kept) == [5]
    freed = store.gc()
    assert only1 <= set(freed.objects) and freed.bytes_freed > 0
    assert not any(tier.exists(o) for o in only1)
    assert not only1 & set(store._root.registry.objects())
    assert_version(store, 5)


def test_lease_of_a_zombie_does_not_count(store5):
    """A killed reader that its parent has not reaped yet (a zombie) holds nothing."""
    store = store5
    victim = Helper()
    try:
        victim.call("checkout", store.root, 2, "zombie")
        assert store.oldest_leased_step() == 2
        victim.kill()
        deadline = time.monotonic() + 10
        while True:  # not joined: wait until the kernel has made it a zombie
            with open(f"/proc/{victim.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert store.leases() == []
    finally:
        victim.stop()


# -- wait_for_readers -------------------------------------------------------------------------
def test_wait_for_readers_returns_at_once_without_old_leases(store5, reader):
    store = store5
    t = time.monotonic()
    store.wait_for_readers(5, timeout=5)
    assert time.monotonic() - t < 0.5
    reader.call("checkout", store.root, 4, "fresh enough")
    with store.checkout(5):
        t = time.monotonic()
        store.wait_for_readers(4, timeout=5)  # leases on 4 and 5 are not older than 4
        assert time.monotonic() - t < 0.5


def test_wait_for_readers_blocks_until_the_reader_closes(store5, reader):
    store = store5
    key, *_ = reader.call("checkout", store.root, 2, "slow")
    reader.send("close", key, 1.0)  # the reader closes its snapshot one second from now
    t_start = time.monotonic()
    store.wait_for_readers(3, timeout=20)
    t_back = time.monotonic()
    t_close, t_closed = reader.recv()
    assert t_back >= t_close, f"returned {t_close - t_back:.3f} s before the reader closed its snapshot"
    assert t_back - t_closed < 1.0, f"returned {t_back - t_closed:.3f} s after the reader closed"
    assert t_back - t_start >= 0.9
    assert store.oldest_leased_step() is None


def test_wait_for_readers_returns_soon_after_the_reader_is_killed(store5):
    store = store5
    victim = Helper()
    try:
        victim.call("checkout", store.root, 1, "doomed")
        killed: list[float] = []
        timer = threading.Timer(1.0, lambda: killed.append(victim.kill()))
        t_start = time.monotonic()
        timer.start()
        try:
            store.wait_for_readers(2, timeout=20)
        finally:
            timer.join()
        t_back = time.monotonic()
        assert killed and t_back >= killed[0], "returned before the reader was killed"
        assert t_back - killed[0] < 1.0, f"returned {t_back - killed[0]:.3f} s after the kill"
        assert t_back - t_start >= 0.9
        assert store.leases() == []
    finally:
        victim.stop()


def test_wait_for_readers_times_out(store5, reader):
    store = store5
    reader.call("checkout", store.root, 1, "stuck reader")
    t = time.monotonic()
    with pytest.raises(WaitTimeoutError, match="stuck reader"):
        store.wait_for_readers(3, timeout=0.3)
    took = time.monotonic() - t
    assert 0.3 <= took < 2.0
    assert store.oldest_leased_step() == 1  # the wait changed nothing
    # a bound the reader does satisfy does not wait
    store.wait_for_readers(1, timeout=0.3)


# -- checkout(min_step=) ----------------------------------------------------------------------
def test_checkout_min_step_returns_the_newest_version_at_or_above(store5):
    store = store5
    with store.checkout(min_step=2) as snap:
        assert snap.step == 5 and matches(snap, 5)
        assert [x.step for x in store.leases()] == [5]
    with store.checkout(min_step=5, timeout=0) as snap:
        assert snap.step == 5
    with store.checkout(min_step=0) as snap:
        assert snap.step == 5
    assert store.leases() == []


def test_checkout_min_step_blocks_until_a_trainer_commits(store5, reader):
    store = store5
    reader.send("commit", store.root, 6, 0.8)  # another process commits step 6 in 0.8 s
    t_start = time.monotonic()
    snap = store.checkout(min_step=6, timeout=20)
    t_back = time.monotonic()
    t_commit, t_visible = reader.recv()
    try:
        assert snap.step == 6 and matches(snap, 6)
        assert t_back >= t_commit
        assert t_back - t_start >= 0.7
        assert t_back - t_visible < 1.0, f"returned {t_back - t_visible:.3f} s after the commit was visible"
        assert [x.step for x in store.leases()] == [6]
    finally:
        snap.close()


def test_checkout_min_step_times_out(store5):
    store = store5
    t = time.monotonic()
    with pytest.raises(WaitTimeoutError):
        store.checkout(min_step=6, timeout=0.3)
    took = time.monotonic() - t
    assert 0.3 <= took < 2.0
    assert store.leases() == []


def test_checkout_version_and_min_step_together_is_an_error(store5):
    store = store5
    store.tag(3, "three")
    for spec in (3, "three", 5):
        with pytest.raises(InvalidArgumentError, match="either version or min_step"):
            store.checkout(spec, min_step=2)
        with pytest.raises(InvalidArgumentError):
            store.checkout(version=spec, min_step=2, timeout=1)
    assert store.leases() == []
    with pytest.raises(TagNotFoundError):
        store.checkout("nope")
    with pytest.raises(paramstore.VersionNotFoundError):
        store.checkout(99)
    assert store.leases() == []


# -- cost -------------------------------------------------------------------------------------
def test_lease_cost_is_small(store5):
    store = store5
    for _ in range(10):  # warm up
        store.checkout("latest").close()
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        snap = store.checkout(4)
        snap.close()
    mean = (time.perf_counter() - t) / n
    assert mean < 0.020, f"checkout + close took {mean * 1e3:.2f} ms on average"
    assert store.leases() == []


# -- fork -------------------------------------------------------------------------------------
_FORKED_READER = textwrap.dedent("""
    import os, sys, torch
    from paramstore import ParamStore
    store = ParamStore(sys.argv[1], prepare_buffers=False)
    store.commit(1, {"w": torch.arange(16.0)}).result()
    pid = os.fork()
    if pid == 0:  # a rollout worker forked from a process that has the store open
        code = 0
        try:
            with store.checkout("latest") as snap:
                held = [lease.pid for lease in store.leases()]
                code = 0 if snap.step == 1 and held == [os.getpid()] else 3
            code = code or (0 if store.leases() == [] else 5)
        except BaseException as e:
            print(repr(e), file=sys.stderr)
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    store.close()
    sys.exit(os.waitstatus_to_exitcode(status))
""")


def test_forked_reader_can_take_and_release_a_lease(store_root):
    proc = subprocess.run([sys.executable, "-c", _FORKED_READER, store_root], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_fork_while_another_thread_writes_does_not_hang_the_child(store_root):
    """A fork waits for a write transaction in flight, so the child can use the registry."""
    import threading

    with ParamStore(store_root) as store:
        store.commit(1, {"x": torch.ones(4)}).result()
        reg = store._root.registry
        entered = threading.Event()

        def hold_write_txn() -> None:
            with reg._write():
                entered.set()
                time.sleep(0.5)

        t = threading.Thread(target=hold_write_txn)
        t.start()
        entered.wait()
        pid = os.fork()
        if pid == 0:  # child: must be able to read (and lease) without hanging
            code = 1
            try:
                signal.alarm(10)
                with store.checkout(1) as snap:
                    code = 0 if torch.equal(snap["x"], torch.ones(4)) else 3
            finally:
                os._exit(code)
        t.join()
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
