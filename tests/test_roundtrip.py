"""Commit -> checkout round trips, deduplication, versions, tags, waiting and the commit handle."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch import nn

import paramstore
from helpers import (
    ALL_DTYPES,
    assert_bits_equal,
    assert_state_equal,
    objects_bytes,
    random_tensor,
    tree,
)
from paramstore import ParamStore, staging
from paramstore.staging import SlabPool
from paramstore.format import parse_header


def _shapes_for(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Plain, 0-dim, empty and non-contiguous tensors of one dtype."""
    base = random_tensor(dtype, (6, 10), seed)
    return {
        "plain": random_tensor(dtype, (3, 5), seed + 1),
        "scalar": random_tensor(dtype, (), seed + 2),
        "empty": random_tensor(dtype, (0,), seed + 3),
        "empty_2d": random_tensor(dtype, (4, 0, 3), seed + 4),
        "transposed": base.t(),
        "stepped": base[1::2, ::3],
        "column": base[:, 7],
        "expanded": random_tensor(dtype, (1, 4), seed + 5).expand(3, 4),
    }


# -- every dtype, every shape ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=[str(d).removeprefix("torch.") for d in ALL_DTYPES])
def test_roundtrip_is_bit_exact_for_every_dtype(store, dtype):
    state = _shapes_for(dtype, seed=ALL_DTYPES.index(dtype) * 100)
    assert not state["transposed"].is_contiguous() and not state["stepped"].is_contiguous()
    version = store.commit(1, state).result()

    assert version.step == 1
    assert version.num_tensors == len(state)
    assert version.nbytes == sum(t.numel() * t.element_size() for t in state.values())
    with store.checkout(1) as snap:
        assert snap.step == 1 and snap.digest == version.digest
        assert_state_equal(dict(snap), state)
        for name in state:
            assert snap[name].dtype == dtype
            assert snap[name].is_contiguous(), name


def test_float_special_values_keep_their_bits(store):
    # NaN with payloads and sign, -0.0, infinities, subnormals: compared bit by bit.
    f32 = torch.tensor([0x7FC00001, 0xFFC00000, 0x7F800001, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001],
                       dtype=torch.int64).to(torch.int32).view(torch.float32)
    f64 = torch.tensor([0x7FF8000000000001, -0x8000000000000000, 0x0000000000000001, 0x7FF0000000000000],
                       dtype=torch.int64).view(torch.float64)
    f16 = torch.tensor([0x7E01, 0x8000, 0x0001, 0xFC00], dtype=torch.int32).to(torch.int16).view(torch.float16)
    bf16 = torch.tensor([0x7FC1, 0x8000, 0x0001, 0xFF80], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    f8 = torch.tensor([0x7F, 0xFF, 0x80, 0x01], dtype=torch.uint8)
    state = {
        "f32": f32, "f64": f64, "f16": f16, "bf16": bf16,
        "e4m3": f8.view(torch.float8_e4m3fn), "e5m2": f8.view(torch.float8_e5m2),
        "e4m3fnuz": f8.view(torch.float8_e4m3fnuz), "e5m2fnuz": f8.view(torch.float8_e5m2fnuz),
    }
    store.commit(1, state).result()
    with store.checkout(1) as snap:
        assert_state_equal(dict(snap), state)
        assert torch.isnan(snap["f32"][0]) and snap["f32"][3].item() == 0.0
        assert torch.signbit(snap["f32"][3])


@pytest.mark.parametrize("shard_size", [1, 100, 4096, 256 << 20])
def test_all_dtypes_in_one_commit_with_any_shard_size(store_root, shard_size):
    state = {}
    for i, dtype in enumerate(ALL_DTYPES):
        for name, t in _shapes_for(dtype, seed=1000 + 10 * i).items():
            state[f"{str(dtype).removeprefix('torch.')}.{name}"] = t
    with ParamStore(store_root, shard_size_bytes=shard_size) as store:
        store.commit(1, state).result()
        # The same tensors in another order: same content, same digest.
        v2 = store.commit(2, dict(reversed(list(state.items())))).result()
        assert v2.digest == store.get(1).digest
        for step in (1, 2):
            with store.checkout(step) as snap:
                assert_state_equal(dict(snap), state)
                objects = snap.manifest.objects()
        if shard_size < 100:
            assert len(objects) > 20
        elif shard_size == 256 << 20:
            assert len(objects) == 1


def test_small_shard_size_splits_tensors_over_many_objects(store_root):
    shard = 1024
    state = {f"t{i}": random_tensor(torch.float32, (150,), i) for i in range(8)}  # 600 B each
    state["big"] = random_tensor(torch.float32, (1250,), 99)  # 5000 B > shard
    state["small"] = random_tensor(torch.int8, (10,), 100)
    with ParamStore(store_root, shard_size_bytes=shard) as store:
        store.commit(1, state).result()
        with store.checkout(1) as snap:
            assert_state_equal(dict(snap), state)
            man = snap.manifest
        assert len(man.objects()) >= 8
        # the tensor above the shard size is alone in its object
        big_obj = man.tensors["big"].object
        assert [n for n, e in man.tensors.items() if e.object == big_obj] == ["big"]
        # no object holds more tensor bytes than the shard size, unless it holds one tensor
        by_obj: dict[str, list[int]] = {}
        for e in man.tensors.values():
            by_obj.setdefault(e.object, []).append(e.nbytes)
        for obj, sizes in by_obj.items():
            assert len(sizes) == 1 or sum(sizes) <= shard, (obj, sizes)
        assert set(store._root.registry.objects()) == man.objects()


# -- non-contiguous views and tied storage -----------------------------------------------------
def test_views_of_one_storage_are_stored_separately(store):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "base": base,
        "t": base.t(),
        "row": base[1],
        "rows_step": base[::2],
        "cols_step": base[:, 1::2],
        "flat_tail": base.view(-1)[5:],
        "as_int": base.view(torch.int32),
    }
    store.commit(1, state).result()
    with store.checkout(1) as snap:
        assert snap.manifest.aliases == {}
        assert_state_equal(dict(snap), state)


