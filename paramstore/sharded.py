"""Sharded commits: the ranks of a trainer commit one version together, each storing its own blocks.

When a state dict holds DTensors, every rank of their mesh calls ``store.commit(step, state_dict)``
(same step, same names). Each rank stages only the blocks it holds (:func:`local_block`): a
``Shard(d)`` block is stored by the rank holding it, a block replicated over some mesh
dimensions by the rank at coordinate 0 on those dimensions only, and a plain tensor (taken as
replicated) by the group's first rank. No rank gathers a tensor.

The ranks then agree on one version through a gloo process group of their own
(:class:`CommitGroup`, made once, by all of them, at their first sharded commit; its collectives
run on the publisher threads, never on the training thread's groups). After each rank has stored
its objects (under its host's GC lock, held until the outcome is known, so GC cannot sweep them),
every rank contributes a *part* (JSON: its chunk entries, its new objects and index entries, or
the error it met) with one ``all_gather``; the first rank merges the parts into one manifest
(:func:`merge_parts`: every tensor's chunks must tile it), publishes it in one registry
transaction, and broadcasts the outcome, so every rank's ``committed`` future resolves the same
way. A rank that dies mid-commit closes its gloo connections: the others' collectives fail at once,
nothing is published, and what the dead rank staged is reclaimed by GC (its slabs belong to a dead
process; its objects, and those of the surviving ranks, are referenced by no version). A rank that
stops without dying is waited for up to the group's timeout (``ParamStore(group_timeout=)``).

No pickle: parts and outcomes cross the group as JSON bytes in uint8 tensors.
"""

from __future__ import annotations

import datetime
import json
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from .errors import CommitGroupError, InvalidTensorError, ParamStoreError
from .format import ITEMSIZE, loads
from .manifest import ASSET_PREFIX, Chunk, TensorEntry, check_tiling

from paramstore.backends.registries.base import check_digests

__all__ = ["Block", "local_block", "is_dtensor", "CommitGroup", "group_ranks", "merge_parts", "chunk_name"]


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor (without importing DTensor: that costs ~0.6 s)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(value, mod.DTensor)


@dataclass(frozen=True)
class Block:
    """This rank's part of a tensor: where it lies in the global tensor and whether this rank stores it."""

    shape: tuple[int, ...]  # global shape
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: torch.Tensor  # the block's data on this rank (shape ``sizes``)
    writes: bool  # this rank stores it (replicated blocks are stored once)

    @property
    def whole(self) -> bool:
        return self.sizes == self.shape


def chunk_name(name: str, offsets: tuple[int, ...]) -> str:
    """The name a block of ``name`` has inside its object file (``name``, NUL, ``o1,o2``: no tensor
    name holds a NUL, so it never meets one; objects are addressed through the manifest, this
    only keeps safetensors names unique)."""
    return f"{name}\0{','.join(map(str, offsets))}"


def local_block(name: str, value: Any, verb: str = "committed") -> Block | None:
    """This rank's block of the DTensor ``value`` (see the module docstring for who stores it);
    None when this rank is not in its mesh. The commit path and ``Snapshot.load_into`` both use it
    (``verb``: what is done with the block, for messages).

    Raises InvalidTensorError for placements whose local block is not one box of the global
    tensor (``Partial``: redistribute it first, e.g. ``redistribute(placements=[Replicate()])``;
    ``_StridedShard``, as FSDP2 + tensor parallel produce), or a local tensor of another shape
    than its placement says (a padded shard).
    """
    key = (value.device_mesh, tuple(value.placements), tuple(value.shape))
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = _block_layout(name, *key, verb)
    if layout is _NOT_IN_MESH:
        return None
    sizes, offsets, writes = layout
    local = value.to_local()
    if tuple(local.shape) != sizes:
        raise InvalidTensorError(f"{name!r}: the DTensor's local tensor has shape {list(local.shape)}, its placements "
                                 f"say {list(sizes)} (a padded shard?)")
    return Block(key[2], offsets, sizes, local, writes and local.numel() > 0)


#: (mesh, placements, global shape) -> this rank's (sizes, offsets, writes), or _NOT_IN_MESH: a
#: trainer commits the same layout at every step, and working it out costs ~0.1 ms per tensor.
_LAYOUTS: dict[tuple, tuple[tuple[int, ...], tuple[int, ...], bool]] = {}
_NOT_IN_MESH: tuple = ()


