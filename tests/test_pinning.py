"""Pinning of staging buffers (``paramstore.pinning`` and ``SlabPool``), against a stub of the
device runtime that records every call: a buffer is registered once and stays registered across
retire -> recycle -> reuse, is unregistered when it is unmapped (slab close, pool close, garbage
collection of a dropped slab, truncate), fetch slabs and readers never pin, a forked child neither
pins nor unregisters, a refused registration is cleared and warned about once, ``pin_memory=False``
and CPU commits never touch the runtime.

The tests marked ``gpu`` run a real CUDA device (skipped without one).
"""

from __future__ import annotations

import gc
import os
import pickle
import threading
import warnings

import pytest
import torch

from helpers import assert_checkout_equal, random_tensor

from paramstore import ParamStore, pinning, staging
from paramstore.retention import KeepLast

SIZE = 1 << 20
SHARD = 64 << 10


class StubRuntime:
    """A device runtime that pins nothing and records every call (and what a real one would reject:
    a second registration of a live address, an unregistration of an unknown one)."""

    flags = pinning.CUDA_HOST_REGISTER_PORTABLE

    def __init__(self, *, refuse: int = 0, fail: BaseException | None = None, bad_fork: bool = False) -> None:
        self.refuse, self.fail, self.bad_fork = refuse, fail, bad_fork
        self.calls: list[tuple] = []
        self.live: dict[int, int] = {}
        self.violations: list[tuple] = []
        self.pending: dict[str, int] = {}  # thread name -> the error a failed call left there
        self.probes = 0  # in_bad_fork() calls (not device calls)
        self._lock = threading.Lock()

    def _record(self, *call) -> None:
        with self._lock:
            self.calls.append((*call, threading.current_thread().name))

    def register(self, addr: int, nbytes: int, flags: int) -> int:
        self._record("register", addr, nbytes, flags)
        if self.fail is not None:
            raise self.fail
        if self.refuse:
            self.pending[threading.current_thread().name] = self.refuse
            return self.refuse
        if addr in self.live:
            self.violations.append(("registered twice", addr))
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.live[addr] = nbytes
        return 0

    def unregister(self, addr: int) -> int:
        self._record("unregister", addr)
        if self.live.pop(addr, None) is None:
            self.violations.append(("not registered", addr))
            return 713  # cudaErrorHostMemoryNotRegistered
        return 0

    def clear_error(self) -> int:
        self._record("clear_error")
        return self.pending.pop(threading.current_thread().name, 0)

    def set_device(self, device) -> None:
        self._record("set_device", str(device))

    def in_bad_fork(self) -> bool:
        self.probes += 1
        return self.bad_fork

    def named(self, name: str) -> list[tuple]:
        with self._lock:
            return [c for c in self.calls if c[0] == name]


@pytest.fixture
def stub():
    rt = StubRuntime()
    with pinning.use_runtime("cuda", rt):
        yield rt
        leaked = pinning.registrations()
        for addr in leaked:  # (a failed test must not leave registrations to the next ones)
            pinning.unregister(addr)
    assert not rt.violations, rt.violations
    assert not leaked, leaked


@pytest.fixture
def tmp_dir(shm_dir):
    d = os.path.join(shm_dir, "tmp")
    os.makedirs(d)
    return d


def registered_addresses(rt: StubRuntime) -> list[int]:
    return [c[1] for c in rt.named("register")]