def test_conjugate_view_is_not_an_alias(store):
    z = random_tensor(torch.float32, (8,), 1).view(torch.complex64)
    state = {"z": z, "zc": z.conj()}
    store.commit(1, state).result()
    with store.checkout(1) as snap:
        assert_bits_equal(snap["zc"], z.conj().resolve_conj(), "zc")


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("counter", torch.tensor(7, dtype=torch.int64))


def test_tied_weights_checkout_as_one_tensor_and_load_into_fresh_module(store):
    torch.manual_seed(0)
    model = TiedLM()
    sd = model.state_dict()
    assert "embed.weight" in sd and "head.weight" in sd
    version = store.commit(1, model).result()
    assert version.num_tensors == len(sd)
    assert version.nbytes == sum(t.nbytes for n, t in sd.items() if n != "head.weight")

    with store.checkout(1) as snap:
        assert len(snap) == len(sd) and sorted(snap) == sorted(sd)
        assert snap["embed.weight"] is snap["head.weight"]
        assert len(snap.manifest.aliases) == 1
        assert_state_equal(dict(snap), sd)

        torch.manual_seed(1)
        fresh = TiedLM()
        assert not torch.equal(fresh.embed.weight, model.embed.weight)
        result = snap.load_into(fresh)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert fresh.head.weight is fresh.embed.weight  # still tied
    assert_state_equal(fresh.state_dict(), sd)


def test_load_into_strict_and_non_strict(store):
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    store.commit(1, src).result()
    other = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2), nn.Linear(2, 2))  # 3.* missing
    other[2] = nn.Linear(3, 2, bias=False)  # 2.bias unexpected

    with store.checkout(1) as snap:
        with pytest.raises(paramstore.errors.LoadError):
            snap.load_into(other)  # strict by default
        res = snap.load_into(other, strict=False)
        assert sorted(res.missing_keys) == ["3.bias", "3.weight"]
        assert res.unexpected_keys == ["2.bias"]
        assert torch.equal(other[0].weight, src[0].weight)
        assert torch.equal(other[2].weight, src[2].weight)

        same = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).double()
        res = snap.load_into(same, strict=True)
        assert res.missing_keys == [] and res.unexpected_keys == []
        assert same[0].weight.dtype == torch.float64  # copied into the module's own dtype
        assert torch.equal(same[0].weight, src[0].weight.double())


