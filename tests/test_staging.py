"""Staging buffers: prepared depth, recycled buffers (reused only when nobody else maps them), crash
safety of recycled slabs, the overlapped hash path, and ``recycle_buffers=False``.

Real files on /dev/shm and real processes; no timing assertions.
"""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing as mp
import os
import signal
import sys
import threading
import time

import pytest
import torch

from helpers import as_bytes, assert_checkout_equal, random_tensor

from paramstore import ParamStore, commit as commit_mod, staging
from paramstore.maintenance import versions_kept
from paramstore.retention import KeepLast

SHARD = 64 << 10  # small shards: several objects per version
SPAWN = mp.get_context("spawn")


def model(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    """Tensors of a few sizes (two over the 1 MiB inline-hash limit, some tiny), all new content."""
    out = {f"w{i}": random_tensor(torch.float32, (4096,), seed * 100 + i) for i in range(n)}  # 16 KiB each
    out["big"] = random_tensor(torch.bfloat16, (1 << 20,), seed * 100 + 98)  # 2 MiB: its own object
    out["b"] = random_tensor(torch.float16, (7,), seed * 100 + 99)
    return out


def settle(store: ParamStore) -> None:
    """Wait until retention (prune + GC) and the slab pool are idle."""
    if store._write.maintainer is not None:
        assert store._write.maintainer.wait_idle(30)
    assert store._pool.wait_prepared(30)


def inodes(paths) -> dict[int, str]:
    return {os.stat(p).st_ino: p for p in paths if os.path.exists(p)}


def object_paths(store: ParamStore, step: int) -> list[str]:
    m = store._root.registry.get_manifest(step)
    return [store._root.tier.object_path(o) for o in m.objects()]


def tmp_inodes(store: ParamStore) -> dict[int, str]:
    tmp = os.path.join(store.root, "tmp")
    return inodes(os.path.join(tmp, f) for f in os.listdir(tmp))


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(as_bytes(t).numpy().tobytes()).hexdigest()


# -- the prepared depth ------------------------------------------------------------------------
def test_versions_kept_counts_what_retention_keeps():
    assert versions_kept(None) == 0
    assert versions_kept(KeepLast(1)) == 1
    assert versions_kept(KeepLast(2)) == 2
    assert versions_kept(KeepLast(50)) == 8  # a run of 8 commits


@pytest.mark.parametrize("retention, recycle, copies", [(None, True, 2), (KeepLast(2), False, 2), (KeepLast(2), True, 4)])
def test_prepare_wait_has_every_buffer_ready(store_root, retention, recycle, copies):
    m = model(1)
    with ParamStore(store_root, shard_size_bytes=SHARD, retention=retention, recycle_buffers=recycle) as store:
        store.prepare(m, wait=True, timeout=60)
        pool = store._pool
        with pool._lock:
            assert not pool._missing()
            ready = sum(len(v) for v in pool._free.values())
        shards = len(store._write._get_committer()._plan(store._write._get_committer()._layout[0]))
        assert ready == copies * shards
        # that many commits, back to back, find them: nothing is faulted on the hot path
        for step in range(1, copies + 1):
            store.commit(step, model(step)).staged.result()
        store.flush()
        assert pool.stats["on_the_spot"] == 0, pool.stats


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_the_pool_prepares_slabs_at_the_lowest_cpu_priority(shm_dir):
    """The background thread faults ahead of need at nice 19 (busy cores serve foreground work
    first); the threads that take slabs keep their own priority."""
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = staging.SlabPool(shm_dir, pin=False)
    try:
        pool.prepare([1 << 20], purpose="fetch")
        assert pool.wait_prepared(30)
        assert pool._thread is not None and pool._thread.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, pool._thread.native_id) == max(before, staging.FILL_NICE)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
        pool.take(1 << 20).discard()
        assert pool.stats["on_the_spot"] == 0
    finally:
        pool.close()


def test_the_background_thread_gives_a_slab_up_between_two_chunks(shm_dir):
    """With ``stop`` (the background thread's: the pool closes, or a commit out of space asks it
    to stand back) a slab is reserved a chunk at a time and given up, its file deleted, as soon
    as ``stop()`` says so; otherwise it comes whole, reserved."""
    pool = staging.SlabPool(shm_dir, pin=False)
    try:
        asked: list[int] = []

        def stop() -> bool:
            asked.append(1)
            return len(asked) > 2

        with pytest.raises(staging._Stopped):
            pool.new(4 * staging._RESERVE_CHUNK, stop=stop)
        assert len(asked) == 3 and not os.listdir(shm_dir)  # two chunks reserved, then given up
        slab = pool.new(2 * staging._RESERVE_CHUNK + 4096, stop=lambda: False)
        assert slab.reserved and os.fstat(slab.fd).st_blocks * 512 >= slab.size
        slab.discard()
    finally:
        pool.close()


