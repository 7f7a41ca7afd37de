"""A stateful property test of commit / checkout / close / prune / gc / crash against a plain-dict model.

Random sequences of operations run against a real store (on /dev/shm) and a model: a dict of step ->
{name: tensor}, the tag ``t``, and the steps of the snapshots held open. Tensor contents are drawn
from a few seeds per name, so contents recur: a commit often deduplicates against an object of an
older version, one that may since have been pruned, collected, or be waiting for collection.

After every step: the store has exactly the model's versions and each reads back bit-exact, every
open snapshot still reads back bit-exact, every object any version references exists on disk, the
live leases are exactly the open snapshots, and after a gc with no prune or crash since there is
no unreferenced object and no slab of a dead process.

A "crash" leaves what a killed commit leaves: an object file no version references (never
registered) in ``objects/``, and a slab in ``tmp/`` named for a process that is not alive (this pid
with another start time).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import SHM, random_tensor

from paramstore import ParamStore
from paramstore.liveness import this_process
from paramstore.retention import AnyOf, KeepEvery, KeepLast, KeepTagged

SPECS = {
    "a": (torch.float32, (64,)),
    "b": (torch.bfloat16, (100,)),
    "c": (torch.int64, (20,)),
    "d": (torch.uint8, (333,)),
    "e": (torch.float16, (8, 8)),
}
NAMES = sorted(SPECS)
SHARD = 600  # 1-3 of these tensors per object


def content(name: str, seed: int) -> torch.Tensor:
    dtype, shape = SPECS[name]
    return random_tensor(dtype, shape, seed=1000 * NAMES.index(name) + seed)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


POLICIES = st.one_of(
    st.builds(KeepLast, st.integers(0, 3)),
    st.builds(KeepEvery, st.integers(1, 4)),
    st.just(KeepTagged("t")),
    st.builds(lambda n, k: AnyOf(KeepLast(n), KeepEvery(k)), st.integers(0, 2), st.integers(2, 4)),
    st.builds(lambda n: AnyOf(KeepLast(n), KeepTagged("t")), st.integers(0, 2)),
)


def model_keep(policy, steps: list[int], tagged: int | None) -> set[int]:
    """What ``policy`` keeps among ``steps`` (sorted), computed independently of the library."""
    if isinstance(policy, KeepLast):
        return set(steps[-policy.n:]) if policy.n else set()
    if isinstance(policy, KeepEvery):
        return {s for s in steps if s % policy.steps == 0}
    if isinstance(policy, KeepTagged):
        return {tagged} if tagged is not None and "t" in policy.tags else set()
    if isinstance(policy, AnyOf):
        return set().union(*(model_keep(p, steps, tagged) for p in policy.policies))
    raise AssertionError(policy)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="paramstore-prop-", dir=SHM)
        self.store = ParamStore(os.path.join(self.dir, "store"), shard_size_bytes=SHARD, create=True)
        self.reg, self.tier = self.store._root.registry, self.store._root.tier
        self.model: dict[int, dict[str, torch.Tensor]] = {}
        self.current: dict[str, torch.Tensor] = {}
        self.tagged: int | None = None  # the step tag "t" points at
        self.snaps: list[tuple[object, int]] = []
        self.step = 0
        self.clean = True  # no prune or crash since the last gc
        self.crash_files: list[str] = []
        self.crashes = 0

    # -- rules ----------------------------------------------------------------------------------
    @initialize(seeds=st.lists(st.integers(0, 3), min_size=len(NAMES), max_size=len(NAMES)))
    def first_commit(self, seeds):
        self.current = {n: content(n, s) for n, s in zip(NAMES, seeds)}
        self._commit(1, tag=False)

    @rule(changes=st.dictionaries(st.sampled_from(NAMES), st.integers(0, 3)), gap=st.integers(1, 3),
          tag=st.booleans())
    def commit(self, changes, gap, tag):
        self.current = {**self.current, **{n: content(n, s) for n, s in changes.items()}}
        self._commit(self.step + gap, tag)

    def _commit(self, step: int, tag: bool) -> None:
        v = self.store.commit(step, self.current, tags=["t"] if tag else ()).result(timeout=60)
        assert v.step == step
        self.step = step
        self.model[step] = dict(self.current)
        if tag:
            self.tagged = step

    @rule(data=st.data())
    def checkout(self, data):
        step = data.draw(st.sampled_from(sorted(self.model)), label="step")
        snap = self.store.checkout(step)
        assert snap.step == step
        self.snaps.append((snap, step))

    @precondition(lambda self: self.snaps)
    @rule(data=st.data(), collect=st.booleans())
    def close(self, data, collect):
        i = data.draw(st.integers(0, len(self.snaps) - 1), label="snapshot")
        snap, _ = self.snaps.pop(i)
        if collect:
            del snap  # dropped unclosed: the lease goes when the snapshot is collected
        else:
            snap.close()

    @rule(policy=POLICIES, dry_run=st.booleans())
    def prune(self, policy, dry_run):
        steps = sorted(self.model)
        keep = model_keep(policy, steps, self.tagged) | {steps[-1]} | {s for _, s in self.snaps}
        report = self.store.prune(policy, dry_run=dry_run)
        want_removed = sorted(set(steps) - keep)
        assert report.removed == want_removed, (str(policy), report)
        assert sorted(report.kept) == sorted(keep)
        assert all(report.kept[s] for s in keep)
        if dry_run:
            return
        for s in want_removed:
            del self.model[s]
        if self.tagged in want_removed:
            self.tagged = None
        if want_removed:
            self.clean = False

    @rule(dry_run=st.booleans())
    def gc(self, dry_run):
        before = set(self.tier.list())
        report = self.store.gc(dry_run=dry_run)
        after = set(self.tier.list())
        if dry_run:
            assert after == before
            return
        assert after == before - set(report.objects)
        assert all(not os.path.exists(p) for p in self.crash_files)
        self.crash_files = []
        self.clean = True

    @rule(data=st.data(), orphan=st.booleans(), slab=st.booleans())
    def crash(self, data, orphan, slab):
        self.crashes += 1
        if orphan:
            digest = data.draw(st.binary(min_size=32, max_size=32), label="digest").hex()
            path = self.tier.object_path(digest)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(b"\0" * 64 + bytes(range(256)))  # a half-written object, never registered
            self.crash_files.append(path)
        if slab:
            pid, start = this_process()
            path = os.path.join(self.tier.tmp_dir, f"slab-{pid}-{start + self.crashes}-{self.crashes}")
            with open(path, "wb") as f:
                f.write(b"\1" * 256)
            self.crash_files.append(path)
        if orphan or slab:
            self.clean = False

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def versions_read_back_bit_exact(self):
        assert [v.step for v in self.store.versions()] == sorted(self.model)
        for step, want in self.model.items():
            with self.store.checkout(step) as snap:
                assert sorted(snap) == sorted(want)
                for name, t in want.items():
                    assert same(snap[name], t), f"step {step} {name}"

    @invariant()
    def open_snapshots_read_back_bit_exact(self):
        for snap, step in self.snaps:
            for name, t in self.model[step].items():
                assert same(snap[name], t), f"open snapshot of step {step}: {name}"

    @invariant()
    def leases_are_the_open_snapshots(self):
        assert sorted(lease.step for lease in self.store.leases()) == sorted(s for _, s in self.snaps)

    @invariant()
    def referenced_objects_exist(self):
        on_disk = set(self.tier.list())
        refs = self.reg.referenced_objects()
        assert refs <= on_disk, f"missing objects {refs - on_disk}"
        for step in self.model:
            assert self.reg.get_manifest(step).objects() <= on_disk

    @invariant()
    def tag_follows_its_version(self):
        assert self.reg.tags() == ({"t": self.tagged} if self.tagged is not None else {})

    @invariant()
    def nothing_unreferenced_after_gc(self):
        if not self.clean:
            return
        refs = self.reg.referenced_objects()
        assert set(self.tier.list()) == refs, "unreferenced objects after gc"
        assert set(self.reg.objects()) == refs, "registered objects nobody references after gc"
        pid, start = this_process()
        mine = f"slab-{pid}-{start}-"
        assert [f for f in self.tier.leftovers() if not f.startswith(mine)] == []

    def teardown(self):
        for snap, _ in self.snaps:
            snap.close()
        self.snaps = []
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestStoreMachine = StoreMachine.TestCase
