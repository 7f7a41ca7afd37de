"""Device checkouts (``checkout(v, device=...)``) and the device tier behind them.

On a CPU-only host: what ``device="cpu"`` means (the zero-copy views), the errors for a device
that is not there, and the device cache's logic (views of whole-object buffers, tied names, chunked
tensors, only changed objects copied, buffers of open snapshots kept) driven on CPU buffers. The
CUDA copies and CUDA IPC run in the ``gpu``-marked tests at the end (skipped without a GPU).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest
import torch

from paramstore import InvalidArgumentError, ParamStore
from paramstore.errors import DeviceError, StoreClosedError
from paramstore.device import DeviceCache


def state(seed: int, *, big: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(big, 8, generator=g).to(torch.bfloat16),
        "w": torch.randn(64, 64, generator=g),
        "b": torch.randn(64, generator=g).to(torch.float16),
        "steps": torch.arange(5, dtype=torch.int64) + seed,
        "mask": torch.rand(33, generator=g) > 0.5,
    }


def test_cpu_means_the_zero_copy_views(store):
    store.commit(1, state(1)).result()
    with store.checkout(1) as plain, store.checkout(1, device="cpu") as snap:
        assert snap.device == torch.device("cpu") and snap.device_source is None and snap.device_bytes == 0
        for name in plain:
            assert torch.equal(snap[name], plain[name])
            # a view of the same shared-memory object file, not a copy
            assert snap[name].untyped_storage().nbytes() == plain[name].untyped_storage().nbytes()


def test_a_device_that_is_not_here_is_refused_before_any_lease(store):
    store.commit(1, state(1)).result()
    missing = "cuda:0" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(DeviceError, match="cuda"):
        store.checkout(1, device=missing)
    with pytest.raises(DeviceError, match="no such device type"):
        store.checkout(1, device="warp:0")
    with pytest.raises(InvalidArgumentError):
        store.checkout(1, device=3.5)
    assert store.leases() == []


def test_device_latest_needs_cuda(store_root):
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="not available"):
            ParamStore(store_root, create=True, device_latest=True)
    with pytest.raises(DeviceError, match="CUDA IPC"):
        ParamStore(store_root, create=True, device_latest="cpu")
    with pytest.raises(InvalidArgumentError):
        ParamStore(store_root, create=True, device_latest=7)
    with pytest.raises(InvalidArgumentError):
        ParamStore(store_root, create=True, device_bucket_bytes=0)


def test_the_device_cache_views_whole_object_buffers(store_root):
    """Driven on CPU buffers: the same code builds CUDA snapshots (the device is the only change)."""
    want = state(1)
    want["tied"] = want["w"]  # tied names: one stored tensor
    with ParamStore(store_root, create=True, shard_size_bytes=16 << 10) as store:
        store.commit(1, want).result()
        cache = DeviceCache(bucket_bytes=4096)  # several buckets per object
        snap = cache.place(store.checkout(1), torch.device("cpu"), store._root)
        try:
            objects = snap.manifest.objects()
            assert snap.device_source == "copy"
            assert snap.device_bytes == sum(store._root.tier.size(o) for o in objects)
            for name, t in want.items():
                assert snap[name].dtype == t.dtype and torch.equal(snap[name], t), name
            assert snap["tied"] is snap["w"]
            # views of the device tier's buffers, not of the shared-memory pages
            buffers = {cache.tier(torch.device("cpu")).buffer(o).data_ptr() for o in objects}
            assert snap["w"].untyped_storage().data_ptr() in buffers
            assert snap._maps  # the shared-memory mapping stays, for assets and verify
            assert snap.verify() == {}
        finally:
            snap.close()


def test_only_changed_objects_move_and_open_snapshots_keep_theirs(store_root):
    a = state(1, big=16384)
    b = dict(a, w=a["w"] + 1)  # one small tensor changed: one object of several
    with ParamStore(store_root, create=True, shard_size_bytes=32 << 10) as store:
        store.commit(1, a).result()
        store.commit(2, b).result()
        cache = DeviceCache(bucket_bytes=8192)
        cpu = torch.device("cpu")
        first = cache.place(store.checkout(1), cpu, store._root)
        one, two = store.manifest(1).objects(), store.manifest(2).objects()
        assert len(one) >= 2 and len(two - one) == 1
        second = cache.place(store.checkout(2), cpu, store._root)
        new = next(iter(two - one))
        assert second.device_bytes == store._root.tier.size(new)  # only the changed object moved
        assert torch.equal(second["w"], b["w"]) and torch.equal(first["w"], a["w"])
        tier = cache.tier(cpu)
        assert set(tier.list()) == one | two  # version 1 is still open: its buffers stay
        first.close()
        third = cache.place(store.checkout(2), cpu, store._root)
        assert third.device_bytes == 0 and set(tier.list()) == two  # closed: version 1's own object dropped
        for s in (second, third):
            s.close()
        with pytest.raises(StoreClosedError):
            third["emb"]


def test_chunked_tensors_are_assembled_on_the_snapshot_device(store_root):
    """A tensor stored in blocks (a sharded commit) is assembled on the snapshot's device."""
    from paramstore.snapshot import Snapshot

    with ParamStore(store_root, create=True) as store:
        store.commit(1, state(1)).result()
        cache = DeviceCache()
        snap = cache.place(store.checkout(1), torch.device("cpu"), store._root)
        try:
            box = snap.read("w", (3, 5), (4, 6))  # read() makes its output on snap.device
            assert box.device == snap.device and torch.equal(box, state(1)["w"][3:7, 5:11])
            assert isinstance(snap, Snapshot)
        finally:
            snap.close()


