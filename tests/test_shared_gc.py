"""GC on one host of a shared (Redis) registry while another host commits (issue 25, item 7).

Host A's GC holds only its own host's lock. It forgets every registered object no version
references, also one that host B's commit has just deduplicated against (the object of a pruned
version, still on B's tier). B's publish must then not leave a version that references an object
the registry does not record: the registry refuses it atomically, and the commit registers the
object again (its file is on B, kept there by B's GC lock) and publishes.

The race is made deterministic: B's registry runs A's (real) GC right before B's publish, the
moment in which it would otherwise be a matter of luck. Everything else is real: two store roots,
one redis-server, real commits.
"""

from __future__ import annotations

import os

import torch

from helpers import assert_bits_equal

from paramstore import ParamStore


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def _gc_first(store: ParamStore, other: ParamStore) -> list[int]:
    """Make ``store``'s next publishes run ``other``'s GC first; returns the list of GC runs."""
    reg = store._root.registry
    publish, runs = reg.publish, []

    def gc_then_publish(*args, **kw):
        if not runs:
            runs.append(len(other.gc().objects))
        return publish(*args, **kw)

    reg.publish = gc_then_publish
    return runs


def test_gc_on_another_host_cannot_unregister_what_a_commit_references(redis_url, shm_dir):
    name = f"shared-gc-{os.getpid()}"
    with ParamStore(os.path.join(shm_dir, "b"), registry=redis_url, name=name) as b, \
            ParamStore(os.path.join(shm_dir, "a"), registry=redis_url, name=name) as a:
        one, two = _weights(1), _weights(2)
        b.commit(1, one).result(30)
        b.commit(2, two).result(30)
        old = b.manifest(1).objects()
        reg = b._root.registry
        assert reg.remove_versions([1]) == [1]  # pruned; B's GC has not run: its objects are still on B
        assert all(b._root.tier.exists(o) for o in old)

        runs = _gc_first(b, a)
        version = b.commit(3, one).result(30)  # deduplicates against step 1's objects
        assert runs == [len(old)]  # A's GC forgot them between B's dedup lookup and its publish
        assert b.manifest(3).objects() == old

        sizes = reg.object_sizes(old)
        assert sizes == {o: b._root.tier.size(o) for o in old}  # registered again with the version
        assert set(reg.locate_tensors([e.digest for e in b.manifest(3).tensors.values()])) == \
            {e.digest for e in b.manifest(3).tensors.values()}
        assert reg.get_version(3) == version
        assert b.verify()["ok"]
        with b.checkout(3) as snap:
            for n, t in one.items():
                assert_bits_equal(snap[n], t, n)
        assert a.gc().objects == []  # referenced now: nobody forgets them again
        assert set(reg.object_sizes(old)) == old