def _block_layout(name: str, mesh: Any, placements: tuple, shape: tuple[int, ...], verb: str
                  ) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in placements:
        where = f"{name!r} is a DTensor with placement {p} on mesh {tuple(mesh.shape)}"
        if p.is_partial():
            raise InvalidTensorError(
                f"{where}: a Partial placement's local tensors are summands, not blocks of the weights. "
                f"Redistribute it to Replicate or Shard first (dt.redistribute(placements=[Replicate()])): only "
                f"then can it be {verb}")
        if type(p) is not Shard and type(p) is not Replicate:
            raise InvalidTensorError(
                f"{where}: its local tensor is not one box of the global tensor; only Shard(dim) and Replicate "
                f"are {verb} block by block (redistribute it, or use dt.full_tensor())")
    coords = mesh.get_coordinate()
    if coords is None:
        return _NOT_IN_MESH
    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    writes = all(c == 0 for c, p in zip(coords, placements) if type(p) is Replicate)
    return tuple(sizes), tuple(offsets), writes


def group_ranks(meshes: Iterable[Any]) -> tuple[int, ...]:
    """The global ranks of every mesh, sorted: the ranks that commit together."""
    ranks: set[int] = set()
    for mesh in meshes:
        if mesh not in _MESH_RANKS:
            _MESH_RANKS[mesh] = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        ranks.update(_MESH_RANKS[mesh])
    return tuple(sorted(ranks))


_MESH_RANKS: dict[Any, tuple[int, ...]] = {}  # mesh -> its global ranks (reading them costs ~80 us)


class CommitGroup:
    """A gloo process group of the ranks committing together, used off the training thread.

    Made collectively by every member (``dist.new_group(..., use_local_synchronization=True)``:
    only the members take part), at their first sharded commit. ``ranks`` are global ranks; the
    first is the *lead*, which publishes.
    """

    def __init__(self, ranks: tuple[int, ...], timeout: float, identity: str = "") -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise CommitGroupError("a sharded commit needs torch.distributed to be initialized on every rank")
        self.ranks = ranks
        self.rank = dist.get_rank()
        if self.rank not in ranks:
            raise CommitGroupError(f"rank {self.rank} commits a tensor whose mesh is ranks {list(ranks)}")
        self.index = ranks.index(self.rank)
        self.lead = ranks[0]
        self.timeout = timeout
        self.broken = False  # a collective failed: the store makes a new group for the next commit
        try:
            self._pg = dist.new_group(list(ranks), backend="gloo", timeout=datetime.timedelta(seconds=timeout),
                                      use_local_synchronization=True)
        except (RuntimeError, ValueError) as e:
            raise CommitGroupError(
                f"ranks {list(ranks)} could not form their commit group (does every one of them commit, with "
                f"DTensors of the same meshes or the same group=?): {str(e).splitlines()[0][:300]}") from e
        # Two stores of one process whose first sharded commits come in another order on another rank
        # would pair up the wrong groups: check that every member means the same store.
        others = set(self.all_gather(identity.encode()))
        if len(others) > 1:
            self.broken = True
            raise CommitGroupError(f"ranks {list(ranks)} made their commit groups for different stores "
                                   f"({sorted(o.decode() for o in others)}): stores sharing ranks must make their "
                                   "first sharded commits in the same order on every rank")

    @property
    def is_lead(self) -> bool:
        return self.rank == self.lead

    def all_gather(self, data: bytes) -> list[bytes]:
        """Every member's ``data``, in rank order. Raises CommitGroupError when a member died
        (its connection closed) or did not take part within the timeout."""
        import torch.distributed as dist

        try:
            n = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in self.ranks]
            dist.all_gather(sizes, n, group=self._pg)
            width = max(int(s) for s in sizes)
            mine = torch.zeros(width, dtype=torch.uint8)
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
            bufs = [torch.empty(width, dtype=torch.uint8) for _ in self.ranks]
            dist.all_gather(bufs, mine, group=self._pg)
        except (RuntimeError, ValueError) as e:  # ValueError: the group was destroyed under us
            raise self._failed(e) from e
        return [bytes(b[: int(s)].numpy()) for b, s in zip(bufs, sizes)]

    def broadcast(self, data: bytes) -> bytes:
        """The lead's ``data`` on every member (the others pass b"")."""
        import torch.distributed as dist

        try:
            n = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(n, src=self.lead, group=self._pg)
            buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).clone() if self.is_lead and data
                   else torch.empty(int(n), dtype=torch.uint8))
            if int(n):
                dist.broadcast(buf, src=self.lead, group=self._pg)
        except (RuntimeError, ValueError) as e:
            raise self._failed(e) from e
        return bytes(buf.numpy()) if int(n) else b""

    def fail(self, step: int, error: BaseException) -> None:
        """Take part in the exchange of ``step`` with ``error`` instead of a part (this rank could
        not even queue its commit): every rank's commit of ``step`` fails with it."""
        why = f"{type(error).__name__}: {error} (before its commit was queued)"
        self.all_gather(encode({"error": why, "step": step, "store": ""}))
        self.broadcast(encode({"error": f"rank {self.rank} failed at step {step}: {why}"}) if self.is_lead else b"")

    def _failed(self, e: Exception) -> CommitGroupError:
        self.broken = True
        text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        return CommitGroupError(
            f"the ranks {list(self.ranks)} committing together lost a member (a rank died, or did not commit "
            f"within {self.timeout:g} s): {text}. Nothing was published; GC reclaims what was staged")

    def destroy(self) -> None:
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                dist.destroy_process_group(self._pg)
        except (RuntimeError, ValueError):
            pass


