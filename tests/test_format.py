"""The on-disk format: golden object bytes, safetensors validity, digests, manifests, shard plans.

Digests are recomputed here with ``blake3`` directly from the files' bytes, not with paramstore's
own helpers, so a change in how paramstore names objects shows up as a failure.
"""

from __future__ import annotations

import json
import os
import random
import struct

import blake3
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from helpers import ALL_DTYPES, assert_bits_equal, random_tensor
from paramstore import Manifest, ParamStore, ParamStoreError, TensorEntry, Version
from paramstore.format import (
    DATA_ALIGN,
    ITEMSIZE,
    ObjectHasher,
    TensorSpec,
    build_header,
    layout,
    object_digest,
    parse_header,
    plan_shards,
    rehash,
    tensor_digest,
)
from paramstore.tensors import ST_TO_TORCH, TORCH_TO_ST

OBJECT_DOMAIN = b"paramstore/object/v1\x00"
VERSION_DOMAIN = b"paramstore/version/v1\x00"


# -- independent readers of an object file -----------------------------------------------------
def read_object(path: str) -> tuple[bytes, int, dict]:
    """(file bytes, data start, header entries) parsed with struct/json only."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    entries = json.loads(data[8 : 8 + n])
    entries.pop("__metadata__", None)
    return data, 8 + n, entries


def independent_object_digest(data: bytes, start: int, entries: dict) -> str:
    spans = sorted(tuple(e["data_offsets"]) for e in entries.values())
    h = blake3.blake3(OBJECT_DOMAIN)
    h.update(data[:start])
    for b, e in spans:
        h.update(blake3.blake3(data[start + b : start + e]).digest())
    return h.hexdigest()


def check_object_file(path: str) -> dict:
    """Every structural promise of an object file; returns its header entries."""
    data, start, entries = read_object(path)
    name = os.path.basename(path).removesuffix(".safetensors")
    assert os.path.basename(os.path.dirname(path)) == name[:2]
    assert start % DATA_ALIGN == 0, f"data section starts at {start}"
    assert data[8:start].rstrip(b" ").endswith(b"}")  # padded with spaces only
    spans = sorted((tuple(e["data_offsets"]), k) for k, e in entries.items())
    pos = 0
    for (b, e), k in spans:  # tensors tile the data section exactly
        assert b == pos, f"{k}: gap or overlap at {b} (expected {pos})"
        assert (start + b) % ITEMSIZE[entries[k]["dtype"]] == 0, f"{k} misaligned"
        n = ITEMSIZE[entries[k]["dtype"]]
        for d in entries[k]["shape"]:
            n *= d
        assert e - b == n, k
        pos = e
    assert start + pos == len(data), "bytes past the last tensor"
    assert name == independent_object_digest(data, start, entries)
    return entries


# -- golden bytes ------------------------------------------------------------------------------
GOLDEN_BODY = (
    b'{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},'
    b'"b":{"dtype":"I16","shape":[3],"data_offsets":[24,30]},'
    b'"m":{"dtype":"BOOL","shape":[3],"data_offsets":[30,33]}}'
)
GOLDEN_OBJECT_DIGEST = "b34e10a849187f1dfd76202f7ef2febb594a8418b095fc74233d0b490b55db40"


def golden_state() -> dict[str, torch.Tensor]:
    return {
        "m": torch.tensor([True, False, True]),
        "b": torch.tensor([1, 2, 3], dtype=torch.int16),
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    }


def test_golden_object_bytes(store):
    state = golden_state()
    store.commit(1, state).result()
    (obj,) = store._root.registry.objects()
    path = store._root.tier.object_path(obj)
    with open(path, "rb") as f:
        data = f.read()

    pad = (-(8 + len(GOLDEN_BODY))) % 64
    header = struct.pack("<Q", len(GOLDEN_BODY) + pad) + GOLDEN_BODY + b" " * pad
    payload = (state["w"].numpy().tobytes() + state["b"].numpy().tobytes() + state["m"].numpy().tobytes())
    assert len(header) == 192
    assert data == header + payload

    want = blake3.blake3(OBJECT_DOMAIN + header)
    for part in (state["w"], state["b"], state["m"]):
        want.update(blake3.blake3(part.numpy().tobytes()).digest())
    assert obj == want.hexdigest() == GOLDEN_OBJECT_DIGEST
    assert path.endswith(f"objects/{obj[:2]}/{obj}.safetensors")

    loaded = load_file(path)
    for k, t in state.items():
        assert_bits_equal(loaded[k], t, k)

    man = store._root.registry.get_manifest(1)
    assert man.tensors["w"].offset == 192 and man.tensors["b"].offset == 216 and man.tensors["m"].offset == 222
    for k, t in state.items():
        assert man.tensors[k].digest == blake3.blake3(t.numpy().tobytes()).hexdigest()
        assert man.tensors[k].object == obj


def test_version_digest_recomputed_independently(store):
    state = golden_state()
    v = store.commit(1, state).result()
    canon = {
        "aliases": {},
        "tensors": {k: [TORCH_TO_ST[t.dtype], list(t.shape), blake3.blake3(t.numpy().tobytes()).hexdigest()]
                    for k, t in state.items()},
    }
    body = json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()
    assert v.digest == blake3.blake3(VERSION_DOMAIN + body).hexdigest()
    assert v.digest == store._root.registry.get_manifest(1).digest()


# -- every object is a valid safetensors file --------------------------------------------------
def _mixed_state(seed: int = 0) -> dict[str, torch.Tensor]:
    state = {}
    for i, dtype in enumerate(ALL_DTYPES):
        name = str(dtype).removeprefix("torch.")
        state[f"{name}.a"] = random_tensor(dtype, (5, 3), seed + i)
        state[f"{name}.s"] = random_tensor(dtype, (), seed + 50 + i)
        state[f"{name}.e"] = random_tensor(dtype, (0, 2), 0)
    return state


@pytest.mark.parametrize("shard_size", [1, 64, 500, 256 << 20])
def test_every_object_is_a_valid_safetensors_file(store_root, shard_size):
    state = _mixed_state()
    with ParamStore(store_root, shard_size_bytes=shard_size) as store:
        store.commit(1, state).result()
        changed = dict(state)
        for k in list(changed)[::4]:  # change a quarter: the new objects are compacted shards
            if changed[k].numel():
                changed[k] = random_tensor(changed[k].dtype, changed[k].shape, 999 + len(k))
        store.commit(2, changed).result()
        reg, tier = store._root.registry, store._root.tier
        objects = reg.objects()
        assert sorted(objects) == sorted(tier.list())
        seen_in_files: dict[str, set[str]] = {}
        for obj, size in objects.items():
            path = tier.object_path(obj)
            assert os.path.getsize(path) == size
            entries = check_object_file(path)
            loaded = load_file(path)
            assert set(loaded) == set(entries)
            seen_in_files[obj] = set(entries)
        for step, want in ((1, state), (2, changed)):
            man = reg.get_manifest(step)
            for name, e in man.tensors.items():
                t = want[name]
                assert e.digest == blake3.blake3(as_np_bytes(t)).hexdigest(), name
                assert e.dtype == TORCH_TO_ST[t.dtype] and e.shape == tuple(t.shape)
                _, start, entries = read_object(tier.object_path(e.object))
                # the entry's range is one tensor of the object (stored under this or another name)
                ranges = {(start + h["data_offsets"][0], start + h["data_offsets"][1]) for h in entries.values()}
                assert (e.offset, e.offset + e.nbytes) in ranges or e.nbytes == 0, name
                assert e.offset % ITEMSIZE[e.dtype] == 0
            with store.checkout(step) as snap:
                for name, t in want.items():
                    assert_bits_equal(snap[name], t, name)


def as_np_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# -- digests -----------------------------------------------------------------------------------
def test_tensor_digest_is_blake3_of_the_bytes():
    for data in (b"", b"abc", os.urandom(1000), os.urandom(5 << 20)):  # the last one uses threads
        assert tensor_digest(data) == blake3.blake3(data).hexdigest()
        assert tensor_digest(memoryview(data)) == blake3.blake3(data).hexdigest()


def test_object_digest_definition():
    header, _ = build_header([TensorSpec("x", "U8", (3,))])
    ds = [blake3.blake3(b"abc").hexdigest(), blake3.blake3(b"").hexdigest()]
    want = blake3.blake3(OBJECT_DOMAIN + header + b"".join(bytes.fromhex(d) for d in ds)).hexdigest()
    assert object_digest(header, ds) == want
    assert object_digest(header, ds[::-1]) != want  # file order matters


# -- manifests and versions --------------------------------------------------------------------
def _manifest() -> Manifest:
    e1 = TensorEntry("F32", (2, 3), "aa" * 32, "bb" * 32, 192, 24)
    e2 = TensorEntry("BOOL", (), "cc" * 32, "bb" * 32, 216, 1)
    return Manifest({"w": e1, "flag": e2}, {"w_tied": "w"})


def test_manifest_json_round_trip(store):
    m = _manifest()
    assert Manifest.from_json(m.to_json()) == m
    assert Manifest.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert Manifest.from_json(m.to_json()).digest() == m.digest()
    assert m.names() == ["flag", "w", "w_tied"] and m.entry("w_tied") == m.tensors["w"]
    assert m.nbytes == 25 and m.objects() == {"bb" * 32}

    # and a real one, with an alias, from the store
    w = torch.randn(4, 4)
    store.commit(1, {"a": w, "b": w, "c": torch.zeros(0)}).result()
    real = store._root.registry.get_manifest(1)
    assert real.aliases == {"b": "a"}
    assert Manifest.from_json(json.loads(json.dumps(real.to_json()))) == real

    v = store.get(1)
    assert Version.from_json(json.loads(json.dumps(v.to_json())), v.tags) == v


def test_manifest_with_unknown_or_missing_fields_is_rejected():
    good = _manifest().to_json()

    def mutated(fn):
        d = json.loads(json.dumps(good))
        fn(d)
        return d

    bad = [
        mutated(lambda d: d.__setitem__("extra", 1)),
        mutated(lambda d: d.pop("aliases")),
        mutated(lambda d: d.__setitem__("format", 3)),
        mutated(lambda d: d["tensors"]["w"].__setitem__("compression", "zstd")),
        mutated(lambda d: d["tensors"]["w"].pop("digest")),
    ]
    for d in bad:
        with pytest.raises(ParamStoreError):
            Manifest.from_json(d)

    v = Version(step=1, created_at=1.0, nbytes=3, digest="dd" * 32, num_tensors=1).to_json()
    with pytest.raises(ParamStoreError):
        Version.from_json({**v, "parent": 0})
    v.pop("metrics")
    with pytest.raises(ParamStoreError):
        Version.from_json(v)


# -- shard plans -------------------------------------------------------------------------------
def _plan_invariants(specs: list[TensorSpec], plans, shard_size: int) -> None:
    # groups are consecutive runs of the input, every spec exactly once
    flat = [p.spec for plan in plans for p in sorted(plan.placements, key=lambda p: specs.index(p.spec))]
    assert flat == specs
    for plan in plans:
        assert len(plan.header) % DATA_ALIGN == 0
        start, entries = parse_header(plan.header)
        assert start == len(plan.header)
        pos = start
        for p in sorted(plan.placements, key=lambda p: p.offset):
            assert p.offset == pos  # tiles the data exactly
            assert p.offset % ITEMSIZE[p.spec.dtype] == 0
            assert p.nbytes == p.spec.nbytes
            h = entries[p.spec.name]
            assert h["dtype"] == p.spec.dtype and tuple(h["shape"]) == p.spec.shape
            assert [start + x for x in h["data_offsets"]] == [p.offset, p.offset + p.nbytes]
            pos += p.nbytes
        assert plan.size == pos
        data = sum(p.nbytes for p in plan.placements)
        assert len(plan.placements) == 1 or data <= shard_size


def test_plan_puts_a_tensor_above_the_shard_size_alone():
    specs = [TensorSpec("s1", "F32", (25,)), TensorSpec("big", "F16", (1000,)),
             TensorSpec("s2", "U8", (100,)), TensorSpec("s3", "I64", (10,))]
    plans = plan_shards(specs, 500)
    assert [[p.spec.name for p in plan.placements] for plan in plans] == [["s1"], ["big"], ["s3", "s2"]]
    _plan_invariants(specs, plans, 500)
    first = plan_shards([specs[1], specs[0]], 500)
    assert [[p.spec.name for p in plan.placements] for plan in first] == [["big"], ["s1"]]


def test_plan_keeps_mixed_dtype_offsets_aligned():
    specs = [TensorSpec("flag", "BOOL", (3,)), TensorSpec("h", "BF16", (5,)), TensorSpec("d", "F64", (3,)),
             TensorSpec("i", "I32", (7,)), TensorSpec("q", "F8_E4M3", (9,)), TensorSpec("c", "C64", (2,)),
             TensorSpec("u", "U16", ()), TensorSpec("e", "F64", (0,))]
    (plan,) = plan_shards(specs, 1 << 20)
    assert [p.spec.name for p in plan.placements] == ["d", "c", "e", "i", "h", "u", "flag", "q"]
    _plan_invariants(specs, [plan], 1 << 20)
    assert plan_shards(specs, 1 << 20) == [plan]  # deterministic
    with pytest.raises(ValueError):
        plan_shards(specs, 0)


_dtype_names = sorted(ITEMSIZE)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.sampled_from(_dtype_names), st.lists(st.integers(0, 9), max_size=3)), min_size=1, max_size=25),
    st.integers(1, 600),
)
def test_plan_invariants_hold_for_any_specs(raw, shard_size):
    specs = [TensorSpec(f"t{i}", dt, tuple(shape)) for i, (dt, shape) in enumerate(raw)]
    _plan_invariants(specs, plan_shards(specs, shard_size), shard_size)


def test_header_round_trip_and_malformed_headers():
    specs = [TensorSpec("a.b", "F32", (2, 2)), TensorSpec("ü", "U8", (1,))]
    plan = layout(specs)
    start, entries = parse_header(plan.header + b"\0" * 17)
    assert start == len(plan.header) and set(entries) == {"a.b", "ü"}
    with_meta = json.dumps({"__metadata__": {"k": "v"}, "x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode()
    assert set(parse_header(struct.pack("<Q", len(with_meta)) + with_meta)[1]) == {"x"}
    for bad in (b"", b"\x05\0\0", struct.pack("<Q", 100) + b"{}", struct.pack("<Q", 4) + b"nope",
                struct.pack("<Q", 2) + b"[]"):
        with pytest.raises(ValueError):
            parse_header(bad)


def _object_bytes(sizes: list[int], seed: int) -> bytes:
    plan = layout([TensorSpec(f"t{i}", "U8", (n,)) for i, n in enumerate(sizes)])
    return plan.header + random.Random(seed).randbytes(sum(sizes))


@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=8), st.integers(1, 700), st.randoms(use_true_random=False))
def test_object_hasher_in_any_arrival_order_equals_rehash(sizes, piece, rnd):
    """Bytes declared in any order and any piece size give the digest of hashing the whole file."""
    data = _object_bytes(sizes, rnd.randrange(1 << 30))
    ranges = [(b, min(b + piece, len(data))) for b in range(0, len(data), piece)]
    rnd.shuffle(ranges)
    buf = memoryview(bytearray(len(data)))
    h = ObjectHasher(buf)
    for k, (b, e) in enumerate(ranges):
        buf[b:e] = data[b:e]
        h.arrived(b, e)
        if k < len(ranges) - 1:
            with pytest.raises(ValueError, match="not every byte"):
                h.digest()
        if k == len(ranges) // 2:
            h.arrived(b, e)  # a range declared twice changes nothing
    assert h.digest() == rehash(memoryview(data))[0]


def test_objects_with_empty_tensors_verify(store):
    """An empty tensor starts where the next one does: rehash and verify must not mix them up."""
    from paramstore import objects, ops

    store.commit(0, {"a": torch.zeros(0), "b": torch.ones(3), "c": torch.zeros(0, dtype=torch.int8),
                     "z": torch.ones(1, dtype=torch.int8)}).result()
    root = store._root
    for obj in root.tier.list():
        assert objects.hash_object(root, obj)[0] == obj
    report = ops.verify(root, show_progress=False)
    assert report["ok"] and report["objects_checked"] >= 1, report


def test_object_hasher_rejects_a_malformed_object():
    data = bytearray(_object_bytes([100, 50], 1))
    data[12] ^= 0xFF  # inside the JSON header
    h = ObjectHasher(memoryview(data))
    h.arrived(0, len(data))
    with pytest.raises(ValueError, match="malformed"):
        h.digest()
    good = _object_bytes([100, 50], 1)
    h = ObjectHasher(memoryview(bytearray(good[:-1] + bytes([good[-1] ^ 1]))))
    h.arrived(0, len(good))
    assert h.digest() != rehash(memoryview(good))[0]  # a flipped data bit changes the digest


def test_itemsize_table_matches_torch():
    assert set(TORCH_TO_ST.values()) == set(ITEMSIZE)
    for dtype in ALL_DTYPES:
        assert ITEMSIZE[TORCH_TO_ST[dtype]] == torch.empty((), dtype=dtype).element_size()
        assert ST_TO_TORCH[TORCH_TO_ST[dtype]] == dtype
