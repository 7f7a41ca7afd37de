"""One "host" of the derived-objects-between-hosts test: its own store root, a shared registry.

Run as ``python derived_host.py ROOT REGISTRY NAME ROLE``; prints one JSON line per event:

* ``maker``: commits :func:`model` as step 1, checks it out with the recipe (deriving it), serves
  its objects (derived ones included), prints ``{"ready": ..., "derived": n}`` and waits for a line
  on stdin.
* ``reader``: checks step 1 out with the recipe and prints what it derived, what it read from
  which peer, and whether every tensor equals ``recipes.derive`` of :func:`model`, bit for bit.
* ``patch-maker``: a trainer with ``derive=`` and ``patches=``: commits step 1, then (after a line on
  stdin) step 2 = :func:`model` with 1% of its elements changed, each flushed (derived, patched),
  served; prints ``{"ready": step}`` after each and waits for a line.
* ``patch-reader``: checks step 1 out with the recipe, prints, waits for a line, checks step 2 out
  with the recipe, and prints what moved how (patches, whole objects) and whether it is bit-exact.
"""

from __future__ import annotations

import json
import os
import sys

import torch

os.environ.setdefault("MC_FORCE_TCP", "1")

from paramstore import ParamStore, recipes  # noqa: E402

RECIPE = "fp8-block128"


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(384, 256, generator=g).bfloat16() for i in range(3)} | {
        "model.norm.weight": torch.ones(256).bfloat16()}


def changed(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with 1% of each tensor's elements nudged (a training step: the block maxima kept)."""
    g = torch.Generator().manual_seed(9)
    out = {}
    for k, v in sd.items():
        w = v.float().clone()
        pick = torch.rand(w.shape, generator=g) < 0.01
        w[pick] *= 0.5
        out[k] = w.to(v.dtype)
    return out


def report(store: ParamStore, snap, step: int, want: dict[str, torch.Tensor]) -> dict:
    ok = set(snap) == set(want) and all(
        snap[k].dtype == v.dtype and torch.equal(snap[k].reshape(-1).view(torch.uint8),
                                                 v.contiguous().reshape(-1).view(torch.uint8))
        for k, v in want.items())
    committed_objects = set(store.manifest(step).objects())
    derived_objects = sorted(set(snap.manifest.objects()) - committed_objects)
    size = lambda o: os.path.getsize(store._root.tier.object_path(o))  # noqa: E731
    return dict(ok=ok, derived=snap.derived.derived, units=snap.derived.units, bytes_from=dict(snap.fetch.bytes_from),
                derived_bytes=sum(size(o) for o in derived_objects), committed_bytes=sum(size(o) for o in committed_objects),
                from_peers=len(snap.fetch.from_peers), patched_derived=len(set(snap.fetch.from_patches) & set(derived_objects)),
                patched=len(snap.fetch.from_patches), patch_bytes=snap.fetch.patch_bytes)


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    root, registry, name, role = sys.argv[1:5]
    if role.startswith("patch-"):
        patch_host(root, registry, name, role)
        return
    with ParamStore(root, registry=registry, name=name) as store:
        if role == "maker":
            store.commit(1, model()).result()
            with store.checkout(1, recipe=RECIPE) as snap:
                made = snap.derived.derived
            server = store.serve("127.0.0.1")
            server.sync()
            say(ready=True, derived=made, served=len(server.served))
            sys.stdin.readline()
            return
        want = recipes.derive(RECIPE, model())
        with store.checkout(1, recipe=RECIPE) as snap:
            ok = set(snap) == set(want) and all(
                snap[k].dtype == v.dtype and torch.equal(snap[k].reshape(-1).view(torch.uint8),
                                                         v.contiguous().reshape(-1).view(torch.uint8))
                for k, v in want.items())
            derived_objects = sorted(set(snap.manifest.objects()) - set(store.manifest(1).objects()))
            sizes = {o: os.path.getsize(store._root.tier.object_path(o)) for o in derived_objects}
            committed = sum(os.path.getsize(store._root.tier.object_path(o)) for o in store.manifest(1).objects())
            say(ok=ok, derived=snap.derived.derived, units=snap.derived.units, bytes_from=dict(snap.fetch.bytes_from),
                derived_bytes=sum(sizes.values()), committed_bytes=committed, from_peers=len(snap.fetch.from_peers))


def patch_host(root: str, registry: str, name: str, role: str) -> None:
    versions = {1: model(), 2: changed(model())}
    if role == "patch-maker":
        with ParamStore(root, registry=registry, name=name, derive=[RECIPE], patches=True) as store:
            server = store.serve("127.0.0.1")
            for step, sd in versions.items():
                store.commit(step, sd).result()
                store.flush()  # visible, patched, derived, and its derived objects patched
                server.sync()
                say(ready=step)
                sys.stdin.readline()
        return
    with ParamStore(root, registry=registry, name=name, patches=True) as store:
        for step, sd in versions.items():
            with store.checkout(step, recipe=RECIPE) as snap:
                say(step=step, **report(store, snap, step, recipes.derive(RECIPE, sd)))
            if step == 1:
                sys.stdin.readline()


if __name__ == "__main__":
    main()