def test_an_unreserved_slab_is_reserved_range_by_range(shm_dir):
    """take(reserve=False) with none ready returns at once a slab whose space is neither reserved
    nor faulted (a peer fetch reserves it just ahead of the bytes it receives); a prepared one
    comes reserved."""
    size = 3 << 20
    pool = staging.SlabPool(shm_dir, pin=False)
    try:
        slab = pool.take(size, reserve=False)
        assert not slab.reserved and os.fstat(slab.fd).st_size == size
        assert os.fstat(slab.fd).st_blocks == 0  # no page allocated yet
        with pytest.raises(ValueError):
            slab.reserve(100, 200)  # a reservation starts on a page
        slab.reserve(0, 1 << 20)
        assert os.fstat(slab.fd).st_blocks * 512 >= 1 << 20
        slab.map[: 1 << 20] = b"\x07" * (1 << 20)
        slab.reserve(1 << 20, size)
        assert os.fstat(slab.fd).st_blocks * 512 >= size and slab.map[(1 << 20) - 1] == 7
        slab.discard()
        pool.prepare([size], purpose="fetch")
        assert pool.wait_prepared(30)
        ready = pool.take(size, reserve=False)
        assert ready.reserved and os.fstat(ready.fd).st_blocks * 512 >= size
        assert pool.stats["on_the_spot"] == 1
        ready.discard()
    finally:
        pool.close()


# -- recycling ---------------------------------------------------------------------------------
def test_commits_with_recycling_are_bit_exact_and_reuse_the_files(store_root):
    with ParamStore(store_root, shard_size_bytes=SHARD, retention=KeepLast(2), create=True) as store:
        assert store._pool.recycling
        store.prepare(model(0), wait=True)
        first = None
        for step in range(1, 11):
            m = model(step)
            if step % 3 == 0:  # some tensors unchanged: their objects stay referenced (dedup)
                m["w0"] = model(step - 1)["w0"]
            store.commit(step, m).result()
            assert_checkout_equal(store, step, m)
            if step == 1:
                first = inodes(object_paths(store, 1))
            settle(store)
        for step in (9, 10):  # what retention kept is intact
            m = model(step)
            if step % 3 == 0:
                m["w0"] = model(step - 1)["w0"]
            assert_checkout_equal(store, step, m)
        stats = store._pool.stats
        assert stats["recycled"] > 0 and stats["reused"] > 0, stats
        # the very files of version 1 hold later versions (or sit ready in tmp/)
        live = inodes([os.path.join(d, f) for d, _, fs in os.walk(os.path.join(store.root, "objects")) for f in fs])
        assert set(first) & (set(live) | set(tmp_inodes(store)))
        report = store.verify()
        assert report["ok"] and not report["orphans"], report


def test_a_published_slab_is_lent_for_reads_and_kept_until_given_back(store_root):
    """With recycling, the pool lends its own mapping of an object this process committed (no
    page to fault); while lent it is neither recycled nor unmapped by later commits, and it comes
    back among the retired afterwards. Without it (an unknown path, no recycling): None."""
    with ParamStore(store_root, shard_size_bytes=SHARD, retention=KeepLast(2), create=True) as store:
        pool = store._pool
        store.commit(1, model(1)).result()  # slabs made on the spot: not kept mapped
        settle(store)
        store.commit(2, model(2)).result()  # into slabs the pool prepared: kept mapped once published
        settle(store)
        path = object_paths(store, 2)[0]
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            want = f.read()
        with pool.lent(path) as m, pool.lent(path) as again:
            assert m is not None and again is m and pool.stats["lent"] == 2
            assert bytes(memoryview(m)[:size]) == want
            assert not pool.recycle(path) and os.path.exists(path)  # lent: GC deletes the file as usual
            for step in range(3, 9):  # more commits than keep_mapped: older mappings are unmapped
                store.commit(step, model(step)).result()
            assert bytes(memoryview(m)[:size]) == want  # still mapped
        assert not pool._lent
        assert not os.path.exists(path)  # step 2 was pruned meanwhile (keep_last 2): lent, so deleted, not recycled
        assert m.closed and all(s.map is not m for s in pool._retired.values())  # given back: unmapped
        with pool.lent(os.path.join(store_root, "no-such-object")) as none:
            assert none is None
    with ParamStore(store_root + "-plain", create=True) as plain:  # no retention: no recycling
        for step in (1, 2):
            plain.commit(step, model(step)).result()
            settle(plain)
        with plain._pool.lent(object_paths(plain, 2)[0]) as none:
            assert none is None


