"""Patches between versions (paramstore/delta.py): made after commit, used where bytes would move,
verified, dropped with their base.

Single-host tests take an object of a version away (as a host that never had it) and check it out
again: the store rebuilds it from a patch against a version it holds. The multi-host test runs real
processes with a redis-server and Mooncake over TCP (see test_peers.py)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from paramstore import ParamStore
from paramstore.remote import Remote
from paramstore.retention import KeepLast
from paramstore.delta import make_patches, patch_summary, plan_chain
from paramstore.errors import CorruptObjectError, ObjectUnavailableError


def weights(step: int, n: int = 4, numel: int = 64 * 1024, fraction: float = 0.01) -> dict[str, torch.Tensor]:
    """bf16 weights at ``step``: step 1 random, each later step changes ``fraction`` of each tensor's elements."""
    g = torch.Generator().manual_seed(0)
    out = {f"layer{i}.weight": torch.randn(numel, generator=g).to(torch.bfloat16) for i in range(n)}
    out["step"] = torch.tensor([step])  # a tensor that always changes whole (8 bytes)
    for s in range(2, step + 1):
        for i in range(n):
            t = out[f"layer{i}.weight"]
            idx = torch.randperm(numel, generator=torch.Generator().manual_seed(s * 100 + i))[: int(fraction * numel)]
            t[idx] += 1.0
    return out


def new_objects(store: ParamStore, step: int, before: int) -> list[str]:
    return sorted(store.manifest(step).objects() - store.manifest(before).objects())


def drop(store: ParamStore, objects: list[str]) -> None:
    """Remove objects from the shared-memory tier, as on a host that never received them."""
    for o in objects:
        os.unlink(store._root.tier.object_path(o))


