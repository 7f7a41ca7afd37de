"""Resharded checkout: chunked tensors read whole, by box (``Snapshot.read``), and into DTensors.

A chunked version is made without a multi-rank commit: a plain version whose tensors are the
blocks is committed, then a second version whose entries are chunked over those very bytes is
published straight to the registry (:func:`publish_chunked`). The DTensor tests run real ranks
(spawned processes, a gloo group on CPU) that each load their own block.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from helpers import assert_bits_equal, random_tensor
from ranks import run_ranks
from paramstore import ParamStore
from paramstore.errors import InvalidArgumentError, LoadError, StoreClosedError
from paramstore.manifest import Chunk, Manifest, TensorEntry, Version
from paramstore.snapshot import Snapshot

Cuts = tuple[tuple[int, ...], ...]  # per dimension, where blocks start (besides 0)


def grid(shape: tuple[int, ...], cuts: Cuts) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The blocks (offsets, sizes) of ``shape`` cut at ``cuts``, in C order."""
    spans = []
    for n, cut in zip(shape, cuts):
        edges = [0, *cut, n]
        spans.append([(a, b - a) for a, b in zip(edges, edges[1:])])
    return [(tuple(o for o, _ in cell), tuple(s for _, s in cell)) for cell in itertools.product(*spans)]


def block(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


def publish_chunked(store: ParamStore, step: int, tensors: dict[str, tuple[torch.Tensor, Cuts | None]],
                    aliases: dict[str, str] | None = None) -> int:
    """Commit the blocks of ``tensors`` (name -> (whole tensor, cuts; None: stored whole)) as plain
    version ``step``, then publish version ``step + 1`` whose entries are chunked over those bytes.
    Returns ``step + 1``."""
    plain: dict[str, torch.Tensor] = {}
    for name, (t, cuts) in tensors.items():
        if cuts is None:
            plain[name] = t.clone()
        else:
            for i, (o, s) in enumerate(grid(tuple(t.shape), cuts)):
                plain[f"{name}.{i}"] = block(t, o, s).clone()
    store.commit(step, plain).result()
    stored = store.manifest(step)
    entries = {}
    for name, (t, cuts) in tensors.items():
        if cuts is None:
            entries[name] = stored.tensors[name]
            continue
        chunks = []
        for i, (o, s) in enumerate(grid(tuple(t.shape), cuts)):
            e = stored.tensors[f"{name}.{i}"]
            chunks.append(Chunk(o, s, e.digest, e.object, e.offset, e.nbytes))
        entries[name] = TensorEntry.chunked(stored.tensors[f"{name}.0"].dtype, tuple(t.shape), chunks)
    manifest = Manifest(entries, dict(aliases or {}))
    version = Version(step=step + 1, created_at=time.time(), nbytes=manifest.nbytes, digest=manifest.digest(),
                      num_tensors=len(entries) + len(manifest.aliases))
    store._root.registry.publish(version, manifest, {}, {})
    return step + 1


# The tensors of the single-process tests: 1-D, 2-D and 3-D grids with uneven blocks, and a plain one.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype, Cuts | None]] = {
    "line": ((10,), torch.float32, ((3, 4),)),  # blocks of 3, 1, 6
    "grid": ((5, 7), torch.bfloat16, ((2,), (3, 4))),  # 2 x 3 blocks
    "cube": ((3, 4, 5), torch.float16, ((1,), (), (2,))),  # 2 x 1 x 2 blocks
    "ints": ((6, 2), torch.int64, ((5,), (1,))),
    "plain": ((4, 3), torch.float32, None),
}


def make_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    return {n: random_tensor(dtype, shape, seed + i) if dtype.is_floating_point
            else torch.arange(int(torch.tensor(shape).prod()), dtype=dtype).reshape(shape)
            for i, (n, (shape, dtype, _)) in enumerate(SHAPES.items())}


@pytest.fixture
def chunked(store):
    """(store, step of the chunked version, the whole tensors); ``tied`` aliases ``grid``."""
    full = make_tensors()
    step = publish_chunked(store, 1, {n: (t, SHAPES[n][2]) for n, t in full.items()}, {"tied": "grid"})
    return store, step, full