def _reader_keeps_tensors(root: str, step: int, conn) -> None:
    store = ParamStore(root, create=False)
    with store.checkout(step) as snap:
        kept = {k: snap[k] for k in snap}  # stays mapped after close(); the lease goes
    conn.send({k: sha(t) for k, t in kept.items()})
    conn.recv()
    conn.send({k: sha(t) for k, t in kept.items()})
    conn.recv()
    store.close()


def test_a_buffer_another_process_still_maps_is_never_recycled(store_root):
    with ParamStore(store_root, shard_size_bytes=SHARD, retention=KeepLast(1)) as store:
        store.prepare(model(0), wait=True)
        m1 = model(1)
        store.commit(1, m1).result()
        v1 = inodes(object_paths(store, 1))
        conn, child = SPAWN.Pipe()
        reader = SPAWN.Process(target=_reader_keeps_tensors, args=(store_root, 1, child))
        reader.start()
        try:
            before = conn.recv()
            assert before == {k: sha(t) for k, t in m1.items()}
            for step in range(2, 8):  # version 1 is pruned and swept: its files must stay as they are
                store.commit(step, model(step)).result()
                assert_checkout_equal(store, step, model(step))
                settle(store)
            assert 1 not in [v.step for v in store.versions()]
            conn.send("again")
            assert conn.recv() == before  # the reader's bytes never changed
            stats = store._pool.stats
            assert stats["in_use"] + stats["unwanted"] > 0, stats  # v1's files were handed back, then refused
            assert stats["reused"] > 0, stats  # later versions' files were recycled meanwhile
            objects = inodes([os.path.join(d, f) for d, _, fs in os.walk(os.path.join(store.root, "objects")) for f in fs])
            assert not set(v1) & (set(objects) | set(tmp_inodes(store)))
            conn.send("done")
        finally:
            reader.join(30)
            if reader.is_alive():
                reader.kill()
        assert reader.exitcode == 0


def _reader_checks_latest(root: str, conn) -> None:
    """Check out the latest version over and over while commits run; keep some tensors after
    close() and check them again later. Sends the number of checkouts and of mismatches."""
    store = ParamStore(root, create=False)
    expected: dict[int, dict[str, str]] = {}
    kept: list[tuple[int, dict[str, torch.Tensor]]] = []
    seen = bad = 0
    conn.send("ready")
    while not conn.poll():
        try:
            snap = store.checkout("latest")
        except Exception:  # noqa: BLE001 - no version yet, or pruned meanwhile
            continue
        with snap:
            want = expected.setdefault(snap.step, {k: sha(t) for k, t in model(snap.step).items()})
            got = {k: snap[k] for k in snap}
            bad += sum(sha(t) != want[k] for k, t in got.items())
            seen += 1
            if seen % 5 == 0:
                kept.append((snap.step, got))
        for step, tensors in kept:  # tensors kept after close() never change
            bad += sum(sha(t) != expected[step][k] for k, t in tensors.items())
        kept = kept[-4:]
    conn.send((seen, bad))
    store.close()


def test_commits_back_to_back_with_a_reader_checking_every_byte(store_root):
    with ParamStore(store_root, shard_size_bytes=SHARD, retention=KeepLast(2)) as store:
        store.prepare(model(0), wait=True)
        conn, child = SPAWN.Pipe()
        reader = SPAWN.Process(target=_reader_checks_latest, args=(store_root, child))
        reader.start()
        try:
            assert conn.recv() == "ready"
            for step in range(1, 41):  # the next commit as soon as the previous one is staged
                store.commit(step, model(step)).staged.result()
            store.flush()
            time.sleep(0.5)
            conn.send("stop")
            seen, bad = conn.recv()
        finally:
            reader.join(60)
            if reader.is_alive():
                reader.kill()
        assert seen > 0 and bad == 0, (seen, bad)
        settle(store)
        for step in (39, 40):
            assert_checkout_equal(store, step, model(step))
        assert store._pool.stats["reused"] > 0, store._pool.stats
        assert store.verify()["ok"]