def flip(path: str, from_end: int, mask: int) -> None:
    """XOR the byte ``from_end`` bytes before the end of the file at ``path`` with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - from_end)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ mask]))


def equal(snap, want: dict[str, torch.Tensor]) -> bool:
    return set(snap) == set(want) and all(torch.equal(snap[k], v) for k, v in want.items())


def test_a_missing_object_is_rebuilt_from_a_patch_bit_exact(store_root):
    with ParamStore(store_root, patches=True, shard_size_bytes=1 << 20) as store:
        store.commit(1, weights(1))
        store.commit(2, weights(2))
        assert store.flush().step == 2
        report = store._write.patcher.last
        assert report.base == 1 and report.error is None
        model_bytes = sum(t.nbytes for t in weights(2).values())
        assert 0 < report.bytes < 0.1 * model_bytes  # 1% of elements changed
        targets = new_objects(store, 2, 1)
        assert set(report.patches) == set(targets)
        drop(store, targets)
        with store.checkout(2) as snap:
            assert equal(snap, weights(2))
            assert sorted(snap.fetch.from_patches) == targets and snap.fetch.moved
            assert snap.fetch.as_dict()["from_patches"] == len(targets)
        report = store.verify()  # the patch objects are objects like any other
        assert report["ok"] and report["corrupt"] == {} and report["missing"] == [], report


def test_patches_are_kept_only_when_smaller(store_root):
    with ParamStore(store_root, patches=True) as store:
        store.commit(1, weights(1))
        store.commit(2, weights(2, fraction=0.9))  # most elements changed: a patch would not pay
        store.flush()
        assert store._write.patcher.last.patches == {}
        assert store._root.registry.patches() == {(1, 2): {}}  # made, none kept: readers stop waiting


def patches_damaged_then_checked_out(store_root: str, tmp_path, damage, warning: str) -> None:
    """Versions 1 and 2 (patches 1 -> 2 made, whole objects in a file:// remote); ``damage(path)``
    every patch object, take version 2's new objects away, check 2 out: each patch is refused
    (``warning``), the objects come whole from the remote, and the weights are right."""
    remote = Remote(f"file://{tmp_path}/remote", full_every=1)  # the remote holds whole objects only
    with ParamStore(store_root, remote=remote, shard_size_bytes=1 << 20) as store:  # patches: on with a remote
        store.commit(1, weights(1))
        store.commit(2, weights(2))
        store.flush()
        store.wait_persisted(timeout=60)
        [(pair, pairs)] = store._root.registry.patches().items()
        assert pair == (1, 2)
        for patch in set(pairs.values()):
            damage(store._root.tier.object_path(patch))
        targets = new_objects(store, 2, 1)
        drop(store, targets)
        with pytest.warns(RuntimeWarning, match=warning):
            snap = store.checkout(2)
        with snap:
            assert equal(snap, weights(2))
            assert snap.fetch.from_patches == [] and snap.fetch.rejected["patch"] == len(targets)
            assert sorted(snap.fetch.from_remote) == targets  # whole, from the remote


def test_a_corrupted_patch_is_detected_and_the_whole_object_used(store_root, tmp_path):
    patches_damaged_then_checked_out(store_root, tmp_path, lambda path: flip(path, 3, 0x40), "fetched whole")


def test_a_chain_rebuilds_v_from_v_minus_2(store_root):
    with ParamStore(store_root, patches=True, shard_size_bytes=1 << 20) as store:
        for s in (1, 2, 3):
            store.commit(s, weights(s))
            store.flush()
        assert set(store._root.registry.patches()) == {(1, 2), (2, 3)}
        lost = new_objects(store, 2, 1) + new_objects(store, 3, 2)
        drop(store, lost)  # this host holds version 1 only
        assert [(b, t) for b, t, _ in plan_chain(store._root, 3, set(new_objects(store, 3, 2)))] == [(1, 2), (2, 3)]
        with store.checkout(3) as snap:
            assert equal(snap, weights(3))
            assert sorted(snap.fetch.from_patches) == sorted(lost)  # version 2 rebuilt on the way


def test_retention_drops_the_patches_of_pruned_bases_and_gc_frees_them(store_root):
    with ParamStore(store_root, patches=True, retention=KeepLast(2), shard_size_bytes=1 << 20) as store:
        store.commit(1, weights(1))
        store.commit(2, weights(2))
        store.flush()
        first = set(store._root.registry.patches()[(1, 2)].values())
        assert all(store._root.tier.exists(p) for p in first)
        store.commit(3, weights(3))
        store.flush()
        store._write.maintainer.wait_idle(30)
        store.gc()  # another pass, in case the background one ran before the prune
        assert set(store._root.registry.patches()) == {(2, 3)}  # version 1 went, and the patch to 2 with it
        assert not any(store._root.tier.exists(p) for p in first)
        kept = set(store._root.registry.patches()[(2, 3)].values())
        assert all(store._root.tier.exists(p) for p in kept)
        drop(store, new_objects(store, 3, 2))
        with store.checkout(3) as snap:
            assert equal(snap, weights(3)) and snap.fetch.from_patches


def test_with_patches_off_nothing_is_made_or_used(store_root):
    with ParamStore(store_root, patches=False) as store:
        store.commit(1, weights(1))
        store.commit(2, weights(2))
        store.flush()
        assert store._write.patcher is None and store._root.registry.patches() == {}
    with ParamStore(store_root, patches=True) as store:  # made by another process's store
        make_patches(store._root, 1, 2)
        assert patch_summary(store._root)[(1, 2)]["bytes"] > 0
    with ParamStore(store_root, patches=False) as reader:
        drop(reader, new_objects(reader, 2, 1))
        with pytest.raises(ObjectUnavailableError):
            reader.checkout(2)


def test_single_host_store_makes_no_patches_by_default(store_root):
    with ParamStore(store_root) as store:
        store.commit(1, weights(1))
        store.commit(2, weights(2))
        store.flush()
        assert store._write.patcher is None and store._root.registry.patches() == {}


def test_a_patch_for_another_object_or_a_damaged_base_is_refused(store_root):
    from paramstore.delta import rebuild

    with ParamStore(store_root, patches=True, shard_size_bytes=200 << 10) as store:
        for s in (1, 2):
            store.commit(s, weights(s))
        store.flush()
        pairs = store._root.registry.patches()[(1, 2)]
        a, b = sorted(pairs)[:2]
        drop(store, [a, b])
        store._pool.wait_prepared(60)  # (the pool's own buffers for the next commit are made by now)
        before = set(store._root.tier.leftovers())
        sizes = store._root.registry.object_sizes([a, b])
        with pytest.raises(CorruptObjectError, match="rebuilds"):
            rebuild(store._root, store._pool, pairs[a], b, sizes[b])
        for base in store.manifest(1).objects():  # flip a byte of each tensor of version 1 here
            flip(store._root.tier.object_path(base), 100, 0xFF)
        with pytest.raises(CorruptObjectError, match="damaged patch or base"):
            rebuild(store._root, store._pool, pairs[a], a, sizes[a])
        assert not store._root.tier.exists(a) and not store._root.tier.exists(b)
        assert set(store._root.tier.leftovers()) <= before  # nothing half-built left


def test_du_show_and_patches_report_patch_bytes(store_root):
    import json
    import subprocess
    import sys

    with ParamStore(store_root, patches=True, shard_size_bytes=1 << 20) as store:
        for s in (1, 2):
            store.commit(s, weights(s))
        store.flush()
        made = store._write.patcher.last.bytes
        assert store.patches() == store.patches(2) == {(1, 2): {"objects": 1, "bytes": made, "changed": 1}}
        assert store.patches(1) == {}
        du = store.du()
        assert du["patch_objects"] == 1 and du["patch_bytes"] == made and du["stored_bytes"] > made
    cli = [sys.executable, "-m", "paramstore", "--root", store_root]
    show = json.loads(subprocess.run([*cli, "show", "2", "--json"], capture_output=True, text=True, check=True).stdout)
    assert show["patches"] == [{"base": 1, "objects": 1, "bytes": made, "changed": 1}]
    text = subprocess.run([*cli, "show", "2"], capture_output=True, text=True, check=True).stdout
    assert "patches    from 1: " in text
    text = subprocess.run([*cli, "du"], capture_output=True, text=True, check=True).stdout
    assert "patches " in text and "in 1 object" in text and "in 1 objects" not in text


def test_s3_holds_patches_with_full_bases_and_restores_bit_identical(s3_remote, shm_dir):
    """Pushed through a real S3 API (moto over HTTP): versions 2 and 3 as patches, 4 whole (full_every=3),
    5 as a patch again. A fresh host restores 3 (1 whole, then 2 and 3 rebuilt) and a host holding 4
    pulls 5 as its patches only; prune keeps the bases a kept version needs; GC keeps their objects."""
    from paramstore.maintenance import gc_remote, prune_remote

    url, opts = s3_remote
    remote = Remote(url, opts, full_every=3, grace=0)
    with ParamStore(os.path.join(shm_dir, "trainer"), remote=remote, shard_size_bytes=1 << 20) as a:
        pushed = {}
        for s in (1, 2, 3, 4, 5):
            handle = a.commit(s, weights(s))
            assert handle.persisted.result(60).step == s
        pushed = {s: remote._record(s) for s in (1, 2, 3, 4, 5)}
        digests = {v.step: v.digest for v in a.versions()}
    assert [bool(pushed[s].patches) for s in (1, 2, 3, 4, 5)] == [False, True, True, False, True]
    assert {b for _, b, _ in pushed[3].patches.values()} == {2} and {b for _, b, _ in pushed[5].patches.values()} == {4}
    model_bytes = sum(pushed[1].objects.values())
    for s in (2, 3, 5):
        stored = sum(pushed[s].stored().values())
        assert stored < 0.1 * model_bytes, (s, stored)

    with ParamStore(os.path.join(shm_dir, "fresh"), remote=url, storage_options=opts) as b:
        report = b.pull(3, show_progress=False)
        assert report.from_patches and report.patch_bytes > 0
        assert report.bytes < 0.1 * model_bytes  # 3's own transfer: its patches (1 and 2 came first)
        assert sorted(v.step for v in b.versions()) == [1, 2, 3]  # the bases were restored on the way
        for s in (1, 2, 3):
            with b.checkout(s) as snap:
                assert equal(snap, weights(s)) and snap.digest == digests[s]
        b.pull(4, show_progress=False)
        five = b.pull(5, show_progress=False)
        assert five.objects == 0 and 0 < five.bytes == five.patch_bytes < 0.1 * model_bytes
        with b.checkout(5) as snap:
            assert equal(snap, weights(5))

    from paramstore.retention import KeepLast as Keep

    report = prune_remote(remote, Keep(2))  # keeps 4 and 5; 5 needs 4 (kept anyway)
    assert report.removed == [1, 2, 3]
    report = prune_remote(remote, Keep(1))  # keeps 5, which needs 4: spared
    assert report.removed == [] and report.spared == [4]
    gc_remote(remote, grace=0)
    with ParamStore(os.path.join(shm_dir, "late"), remote=url, storage_options=opts) as c:
        with c.checkout(5) as snap:
            assert equal(snap, weights(5))


# -- hostile patches (issue 25, items 1 and 2): a bad patch costs nothing and moves the object whole --
def test_a_frame_cannot_choose_what_its_reader_allocates():
    """A frame's head picks its chunk length: a tiny frame claiming 2-element chunks over 32 MiB
    (millions of chunk records before the table's length was checked), one claiming a single
    chunk of the whole tensor (its changes decompressed at once), or more changes than elements, is
    refused before anything is allocated from it."""
    import struct
    import time
    import tracemalloc

    from paramstore.patch import decode_into

    base = bytes(32 << 20)  # 16 Mi BF16 elements
    out = bytearray(len(base))
    head = struct.Struct("<4sBBH")
    for log2, changed in ((1, 1), (30, 1), (20, 1 << 30)):
        frame = head.pack(b"psp\x02", log2, 4, 0) + bytes(512)  # a 520-byte patch
        tracemalloc.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(CorruptObjectError):
                decode_into(out, base, frame, "BF16", changed, 4)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, (log2, peak)  # was ~2 GiB for log2=1
        assert time.monotonic() - t0 < 1.0


HOSTILE = {
    "no target": lambda meta, entries: meta.pop("target"),
    "empty data_offsets": lambda meta, entries: entries["head"].update(data_offsets=[]),
    "absurd size": lambda meta, entries: meta.update(size=str(1 << 50)),
    "deeply nested spans": lambda meta, entries: meta.update(spans="[" * 100_000),
    "spans of the wrong kind": lambda meta, entries: meta.update(spans='[["a", 0, 0, 0, 0, 0, 0]]'),
    "offsets outside the object": lambda meta, entries: entries["head"].update(data_offsets=[0, 1 << 40]),
}


def rewrite_patch(path: str, change) -> None:
    """Rewrite the patch object at ``path`` with ``change(meta, entries)`` applied to its header (as a
    hostile bucket or peer would serve it: the data as it was, the header rewritten)."""
    import json
    import struct

    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__")
    change(meta, header)
    raw = json.dumps({"__metadata__": meta, **header}).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


@pytest.mark.parametrize("how", sorted(HOSTILE))
def test_a_malformed_patch_object_falls_back_to_the_whole_object(store_root, tmp_path, how):
    patches_damaged_then_checked_out(store_root, tmp_path, lambda path: rewrite_patch(path, HOSTILE[how]),
                                     "malformed patch object|rebuilds")


def test_a_patch_and_record_agreeing_on_a_huge_size_allocate_nothing(store_root):
    """A patch object whose size the registry repeats (both hostile) must still match the header the
    patch carries for its target before a slab of that size is taken (1 TiB here: the tmpfs would
    refuse it with StorageFullError, not the patch with CorruptObjectError)."""
    from paramstore.delta import rebuild

    with ParamStore(store_root, patches=True, shard_size_bytes=1 << 20) as store:
        store.commit(1, weights(1))
        store.commit(2, weights(2))
        store.flush()
        [pairs] = store._root.registry.patches().values()
        target, patch = sorted(pairs.items())[0]
        rewrite_patch(store._root.tier.object_path(patch), lambda meta, entries: meta.update(size=str(1 << 40)))
        with pytest.raises(CorruptObjectError, match="malformed patch object"):
            rebuild(store._root, store._pool, patch, target, 1 << 40)


def test_verify_reports_a_damaged_patch_object_and_repair_quarantines_it(store_root):
    """Issue 25, item 3: patch objects are read by checkouts, so verify re-hashes them too."""
    with ParamStore(store_root, patches=True, shard_size_bytes=1 << 20) as store:
        store.commit(1, weights(1))
        store.commit(2, weights(2))
        store.flush()
        [pairs] = store._root.registry.patches().values()
        patch = sorted(set(pairs.values()))[0]
        assert store.verify()["ok"]
        flip(store._root.tier.object_path(patch), 3, 0x40)
        report = store.verify()
        assert not report["ok"] and report["corrupt"][patch].startswith("patch object: bytes hash to")
        assert patch not in report["orphans"] and "--repair" in report["advice"]
        repaired = store.verify(repair=True)
        assert patch in repaired["quarantined"] and repaired["ok"], repaired
        assert store.verify()["ok"] and not store._root.tier.exists(patch)
        with store.checkout(2) as snap:  # the version itself was never damaged
            assert equal(snap, weights(2))


# -- the rebuild: one pass per piece, written without a slab (issue 27) --------------------------------
def big_weights(step: int) -> dict[str, torch.Tensor]:
    """A bf16 tensor of 2.5 pieces (20 MiB: its digest is over pieces, its frame has 10 chunks), one
    of a piece and a half and a small one; at step 2, 1% of every tensor's elements changed."""
    g = torch.Generator().manual_seed(1)
    out = {"big": torch.randn(10 << 20, generator=g).to(torch.bfloat16),
           "mid": torch.randn(3 << 21, generator=g).to(torch.float32)[: 3 << 20].contiguous(),
           "small": torch.randn(1000, generator=g).to(torch.bfloat16)}
    if step > 1:
        for name, t in out.items():
            idx = torch.randperm(t.numel(), generator=torch.Generator().manual_seed(7))[: t.numel() // 100]
            t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)[idx] += 1
    return out


def _one_big_patch(store: ParamStore) -> tuple[dict[str, str], str, str]:
    """Commit :func:`big_weights` 1 and 2 (patches made): the patch record, step 2's new object and
    step 1's object (its base)."""
    store.commit(1, big_weights(1))
    store.commit(2, big_weights(2))
    store.flush()
    [pairs] = store._root.registry.patches().values()
    [target] = new_objects(store, 2, 1)
    [base] = store.manifest(1).objects()
    return pairs, target, base


def test_a_patch_object_lists_its_own_piece_digests(store_root):
    """Each patch object's header lists its tensors' piece digests, and they make its name
    (``format.listed_digests``): what lets hosts relay a patch larger than a block piece by piece.
    Here one tensor changed whole, so the patch carries its 12 MiB as they are: two pieces."""
    from paramstore.format import PIECE_SIZE, listed_digests, piece_digest, rehash

    with ParamStore(store_root, patches=True) as store:
        store.commit(1, big_weights(1))
        step2 = big_weights(2)
        step2["mid"] = torch.randn(3 << 20, generator=torch.Generator().manual_seed(9))
        store.commit(2, step2)
        store.flush()
        [pairs] = store._root.registry.patches().values()
        [patch] = set(pairs.values())
        with open(store._root.tier.object_path(patch), "rb") as f:
            data = f.read()
        tensors, pieces = listed_digests(data, len(data), patch)
        assert tensors == rehash(memoryview(data))[1]
        assert any(e - b > PIECE_SIZE for b, e in tensors), "the whole tensor is over a piece"
        assert len(pieces) > len(tensors)
        assert all(piece_digest(data[b:e]) == d for (b, e), d in pieces.items())


def test_an_object_of_many_pieces_is_rebuilt_bit_exact_with_every_piece_checked(store_root):
    """Pieces of a tensor over 8 MiB are decoded and hashed one by one (on the threads): the rebuilt
    object is the committed one, byte for byte; a byte flipped in the base inside the second piece of
    the large tensor is caught (the object's digest covers every piece), nothing is placed and nothing
    is left in tmp/."""
    from paramstore.delta import rebuild

    with ParamStore(store_root, patches=True) as store:
        pairs, target, base = _one_big_patch(store)
        path = store._root.tier.object_path(target)
        with open(path, "rb") as f:
            committed = f.read()
        size = len(committed)
        drop(store, [target])
        before = set(store._root.tier.leftovers())
        for pool in (store._pool, None):  # into a slab, into a new file
            assert rebuild(store._root, pool, pairs[target], target, size) == size
            with open(path, "rb") as f:
                assert f.read() == committed
            drop(store, [target])
        entry = store.manifest(1).tensors["big"]
        with open(store._root.tier.object_path(base), "r+b") as f:  # a byte of "big"'s second piece
            f.seek(entry.offset + (8 << 20) + 12345)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x01]))
        for pool in (store._pool, None):
            with pytest.raises(CorruptObjectError, match="damaged patch or base"):
                rebuild(store._root, pool, pairs[target], target, size)
        assert not store._root.tier.exists(target)
        assert set(store._root.tier.leftovers()) <= before