def test_writing_through_a_checkout_does_not_change_the_store(store):
    state = {"w": random_tensor(torch.float32, (64, 64), 1), "b": random_tensor(torch.int64, (10,), 2)}
    store.commit(1, state).result()
    files_before = tree(os.path.join(store.root, "objects"))
    with store.checkout(1) as snap:
        snap["w"].fill_(3.0)
        snap["b"].zero_()
        assert torch.all(snap["w"] == 3.0)  # the write took effect in this view
    with store.checkout(1) as snap2:
        assert_state_equal(dict(snap2), state)
    assert tree(os.path.join(store.root, "objects")) == files_before


def test_tensors_stay_valid_after_snapshot_close(store):
    state = {"w": random_tensor(torch.float32, (32,), 1)}
    store.commit(1, state).result()
    snap = store.checkout(1)
    w = snap["w"]
    snap.close()
    assert_bits_equal(w, state["w"], "w")
    with pytest.raises(paramstore.errors.StoreClosedError):
        snap["w"]


def _mapped(path: str) -> int:
    """How many mappings of ``path`` this process has (the committer may keep its own)."""
    with open("/proc/self/maps") as f:
        return sum(line.rstrip().endswith(path) for line in f)


def test_closing_a_snapshot_releases_its_lease_at_once_and_its_mappings_in_the_background(store_root, monkeypatch):
    from paramstore import snapshot as snapshot_module
    from paramstore.snapshot import release_mappings

    gently = []  # mappings dropped a few MiB at a time (nothing else held them)
    monkeypatch.setattr(snapshot_module, "unmap", lambda m: (gently.append(len(m)), staging.unmap(m)))

    with ParamStore(store_root, create=True) as writer:  # closed: its staging mappings are gone
        writer.commit(1, {"w": torch.ones(1 << 16), "v": torch.zeros(1 << 16)}).result()
    store = ParamStore(store_root)
    files = [os.path.realpath(store._open.root.tier.object_path(o)) for o in store.manifest(1).objects()]
    before = [_mapped(f) for f in files]
    snap = store.checkout(1)
    assert [_mapped(f) for f in files] == [n + 1 for n in before]
    snap.close()
    assert store.leases() == []  # released before close returned
    assert release_mappings(timeout=30)
    assert [_mapped(f) for f in files] == before
    assert sorted(gently) == sorted(os.path.getsize(f) for f in files)
    store.close()


def test_a_tensor_taken_keeps_its_mapping_after_the_snapshot_is_released(store_root):
    from paramstore.snapshot import release_mappings

    with ParamStore(store_root, create=True) as writer:
        writer.commit(1, {"w": torch.ones(1 << 16)}).result()
    store = ParamStore(store_root)
    snap = store.checkout(1)
    (obj,) = snap.manifest.objects()
    path = os.path.realpath(store._open.root.tier.object_path(obj))
    w = snap["w"]
    w.add_(1)  # written in this process only (the mapping is private): must not be dropped
    mapped = _mapped(path)
    snap.close()
    assert release_mappings(timeout=30)
    assert _mapped(path) == mapped  # the tensor holds the snapshot's mapping
    assert torch.equal(w, torch.full((1 << 16,), 2.0))
    del w
    assert _mapped(path) == mapped - 1
    store.close()


def test_snapshot_is_a_read_only_mapping(store):
    state = {"b": torch.ones(2), "a": torch.zeros(3), "c": torch.arange(4)}
    v = store.commit(3, state, metrics={"loss": 0.5}).result()
    with store.checkout(3) as snap:
        assert list(snap) == ["a", "b", "c"]
        assert len(snap) == 3
        assert "a" in snap and "zz" not in snap
        with pytest.raises(KeyError):
            snap["zz"]
        assert snap.version == v
        assert snap.step == 3 and snap.digest == v.digest
        assert "step=3" in repr(snap)