def _map_and_wait(path: str, conn) -> None:
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)  # only the mapping holds the file now
    conn.send(os.getpid())
    conn.recv()
    m.close()
    conn.send("unmapped")
    conn.recv()


@pytest.fixture
def mapped_elsewhere(shm_dir):
    """A slab of this process's pool, and a second process that maps its file (fd closed)."""
    os.makedirs(os.path.join(shm_dir, "tmp"))
    pool = staging.SlabPool(os.path.join(shm_dir, "tmp"), pin=False)
    slab = pool.new(1 << 20)
    conn, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_map_and_wait, args=(slab.path, child))
    proc.start()
    pid = conn.recv()
    try:
        yield slab, conn, pid
    finally:
        conn.send("exit")
        proc.join(30)
        slab.discard()
        pool.close()


def test_lease_sees_a_mapping_in_another_process(mapped_elsewhere):
    slab, conn, _ = mapped_elsewhere
    if staging._lease(slab.fd) is None:
        pytest.skip("no file leases here")
    assert staging._lease(slab.fd) is False
    conn.send("unmap")
    assert conn.recv() == "unmapped"
    assert staging._lease(slab.fd) is True
    assert staging._lease_exact(os.path.dirname(slab.path)) in (True, False)


def test_proc_scan_sees_a_mapping_in_another_process(mapped_elsewhere):
    slab, conn, pid = mapped_elsewhere
    st = os.fstat(slab.fd)
    lo = staging.address(slab.map)
    # this process's own mapping of the slab does not count; the other process's does
    own = (lo, lo + slab.size, slab.fd)
    assert not staging._holds(os.getpid(), st.st_dev, st.st_ino, own)
    with open(slab.path, "rb") as f:  # a reader in this very process (a checkout, say) does count
        assert staging._holds(os.getpid(), st.st_dev, st.st_ino, own)
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    assert staging._holds(os.getpid(), st.st_dev, st.st_ino, own)
    m.close()
    assert not staging._holds(os.getpid(), st.st_dev, st.st_ino, own)
    assert staging._holds(pid, st.st_dev, st.st_ino, None)
    assert staging._used_elsewhere(slab)
    conn.send("unmap")
    assert conn.recv() == "unmapped"
    assert not staging._holds(pid, st.st_dev, st.st_ino, None)


def test_without_a_trusted_lease_the_proc_scan_decides(store_root, monkeypatch):
    monkeypatch.setattr(staging, "_lease", lambda fd: None)  # as where leases are unavailable
    with ParamStore(store_root, shard_size_bytes=SHARD, retention=KeepLast(1)) as store:
        for step in range(1, 6):
            store.commit(step, model(step)).result()
            settle(store)
            assert_checkout_equal(store, step, model(step))
        pool = store._pool
        # reused only if every process could be inspected (here some may not be: then none is);
        # every slab GC handed back was either reused or deleted
        deadline = time.monotonic() + 30
        while pool._recycled and time.monotonic() < deadline:
            time.sleep(0.01)
        settle(store)
        assert pool.stats["recycled"] > 0
        assert store.verify()["ok"]


# -- crash safety ------------------------------------------------------------------------------
def _trainer_that_hangs(root: str, conn) -> None:
    store = ParamStore(root, shard_size_bytes=SHARD, retention=KeepLast(1))
    store.prepare(model(0), wait=True)
    store.commit(1, model(1)).result()
    v1 = inodes(object_paths(store, 1))
    store.commit(2, model(2)).result()
    settle(store)
    tmp = tmp_inodes(store)
    conn.send(sorted(os.path.basename(tmp[i]) for i in v1 if i in tmp))  # v1's files, now slabs of ours
    time.sleep(600)


def test_recycled_slabs_of_a_killed_process_are_reclaimed_by_gc(store_root):
    conn, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_trainer_that_hangs, args=(store_root, child))
    proc.start()
    try:
        assert conn.poll(120)
        recycled = conn.recv()
        assert recycled and all(name.startswith(f"slab-{proc.pid}-") for name in recycled)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    with ParamStore(store_root) as store:
        tmp = os.path.join(store.root, "tmp")
        assert set(recycled) <= set(os.listdir(tmp))
        report = store.gc()
        assert set(recycled) <= set(report.temporary_files)
        assert os.listdir(tmp) == []
        assert_checkout_equal(store, 2, model(2))
        v = store.verify()
        assert v["ok"] and not v["leftovers"], v