def test_a_truncated_base_or_spans_not_the_header_are_refused(store_root):
    """A base object shorter than the patch reads (truncated behind the store's back) and a patch
    whose spans do not tile the header it carries: CorruptObjectError, nothing placed."""
    from paramstore.delta import rebuild

    with ParamStore(store_root, patches=True) as store:
        pairs, target, base = _one_big_patch(store)
        size = store._root.registry.object_sizes([target])[target]
        drop(store, [target])
        base_path = store._root.tier.object_path(base)
        with open(base_path, "rb") as f:
            good = f.read()
        os.truncate(base_path, len(good) - 100)
        for pool in (store._pool, None):
            with pytest.raises(CorruptObjectError, match="does not apply"):
                rebuild(store._root, pool, pairs[target], target, size)
        with open(base_path, "wb") as f:
            f.write(good)

        def shift(meta, entries):  # the spans moved by 2 bytes: no longer the header's tensors
            import json

            spans = json.loads(meta["spans"])
            spans[0][1] -= 2
            spans[1][0] -= 2
            meta["spans"] = json.dumps(spans)

        rewrite_patch(store._root.tier.object_path(pairs[target]), shift)
        with pytest.raises(CorruptObjectError, match="spans are not the tensors"):
            rebuild(store._root, store._pool, pairs[target], target, size)
        assert not store._root.tier.exists(target)


def test_without_prepared_buffers_a_checkout_by_patches_takes_and_faults_no_slab(store_root):
    """With ``prepare_buffers=False`` a rebuild writes a new file (pwrite): no slab is made, neither on
    the spot for the rebuild nor for the next version (before: each rebuild faulted a slab of the
    object's size on the checkout's path, ~0.5 CPU-s per GiB, then unmapped it). The weights are the
    committed ones, with both destinations."""
    for prepare in (False, True):
        with ParamStore(store_root, patches=True, shard_size_bytes=1 << 20, prepare_buffers=prepare) as store:
            store.commit(1, weights(1))
            store.commit(2, weights(2))
            store.flush()
            targets = new_objects(store, 2, 1)
            drop(store, targets)
            store._pool.wait_prepared(60)
            created = store._pool.stats["created"]
            with store.checkout(2) as snap:
                assert sorted(snap.fetch.from_patches) == targets and equal(snap, weights(2))
            store._pool.wait_prepared(60)
            assert (store._pool.stats["created"] > created) is prepare, (prepare, store._pool.stats)
        shutil.rmtree(store_root)