# -- deduplication -----------------------------------------------------------------------------
def _ten_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": random_tensor(torch.float32, (4096,), seed + i) for i in range(10)}


def test_recommitting_an_unchanged_model_creates_no_object(store):
    state = _ten_tensors()
    v1 = store.commit(1, state).result()
    objects = store._root.registry.objects()
    files = tree(os.path.join(store.root, "objects"))
    v2 = store.commit(2, {k: v.clone() for k, v in state.items()}).result()
    v3 = store.commit(3, state).result()

    assert store._root.registry.objects() == objects
    assert tree(os.path.join(store.root, "objects")) == files
    assert v1.digest == v2.digest == v3.digest
    m1, m3 = store._root.registry.get_manifest(1), store._root.registry.get_manifest(3)
    assert m1.tensors == m3.tensors
    with store.checkout(3) as snap:
        assert_state_equal(dict(snap), state)


@pytest.mark.parametrize("shard_size", [256 << 20, 16384, 40000], ids=["one-shard", "shard-per-tensor", "two-per-shard"])
def test_changing_one_of_ten_tensors_adds_about_a_tenth(store_root, shard_size):
    state = _ten_tensors()
    with ParamStore(store_root, shard_size_bytes=shard_size) as store:
        store.commit(1, state).result()
        before_bytes = objects_bytes(store.root)
        before_objects = store._root.registry.objects()
        assert before_bytes >= sum(t.nbytes for t in state.values())

        changed = dict(state)
        changed["layer3.weight"] = random_tensor(torch.float32, (4096,), 12345)
        changed_nbytes = changed["layer3.weight"].nbytes
        v2 = store.commit(2, changed).result()

        added = objects_bytes(store.root) - before_bytes
        assert changed_nbytes <= added <= 1.1 * changed_nbytes + 4096, added
        after_objects = store._root.registry.objects()
        assert set(before_objects) <= set(after_objects)
        assert len(after_objects) == len(before_objects) + 1
        assert sum(after_objects.values()) - sum(before_objects.values()) == added
        assert v2.digest != store.get(1).digest
        with store.checkout(2) as snap:
            assert_state_equal(dict(snap), changed)
        with store.checkout(1) as snap:
            assert_state_equal(dict(snap), state)


@pytest.mark.parametrize("shard_size", [256 << 20, 16, 1])
def test_same_bytes_under_different_dtypes_in_one_commit(store_root, shard_size):
    state = {
        "zeros_u8": torch.zeros(16, dtype=torch.uint8),
        "zeros_f32": torch.zeros(4, dtype=torch.float32),
        "flag": torch.ones(1, dtype=torch.bool),  # shifts the 1-byte tensors off 4-byte alignment
        "zeros_bf16": torch.zeros(8, dtype=torch.bfloat16),
        "zeros_i64_2d": torch.zeros(1, 2, dtype=torch.int64),
        "ones_u8": torch.full((8,), 0x3F, dtype=torch.uint8),
        "ones_i16": torch.full((4,), 0x3F3F, dtype=torch.int16),
    }
    with ParamStore(store_root, shard_size_bytes=shard_size) as store:
        store.commit(1, state).result()
        with store.checkout(1) as snap:
            assert_state_equal(dict(snap), state)
            entries = snap.manifest.tensors
            zero_digests = {entries[n].digest for n in ("zeros_u8", "zeros_f32", "zeros_bf16", "zeros_i64_2d")}
        assert len(zero_digests) == 1  # dtype and shape are not part of the tensor digest
        # A later commit of the same values under other dtypes still reads back right.
        state2 = {"a": torch.zeros(2, 2, dtype=torch.int32), "b": torch.zeros(16, dtype=torch.int8)}
        store.commit(2, state2).result()
        with store.checkout(2) as snap:
            assert_state_equal(dict(snap), state2)
        if shard_size == 256 << 20:
            # one object, in which the 16 zero bytes and the 8 0x3F bytes are stored once each
            assert len(store._root.registry.objects()) == 1
            (obj,) = store._root.registry.objects()
            with open(store._root.tier.object_path(obj), "rb") as f:
                data = f.read()
            data_start, _ = parse_header(data)
            assert len(data) - data_start == 16 + 8 + 1