# -- the option off ----------------------------------------------------------------------------
def test_recycle_buffers_off_deletes_swept_objects_as_before(store_root):
    with ParamStore(store_root, shard_size_bytes=SHARD, retention=KeepLast(1), recycle_buffers=False,
                    create=True) as store:
        pool = store._pool
        assert not pool.recycling and not staging.recyclers(pool._tmp)
        store.prepare(model(0), wait=True)
        swept: dict[int, str] = {}
        for step in range(1, 6):
            store.commit(step, model(step)).result()
            swept.update(inodes(object_paths(store, step)))
            settle(store)
            assert_checkout_equal(store, step, model(step))
            assert not pool._retired  # published buffers are unmapped at once
        assert pool.stats["recycled"] == pool.stats["reused"] == 0
        live = set(inodes(object_paths(store, 5)))
        assert not (set(swept) - live) & set(tmp_inodes(store))  # no swept file came back as a slab
        assert store.verify()["ok"]


def test_no_retention_means_no_recycling(store_root):
    with ParamStore(store_root, shard_size_bytes=SHARD, create=True) as store:
        assert not store._pool.recycling
        store.commit(1, model(1)).result()
        assert not store._pool._retired


# -- GC elsewhere, hashing while copying -------------------------------------------------------
def test_mappings_of_objects_deleted_by_another_gc_are_released(store_root):
    from paramstore.maintenance import gc, prune
    from paramstore.root import open_root

    with ParamStore(store_root, shard_size_bytes=SHARD, retention=KeepLast(5)) as store:
        for step in range(1, 4):
            store.commit(step, model(step)).result()
            settle(store)
        retired = dict(store._pool._retired)
        assert retired
        other = open_root(store_root, create=False)  # another GC (here: same process, no pool of its own)
        try:
            prune(other, KeepLast(1))
            staging._pools.clear()  # as in another process: no pool to recycle into
            gc(other)
        finally:
            other.close()
        store.commit(4, model(4)).result()
        settle(store)
        for key, slab in retired.items():  # those files were unlinked: their mappings went too
            if slab.fd < 0 or os.fstat(slab.fd).st_nlink == 0:
                assert key not in store._pool._retired
        assert all(os.fstat(s.fd).st_nlink for s in store._pool._retired.values())
        assert_checkout_equal(store, 4, model(4))


@pytest.mark.parametrize("cores", [1, 2, 4])
def test_hashing_overlapped_with_the_copy_is_exact(store_root, monkeypatch, cores):
    monkeypatch.setattr(commit_mod, "cores", lambda: cores)
    with ParamStore(store_root, shard_size_bytes=SHARD, retention=KeepLast(2), create=True) as store:
        hashers = store._write._get_committer()._hashers
        assert (hashers.threads, hashers.while_staging) == (cores, {1: 0, 2: 1, 4: 2}[cores])
        prev = None
        for step in range(1, 7):
            m = model(step)
            m["tied"] = m["w1"]  # an alias
            if step % 2 == 0:
                m["w2"] = prev["w2"]  # unchanged: deduplicated, its shard compacted
            store.commit(step, m).result()
            assert_checkout_equal(store, step, m)
            prev = m
            settle(store)
        assert store.verify()["ok"]