def test_the_recipe_makes_chunked_entries(chunked):
    store, step, _ = chunked
    m = store.manifest(step)
    assert m.chunked and m.entry("tied") is m.entry("grid")
    assert [len(m.tensors[n].chunks) for n in SHAPES] == [3, 6, 4, 4, 0]
    assert {c.sizes for c in m.tensors["line"].chunks} == {(3,), (1,), (6,)}


def test_getitem_assembles_a_chunked_tensor_once(chunked):
    store, step, full = chunked
    with store.checkout(step) as snap:
        for name, want in full.items():
            got = snap[name]
            assert got.dtype == want.dtype and got.shape == want.shape
            assert_bits_equal(got, want, name)
            assert snap[name] is got  # cached
        assert snap["tied"] is snap["grid"]
        assert snap["grid"].device.type == "cpu"
        # a chunked tensor is a fresh tensor; a plain one still a view of the store's pages
        assert snap["grid"].untyped_storage().nbytes() == full["grid"].nbytes
        assert snap["plain"].untyped_storage().nbytes() > full["plain"].nbytes
        assert_bits_equal(dict(snap)["tied"], full["grid"], "tied")
        assert snap.verify() == {}


def test_verify_checks_each_chunk_against_its_digest(chunked):
    """A manifest whose chunk says another digest than its bytes have (the object itself intact)."""
    store, step, _ = chunked
    m = store.manifest(step)
    first, second, *rest = m.tensors["line"].chunks
    lying = Chunk(first.offsets, first.sizes, second.digest, first.object, first.offset, first.nbytes)
    manifest = Manifest({**m.tensors, "line": TensorEntry.chunked("F32", (10,), [lying, second, *rest])},
                        m.aliases)
    store._root.registry.publish(Version(step=step + 1, created_at=time.time(), nbytes=manifest.nbytes,
                                         digest=manifest.digest(), num_tensors=len(SHAPES) + 1),
                                 manifest, {}, {})
    with store.checkout(step + 1) as snap:
        bad = snap.verify()
    assert list(bad) == [first.object]
    assert bad[first.object] == f"tensor digests differ from the manifest at bytes {first.offset}..{first.offset + first.nbytes}"