# -- once per buffer, for as long as it is mapped ---------------------------------------------
def test_a_slab_is_registered_once_across_retire_recycle_and_reuse(stub, tmp_dir, shm_dir):
    objects = os.path.join(shm_dir, "objects")
    os.makedirs(objects)
    pool = staging.SlabPool(tmp_dir, recycle=True, keep_mapped=4)
    try:
        assert pool.pin_for(torch.device("cuda", 0)) and pool.pin_device == torch.device("cuda", 0)
        slab = pool.take(SIZE, pinned=True)  # the first commit: pinned when taken
        addr = staging.address(slab.map)
        assert slab.pinned and pinning.registered(addr) == (SIZE, "cuda")
        assert stub.named("register") == [("register", addr, SIZE, pinning.CUDA_HOST_REGISTER_PORTABLE,
                                            threading.current_thread().name)]
        pool._layout_bytes = {"commit": SIZE}  # one commit's worth (set by prepare): retired slabs stay mapped
        for step in range(3):
            slab.map[:8] = step.to_bytes(8, "little")
            published = os.path.join(objects, f"obj-{step}")
            os.rename(slab.path, published)  # what LocalTier.put does: the slab becomes an object
            pool.retire(slab)
            assert pinning.registered(addr) == (SIZE, "cuda")  # retired: still mapped, still pinned
            assert pool.recycle(published)  # GC swept its version: back to tmp/
            again = pool.take(SIZE, pinned=True)
            assert again is slab and staging.address(again.map) == addr and again.pinned
            assert int.from_bytes(again.map[:8], "little") == step  # the very pages, not a new mapping
        assert pool.stats["recycled"] == pool.stats["reused"] == 3
        assert registered_addresses(stub) == [addr]  # pinned once for three commits
        assert not stub.named("unregister")
        slab.discard()
        assert [c[1] for c in stub.named("unregister")] == [addr]
        assert pinning.registered(addr) is None
    finally:
        pool.close()