def _overlap_commit(store_root: str, monkeypatch: pytest.MonkeyPatch, cores: int, torn: bool = False,
                    wait_s: float = 60.0):
    """A store and a model whose first tensor is three pieces (17 MiB); the copy of its last tensor
    waits (up to ``wait_s``) until a hash thread has taken a unit, if one may run while staging.
    Returns the store, the model, the committer's hash queue and {"overlapped": whether one had}."""
    monkeypatch.setattr(commit_mod, "cores", lambda: cores)
    m = {"first": random_tensor(torch.float32, ((17 << 20) // 4,), 1)}  # 3 pieces of 8 MiB
    m.update({f"w{i}": random_tensor(torch.float32, (4096,), 10 + i) for i in range(8)})
    m["last"] = random_tensor(torch.float32, (1 << 18,), 2)
    seen: dict[str, bool] = {}
    real = commit_mod._Copier.copy

    def copy(self, dst, src, **kw):
        if src.data_ptr() == m["last"].data_ptr() and "overlapped" not in seen:  # the first commit only
            deadline = time.monotonic() + wait_s
            while hashers.started_while_staging == 0 and hashers.while_staging and time.monotonic() < deadline:
                time.sleep(0.001)
            seen["overlapped"] = hashers.started_while_staging > 0
            if torn:
                m["first"].add_(1.0)  # no effect on the torn check: "first" is copied already
                src.add_(1.0)  # changed before its copy: the commit must fail
        return real(self, dst, src, **kw)

    monkeypatch.setattr(commit_mod._Copier, "copy", copy)
    store = ParamStore(store_root, create=True)
    hashers = store._write._get_committer()._hashers
    return store, m, hashers, seen


def test_pieces_are_hashed_while_the_commit_is_still_copying(store_root, monkeypatch):
    """With a spare core, a piece is hashed as soon as its tensor is copied, before staging ends
    (the copy of the last tensor waits for it: no timing involved); the version is exact."""
    store, m, hashers, seen = _overlap_commit(store_root, monkeypatch, cores=2)
    with store:
        h = store.commit(1, m)
        assert h.result(timeout=60).step == 1
        assert seen["overlapped"] and hashers.started_while_staging >= 1
        assert_checkout_equal(store, 1, m)
        assert store.verify()["ok"]


def test_a_streaming_commit_hashes_while_its_tensors_arrive(store_root, monkeypatch, shm_dir):
    """With cores to spare (4), a commit of an iterable hands each tensor to the hash threads once
    copied, as a state dict's does (the copy of its last tensor waits for a hash thread to start: no
    timing); its digests are those of the same tensors committed as a state dict, also after a
    commit whose layout lost a tensor (its shard compacted, the early digests' bytes moved)."""
    store, m, hashers, seen = _overlap_commit(store_root, monkeypatch, cores=4)
    with store:
        h = store.commit(1, iter(list(m.items())))
        assert h.result(timeout=60).step == 1
        assert seen["overlapped"] and hashers.started_while_staging >= 1
        assert_checkout_equal(store, 1, m)
        fewer = {k: v for k, v in m.items() if k != "w3"}  # its shard loses a tensor: compacted
        fewer["first"] = fewer["first"] + 1
        store.commit(2, iter(list(fewer.items()))).result(timeout=60)
        assert_checkout_equal(store, 2, fewer)
        assert store.verify()["ok"]
        streamed = [store.manifest(s).digest() for s in (1, 2)]
    with ParamStore(os.path.join(shm_dir, "as-dicts")) as other:
        other.commit(1, m).result(timeout=60)
        other.commit(2, fewer).result(timeout=60)
        assert [other.manifest(s).digest() for s in (1, 2)] == streamed


def test_a_streaming_commit_on_two_cores_leaves_the_callers_copy_its_core(store_root, monkeypatch):
    """On a small host a stream is copied on the caller's (the trainer's) thread: nothing is hashed
    beside it (that would slow the trainer), the publisher hashes after the last tensor."""
    store, m, hashers, seen = _overlap_commit(store_root, monkeypatch, cores=2, wait_s=1.0)  # 1 s: would have
    with store:
        assert store.commit(1, iter(list(m.items()))).result(timeout=60).step == 1
        assert seen["overlapped"] is False and hashers.started_while_staging == 0
        assert_checkout_equal(store, 1, m)


def test_one_core_hashes_nothing_while_copying(store_root, monkeypatch):
    store, m, hashers, seen = _overlap_commit(store_root, monkeypatch, cores=1)
    with store:
        assert store.commit(1, m).result(timeout=60).step == 1
        assert seen["overlapped"] is False and hashers.started_while_staging == 0
        assert_checkout_equal(store, 1, m)


def test_a_torn_commit_hashed_while_copying_fails_and_stores_nothing(store_root, monkeypatch):
    from paramstore.errors import TornCommitError

    store, m, hashers, seen = _overlap_commit(store_root, monkeypatch, cores=2, torn=True)
    with store:
        h = store.commit(1, m)
        with pytest.raises(TornCommitError, match="'last'"):
            h.result(timeout=60)
        assert seen["overlapped"]
        assert store.versions() == []
        m["last"].sub_(1.0)
        assert store.commit(1, m).result(timeout=60).step == 1
        assert_checkout_equal(store, 1, m)
