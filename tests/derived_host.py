"""One "host" of the derived-objects-between-hosts test: its own store root, a shared registry.

Run as ``python derived_host.py ROOT REGISTRY NAME ROLE``; prints one JSON line per event:

* ``maker``: commits :func:`model` as step 1, checks it out with the recipe (deriving it), serves
  its objects (derived ones included), prints ``{"ready": ..., "derived": n}`` and waits for a line
  on stdin.
* ``reader``: checks step 1 out with the recipe and prints what it derived, what it read from
  which peer, and whether every tensor equals ``recipes.derive`` of :func:`model`, bit for bit.
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


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    root, registry, name, role = sys.argv[1:5]
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


if __name__ == "__main__":
    main()
