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
    for data in (b"", b"abc", os.urandom(1000), os.urandom(2 << 20)):  # the last one: a whole piece
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


# -- pieces (format 4): large tensors hashed and verified piece by piece --------------------------
PIECES_DOMAIN = b"paramstore/pieces/v1\x00"


def reference_tensor_digest(data: bytes, p: int) -> str:
    """The tensor digest computed here directly with blake3: whole up to ``p`` bytes, else the root
    over ``p``-byte pieces."""
    if len(data) <= p:
        return blake3.blake3(data).hexdigest()
    parts = b"".join(blake3.blake3(data[i : i + p]).digest() for i in range(0, len(data), p))
    return blake3.blake3(PIECES_DOMAIN + struct.pack("<Q", len(data)) + parts).hexdigest()


@pytest.fixture(scope="module")
def big_bytes():
    from paramstore.format import PIECE_SIZE

    return random.Random(7).randbytes(3 * PIECE_SIZE + 5)


@pytest.mark.parametrize("n", ["0", "1", "P-1", "P", "P+1", "2P", "3P", "3P+5"])
def test_tensor_digest_over_pieces_at_the_boundaries(n, big_bytes):
    from paramstore.format import PIECE_SIZE, bad_pieces, pieces, tensor_pieces

    assert 1 << 20 <= PIECE_SIZE <= 16 << 20
    size = eval(n.replace("P", "*PIECE_SIZE").lstrip("*"), {"PIECE_SIZE": PIECE_SIZE}) if "P" in n else int(n)
    data = big_bytes[:size]
    want = reference_tensor_digest(data, PIECE_SIZE)
    assert tensor_digest(data) == want
    assert tensor_digest(data, parallel=False) == want
    assert tensor_digest(memoryview(data)) == want
    digest, ds = tensor_pieces(data)
    k = max(1, -(-size // PIECE_SIZE))
    assert digest == want and len(pieces(size)) == k and len(ds) == (k if k > 1 else 0)
    assert [bytes.fromhex(d) for d in ds] == [blake3.blake3(data[b:e]).digest() for b, e in pieces(size)] * (k > 1)
    assert bad_pieces(data, ds, digest) == []
    # the old rule (objects written before pieces) is blake3 of all the bytes
    assert tensor_digest(data, piece_size=0) == blake3.blake3(data).hexdigest()
    # in an object: rehash and ObjectHasher (bytes arriving in any order) agree with the reference
    plan = layout([TensorSpec("x", "U8", (size,))])
    obj = plan.header + data
    meta = json.loads(plan.header[8:])["__metadata__"] if size > PIECE_SIZE else {}
    assert meta == ({"paramstore_pieces": str(PIECE_SIZE)} if size > PIECE_SIZE else {})
    want_obj = blake3.blake3(OBJECT_DOMAIN + plan.header + bytes.fromhex(want)).hexdigest()
    assert rehash(memoryview(obj))[0] == want_obj
    h = ObjectHasher(memoryview(obj))
    cuts = sorted({0, len(obj), *random.Random(size).sample(range(len(obj) + 1), 6)})
    ranges = list(zip(cuts, cuts[1:]))
    random.Random(1).shuffle(ranges)
    for b, e in ranges:
        h.arrived(b, e)
    assert h.digest() == want_obj
    assert h.tensor_digests() == {(len(plan.header), len(obj)): want}
    expected = ds or (want,)
    got_pieces = h.pieces()
    assert [(b - len(plan.header), e - len(plan.header)) for b, e in got_pieces] == pieces(size)
    assert all(h.check_piece(b, d) for (b, _), d in zip(got_pieces, expected))


def test_a_corrupted_piece_is_detected_and_located(big_bytes):
    from paramstore.format import PIECE_SIZE, bad_pieces, pieces, tensor_pieces

    data = big_bytes[: 3 * PIECE_SIZE + 5]
    digest, ds = tensor_pieces(data)
    for at in (0, PIECE_SIZE - 1, PIECE_SIZE, 2 * PIECE_SIZE + 17, len(data) - 1):
        bad = bytearray(data)
        bad[at] ^= 0x40
        assert tensor_digest(bytes(bad)) != digest
        assert bad_pieces(bytes(bad), ds) == [at // PIECE_SIZE]
        plan = layout([TensorSpec("x", "U8", (len(data),))])
        h = ObjectHasher(memoryview(plan.header + bytes(bad)), parallel=True)
        h.arrived(0, len(plan.header) + PIECE_SIZE + 3)  # part of the object: the first piece can be checked
        first = h.pieces()[0][0]
        assert h.check_piece(first, ds[0]) == (at >= PIECE_SIZE)
        assert h.piece_digest(h.pieces()[1][0]) is None  # not all there yet
        h.arrived(0, len(plan.header) + len(data))
        wrong = [i for i, (b, _) in enumerate(h.pieces()) if not h.check_piece(b, ds[i])]
        assert wrong == [at // PIECE_SIZE]
    assert len(pieces(len(data))) == 4


def test_a_committed_large_tensor_is_recorded_with_its_piece_digests(store):
    from paramstore.format import PIECE_SIZE, pieces

    w = torch.arange(PIECE_SIZE // 4 * 2 + 3, dtype=torch.float32)  # 3 pieces
    v = store.commit(1, {"w": w, "b": torch.ones(3)}).result()
    man = store._root.registry.get_manifest(1)
    assert man.to_json()["format"] == 5
    e = man.tensors["w"]
    data = w.numpy().tobytes()
    assert e.digest == reference_tensor_digest(data, PIECE_SIZE)
    assert [bytes.fromhex(d) for d in e.piece_digests] == [blake3.blake3(data[b:x]).digest() for b, x in pieces(len(data))]
    assert man.tensors["b"].piece_digests == ()
    assert Manifest.parse(json.dumps(man.to_json())) == man
    (obj,) = store._root.registry.objects()
    got, start, entries = read_object(store._root.tier.object_path(obj))
    spans = sorted(tuple(x["data_offsets"]) for x in entries.values())
    want = blake3.blake3(OBJECT_DOMAIN + got[:start])
    for b, x in spans:
        want.update(bytes.fromhex(reference_tensor_digest(got[start + b : start + x], PIECE_SIZE)))
    assert obj == want.hexdigest()
    assert [(b, x, d) for b, x, d in e.pieces()[0].hash_pieces()] == [
        (e.offset + b, e.offset + x, d) for (b, x), d in zip(pieces(len(data)), e.piece_digests)]
    assert store.verify()["ok"]
    with store.checkout(1, verify=True) as snap:
        assert torch.equal(snap["w"], w)
    assert v.digest == man.digest()


def test_manifest_piece_digests_are_checked_on_parse(store):
    from paramstore.errors import CorruptObjectError
    from paramstore.format import PIECE_SIZE

    store.commit(1, {"w": torch.zeros(PIECE_SIZE // 4 + 1)}).result()
    good = store._root.registry.get_manifest(1).to_json()
    for damage in ("flip", "drop", "missing", "old format"):
        d = json.loads(json.dumps(good))
        e = d["tensors"]["w"]
        if damage == "flip":
            e["piece_digests"][1] = "0" * 64
        elif damage == "drop":
            e["piece_digests"].pop()
        elif damage == "missing":
            del e["piece_digests"]
        else:
            d["format"] = 1
        with pytest.raises(CorruptObjectError):
            Manifest.from_json(d)


def test_a_too_new_format_is_refused_saying_to_upgrade():
    from paramstore.format import PIECE_SIZE, PIECES_KEY

    with pytest.raises(ParamStoreError, match="upgrade paramstore"):
        Manifest.from_json({"format": 6, "tensors": {}, "aliases": {}})
    # an object whose header names a piece size this paramstore does not know
    header, _ = build_header([TensorSpec("x", "U8", (4,))], {PIECES_KEY: str(2 * PIECE_SIZE)})
    obj = memoryview(header + b"abcd")
    with pytest.raises(ValueError, match="upgrade paramstore"):
        rehash(obj)
    h = ObjectHasher(obj)
    h.arrived(0, len(obj))
    with pytest.raises(ValueError, match="upgrade paramstore"):
        h.digest()


def test_a_store_of_a_newer_format_is_refused_saying_to_upgrade(store_root):
    ParamStore(store_root, create=True).close()
    from paramstore.root import MARKER

    marker = os.path.join(store_root, MARKER)
    with open(marker) as f:
        info = json.load(f)
    info["format"] = 99
    with open(marker, "w") as f:
        json.dump(info, f)
    with pytest.raises(ParamStoreError, match="upgrade paramstore"):
        ParamStore(store_root)


def commit_as_before(store_root, monkeypatch, state, *, marker: int, piece_size: int) -> None:
    """Commit ``state`` as step 1 of a new store the way an older paramstore did: headers say
    pieces of ``marker`` bytes where a tensor is larger (``1 << 62``: never, no marker), and
    digests are over pieces of ``piece_size`` bytes (0: whole tensors, format v1)."""
    import paramstore.format as fmt
    import paramstore.hashing as hashing

    with monkeypatch.context() as m:
        m.setattr(fmt, "PIECE_SIZE", marker)
        m.setattr(hashing, "pieces", lambda n, size=piece_size: fmt.pieces(n, size))  # hashing.piece_spans
        with ParamStore(store_root, create=True) as s:
            s.commit(1, state).result()


def test_a_store_written_with_whole_tensor_digests_stays_readable(store_root, monkeypatch):
    """An old-format store (format v1: a large tensor's digest is blake3 of all its bytes, objects
    without the pieces marker, manifests of format 1) written by forcing the old rule: it still
    reads, verifies (every path recomputing digests uses the old rule for its objects), and a new
    commit of the same weights next to it uses pieces."""
    import paramstore.format as fmt
    from paramstore.objects import check_buffer

    P = fmt.PIECE_SIZE
    w = torch.randn(P // 4 + 100)  # two pieces' worth
    commit_as_before(store_root, monkeypatch, {"w": w, "b": torch.ones(4)}, marker=1 << 62, piece_size=0)
    s = ParamStore(store_root)
    try:
        old = s.manifest(1)
        assert old.to_json()["format"] == 1 and old.tensors["w"].piece_digests == ()
        assert old.tensors["w"].digest == blake3.blake3(w.numpy().tobytes()).hexdigest()
        (obj,) = s._root.registry.objects()
        data, start, entries = read_object(s._root.tier.object_path(obj))
        assert b"paramstore_pieces" not in data[:start]
        assert obj == independent_object_digest(data, start, entries)  # whole-tensor blake3 in the object digest
        assert rehash(memoryview(data))[0] == obj
        assert check_buffer(obj, memoryview(data), old.spans()[obj]) is None
        h = ObjectHasher(memoryview(data), parallel=True)
        h.arrived(0, len(data))
        assert h.digest() == obj
        assert s.verify()["ok"]
        with s.checkout(1, verify=True) as snap:
            assert torch.equal(snap["w"], w)
        s.commit(2, {"w": w, "b": torch.ones(4)}).result()  # the same weights, new format
        new = s.manifest(2)
        assert new.to_json()["format"] == 5 and len(new.tensors["w"].piece_digests) == 2
        assert new.tensors["w"].object != old.tensors["w"].object
        assert new.tensors["b"].object == old.tensors["b"].object  # one piece: the same digest, deduplicated
        assert s.verify()["ok"]
    finally:
        s.close()


def test_a_store_written_with_8_mib_pieces_stays_readable(store_root, monkeypatch):
    """A store written before pieces were 2 MiB (objects saying ``paramstore_pieces: 8388608``,
    manifests of format 4 with 8 MiB piece digests), written by forcing that size: it reads,
    verifies, checks each 8 MiB piece alone and relays an 8 MiB piece as a block of its own (a
    unit is never cut); a new commit of the same weights next to it uses 2 MiB pieces (format 5),
    and a tensor of one piece either way keeps its object."""
    from paramstore.objects import check_buffer
    from paramstore.relay import Relay

    old_p = 8 << 20
    w = torch.randn(old_p // 4 * 2 + 100)  # 3 pieces of 8 MiB, 9 of 2 MiB
    commit_as_before(store_root, monkeypatch, {"w": w, "b": torch.ones(4)}, marker=old_p, piece_size=old_p)
    s = ParamStore(store_root)
    try:
        old = s.manifest(1)
        e = old.tensors["w"]
        assert old.to_json()["format"] == 4 and len(e.piece_digests) == 3 and e.piece_size == old_p
        assert Manifest.parse(json.dumps(old.to_json())) == old
        (obj,) = s._root.registry.objects()
        data, start, entries = read_object(s._root.tier.object_path(obj))
        assert json.loads(data[8:start])["__metadata__"] == {"paramstore_pieces": str(old_p)}
        assert rehash(memoryview(data))[0] == obj
        assert check_buffer(obj, memoryview(data), old.spans()[obj]) is None
        ranges = [(b, x) for b, x, _ in e.pieces()[0].hash_pieces()]
        assert [x - b for b, x in ranges] == [old_p, old_p, 400]
        bad = bytearray(data)
        bad[ranges[1][0] + 5] ^= 1
        h = ObjectHasher(memoryview(bytes(bad)))
        h.arrived(0, len(bad))
        assert [h.check_piece(b, d) for (b, _), d in zip(ranges, e.piece_digests)] == [True, False, True]
        _, blocks, _ = Relay.plan(obj, len(data), old.spans(), old.piece_spans())
        assert [(b, x) for _, _, units in blocks for b, x, d in units if d is not None and x - b == old_p] == ranges[:2]
        assert s.verify()["ok"]
        with s.checkout(1, verify=True) as snap:
            assert torch.equal(snap["w"], w)
        s.commit(2, {"w": w, "b": torch.ones(4)}).result()  # the same weights, 2 MiB pieces
        new = s.manifest(2)
        assert new.to_json()["format"] == 5 and len(new.tensors["w"].piece_digests) == 9
        assert new.tensors["w"].object != e.object and new.tensors["w"].digest != e.digest
        assert new.tensors["b"].object == old.tensors["b"].object  # one piece: the same digest, deduplicated
        assert s.verify()["ok"]
        with s.checkout(2, verify=True) as snap:
            assert torch.equal(snap["w"], w)
    finally:
        s.close()


def test_a_header_that_lists_its_piece_digests_is_checked_against_the_name():
    """An object whose header lists its own piece digests (patch objects: ``DIGESTS_KEY``) gives
    each piece's digest keyed by its absolute range once the list makes the object's name; a list
    changed in any way (a digest, a count, its shape) cannot make the name and is refused, and an
    object without a list gives None."""
    from paramstore.format import DIGESTS_KEY, PIECE_SIZE, listed_digests, piece_digest, tensor_pieces

    blobs = [bytes(range(256)) * 3, os.urandom(2 * PIECE_SIZE + 100), b""]
    hashed = [tensor_pieces(b) for b in blobs]
    listed = [list(p) or [d] for d, p in hashed]
    specs = [TensorSpec(f"t{i}", "U8", (len(b),)) for i, b in enumerate(blobs)]

    def made(lst: object) -> tuple[bytes, int, str]:
        head, _ = build_header(specs, {DIGESTS_KEY: json.dumps(lst)})
        data = head + b"".join(blobs)
        return data, len(data), rehash(memoryview(data))[0]

    data, size, name = made(listed)
    tensors, pieces = listed_digests(data[:4096], size, name)  # the header alone is enough
    assert tensors == rehash(memoryview(data))[1]
    assert len(pieces) == 1 + 3 + 1
    for (b, e), d in pieces.items():
        assert piece_digest(data[b:e]) == d
    assert sorted(pieces)[1] == (sorted(tensors)[1][0], sorted(tensors)[1][0] + PIECE_SIZE)

    bad = [listed[0], listed[1][:2] + [listed[1][2][::-1]], listed[2]]
    with pytest.raises(ValueError, match="do not make the object's name"):
        listed_digests(*made(bad)[:2], name)  # the damaged list's own header: not the name
    for wrong in ([listed[0], listed[1][:2], listed[2]], listed[:2], [listed[0], listed[1], "ab"],
                  [listed[0], listed[1], ["AB" * 32]]):
        with pytest.raises(ValueError, match="malformed"):  # refused for its shape, before the name is checked
            listed_digests(*made(wrong)[:2], name)
    head, _ = build_header(specs, {DIGESTS_KEY: listed})  # type: ignore[dict-item]  # a list, not a JSON string
    with pytest.raises(ValueError, match="malformed"):
        listed_digests(head, len(head) + sum(map(len, blobs)), name)
    head, _ = build_header(specs)
    assert listed_digests(head, len(head) + sum(map(len, blobs)), name) is None