def test_prepared_slabs_are_pinned_in_the_background_thread_with_its_device_set(stub, tmp_dir):
    pool = staging.SlabPool(tmp_dir)
    try:
        assert pool.pin_for("cuda:1")
        pool.prepare([SIZE, SIZE // 2], copies=2)
        assert pool.wait_prepared(30)
        regs = stub.named("register")
        assert len(regs) == 4 and all(c[-1] == "paramstore-slabs" for c in regs)
        sets = stub.named("set_device")
        assert sets == [("set_device", "cuda:1", "paramstore-slabs")]  # once for the thread
        assert stub.calls.index(sets[0]) < stub.calls.index(regs[0])  # before its first registration
        first = set(registered_addresses(stub))
        taken = [pool.take(SIZE, pinned=True) for _ in range(2)]
        assert all(s.pinned and staging.address(s.map) in first for s in taken)
        for s in taken:
            s.discard()
    finally:
        pool.close()
    addrs = registered_addresses(stub)  # (the thread refilled what was taken meanwhile)
    assert len(addrs) >= 4 and all(c[-1] == "paramstore-slabs" for c in stub.named("register"))
    assert not pinning.registrations() and not stub.live


def test_pool_close_unregisters_pooled_and_retired_slabs(stub, tmp_dir, shm_dir):
    pool = staging.SlabPool(tmp_dir, recycle=True)
    pool.pin_for("cuda:0")
    pool.prepare([SIZE], copies=1)
    pooled = pool.take(SIZE, pinned=True)
    retired = pool.take(SIZE, pinned=True)
    os.rename(retired.path, os.path.join(shm_dir, "object"))
    pool.retire(retired)
    pool.give_back(pooled)
    assert pool.wait_prepared(30)
    live = pinning.registrations()
    assert len(live) >= 2 and set(live) == set(stub.live)
    pool.close()
    assert set(live) <= {c[1] for c in stub.named("unregister")}
    assert not pinning.registrations() and not stub.live


def test_a_dropped_slab_is_unregistered_when_garbage_collected(stub, tmp_dir):
    pool = staging.SlabPool(tmp_dir)
    try:
        pool.pin_for("cuda:0")
        slab = pool.take(SIZE, pinned=True)
        addr, path = staging.address(slab.map), slab.path
        cycle = [slab]
        cycle.append(cycle)  # only the cycle collector frees it
        del slab, cycle
        assert pinning.registered(addr) is not None
        gc.collect()
        assert [c[1] for c in stub.named("unregister")] == [addr]
        assert pinning.registered(addr) is None
        os.unlink(path)
    finally:
        pool.close()


def test_close_and_truncate_unregister_before_unmapping(stub, tmp_dir):
    pool = staging.SlabPool(tmp_dir)
    try:
        pool.pin_for("cuda:0")
        slab = pool.take(SIZE, pinned=True)
        addr = staging.address(slab.map)
        slab.map[:4] = b"abcd"
        slab.truncate(SIZE // 4)  # compacted for publishing: unpinned, remapped
        assert not slab.pinned and slab.size == SIZE // 4 and slab.map[:4] == b"abcd"
        assert [c[1] for c in stub.named("unregister")] == [addr] and not stub.live
        assert pool.pin(slab) and len(stub.named("register")) == 2  # a commit that reuses it pins it again
        slab.close()
        assert len(stub.named("unregister")) == 2 and not stub.live
        os.unlink(slab.path)
    finally:
        pool.close()


# -- who never pins ---------------------------------------------------------------------------
def test_fetch_slabs_are_never_pinned(stub, tmp_dir):
    pool = staging.SlabPool(tmp_dir)
    try:
        pool.prepare([SIZE], purpose="fetch", copies=2)
        assert pool.wait_prepared(30)
        fetched = pool.take(SIZE)
        assert not fetched.pinned
        # A process that also commits accelerator tensors: its fetch slabs still are not pinned.
        pool.pin_for("cuda:0")
        pool.prepare([SIZE * 2], purpose="fetch", copies=1)
        assert pool.wait_prepared(30)
        other = pool.take(SIZE * 2)
        assert not other.pinned and not pool.take(SIZE).pinned
        assert stub.calls == [] and not pinning.registrations()
    finally:
        pool.close()


def test_a_reading_process_never_touches_the_runtime(stub, store_root):
    m = {"w": random_tensor(torch.float32, (4096,), 1), "b": random_tensor(torch.bfloat16, (7,), 2)}
    with ParamStore(store_root, shard_size_bytes=SHARD, create=True) as writer:
        writer.commit(1, m).result()
    with ParamStore(store_root) as reader:
        assert_checkout_equal(reader, 1, m)
        assert reader._pool is None or reader._pool.pin_device is None
    assert stub.calls == [] and stub.probes == 0


def test_cpu_commits_never_touch_the_runtime(stub, store_root):
    with ParamStore(store_root, shard_size_bytes=SHARD, retention=KeepLast(1), create=True) as store:
        store.prepare({"w": torch.zeros(4096), "v": torch.zeros(8192)}, wait=True)
        for step in range(1, 5):
            m = {"w": random_tensor(torch.float32, (4096,), step), "v": random_tensor(torch.float32, (8192,), -step)}
            store.commit(2 * step - 1, m).result()
            store.commit(2 * step, iter(m.items())).result()  # the streaming path too
            assert_checkout_equal(store, 2 * step, m)
        assert store._pool.pin_device is None
    assert stub.calls == [] and stub.probes == 0


def test_pin_memory_false_never_calls_the_runtime(stub, store_root):
    with ParamStore(store_root, shard_size_bytes=SHARD, pin_memory=False, create=True) as store:
        store.commit(1, {"w": torch.ones(4096)}).result()
        pool = store._pool
        assert pool.pin_for("cuda:0") is False and pool.pin_device is None
        slab = pool.take(SIZE, pinned=True)
        assert not slab.pinned
        slab.discard()
    assert stub.calls == []


# -- fork ---------------------------------------------------------------------------------------
def _in_child(conn_w: int, work) -> None:
    """Run ``work()`` in a forked child and report its result (or error) through a pipe."""
    try:
        result = ("ok", work())
    except BaseException as e:  # noqa: BLE001
        result = ("error", repr(e))
    os.write(conn_w, pickle.dumps(result))
    os._exit(0)


def fork_and_run(work):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        _in_child(w, work)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    kind, value = pickle.loads(data)
    assert kind == "ok", value
    return value


def test_a_forked_child_neither_pins_nor_unregisters_the_parents_buffers(stub, tmp_dir):
    pool = staging.SlabPool(tmp_dir)
    try:
        pool.pin_for("cuda:0")
        slab = pool.take(SIZE, pinned=True)
        addr = staging.address(slab.map)
        before = len(stub.calls)

        def child():
            table = pinning.registrations()
            fresh = staging.SlabPool(tmp_dir)
            on = fresh.pin_for("cuda:0")
            other = fresh.take(SIZE, pinned=True)
            again = slab.pin("cuda:0")  # already pinned in the parent: stays so, nothing called
            direct = pinning.register(staging.address(other.map), SIZE, "cuda:0")
            other.discard()
            slab.close()  # the parent's slab (not even mapped here: MADV_DONTFORK)
            fresh.close()
            pool.close()
            return {"table": table, "pin_for": on, "pinned": other.pinned, "again": again, "direct": direct,
                    "calls": stub.calls[before:]}

        seen = fork_and_run(child)
        assert seen == {"table": {}, "pin_for": False, "pinned": False, "again": True, "direct": False, "calls": []}
        assert pinning.registered(addr) == (SIZE, "cuda") and stub.live == {addr: SIZE}  # the parent's is intact
        assert slab.map[:4] == b"\0\0\0\0"
        slab.discard()
    finally:
        pool.close()


def test_a_child_of_a_process_that_never_used_the_runtime_may_pin(stub, tmp_dir, monkeypatch):
    assert not pinning.registrations()
    monkeypatch.setattr(pinning, "_used", False)
    monkeypatch.setattr(pinning, "_forked_after_use", False)

    def child():
        pool = staging.SlabPool(tmp_dir)
        pool.pin_for("cuda:0")
        slab = pool.take(SIZE, pinned=True)
        pinned = slab.pinned
        slab.discard()
        pool.close()
        return pinned, [c[0] for c in stub.calls]

    assert fork_and_run(child) == (True, ["register", "unregister"])
    assert stub.calls == []  # nothing in the parent


def test_a_runtime_in_a_bad_fork_is_never_called(tmp_dir):
    rt = StubRuntime(bad_fork=True)
    with pinning.use_runtime("cuda", rt):
        pool = staging.SlabPool(tmp_dir)
        try:
            assert pool.pin_for("cuda:0") is False
            assert pinning.register(pinning.address_of(bytearray(64)), 64, "cuda:0") is False
        finally:
            pool.close()
    assert rt.calls == [] and rt.probes >= 1


# -- refused ------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["error code", "exception"])
def test_a_refused_registration_is_cleared_warned_once_and_staging_goes_on(tmp_dir, how):
    rt = StubRuntime(refuse=2) if how == "error code" else StubRuntime(
        fail=RuntimeError("Cannot re-initialize CUDA in forked subprocess"))
    with pinning.use_runtime("cuda", rt):
        pool = staging.SlabPool(tmp_dir)
        try:
            pool.pin_for("cuda:0")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                slabs = [pool.take(SIZE, pinned=True) for _ in range(3)]
            refused = [w for w in caught if issubclass(w.category, RuntimeWarning)]
            assert len(refused) == 1 and "refused" in str(refused[0].message), [str(w.message) for w in caught]
            # every failed call was followed at once, on its thread, by clearing the error
            names = [c[0] for c in rt.calls]
            assert names == ["register", "clear_error"] * 3
            assert all(rt.calls[i][-1] == rt.calls[i + 1][-1] for i in range(0, 6, 2))
            assert not rt.pending  # no error left behind on any thread
            for i, s in enumerate(slabs):  # unpinned, and usable
                assert not s.pinned
                s.map[:3] = bytes([i, i, i])
                assert s.map[:3] == bytes([i, i, i])
                s.discard()
            assert [c[0] for c in rt.calls].count("unregister") == 0 and not pinning.registrations()
        finally:
            pool.close()


def test_no_runtime_for_a_device_type_means_unpinned_with_one_warning(tmp_dir, monkeypatch):
    monkeypatch.setattr(pinning, "_runtimes", {})
    monkeypatch.setattr(pinning, "_warned", set())
    pool = staging.SlabPool(tmp_dir)
    try:
        assert pool.pin_for("xpu:0")  # no host-register call known for it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            slabs = [pool.take(SIZE, pinned=True) for _ in range(2)]
        assert [str(w.message) for w in caught if "cannot pin host memory for 'xpu'" in str(w.message)] \
            and len(caught) == 1, [str(w.message) for w in caught]
        assert not any(s.pinned for s in slabs) and not pinning.registrations()
        for s in slabs:
            s.discard()
    finally:
        pool.close()


# -- GPU: a real device (skipped without one) ---------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class CountingRuntime:
    """The real CUDA runtime, counting the calls."""

    flags = pinning.CUDA_HOST_REGISTER_PORTABLE

    def __init__(self) -> None:
        self.real = pinning.CudaRuntime()
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def register(self, addr, nbytes, flags):
        self.registered.append(addr)
        return self.real.register(addr, nbytes, flags)

    def unregister(self, addr):
        self.unregistered.append(addr)
        return self.real.unregister(addr)

    def clear_error(self):
        return self.real.clear_error()

    def set_device(self, device):
        self.real.set_device(device)

    def in_bad_fork(self):
        return self.real.in_bad_fork()


@pytest.mark.gpu
@cuda
def test_gpu_staging_is_ordered_after_the_callers_stream_and_before_the_optimizer(store_root):
    dev = torch.device("cuda", 0)
    n = 1 << 24  # 64 MiB of fp32: a copy that takes a while
    w = torch.nn.Parameter(torch.zeros(n, device=dev))
    opt = torch.optim.SGD([w], lr=1.0)
    with ParamStore(store_root, create=True) as store:
        store.guard(opt)
        for step in range(1, 4):
            # The weights of this step are written by a kernel still queued when commit() is
            # called (behind a sleep): the copy must wait for it.
            torch.cuda._sleep(50_000_000)
            with torch.no_grad():
                w.fill_(float(step))
            handle = store.commit(step, {"w": w.detach()})  # shares w's memory
            # The "optimizer" right after commit() returns: the guard waits for the copy, then
            # the step writes the weights on the current stream.
            w.grad = torch.full_like(w, 1000.0)
            opt.step()
            handle.result(timeout=120)
            with store.checkout(step) as snap:
                assert torch.equal(snap["w"], torch.full((n,), float(step)))
            assert torch.equal(w.detach().cpu(), torch.full((n,), float(step) - 1000.0))


@pytest.mark.gpu
@cuda
def test_gpu_slabs_are_registered_with_cuda_once_each(store_root):
    dev = torch.device("cuda", 0)
    rt = CountingRuntime()
    with pinning.use_runtime("cuda", rt):
        with ParamStore(store_root, shard_size_bytes=4 << 20, retention=KeepLast(1), create=True) as store:
            for step in range(1, 9):
                m = {f"w{i}": torch.randn(1 << 20, device=dev) for i in range(4)}
                store.commit(step, m).result(timeout=120)
                assert_checkout_equal(store, step, {k: v.cpu() for k, v in m.items()})
                assert store._write.maintainer.wait_idle(30) and store._pool.wait_prepared(30)
            pool = store._pool
            assert pool.pin_device == dev and pool.stats["reused"] > 0, pool.stats
            # each buffer pinned at most once while mapped: no more registrations than buffers made
            assert 0 < len(rt.registered) <= pool.stats["created"], (len(rt.registered), pool.stats)
            assert len(rt.registered) - len(rt.unregistered) == len(pinning.registrations())
        assert not pinning.registrations()
        assert sorted(rt.registered) == sorted(rt.unregistered)
        assert rt.clear_error() == 0  # cudaGetLastError was found, and no error is left on this thread