def test_a_derived_snapshot_is_placed_like_any_other(store_root):
    """checkout(v, recipe=..., device=...): the derived snapshot's objects (derived and committed)
    go through the same device cache (driven on CPU buffers here; CUDA in the gpu test below)."""
    from paramstore import recipes

    want = {"mlp.up_proj.weight": torch.randn(256, 384).bfloat16(), "norm.weight": torch.ones(384).bfloat16()}
    expected = recipes.derive("fp8-block128", want)
    with ParamStore(store_root, create=True) as store:
        store.commit(1, want).result()
        snap = DeviceCache(bucket_bytes=4096).place(store.checkout(1, recipe="fp8-block128"), torch.device("cpu"),
                                                    store._root)
        try:
            assert snap.device_source == "copy" and snap.recipe == "fp8-block128"
            assert snap.device_bytes == sum(store._root.tier.size(o) for o in snap.manifest.objects())
            for name, t in expected.items():
                got = snap[name]
                assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
        finally:
            snap.close()
        assert store.leases() == []


# -- on a GPU -------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device in this process")


@pytest.mark.gpu
@cuda
def test_cuda_checkout_is_bit_exact_and_moves_only_what_changed(store_root):
    a = state(1, big=1 << 16)
    b = dict(a, w=a["w"] * 2)
    with ParamStore(store_root, create=True, shard_size_bytes=256 << 10, device_bucket_bytes=64 << 10) as store:
        store.commit(1, a).result()
        store.commit(2, b).result()
        with store.checkout(1, device="cuda:0") as s1:
            assert s1.device == torch.device("cuda", 0) and s1.device_source == "copy"
            for name, t in a.items():
                assert s1[name].is_cuda and torch.equal(s1[name].cpu(), t), name
            with store.checkout(2, device="cuda") as s2:
                changed = store.manifest(2).objects() - store.manifest(1).objects()
                assert s2.device_bytes == sum(store._root.tier.size(o) for o in changed)
                assert torch.equal(s2["w"].cpu(), b["w"])