def test_verify_finds_a_flipped_byte_in_a_chunk(chunked):
    store, step, _ = chunked
    c = store.manifest(step).tensors["grid"].chunks[4]
    with open(store._root.tier.object_path(c.object), "r+b") as f:  # one byte of one chunk
        f.seek(c.offset + 1)
        b = f.read(1)
        f.seek(c.offset + 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with store.checkout(step) as snap:
        assert list(snap.verify()) == [c.object]


@pytest.mark.parametrize("name", list(SHAPES))
def test_read_the_whole_tensor_and_single_elements(chunked, name):
    store, step, full = chunked
    want = full[name]
    with store.checkout(step) as snap:
        assert_bits_equal(snap.read(name, (0,) * want.dim(), want.shape), want, name)
        for idx in itertools.product(*(range(n) for n in want.shape)):
            got = snap.read(name, idx, (1,) * want.dim())
            assert_bits_equal(got, block(want, idx, (1,) * want.dim()), f"{name}{idx}")


def test_read_random_boxes_equals_slicing(chunked):
    store, step, full = chunked
    with store.checkout(step) as snap:

        @settings(max_examples=300, deadline=None, derandomize=True)
        @given(st.data())
        def check(data: st.DataObject) -> None:
            name = data.draw(st.sampled_from([*SHAPES, "tied"]))
            want = full[snap.manifest.aliases.get(name, name)]
            offsets, sizes = [], []
            for n in want.shape:
                lo = data.draw(st.integers(0, n))
                offsets.append(lo)
                sizes.append(data.draw(st.integers(0, n - lo)))
            expect = block(want, tuple(offsets), tuple(sizes))
            into = data.draw(st.sampled_from([None, want.dtype, torch.float64]))
            if into is None:
                got = snap.read(name, offsets, sizes)
                assert got.dtype == want.dtype and got.is_contiguous()
                assert_bits_equal(got, expect, f"{name} {offsets} {sizes}")
            else:
                out = torch.full(sizes, 7, dtype=into)
                assert snap.read(name, tuple(offsets), torch.Size(sizes), out=out) is out
                assert_bits_equal(out, expect.to(into), f"{name} {offsets} {sizes} into {into}")

        check()


def test_read_copies_only_the_pieces_that_meet_the_box(chunked, monkeypatch):
    store, step, full = chunked
    touched: list[tuple[int, ...]] = []
    piece = Snapshot._piece

    def spy(self, e, c):
        touched.append(c.offsets)
        return piece(self, e, c)

    monkeypatch.setattr(Snapshot, "_piece", spy)
    with store.checkout(step) as snap:
        # grid (5, 7): rows cut at 2, columns at 3 and 4
        for offsets, sizes, pieces in [
            ((0, 0), (2, 3), [(0, 0)]),
            ((3, 5), (2, 2), [(2, 4)]),
            ((1, 2), (2, 3), [(0, 0), (0, 3), (0, 4), (2, 0), (2, 3), (2, 4)]),
            ((1, 3), (4, 1), [(0, 3), (2, 3)]),
            ((2, 3), (0, 1), []),  # an empty box touches nothing
            ((5, 7), (0, 0), []),
        ]:
            touched.clear()
            got = snap.read("grid", offsets, sizes)
            assert touched == pieces, (offsets, sizes)
            assert_bits_equal(got, block(full["grid"], offsets, sizes))
        touched.clear()
        snap.read("line", (4,), (6,))
        assert touched == [(4,)]


def test_read_a_scalar_and_an_empty_tensor(store):
    store.commit(1, {"s": torch.tensor(2.5, dtype=torch.float64), "e": torch.empty(0, 3)}).result()
    with store.checkout(1) as snap:
        assert snap.read("s", (), ()).item() == 2.5
        out = torch.zeros((), dtype=torch.float32)
        assert snap.read("s", [], [], out=out) is out and out.item() == 2.5
        assert snap.read("e", (0, 1), (0, 2)).shape == (0, 2)


def test_read_refuses_bad_arguments(chunked):
    store, step, full = chunked
    snap = store.checkout(step)
    bad = [
        ((0,), (2, 3), None),  # too few offsets
        ((0, 0, 0), (1, 1, 1), None),  # too many
        ((0, 0), (2,), None),
        ((-1, 0), (1, 1), None),
        ((0, 0), (1, -1), None),
        ((True, 0), (1, 1), None),
        ((0.0, 0), (1, 1), None),
        ("ab", (1, 1), None),
        (3, (1, 1), None),
        ((4, 0), (2, 1), None),  # past the end of dimension 0 (5)
        ((0, 7), (1, 1), None),
        ((0, 0), (6, 7), None),
        ((0, 0), (2, 3), torch.empty(3, 2)),  # out of another shape
        ((0, 0), (2, 3), torch.empty(6)),
        ((0, 0), (2, 3), [[0] * 3] * 2),  # not a tensor
    ]
    for offsets, sizes, out in bad:
        with pytest.raises(InvalidArgumentError):
            snap.read("grid", offsets, sizes, out=out)
    with pytest.raises(KeyError, match="nope"):
        snap.read("nope", (0,), (1,))
    assert_bits_equal(snap.read("grid", torch.tensor([1, 2]), [1, 1]), full["grid"][1:2, 2:3])
    snap.close()
    with pytest.raises(StoreClosedError):
        snap.read("grid", (0, 0), (1, 1))


# -- load_into a plain module --------------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.proj = nn.Linear(6, 4)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("count", torch.zeros(3, dtype=torch.int64))


def tied_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    sd = Tied().state_dict()
    sd["count"] = torch.tensor([1, 2, 3])
    return {k: v.detach().clone() for k, v in sd.items() if k != "head.weight"}


def test_load_into_a_plain_module_from_chunks(store):
    want = tied_state(1)
    cuts = {"embed.weight": ((3, 7), (2,)), "proj.weight": ((1,), ()), "proj.bias": ((2,),), "count": None}
    step = publish_chunked(store, 1, {n: (want[n], cuts[n]) for n in want}, {"head.weight": "embed.weight"})
    module = Tied()
    with store.checkout(step) as snap:
        assert snap.load_into(module) == ([], [])
    assert module.head.weight is module.embed.weight  # still tied
    for name, t in want.items():
        assert_bits_equal(module.state_dict()[name], t, name)
    assert module.embed.weight.requires_grad and module.embed.weight.grad is None

    double = Tied().double()  # cast into the module's own dtype
    with store.checkout(step) as snap:
        snap.load_into(double)
    assert double.proj.weight.dtype == torch.float64
    assert torch.equal(double.proj.weight, want["proj.weight"].double())


def test_load_into_checks_names_and_shapes_before_copying(store):
    want = tied_state(2)
    step = publish_chunked(store, 1, {n: (t, None if t.dim() == 1 else ((1,),) * t.dim()) for n, t in want.items()},
                           {"head.weight": "embed.weight"})
    with store.checkout(step) as snap:
        extra = Tied()
        extra.more = nn.Linear(2, 2)
        before = extra.proj.weight.detach().clone()
        with pytest.raises(LoadError, match=r"missing keys \['more.weight', 'more.bias'\]"):
            snap.load_into(extra)
        assert torch.equal(extra.proj.weight, before)  # nothing copied
        assert snap.load_into(extra, strict=False) == (["more.weight", "more.bias"], [])
        assert torch.equal(extra.proj.weight, want["proj.weight"])

        fewer = Tied()
        del fewer.proj
        with pytest.raises(LoadError, match="unexpected keys"):
            snap.load_into(fewer)
        assert snap.load_into(fewer, strict=False) == ([], ["proj.bias", "proj.weight"])

        wrong = Tied()
        wrong.proj = nn.Linear(6, 5)
        for strict in (True, False):
            with pytest.raises(LoadError, match=r"size mismatch for 'proj.weight': the version has shape \[4, 6\]"):
                snap.load_into(wrong, strict=strict)
    with pytest.raises(StoreClosedError):
        snap.load_into(Tied())


# -- load_into DTensors --------------------------------------------------------------------------
# The version the ranks load: stored in chunks unlike any DTensor layout below (and ``c``, ``p`` whole).
DIST: dict[str, tuple[tuple[int, ...], torch.dtype, Cuts | None]] = {
    "a": ((7, 5), torch.float32, ((3,), (2, 4))),
    "b": ((7, 5), torch.bfloat16, ((), (1,))),
    "c": ((6,), torch.float32, None),
    "buf": ((5,), torch.int64, ((2,),)),
    "p": ((3,), torch.float32, None),
}
# Placements per mesh: "S<d>" Shard(d), "R" Replicate; ``p`` stays a plain parameter.
PLACEMENTS: dict[str, dict[str, tuple[str, ...]]] = {
    "1d": {"a": ("S0",), "b": ("S1",), "c": ("R",), "buf": ("S0",)},
    "2d": {"a": ("S0", "S1"), "b": ("S1", "R"), "c": ("R", "S0"), "buf": ("S0", "S0")},
}


def dist_tensor(name: str) -> torch.Tensor:
    shape, dtype, _ = DIST[name]
    g = torch.Generator().manual_seed(list(DIST).index(name) + 100)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def dtensor_module(mesh, placements: dict[str, tuple[str, ...]], fill: float = 0.0) -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    module = nn.Module()
    for name, (shape, dtype, _) in DIST.items():
        value = torch.full(shape, fill).to(dtype)
        if name in placements:
            value = distribute_tensor(value, mesh, [Replicate() if p == "R" else Shard(int(p[1:]))
                                                    for p in placements[name]])
        if dtype.is_floating_point:
            setattr(module, name, nn.Parameter(value))
        else:
            module.register_buffer(name, value)
    return module


# The ranks' meshes, all in one world of 4 processes (starting processes is what costs here): 2 and 3
# ranks (1-D placements; the ranks outside such a mesh hold nothing of its DTensors) and a 2 x 2 mesh.
WORLD = 4
MESHES: dict[str, tuple[list, str]] = {
    "2 ranks": ([0, 1], "1d"),
    "3 ranks": ([0, 1, 2], "1d"),
    "2x2 mesh": ([[0, 1], [2, 3]], "2d"),
}


def check_dtensor_load(root: str, step: int) -> None:
    """On one rank: load version ``step`` into DTensors on each mesh and check this rank's blocks."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    meshes = {what: DeviceMesh("cpu", torch.tensor(ranks)) for what, (ranks, _) in MESHES.items()}
    with ParamStore(root, create=False) as store, store.checkout(step) as snap:
        for what, mesh in meshes.items():
            placements = PLACEMENTS[MESHES[what][1]]
            module = dtensor_module(mesh, placements, fill=-7.0)
            assert snap.load_into(module) == ([], []), what
            member = mesh.get_coordinate() is not None
            for name in DIST:
                got, want, at = getattr(module, name), dist_tensor(name), f"{name} on the {what}"
                if name not in placements:
                    assert type(got) is nn.Parameter and torch.equal(got, want), at
                elif not member:
                    assert got.to_local().numel() == 0, at
                else:  # this rank's block: torch's own scatter of the whole tensor is the reference
                    expect = distribute_tensor(want, mesh, got.placements).to_local()
                    assert got.to_local().shape == expect.shape, (at, got.to_local().shape, expect.shape)
                    assert_bits_equal(got.to_local(), expect, at)
                    assert_bits_equal(got.full_tensor(), want, at)


def rank_main(rank: int, world: int, root: str, step: int) -> str:
    """On each spawned rank (tests/ranks.py's ``run_ranks``): every check, then a barrier."""
    import torch.distributed as dist

    check_dtensor_load(root, step)
    dist.barrier()
    return "ok"


@pytest.fixture
def dist_version(store, shm_dir):
    step = publish_chunked(store, 1, {n: (dist_tensor(n), DIST[n][2]) for n in DIST})
    return store.root, step, shm_dir


@pytest.mark.slow
def test_load_into_dtensors_on_spawned_ranks(dist_version):
    """2 and 3 ranks with Shard(0), Shard(1), Replicate (uneven blocks); a (2, 2) mesh with
    (Shard(0), Shard(1)), (Shard(1), Replicate()), (Replicate(), Shard(0)), (Shard(0), Shard(0))."""
    root, step, _ = dist_version
    assert run_ranks(WORLD, rank_main, root, step, timeout=120) == {r: "ok" for r in range(WORLD)}


@pytest.fixture
def one_rank(gloo_group):
    """A (1,) CPU mesh in this process (a one-process gloo group: conftest's ``gloo_group``)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def test_load_into_dtensors_in_one_process_and_what_is_refused(one_rank, dist_version):
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    root, step, _ = dist_version
    mesh = one_rank
    with ParamStore(root, create=False) as store, store.checkout(step) as snap:
        module = dtensor_module(mesh, PLACEMENTS["1d"])
        assert snap.load_into(module) == ([], [])
        assert_bits_equal(module.a.to_local(), dist_tensor("a"))
        assert_bits_equal(module.b.to_local(), dist_tensor("b"))

        partial = dtensor_module(mesh, PLACEMENTS["1d"])
        partial.c = nn.Parameter(DTensor.from_local(torch.zeros(6), mesh, [Partial()]))
        with pytest.raises(LoadError, match=r"'c' is a DTensor with placement P.*Redistribute it"):
            snap.load_into(partial)

        wrong = dtensor_module(mesh, PLACEMENTS["1d"])
        wrong.a = nn.Parameter(distribute_tensor(torch.zeros(8, 5), mesh, [Replicate()]))
        with pytest.raises(LoadError, match=r"size mismatch for 'a'.*\[7, 5\].*\[8, 5\] \(the DTensor's global"):
            snap.load_into(wrong, strict=False)
        assert torch.equal(wrong.b.to_local(), torch.zeros(7, 5, dtype=torch.bfloat16))  # nothing copied


def test_no_dtensor_import_for_a_plain_load(chunked):
    """DTensor is looked for only where something imported it (it costs ~0.6 s to import)."""
    import subprocess
    import sys

    store, step, full = chunked
    code = ("import sys, torch\nfrom paramstore import ParamStore\n"
            f"with ParamStore({store.root!r}, create=False) as s, s.checkout({step}) as snap:\n"
            "    m = torch.nn.Module(); m.line = torch.nn.Parameter(torch.zeros(10))\n"
            "    snap.load_into(m, strict=False)\n"
            "    print(float(m.line.sum()), 'torch.distributed.tensor' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    total, imported = proc.stdout.split()
    assert float(total) == pytest.approx(float(full["line"].sum())) and imported == "False"
