"""Resharding checked against ``torch.distributed.checkpoint`` (DCP), and FSDP2 state dicts.

4 spawned ranks (gloo, CPU) commit a few random layouts of DTensors (random shapes and dtypes,
bf16 among them, sizes not divisible by the world size, ``Shard(0)``, ``Shard(1)``,
``Replicate``, a (2, 2) mesh, plain tensors) to a store *and* save them with ``dcp.save``. Then
2, 3 and 1 ranks build the same global shapes on a (n,) mesh with random placements, load them
once with ``dcp.load`` and once with paramstore (``snap.load_into(module)``, ``snap.read``), and
every local tensor must be bit-identical between the two (and to the tensors the seed makes).

The FSDP2 test commits a ``fully_shard`` model's state dict from 2 ranks, checks the version
whole in another process, and loads it back into a fresh ``fully_shard`` model.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import zlib
from typing import Any

import pytest
import torch
from helpers import SHM, as_bytes, random_tensor
from ranks import run_ranks
from torch import nn

from paramstore import ParamStore

SEED = 20240613  # the whole file is a pure function of it: a failure replays exactly
CASES = 3  # random layouts committed by 4 ranks, each loaded by 2, 3 and 1 ranks
SAVERS = 4

# A tensor of a case: (name, global shape, dtype, mesh "1d"/"2d"/"plain", placements on that mesh)
Spec = tuple[str, tuple[int, ...], torch.dtype, str, tuple[str, ...]]

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.int32, torch.int64]
SIZES = [1, 2, 3, 5, 6, 7, 9, 11, 13]  # mostly not divisible by 4 (or 3, or 2); 1, 2, 3: some rank empty


def case_specs(case: int) -> list[Spec]:
    """The tensors of ``case`` (a pure function of SEED and case: every process rebuilds it)."""
    rng = random.Random(f"{SEED}/specs/{case}")

    def shape(ndim: int) -> tuple[int, ...]:
        return tuple(rng.choice(SIZES) for _ in range(ndim))

    specs: list[Spec] = [
        # The layouts every case has, with random sizes and dtypes.
        ("embed.weight", shape(2), torch.bfloat16, "1d", ("S0",)),
        ("layers.0.proj.weight", shape(2), rng.choice(DTYPES[:4]), "1d", ("S1",)),
        ("layers.0.norm.weight", shape(1), rng.choice(DTYPES[:4]), "1d", ("R",)),
        ("layers.1.grid", shape(2), torch.bfloat16, "2d", ("S0", "S1")),
        ("step_count", (), torch.int64, "plain", ()),
    ]
    for i in range(3):  # and a few random ones
        ndim = rng.choice([1, 2, 2, 3])
        mesh = rng.choice(["1d", "2d"])
        dims = [f"S{d}" for d in range(ndim)] + ["R"]
        places = tuple(rng.choice(dims) for _ in range(1 if mesh == "1d" else 2))
        specs.append((f"layers.{i + 2}.w", shape(ndim), rng.choice(DTYPES), mesh, places))
    return specs


def full(case: int, spec: Spec) -> torch.Tensor:
    """The whole tensor of ``spec`` in ``case``: random bits (NaNs, infinities, subnormals)."""
    name, shape, dtype = spec[:3]
    return random_tensor(dtype, shape, zlib.crc32(f"{SEED}/{case}/{name}".encode()))


def target_placements(case: int, world: int, spec: Spec) -> tuple[str, ...]:
    """Where ``world`` loading ranks hold tensor ``spec`` (on a (world,) mesh): random, seeded."""
    ndim = len(spec[1])
    if spec[3] == "plain":
        return ()
    rng = random.Random(f"{SEED}/target/{case}/{world}/{spec[0]}")
    return (rng.choice([*(f"S{d}" for d in range(min(ndim, 2))), "R"]),)


def placements(codes: tuple[str, ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if c == "R" else Shard(int(c[1:])) for c in codes]


def block_of(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(as_bytes(a), as_bytes(b))


def difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where ``got`` first differs from ``want`` (dtype, shape, or the first byte that differs)."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    a, b = as_bytes(got), as_bytes(want)
    size = got.element_size()
    at = int((a != b).nonzero()[0]) // size
    index = list(torch.unravel_index(torch.tensor(at), tuple(got.shape))) if got.dim() else []
    elem = slice(at * size, (at + 1) * size)
    return (f"{int((a != b).sum())} of {a.numel()} bytes differ, first in element {[int(x) for x in index]} of "
            f"{got.dtype} {tuple(got.shape)}: got bytes {a[elem].tolist()}, want {b[elem].tolist()}")


# -- what the ranks run (module level: spawned processes import it) ----------------------------
def _save(rank: int, world: int, root: str, dcp_dir: str) -> list[str]:
    """Every case: commit it as version ``case + 1`` and ``dcp.save`` it to ``dcp_dir/case``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    meshes = {"1d": init_device_mesh("cpu", (world,)), "2d": init_device_mesh("cpu", (2, world // 2))}
    digests = []
    with ParamStore(root) as store:
        for case in range(CASES):
            state: dict[str, torch.Tensor] = {}
            for spec in case_specs(case):
                whole = full(case, spec)
                state[spec[0]] = whole if spec[3] == "plain" else distribute_tensor(
                    whole, meshes[spec[3]], placements(spec[4]))
            digests.append(store.commit(case + 1, state).result(timeout=60).digest)
            dcp.save(state, checkpoint_id=os.path.join(dcp_dir, str(case)))
    return digests


def _target(case: int, world: int, mesh: Any, fill: int) -> dict[str, torch.Tensor]:
    """The tensors of ``case`` as ``world`` loading ranks hold them, every byte set to ``fill``."""
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for spec in case_specs(case):
        _, shape, dtype, _, _ = spec
        n = 1
        for d in shape:
            n *= d
        whole = torch.full((n * torch.empty((), dtype=dtype).element_size(),), fill, dtype=torch.uint8)
        whole = whole.view(dtype).reshape(shape)
        codes = target_placements(case, world, spec)
        out[spec[0]] = whole if not codes else distribute_tensor(whole, mesh, placements(codes))
    return out


def _as_module(state: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose state dict is ``state`` (the very tensors): floats as parameters, the rest as buffers."""
    root = nn.Module()
    for name, t in state.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, nn.Module())
            m = getattr(m, p)
        if t.is_floating_point():
            m.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
        else:
            m.register_buffer(leaf, t)
    return root


def _load(rank: int, world: int, root: str, dcp_dir: str) -> dict:
    """Every case: load it with DCP and with paramstore on a (world,) mesh; list every difference."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (world,))
    bad: list[str] = []
    checked = 0
    with ParamStore(root) as store:
        for case in range(CASES):
            ref = _target(case, world, mesh, 0x00)
            dcp.load(ref, checkpoint_id=os.path.join(dcp_dir, str(case)))
            module = _as_module(_target(case, world, mesh, 0xFF))  # other bytes: an unwritten one shows
            with store.checkout(case + 1) as snap:
                result = snap.load_into(module)
                if result.missing_keys or result.unexpected_keys:
                    bad.append(f"case {case}: load_into reported {result}")
                mine = module.state_dict()
                rng = random.Random(f"{SEED}/box/{case}/{world}/{rank}")
                for spec in case_specs(case):
                    name, shape = spec[0], spec[1]
                    where = f"case {case} rank {rank}/{world} {name} {shape} {spec[2]} " \
                            f"saved {spec[3]}{list(spec[4])} loaded {list(target_placements(case, world, spec))}"
                    want, got = ref[name], mine[name]
                    if isinstance(want, DTensor):
                        sizes, offsets = compute_local_shape_and_global_offset(want.shape, want.device_mesh,
                                                                               want.placements)
                        sizes, offsets = tuple(sizes), tuple(offsets)
                        want, got = want.to_local(), got.to_local()
                    else:
                        sizes, offsets = tuple(shape), (0,) * len(shape)
                    truth = block_of(full(case, spec), offsets, sizes)
                    if not same_bits(want, truth):
                        bad.append(f"{where}: dcp.load differs from the saved tensor: {difference(want, truth)}")
                    if not same_bits(got, want):
                        bad.append(f"{where}: load_into differs from dcp.load: {difference(got, want)}")
                    # read(): this rank's block, and a random box, into a fresh tensor
                    block = snap.read(name, offsets, sizes)
                    if not same_bits(block, want):
                        bad.append(f"{where}: read{offsets, sizes} differs from dcp.load: {difference(block, want)}")
                    lo = tuple(rng.randrange(n + 1) for n in shape)
                    n = tuple(rng.randrange(s - o + 1) for o, s in zip(lo, shape))
                    box = snap.read(name, lo, n)
                    if not same_bits(box, block_of(full(case, spec), lo, n)):
                        bad.append(f"{where}: read{lo, n} differs from the saved tensor: "
                                   f"{difference(box, block_of(full(case, spec), lo, n))}")
                    checked += 1
    return {"bad": bad, "checked": checked}


# -- the tests ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved():
    """(store root, DCP directory): every case committed and ``dcp.save``d by 4 ranks (once per module)."""
    d = tempfile.mkdtemp(prefix="paramstore-test-", dir=SHM)  # as the shm_dir fixture, for the module
    try:
        root, dcp_dir = os.path.join(d, "store"), os.path.join(d, "dcp")
        digests = run_ranks(SAVERS, _save, root, dcp_dir, timeout=120)
        assert all(digests[r] == digests[0] for r in digests)  # every rank: the same versions
        yield root, dcp_dir
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_saved_layouts_cover_what_they_should():
    """The seeded cases cover what the file promises (so a new SEED cannot quietly lose coverage)."""
    specs = [s for c in range(CASES) for s in case_specs(c)]
    assert {s[2] for s in specs} >= {torch.bfloat16, torch.float32}
    assert {s[4] for s in specs if s[3] == "1d"} >= {("S0",), ("S1",), ("R",)}
    assert ("S0", "S1") in {s[4] for s in specs if s[3] == "2d"}
    assert any(n % SAVERS for s in specs for n in s[1])  # sizes not divisible by the world size
    targets = {target_placements(c, w, s) for c in range(CASES) for s in case_specs(c) for w in (2, 3)}
    assert targets >= {("S0",), ("S1",), ("R",)}


@pytest.mark.parametrize("world", [2, 3, 1])
def test_a_version_of_4_ranks_loads_into_n_ranks_as_dcp_loads_it(saved, world):
    root, dcp_dir = saved
    got = run_ranks(world, _load, root, dcp_dir, timeout=120)
    bad = [m for r in sorted(got) for m in got[r]["bad"]]
    assert not bad, "\n".join(bad)
    assert all(got[r]["checked"] == sum(len(case_specs(c)) for c in range(CASES)) for r in got)


# -- FSDP2 -------------------------------------------------------------------------------------
class MLP(nn.Module):
    """Two layers of uneven sizes (7 and 3 rows over 2 ranks), the second in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(5, 7)
        self.down = nn.Linear(7, 3, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)).to(torch.bfloat16))


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MLP()


def _fully_sharded(seed: int, world: int) -> nn.Module | str:
    """``_mlp(seed)`` under FSDP2 on a (world,) CPU mesh, or why FSDP2 cannot run here."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        model = _mlp(seed)
        fully_shard(model.up, mesh=mesh)
        fully_shard(model, mesh=mesh)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which skips with it
        return f"fully_shard on CPU/gloo (torch {torch.__version__}) failed: {type(e).__name__}: {e}"
    return model


def _fsdp_commit(rank: int, world: int, root: str) -> dict:
    model = _fully_sharded(1, world)
    if isinstance(model, str):
        return {"skip": model}
    state = model.state_dict()
    layout = {n: [type(v).__name__, [repr(p) for p in getattr(v, "placements", ())]] for n, v in state.items()}
    with ParamStore(root) as store:
        digest = store.commit(1, state).result(timeout=60).digest
    return {"digest": digest, "layout": layout}


def _fsdp_load(rank: int, world: int, root: str) -> dict:
    model = _fully_sharded(2, world)  # other weights than those committed
    if isinstance(model, str):
        return {"skip": model}
    want = _fully_sharded(1, world).state_dict()  # the local shards that were committed
    bad = []
    with ParamStore(root) as store, store.checkout(1) as snap:
        result = snap.load_into(model)
    got = model.state_dict()
    for name, w in want.items():
        if not same_bits(got[name].to_local(), w.to_local()):
            bad.append(f"rank {rank} {name}: load_into differs from the committed shard: "
                       f"{difference(got[name].to_local(), w.to_local())}")
    # FSDP2 gathers the loaded shards in forward: the output is the unsharded model's, bit for bit.
    x = torch.linspace(-1, 1, 10).reshape(2, 5)
    with torch.no_grad():
        y, y_ref = model(x), _mlp(1)(x)
    if not same_bits(y, y_ref):
        bad.append(f"rank {rank}: forward after load_into differs from the unsharded model's")
    return {"bad": bad, "missing": result.missing_keys, "unexpected": result.unexpected_keys}


def _check_whole(root: str) -> list[str]:
    """Version 1 is the unsharded model's state dict, bit for bit (the names that differ)."""
    want = _mlp(1).state_dict()
    with ParamStore(root) as store, store.checkout(1) as snap:
        assert sorted(snap) == sorted(want)
        return [n for n, t in want.items() if not same_bits(snap[n], t)]


def test_an_fsdp2_model_commits_its_shards_and_loads_them_back(shm_dir):
    root = os.path.join(shm_dir, "store")
    got = run_ranks(2, _fsdp_commit, root, timeout=120)
    if "skip" in got[0]:
        pytest.skip(got[0]["skip"])
    assert got[0]["digest"] == got[1]["digest"]
    assert got[0]["layout"] == {n: ["DTensor", ["Shard(dim=0)"]] for n in _mlp(0).state_dict()}
    with ParamStore(root) as store:  # each rank stored its Shard(0) rows: 2 chunks per tensor
        assert {n: len(e.chunks) for n, e in store.manifest(1).tensors.items()} == \
            {n: 2 for n in _mlp(0).state_dict()}
    assert _check_whole(root) == []  # in this process: not one of the ranks that committed
    loaded = run_ranks(2, _fsdp_load, root, timeout=120)
    for r in loaded.values():
        assert r["missing"] == r["unexpected"] == []
    bad = [m for r in sorted(loaded) for m in loaded[r]["bad"]]
    assert not bad, "\n".join(bad)
