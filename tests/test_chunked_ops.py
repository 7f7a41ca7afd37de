"""Chunked tensors (a DTensor committed by several ranks, each storing its own block) in the whole-store
operations: verify, diff, du, ``show``, the Hugging Face export, and push/pull through S3.

A chunked version is made without several ranks: the blocks are committed as plain tensors (step 1),
then a version whose manifest places each block in its tensor is published next to it (step 2), on
the very same objects. Bytes are read back through the manifest and the objects (``torch.frombuffer``),
not through ``Snapshot``.
"""

from __future__ import annotations

import itertools
import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import assert_bits_equal, random_tensor
from paramstore import ParamStore
from paramstore.cli import main
from paramstore.errors import CorruptObjectError
from paramstore.manifest import Chunk, Manifest, TensorEntry, Version
from paramstore.remote import Remote
from paramstore.tensors import ST_TO_TORCH

def normal(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


#: name -> (whole tensor, the sizes of its blocks along each dimension)
GRIDS = {
    "w": (normal(torch.float32, (300, 40), 1), ((100, 200), (40,))),  # split on rows
    "g": (normal(torch.bfloat16, (64, 96), 2), ((20, 44), (30, 30, 36))),  # a 2 x 3 grid
    "q": (random_tensor(torch.int64, (8, 12), 3), ((8,), (5, 7))),  # split on the last dimension
    "m": (random_tensor(torch.bool, (10,), 4), ((3, 7),)),  # 1-D
}
PLAIN = {"b": random_tensor(torch.float32, (16,), 4)}


def blocks(t: torch.Tensor, grid: tuple[tuple[int, ...], ...]) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The blocks of ``t`` cut by ``grid`` (sizes per dimension): (offsets, contiguous copy) each."""
    starts = [list(itertools.accumulate((0, *sizes[:-1]))) for sizes in grid]
    out = []
    for cell in itertools.product(*(list(zip(s, n)) for s, n in zip(starts, grid))):
        box = tuple(slice(o, o + n) for o, n in cell)
        out.append((tuple(o for o, _ in cell), t[box].clone().contiguous()))
    return out


def publish_chunked(store: ParamStore, step: int, grids=GRIDS, plain=PLAIN, *, lie: bool = False) -> Manifest:
    """Commit the blocks of ``grids`` and the ``plain`` tensors at ``step``, then publish at ``step + 1``
    the version holding them as chunked tensors (``lie``: the last chunk of "w" claims the first's digest)."""
    parts = {f"{n}.{i}": b for n, (t, grid) in grids.items() for i, (_, b) in enumerate(blocks(t, grid))}
    store.commit(step, {**parts, **plain}).result()
    m1 = store.manifest(step)
    tensors = {n: m1.tensors[n] for n in plain}
    for n, (t, grid) in grids.items():
        chunks = []
        for i, (offsets, b) in enumerate(blocks(t, grid)):
            e = m1.tensors[f"{n}.{i}"]
            chunks.append(Chunk(offsets, tuple(b.shape), e.digest, e.object, e.offset, e.nbytes))
        if lie and n == "w":
            chunks[-1] = Chunk(chunks[-1].offsets, chunks[-1].sizes, chunks[0].digest, chunks[-1].object,
                               chunks[-1].offset, chunks[-1].nbytes)
        tensors[n] = TensorEntry.chunked(m1.tensors[f"{n}.0"].dtype, tuple(t.shape), chunks)
    man = Manifest(tensors)
    version = Version(step=step + 1, created_at=time.time(), nbytes=man.nbytes, digest=man.digest(),
                      num_tensors=len(man.tensors) + len(man.aliases))
    store._root.registry.publish(version, man, {}, {})  # the objects are step's
    return man


def read_whole(store: ParamStore, entry: TensorEntry) -> torch.Tensor:
    """The tensor ``entry`` assembled from its pieces' bytes, read from the objects of ``store``."""
    out = torch.empty(entry.shape, dtype=ST_TO_TORCH[entry.dtype])
    for c in entry.pieces():
        with open(store._root.tier.object_path(c.object), "rb") as f:
            f.seek(c.offset)
            data = bytearray(f.read(c.nbytes))
        block = torch.frombuffer(data, dtype=torch.uint8).view(out.dtype).view(c.sizes)
        out[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] = block
    return out


@pytest.fixture
def chunked(store_root):
    """Root of a store holding step 1 (the blocks, plain) and step 2 (chunked), closed."""
    with ParamStore(store_root) as store:
        man = publish_chunked(store, 1)
    assert man.chunked and [n for n, e in man.tensors.items() if e.chunks] == list(GRIDS)
    return store_root


def test_the_recipe_makes_a_chunked_version(chunked):
    with ParamStore(chunked) as store:
        man = store.manifest(2)
        assert len(man.tensors["g"].chunks) == 6 and man.to_json()["format"] == 2
        for n, (t, _) in GRIDS.items():
            assert_bits_equal(read_whole(store, man.tensors[n]), t, n)
        assert_bits_equal(read_whole(store, man.tensors["b"]), PLAIN["b"], "b")


# -- verify ---------------------------------------------------------------------------------------
def test_verify_checks_every_chunk(chunked):
    with ParamStore(chunked) as store:
        r = store.verify()
        assert r["ok"] and r["versions_checked"] == 2 and r["objects_checked"] == 1, r
        c = store.manifest(2).tensors["w"].chunks[1]
        path = store._root.tier.object_path(c.object)
        with open(path, "r+b") as f:  # one bit inside the second chunk of "w"
            f.seek(c.offset + c.nbytes // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        r = store.verify(2)
        assert not r["ok"] and c.object in r["corrupt"] and r["damaged_versions"] == [2]
        assert "bytes hash to" in r["corrupt"][c.object]


def test_verify_names_a_chunk_whose_digest_is_wrong(store_root):
    with ParamStore(store_root) as store:
        man = publish_chunked(store, 1, lie=True)
        r = store.verify()
        (obj,) = man.objects()
        assert not r["ok"] and 2 in r["damaged_versions"]  # (and 1, as every version of that object)
        assert r["corrupt"][obj] == "tensor digests differ for step 2 'w[100:300, 0:40]'"


# -- diff and du ------------------------------------------------------------------------------------
def test_diff_between_chunked_and_plain_versions(chunked):
    with ParamStore(chunked) as store:
        w, g = GRIDS["w"][0], GRIDS["g"][0]
        store.commit(3, {**{n: t for n, (t, _) in GRIDS.items()}, "w": w + 0.5, **PLAIN}).result()  # all whole
        r = store.diff(2, 3)
        changed = {c["name"]: c for c in r["changed"]}
        assert sorted(changed) == sorted(GRIDS) and r["unchanged"] == 1 and not r["added"] and not r["removed"]
        # w: other values; g, q: the same values, chunked otherwise (compared by digest, which covers the layout)
        assert changed["w"]["max_abs_diff"] == pytest.approx(0.5, abs=1e-5) and changed["w"]["relayout"]
        assert changed["g"]["max_abs_diff"] == 0.0 and changed["g"]["relayout"]
        assert changed["q"]["max_abs_diff"] == 0.0
        assert "max_abs_diff" not in changed["m"]  # bool
        assert changed["w"]["nbytes"] == w.numel() * 4 and changed["g"]["nbytes"] == g.numel() * 2
        assert r["changed_bytes"] == store.manifest(2).nbytes - PLAIN["b"].numel() * 4
        assert store.diff(2, 2)["changed"] == []

        back = store.diff(3, 2)
        assert sorted(c["name"] for c in back["changed"]) == sorted(GRIDS)
        assert {c["name"]: c.get("max_abs_diff") for c in back["changed"]}["w"] == pytest.approx(0.5, abs=1e-5)
        first = store.diff(1, 2)  # blocks as tensors -> whole chunked tensors
        assert first["added"] == sorted(GRIDS) and "w.0" in first["removed"] and first["unchanged"] == 1
        assert first["added_bytes"] == store.manifest(2).nbytes - PLAIN["b"].numel() * 4


def test_diff_of_two_chunked_versions(chunked):
    with ParamStore(chunked) as store:
        w = GRIDS["w"][0]
        w2 = w.clone()
        w2[150, 3] += 1000.0  # in the second chunk
        publish_chunked(store, 3, {**GRIDS, "w": (w2, GRIDS["w"][1])})
        r = store.diff(2, 4)
        assert [c["name"] for c in r["changed"]] == ["w"] and "relayout" not in r["changed"][0]
        assert r["changed"][0]["max_abs_diff"] == pytest.approx(1000.0, rel=1e-4)
        assert r["changed_bytes"] == w.numel() * 4 and r["unchanged"] == len(GRIDS)


def test_du_counts_a_chunked_version_once_stored(chunked):
    with ParamStore(chunked) as store:
        r = store.du()
        logical = sum(t.numel() * t.element_size() for t, _ in GRIDS.values()) + 64
        assert r["versions"] == 2 and r["objects"] == 1 and r["logical_bytes"] == 2 * logical
        assert r["dedup_ratio"] > 1.9  # the chunked version stores nothing of its own


# -- the CLI ----------------------------------------------------------------------------------------
def run(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().out


def test_show_prints_chunked_tensors(chunked, capsys):
    code, out = run(capsys, "--root", chunked, "show", "2")
    assert code == 0
    assert "format     2 (4 tensors chunked)" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert lines["w"].split()[1:3] == ["F32[300,", "40]"] and lines["w"].endswith("2 chunks")
    assert lines["g"].endswith("6 chunks") and "chunks" not in lines["b"]
    code, out = run(capsys, "--root", chunked, "show", "1")
    assert code == 0 and "format     1 (every tensor whole)" in out
    code, out = run(capsys, "--root", chunked, "show", "2", "--json")
    shown = json.loads(out)
    assert shown["manifest"]["format"] == 2 and len(shown["manifest"]["tensors"]["g"]["chunks"]) == 6
    assert run(capsys, "--root", chunked, "verify")[0] == 0
    code, out = run(capsys, "--root", chunked, "du", "--json")
    assert code == 0 and json.loads(out)["versions"] == 2


# -- export ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shard_size", [None, 1000])  # one file; one tensor per file
def test_export_assembles_chunked_tensors(chunked, tmp_path, shard_size):
    out = tmp_path / "hf"
    with ParamStore(chunked) as store:
        r = store.export(2, out, shard_size_bytes=shard_size, weights_only=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted([*GRIDS, *PLAIN])
    assert len(r["files"]) == (2 if shard_size is None else 5)
    got = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(load_file(str(out / f)))
    for n, (t, _) in GRIDS.items():
        assert_bits_equal(got[n], t, n)
    assert_bits_equal(got["b"], PLAIN["b"], "b")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert not [f for f in os.listdir(out) if f.endswith(".partial")]


# -- push and pull ----------------------------------------------------------------------------------
def test_push_and_pull_a_chunked_version_bit_identical(s3_remote, shm_dir):
    url, opts = s3_remote
    with ParamStore(os.path.join(shm_dir, "a"), remote=url, storage_options=opts) as a:
        man = publish_chunked(a, 1)
        a.push(2)
        assert a.persisted().get(2) == url

    with ParamStore(os.path.join(shm_dir, "b"), remote=url, storage_options=opts) as b:
        r = b.pull(2)
        assert r.objects == 1
        assert b.manifest(2) == man and b.get(2).digest == man.digest()
        assert b.verify()["ok"]
        pulled = b.manifest(2)
        for n, (t, _) in GRIDS.items():
            assert_bits_equal(read_whole(b, pulled.tensors[n]), t, n)
            for c in pulled.tensors[n].chunks:  # each chunk is indexed where it lies (dedup by chunk digest)
                assert b._root.registry.locate_tensors([c.digest])[c.digest] == (c.object, c.offset, c.nbytes)
        assert_bits_equal(read_whole(b, pulled.tensors["b"]), PLAIN["b"], "b")


def test_pull_refuses_a_manifest_that_misplaces_a_chunk(s3_remote, shm_dir):
    url, opts = s3_remote
    with ParamStore(os.path.join(shm_dir, "a"), remote=url, storage_options=opts) as a:
        man = publish_chunked(a, 1)
        a.push(2)
    # Point the first chunk of "g" at the bytes of the second (same size): the version digest does not
    # cover where bytes lie, so only the check of each chunk's bytes can tell.
    raw = man.to_json()
    g = raw["tensors"]["g"]["chunks"]
    assert g[0]["nbytes"] == g[1]["nbytes"]
    g[0]["offset"] = g[1]["offset"]
    Remote(url, opts).tier.put_record(f"manifests/{2:020d}.json", json.dumps(raw).encode())
    with ParamStore(os.path.join(shm_dir, "b"), remote=url, storage_options=opts) as b:
        with pytest.raises(CorruptObjectError, match=r"tensor 'g\[0:20, 0:30\]'.*a tampered manifest"):
            b.pull(2)
        assert b.versions() == [] and list(b._root.tier.list()) == []