def test_unchanged_tensor_is_not_stored_again_when_first_seen_under_a_narrower_dtype(store):
    x = torch.arange(1, 17, dtype=torch.uint8)
    # v1: the 16 bytes land at an odd offset (after a 1-byte bool)
    store.commit(1, {"b": torch.ones(1, dtype=torch.bool), "u": x.clone()}).result()
    # v2: the same bytes as float32 must be stored again (aligned) -- fine
    store.commit(2, {"f": x.clone().view(torch.float32), "g": torch.full((4,), 2.0)}).result()
    before = objects_bytes(store.root)
    # v3: only "g" changed; "f" must not be stored a third time
    store.commit(3, {"f": x.clone().view(torch.float32), "g": torch.full((4,), 3.0)}).result()
    m2, m3 = store._root.registry.get_manifest(2), store._root.registry.get_manifest(3)
    assert m3.tensors["f"].object == m2.tensors["f"].object
    assert objects_bytes(store.root) - before <= 64 + 16


def test_slab_pool_stays_bounded_and_close_leaves_no_temporary_file(store_root):
    shards = 6
    state = {f"t{i}": random_tensor(torch.float32, (1024,), i) for i in range(shards)}  # one shard each
    store = ParamStore(store_root, shard_size_bytes=4096)
    tmp = os.path.join(store.root, "tmp")
    for step in range(1, 9):
        if step % 2:
            state["t0"] = random_tensor(torch.float32, (1024,), 100 + step)  # the other shards go back to the pool
        store.commit(step, state).result()
        # the pool keeps at most PREPARE_COPIES (2) commits' slabs (one more while a commit is in flight)
        assert len(os.listdir(tmp)) <= 3 * shards, os.listdir(tmp)
        # once it settles, two commits' worth
        deadline = time.monotonic() + 5
        while len(os.listdir(tmp)) > 2 * shards and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir(tmp)) <= 2 * shards, os.listdir(tmp)
    store.close()
    assert os.listdir(tmp) == []
    assert len(tree(os.path.join(store_root, "objects"))) == (shards - 1) + 4  # t0 took 4 values


def test_pool_drops_a_slab_no_longer_wanted(shm_dir):
    # A race: each attempt asks for a 16 MiB slab and, as soon as its file appears, says that
    # nothing is wanted any more. The pool must then hold nothing. (Before the fix about half of
    # the attempts keep the slab; after it, none may.)
    for attempt in range(30):
        tmp = os.path.join(shm_dir, f"attempt{attempt}")
        os.mkdir(tmp)
        pool = SlabPool(tmp, pin=False)
        try:
            pool.prepare([16 << 20])
            deadline = time.monotonic() + 10
            while not os.listdir(tmp) and time.monotonic() < deadline:
                time.sleep(0.0002)
            pool.prepare([])
            deadline = time.monotonic() + 0.5
            while os.listdir(tmp) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert os.listdir(tmp) == [], f"attempt {attempt}: an unwanted slab stayed in the pool"
        finally:
            pool.close()
        assert os.listdir(tmp) == []


