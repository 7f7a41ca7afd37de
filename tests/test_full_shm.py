"""A full shared-memory filesystem fails the commit cleanly (ENOSPC), never with SIGBUS.

Uses a real 2 MiB tmpfs mounted in a private mount namespace (needs root and `unshare`; skipped
otherwise).
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from helpers import run_in_small_tmpfs

CHILD = textwrap.dedent("""
    import sys, torch, paramstore
    root = sys.argv[1]
    with paramstore.ParamStore(root, prepare_buffers=False) as store:
        store.commit(1, {"small": torch.ones(16)}).result()
        try:
            store.commit(2, {"big": torch.ones(4 << 20)}).result()  # 16 MiB into a 2 MiB tmpfs
        except OSError as e:  # the package's error, naming this filesystem (not /dev/shm)
            ok = isinstance(e, paramstore.StorageFullError) and e.errno == 28 and root in str(e) and "/dev/shm" not in str(e)
            print("ENOSPC" if ok else repr(e).replace(" ", "_"))
        with store.checkout("latest") as snap:
            print("latest", snap.step, float(snap["small"].sum()))
""")


def test_full_tmpfs_fails_the_commit_not_the_process(tmp_path):
    proc = run_in_small_tmpfs(tmp_path, "2m", CHILD)
    assert proc.returncode == 0, f"exit {proc.returncode} (135 = SIGBUS): {proc.stderr}"
    assert proc.stdout.split() == ["ENOSPC", "latest", "1", "16.0"], proc.stdout


# -- a full store recovers: retention and GC run before a commit gives up ---------------------------
# The model is sized from the space left once the store exists (whatever the registry reserves), so
# that ``keep`` versions plus one being written fit, with half a model to spare, but no more: the
# pool cannot also hold its prepared buffers, and every commit after the first few finds the
# filesystem full. Retention after each commit is switched off (Maintainer.poke does nothing), so
# only the committer's own call (Maintainer.reclaim) can make room: every commit must still succeed.
RECOVER = textwrap.dedent("""
    import os, sys, torch, paramstore
    from paramstore.maintenance import Maintainer
    from paramstore.retention import KeepLast
    root, keep, prepare = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    Maintainer.poke = lambda self, *a: None  # retention runs only when a commit finds the disk full
    reclaims = []
    real = Maintainer.reclaim  # what the store hands its committer
    Maintainer.reclaim = lambda self, *a, **k: reclaims.append(1) or real(self, *a, **k)
    with paramstore.ParamStore(root, retention=KeepLast(keep), prepare_buffers=prepare) as store:
        st = os.statvfs(os.path.dirname(root))  # the tmpfs
        model_bytes = int(st.f_bavail * st.f_frsize / (keep + 1.5)) // 65536 * 65536 - 65536
        model = {f"w{i}": torch.zeros(model_bytes // 16) for i in range(4)}  # 4 float32 tensors
        committed = 0
        for step in range(1, 21):
            for i, t in enumerate(model.values()):
                t.fill_(step * 10 + i)  # every tensor changes: no deduplication
            committed += store.commit(step, model).result(timeout=60).step == step
        # the last commit was not followed by a prune: one version more than retention keeps
        print("committed", committed, "kept", len(store.versions()) <= keep + 1, "reclaims", len(reclaims) > 0)
        print("alive", store._pool._thread is None or store._pool._thread.is_alive())
""")


@pytest.mark.parametrize("keep, prepare", [(1, True), (2, False)])
def test_full_tmpfs_commits_go_on_with_retention(tmp_path, keep, prepare):
    proc = run_in_small_tmpfs(tmp_path, "6m", RECOVER, str(keep), "1" if prepare else "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["committed", "20", "kept", "True", "reclaims", "True", "alive", "True"], \
        proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr


# -- the tmpfs filled by another file: a clean error, and recovery once the file is gone -------------
# A filler leaves room for one version and half a model: the first commit fits, the pool's
# background thread then fails to prepare the next buffers (ENOSPC: recorded, the thread lives on),
# the second commit fails with StorageFullError even after retention and GC. Once the filler is
# deleted the third commit succeeds and the pool prepares buffers again.
FILLED = textwrap.dedent("""
    import os, sys, time, torch, paramstore
    from paramstore.retention import KeepLast
    root = sys.argv[1]
    mnt = os.path.dirname(root)
    with paramstore.ParamStore(root, retention=KeepLast(1)) as store:
        st = os.statvfs(mnt)
        free = st.f_bavail * st.f_frsize
        model_bytes = free // 4 // 65536 * 65536
        model = {f"w{i}": torch.full((model_bytes // 16,), float(i)) for i in range(4)}
        filler = os.path.join(mnt, "filler")
        fd = os.open(filler, os.O_RDWR | os.O_CREAT, 0o644)
        os.posix_fallocate(fd, 0, free - int(1.5 * model_bytes))
        os.close(fd)
        store.commit(1, model).result(timeout=60)
        pool = store._pool
        deadline = time.monotonic() + 20
        while pool.prefault_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        print("prefault", type(pool.prefault_error).__name__, "alive", pool._thread.is_alive())
        try:
            store.commit(2, model).result(timeout=60)
            print("committed 2")
        except paramstore.StorageFullError as e:
            print("full", e.errno, mnt in str(e), "/dev/shm" not in str(e), "step 2" in str(e))
        try:
            store.prepare(model, wait=True, timeout=20)
            print("prepared")
        except paramstore.StorageFullError:
            print("prepare-full")
        print("alive", pool._thread.is_alive())
        os.unlink(filler)
        print("committed", store.commit(3, model).result(timeout=60).step)
        print("prepared", pool.wait_prepared(20), pool.prefault_error is None, pool._thread.is_alive(),
              sum(len(v) for v in pool._free.values()) >= 2)
        with store.checkout("latest") as snap:
            print("latest", snap.step, float(snap["w3"][0]))
""")


def test_full_tmpfs_filled_by_another_file(tmp_path):
    proc = run_in_small_tmpfs(tmp_path, "6m", FILLED)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "prefault StorageFullError alive True",
        "full 28 True True True",
        "prepare-full",
        "alive True",
        "committed 3",
        "prepared True True True True",
        "latest 3 3.0",
    ], proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr


# -- a rebuild from a patch on a full filesystem: StorageFullError, nothing placed or left -------------
REBUILD = textwrap.dedent("""
    import os, sys, torch, paramstore
    from paramstore.delta import rebuild
    root = sys.argv[1]
    with paramstore.ParamStore(root, patches=True, prepare_buffers=False) as store:
        w = torch.randn(2 << 20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # 4 MiB
        store.commit(1, {"w": w}).result()
        w.view(torch.int16)[::100] += 1
        store.commit(2, {"w": w}).result()
        store.flush()
        [pairs] = store._root.registry.patches().values()
        [target] = [o for o in store.manifest(2).objects() if o in pairs]
        size = store._root.registry.object_sizes([target])[target]
        os.unlink(store._root.tier.object_path(target))
        before = set(store._root.tier.leftovers())
        st = os.statvfs(root)
        filler = os.path.join(os.path.dirname(root), "filler")
        with open(filler, "wb") as f:  # 1 MiB left: the rebuilt object does not fit
            f.write(bytes(st.f_bavail * st.f_frsize - (1 << 20)))
        try:
            rebuild(store._root, None, pairs[target], target, size)  # into a new file (no slab: pwrite)
            print("placed")
        except paramstore.StorageFullError as e:
            print("ENOSPC" if e.errno == 28 and root in str(e) else repr(e).replace(" ", "_"))
        print(sorted(set(store._root.tier.leftovers()) - before), store._root.tier.exists(target))
        os.unlink(filler)
        rebuild(store._root, store._pool, pairs[target], target, size)
        with store.checkout(2) as snap:
            print(torch.equal(snap["w"], w))
""")


def test_a_rebuild_on_a_full_filesystem_places_nothing_and_leaves_nothing(tmp_path):
    proc = run_in_small_tmpfs(tmp_path, "32m", REBUILD)
    assert proc.returncode == 0, f"exit {proc.returncode} (135 = SIGBUS): {proc.stderr}"
    assert proc.stdout.split() == ["ENOSPC", "[]", "False", "True"], proc.stdout