@pytest.mark.gpu
@cuda
def test_a_cuda_checkout_in_a_recipes_form_is_bit_exact(store_root):
    from paramstore import recipes

    want = {"mlp.up_proj.weight": torch.randn(256, 384).bfloat16(), "norm.weight": torch.ones(384).bfloat16()}
    expected = recipes.derive("fp8-block128", want)
    with ParamStore(store_root, create=True) as store:
        store.commit(1, want).result()
        with store.checkout(1, recipe="fp8-block128", device="cuda:0") as snap:
            assert snap.device == torch.device("cuda", 0) and snap.recipe == "fp8-block128"
            for name, t in expected.items():
                got = snap[name]
                assert got.is_cuda and got.dtype == t.dtype, name
                assert torch.equal(got.cpu().view(torch.uint8), t.view(torch.uint8)), name
        assert store.leases() == []


def _ipc_reader(root: str, step: int, out: str) -> None:
    torch.cuda.set_device(0)
    with ParamStore(root) as store, store.checkout(step, device="cuda:0") as snap:
        sums = {n: float(snap[n].double().sum().item()) for n in snap}
        with open(out, "w") as f:
            json.dump({"source": snap.device_source, "bytes": snap.device_bytes, "sums": sums}, f)


@pytest.mark.gpu
@cuda
def test_a_colocated_reader_maps_the_latest_through_cuda_ipc(store_root, tmp_path):
    a = state(3, big=1 << 15)
    with ParamStore(store_root, create=True, device_latest="cuda:0") as store:
        store.commit(1, {k: v.cuda() for k, v in a.items()}).result()
        assert store._write.exporter is not None and store._write.exporter.wait(1, timeout=60)
        assert store._write.exporter.error is None
        out = str(tmp_path / "reader.json")
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=_ipc_reader, args=(store_root, 1, out))
        p.start()
        p.join(120)
        assert p.exitcode == 0
        with open(out) as f:
            got = json.load(f)
        assert got["source"] == "ipc" and got["bytes"] == 0
        for n, t in a.items():
            assert got["sums"][n] == pytest.approx(float(t.double().sum().item()), rel=0, abs=1e-6), n
        # the next commit allocates new buffers; version 1's go once nobody leases it
        store.commit(2, {k: (v + 1 if v.is_floating_point() else v).cuda() for k, v in a.items()}).result()
        assert store._write.exporter.wait(2, timeout=60)
        assert set(store._write.exporter._exported) == {2}
        assert os.path.exists(store._write.exporter.path)


def test_src_and_bucket_bytes_need_a_group(store):
    store.commit(1, state(1)).result()
    for kwargs in ({"src": 1}, {"bucket_bytes": 1 << 20}):
        with pytest.raises(InvalidArgumentError, match="group="):
            store.checkout(1, **kwargs)
    assert store.leases() == []


def test_a_failed_device_placement_releases_the_lease(store, monkeypatch):
    """Whatever fails while the snapshot moves to a device, the checkout leaves no lease behind."""
    store.commit(1, state(1)).result()
    from paramstore.backends.tiers.device import DeviceTier

    def refuse(self, sources):
        raise DeviceError("out of device memory (made up for this test)")

    monkeypatch.setattr(DeviceTier, "load", refuse)  # a device out of memory: not to be had on a CPU host
    cache = DeviceCache()
    # the placement a device checkout makes, onto this host's CPU (the only device here)
    monkeypatch.setattr(store._read, "_device_placer",
                        lambda device: lambda snap: cache.place(snap, torch.device("cpu"), store._root))
    with pytest.raises(DeviceError, match="made up"):
        store.checkout(1, device="cpu")
    assert store.leases() == []


def test_parsing_a_manifest_restores_the_collector_as_it_was(store):
    import gc

    from paramstore.manifest import Manifest

    store.commit(1, state(1)).result()
    raw = json.dumps(store.manifest(1).to_json())
    assert gc.isenabled()
    assert Manifest.parse(raw) == store.manifest(1) and gc.isenabled()
    gc.disable()
    try:
        Manifest.parse(raw)
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()