def test_prepare_runs_in_the_background_without_stalling_python(store):
    try:  # paid once by the first commit (see test_first_commit_call_returns_at_once), not measured here
        import torch.distributed.tensor  # noqa: F401
    except ImportError:
        pass
    size = 256 << 20
    model = {"w": torch.zeros(1).expand(size // 4)}  # 256 MiB to lay out, 4 bytes of storage
    tmp = os.path.join(store.root, "tmp")
    worst = 0.0
    prepared_at = None
    last = t0 = time.monotonic()
    store.prepare(model)  # returns at once; the slab is created by a background thread
    while time.monotonic() - t0 < 20:
        now = time.monotonic()
        worst = max(worst, now - last)  # how long this thread could not run (this loop included)
        last = now
        if prepared_at is None:
            files = os.listdir(tmp)
            if files and os.stat(os.path.join(tmp, files[0])).st_blocks * 512 >= size:
                prepared_at = now
        elif now - prepared_at > 0.05:
            break
    assert prepared_at is not None, "the slab was never prepared"
    assert worst < 0.12, f"the calling thread was stalled for {worst:.3f} s"  # MAP_POPULATE held the GIL 0.15-0.5 s


def test_close_finishes_in_flight_commits(store_root):
    store = ParamStore(store_root)
    handles = [store.commit(s, {"w": random_tensor(torch.float32, (4096,), s)}) for s in range(1, 6)]
    store.close()
    assert all(h.done() for h in handles)
    with ParamStore(store_root, create=False) as again:
        assert [v.step for v in again.versions()] == [1, 2, 3, 4, 5]
        with again.checkout(5) as snap:
            assert_bits_equal(snap["w"], random_tensor(torch.float32, (4096,), 5), "w")


# -- version digest ----------------------------------------------------------------------------
def test_version_digest_depends_on_content_only(shm_dir):
    state = {"a": random_tensor(torch.float32, (10,), 1), "b": random_tensor(torch.int8, (7,), 2),
             "c": random_tensor(torch.bfloat16, (2, 3), 3)}
    with ParamStore(os.path.join(shm_dir, "s1")) as s1, ParamStore(os.path.join(shm_dir, "s2"), shard_size_bytes=1) as s2:
        d1 = s1.commit(1, state).result().digest
        d_rev = s1.commit(2, dict(reversed(list(state.items())))).result().digest
        d_other_store = s2.commit(7, dict(sorted(state.items(), key=lambda kv: kv[0][::-1]))).result().digest
        assert d1 == d_rev == d_other_store

        changed = dict(state)
        changed["b"] = state["b"].clone()
        changed["b"][3] += 1
        assert s1.commit(3, changed).result().digest != d1
        renamed = {("a2" if k == "a" else k): v for k, v in state.items()}
        assert s1.commit(4, renamed).result().digest != d1
        reshaped = dict(state, c=state["c"].reshape(3, 2))
        assert s1.commit(5, reshaped).result().digest != d1
        retyped = dict(state, a=state["a"].view(torch.int32))  # same bytes, other dtype
        assert s1.commit(6, retyped).result().digest != d1
        assert s1.commit(8, state).result().digest == d1


def test_version_digest_of_tied_weights_is_order_independent(store):
    w = random_tensor(torch.float32, (5,), 1)
    d1 = store.commit(1, {"a": w, "b": w}).result().digest
    d2 = store.commit(2, {"b": w, "a": w}).result().digest
    assert d1 == d2


def test_module_and_its_state_dict_commit_the_same_content(store):
    torch.manual_seed(0)
    model = TiedLM()
    assert store.commit(1, model).result().digest == store.commit(2, model.state_dict()).result().digest


# -- versions, latest, get, tags ---------------------------------------------------------------
def test_versions_latest_and_get(store):
    assert store.versions() == [] and store.latest() is None
    t0 = time.time()
    for step, loss in [(0, 3.0), (5, 2.0), (10, 1.5)]:
        store.commit(step, {"w": torch.full((3,), float(step))}, metrics={"loss": loss, "n": 3},
                     metadata={"run": "abc", "cfg": {"lr": [1e-3, 2]}}).result()
    versions = store.versions()
    assert [v.step for v in versions] == [0, 5, 10]
    assert store.latest().step == 10
    assert store.get("latest") == store.latest()
    v5 = store.get(5)
    assert v5 == versions[1]
    assert v5.metrics == {"loss": 2.0, "n": 3.0}
    assert v5.metadata == {"run": "abc", "cfg": {"lr": [1e-3, 2]}}
    assert v5.nbytes == 12 and v5.num_tensors == 1
    assert t0 - 1 <= versions[0].created_at <= versions[1].created_at <= versions[2].created_at <= time.time() + 1
    with store.checkout() as snap:  # default: latest
        assert snap.step == 10
        assert torch.equal(snap["w"], torch.full((3,), 10.0))
    with store.checkout(0) as snap:
        assert torch.equal(snap["w"], torch.zeros(3))


def test_tags_at_commit_tag_move_and_untag(store):
    sd = lambda s: {"w": torch.full((2,), float(s))}  # noqa: E731
    store.commit(1, sd(1), tags=["best", "first"]).result()
    store.commit(2, sd(2), tags="best").result()  # a plain string is one tag; "best" moves
    assert store.get("best").step == 2
    assert store.get("first").step == 1
    assert store.get(1).tags == ("first",)
    assert store.get(2).tags == ("best",)

    v = store.tag(1, "best")  # move back
    assert v.step == 1 and v.tags == ("best", "first")
    assert store.get(2).tags == ()
    with store.checkout("best") as snap:
        assert snap.step == 1 and torch.equal(snap["w"], sd(1)["w"])

    assert store.tag("latest", "eval").step == 2
    assert store.tag("first", "also-first").step == 1  # a tag names a version too
    assert [v.tags for v in store.versions()] == [("also-first", "best", "first"), ("eval",)]

    store.untag("best")
    assert store.get(1).tags == ("also-first", "first")
    with pytest.raises(paramstore.errors.TagNotFoundError):
        store.get("best")
    with pytest.raises(paramstore.errors.TagNotFoundError):
        store.untag("best")
    store.commit(3, sd(3), tags=("eval",)).result()
    assert store.get("eval").step == 3 and store.get(2).tags == ()


# -- subscribe, wait_for -----------------------------------------------------------------------
def test_subscribe_yields_every_version_in_order_then_times_out(store):
    for step in (1, 2, 4, 8):
        store.commit(step, {"w": torch.full((2,), float(step))}).result()
    t0 = time.monotonic()
    seen = [v.step for v in store.subscribe(min_step=0, timeout=0.3)]
    elapsed = time.monotonic() - t0
    assert seen == [1, 2, 4, 8]
    assert 0.25 <= elapsed < 5, elapsed
    assert [v.step for v in store.subscribe(min_step=3, timeout=0.05)] == [4, 8]
    assert [v.step for v in store.subscribe(timeout=0.05)] == []  # default: only new versions


def test_subscribe_sees_versions_committed_while_waiting(store):
    store.commit(1, {"w": torch.zeros(2)}).result()

    def commit_later():
        for step in (2, 3, 4):
            time.sleep(0.05)
            store.commit(step, {"w": torch.full((2,), float(step))}).result()

    t = threading.Thread(target=commit_later)
    t.start()
    try:
        seen = []
        for v in store.subscribe(min_step=2, timeout=5):
            seen.append(v.step)
            with store.checkout(v.step) as snap:
                assert torch.equal(snap["w"], torch.full((2,), float(v.step)))
            if v.step == 4:
                break
    finally:
        t.join()
    assert seen == [2, 3, 4]


def test_subscribe_default_after_is_the_latest_at_the_call(store):
    store.commit(1, {"w": torch.zeros(2)}).result()
    it = store.subscribe(timeout=0.3)
    store.commit(2, {"w": torch.ones(2)}).result()
    assert [v.step for v in it] == [2]


def test_wait_for_returns_and_times_out(store):
    with pytest.raises(paramstore.WaitTimeoutError) as ei:
        t0 = time.monotonic()
        store.wait_for(1, timeout=0.2)
    assert time.monotonic() - t0 >= 0.19
    assert isinstance(ei.value, TimeoutError)

    store.commit(3, {"w": torch.zeros(2)}).result()
    assert store.wait_for(1, timeout=0).step == 3  # newest version >= step

    timer = threading.Timer(0.1, lambda: store.commit(5, {"w": torch.ones(2)}))
    timer.start()
    try:
        t0 = time.monotonic()
        v = store.wait_for(4, timeout=10)
        assert v.step == 5 and time.monotonic() - t0 < 5
    finally:
        timer.join()
    with pytest.raises(paramstore.WaitTimeoutError):
        store.wait_for(6, timeout=0.05)


# -- commit handle, guard ----------------------------------------------------------------------
def test_handle_futures(store):
    state = {"w": random_tensor(torch.float32, (256,), 1)}
    h = store.commit(4, state, tags=["t"], metrics={"r": 1})
    assert h.step == 4
    assert h.staged.result(timeout=30) is None
    v = h.committed.result(timeout=30)
    assert h.done() and h.result() is v
    assert isinstance(v, paramstore.Version)
    assert v.step == 4 and v.tags == ("t",) and v.metrics == {"r": 1.0}
    assert v == store.get(4)
    assert "committed" in repr(h)
    assert store.flush() == v
    store.wait_staged(timeout=1)


def test_first_commit_call_returns_at_once(shm_dir):
    # A fresh interpreter, as a trainer starts: time the first commit() call (not its completion).
    code = textwrap.dedent("""
        import sys, time, torch, paramstore
        store = paramstore.ParamStore(sys.argv[1])
        state = {"w": torch.ones(16)}
        t0 = time.perf_counter()
        handle = store.commit(1, state)
        took = time.perf_counter() - t0
        handle.result()
        store.close()
        print(took)
    """)
    out = subprocess.run([sys.executable, "-c", code, os.path.join(shm_dir, "s")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    took = float(out.stdout.strip().splitlines()[-1])
    assert took < 0.25, f"the first commit() call took {took:.3f} s"  # importing DTensor took ~0.6 s


def test_flush_waits_for_every_commit(store):
    handles = [store.commit(s, {"w": torch.full((1000,), float(s))}) for s in range(1, 6)]
    last = store.flush(timeout=30)
    assert last.step == 5
    assert all(h.done() for h in handles)
    assert [v.step for v in store.versions()] == [1, 2, 3, 4, 5]


def test_guard_makes_optimizer_step_wait_for_staging(store):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256))  # ~1 MiB
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    hook = store.guard(opt)
    x = torch.randn(8, 256)

    for step in range(1, 4):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        pre = {k: v.clone() for k, v in model.state_dict().items()}
        h = store.commit(step, model)
        opt.step()  # must not run before the snapshot copy is taken
        assert h.staged.done()
        assert not torch.equal(model[0].weight, pre["0.weight"])  # the step did change weights
        h.result(timeout=30)
        with store.checkout(step) as snap:
            assert_state_equal(dict(snap), pre)
    hook.remove()


# -- reopening ---------------------------------------------------------------------------------
def test_reopened_store_sees_versions_and_tags(store_root):
    state = {"w": random_tensor(torch.bfloat16, (33,), 1), "i": random_tensor(torch.int64, (5,), 2)}
    with ParamStore(store_root) as s:
        s.commit(1, state, tags=["keep"]).result()
        s.commit(2, {"w": state["w"]}).result()
    with ParamStore(store_root, create=False) as s:
        assert [v.step for v in s.versions()] == [1, 2]
        assert s.get("keep").step == 1
        with s.checkout("keep") as snap:
            assert_state_equal(dict(snap), state)
        # and it can go on committing
        s.commit(3, state).result()
        with pytest.raises(paramstore.StepOrderError):
            s.commit(3, state)
    with ParamStore(store_root) as s:
        assert s.latest().step == 3


def test_two_store_objects_on_one_root_see_each_other(store_root):
    with ParamStore(store_root) as a, ParamStore(store_root) as b:
        a.commit(1, {"w": torch.ones(3)}).result()
        assert b.latest().step == 1
        with pytest.raises(paramstore.StepOrderError):
            b.commit(1, {"w": torch.ones(3)})
        b.commit(2, {"w": torch.zeros(3)}).result()
        with a.checkout("latest") as snap:
            assert snap.step == 2 and torch.equal(snap["w"], torch.zeros(3))


def test_prefault_maps_pages_and_keeps_bits(store):
    import resource

    t = random_tensor(torch.float32, (512, 1024), 7)  # 2 MiB
    store.commit(1, {"t": t}).result()
    with store.checkout(1) as snap:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        snap.prefault()
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert_bits_equal(snap["t"], t, "t")
    assert faulted > 0  # the pages were mapped by prefault, not by the read
    with pytest.raises(paramstore.errors.StoreClosedError):
        snap.prefault()