def check_part(part: Any, rank: int) -> None:
    """Raise CommitGroupError unless ``part`` (rank ``rank``'s, as received) has the form a part has:
    ``names`` (name -> [dtype paramstore stores, shape]), ``blocks`` (name -> chunk JSON list),
    ``objects`` (digest -> [size, tensor digests]), ``tensors`` (digest -> [object, offset, length])
    and ``reused`` (digest -> size). What the chunks say is checked after the merge
    (:func:`~paramstore.manifest.check_manifest`: lengths, dtypes, offsets inside objects)."""
    def bad(why: str) -> CommitGroupError:
        return CommitGroupError(f"rank {rank} sent a malformed part: {why}")

    def count(n: Any) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 0

    if not isinstance(part, dict) or not all(isinstance(part.get(k), dict)
                                             for k in ("names", "blocks", "objects", "tensors", "reused")):
        raise bad("not an object with names, blocks, objects, tensors and reused")
    for name, spec in part["names"].items():
        if (not isinstance(spec, list) or len(spec) != 2 or not isinstance(spec[0], str) or spec[0] not in ITEMSIZE
                or not isinstance(spec[1], list)
                or not all(count(n) for n in spec[1])):
            raise bad(f"tensor {name!r} has no dtype and shape: {spec!r}"[:300])
    for name, blocks in part["blocks"].items():
        if name not in part["names"] or not isinstance(blocks, list):
            raise bad(f"blocks of {name!r}, which it does not name"[:300])
    try:
        for o, info in part["objects"].items():
            if not isinstance(info, list) or len(info) != 2 or not count(info[0]) or not isinstance(info[1], list):
                raise bad(f"object {o!r} has no size and tensors"[:300])
            check_digests([o, *info[1]])
        for d, loc in part["tensors"].items():
            if not isinstance(loc, list) or len(loc) != 3 or not all(count(n) for n in loc[1:]):
                raise bad(f"tensor {d!r} has no location"[:300])
            check_digests([d, loc[0]])
        if not all(count(n) for n in part["reused"].values()):
            raise bad("an object it reuses has a bad size")
        check_digests(part["reused"])
    except ParamStoreError as e:
        if isinstance(e, CommitGroupError):
            raise
        raise bad(str(e)) from None


def merge_parts(parts: list[Mapping[str, Any]], ranks: tuple[int, ...]) -> dict[str, TensorEntry]:
    """The manifest entries of a sharded commit from every rank's part.

    Each part has ``names`` (every tensor name with its dtype and global shape, as that rank saw
    them) and ``blocks`` (name -> list of chunk JSON it stored). Raises CommitGroupError when the
    ranks disagree on names, dtypes or shapes, or a tensor's blocks do not tile it. (Parts received
    from other ranks pass :func:`check_part` first.)
    """
    first = parts[0]["names"]
    for rank, part in zip(ranks[1:], parts[1:]):
        if part["names"] != first:
            diff = sorted(set(part["names"]) ^ set(first)) or sorted(
                n for n in first if part["names"].get(n) != first[n])
            first_diff = diff[0].replace(ASSET_PREFIX, "asset ")
            raise CommitGroupError(f"rank {rank} committed other tensors or assets than rank {ranks[0]} (first "
                                   f"difference: {first_diff!r}): every rank must commit the same names, dtypes and "
                                   "shapes, and the same asset files")
    chunks: dict[str, list[Chunk]] = {n: [] for n in first}
    for part in parts:
        for name, blocks in part["blocks"].items():
            chunks[name].extend(Chunk.from_json(c) for c in blocks)
    entries = {}
    for name, (dtype, shape) in first.items():
        shape = tuple(shape)
        got = chunks[name]
        if not got:
            raise CommitGroupError(f"no rank stored tensor {name!r}")
        whole = [c for c in got if c.sizes == shape and not any(c.offsets)]
        if whole and len(got) == 1:
            entries[name] = TensorEntry.chunked(dtype, shape, got)
            continue
        try:
            check_tiling(shape, got, f"of {name!r}")
        except Exception as e:  # noqa: BLE001 - a CorruptObjectError from the check, reported as a group error
            raise CommitGroupError(f"the ranks' blocks of {name!r} do not make the whole tensor: {e}") from None
        entries[name] = TensorEntry.chunked(dtype, shape, got)
    return entries


def encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def decode(data: bytes) -> Any:
    """The JSON object a member sent; CommitGroupError for anything else (bad JSON or UTF-8, too
    deep, not an object)."""
    try:
        return loads(data, dict, "a message of a sharded commit")
    except ValueError as e:
        raise CommitGroupError(str(e)) from None
