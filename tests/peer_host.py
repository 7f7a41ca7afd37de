"""One "host" of the multi-host tests: its own store root, peer server and transfer engine.

Run as ``python peer_host.py ROOT REGISTRY NAME ROLE [ARGS]``; it prints one JSON line per event
on stdout and reads commands from stdin:

* ``trainer``: serves, then for each stdin line ``commit STEP SEED CHANGED [SPARSE]`` commits
  :func:`model` and prints ``{"committed": step, "session": ...}`` (``patches`` then waits for
  the patches of the last commit and prints their bytes; ``commit-quiet`` does not ask the peer
  server to rescan after the commit, and ``stop-rescans`` stops its rescans altogether).
* ``prefetch STEP SEED CHANGED`` (rollout): prefetches ``min_step=STEP`` (says so at once), then
  checks the version out and prints whether the checkout moved any byte.
* ``rollout``: serves, then for each stdin line ``checkout STEP SEED CHANGED`` checks the step
  out, compares every tensor with :func:`model` and prints what it read from which peer, and how
  many fetched objects landed in slabs the store had prepared (faulted in) beforehand, and how
  many it read whole (``paramstore.peer._Fetch``: not relayed, checked at the end) and how many
  reads of those failed (counted by its retry bookkeeping).

``PEER_HOST_LOG=1`` in the environment: the library's debug log (the relay's decisions) on stderr.
"""

from __future__ import annotations

import json
import os
import sys

import torch

os.environ.setdefault("MC_FORCE_TCP", "1")

import paramstore.peer  # noqa: E402
from paramstore import ParamStore, ParamStoreError  # noqa: E402

TENSORS, SHAPE = 16, (1024, 1024)  # 16 x 4 MiB float32 = 64 MiB


def model(seed: int, changed: int = TENSORS, sparse: float = 0.0) -> dict[str, torch.Tensor]:
    """Version ``seed``: the first ``changed`` tensors (``changed`` < 0: the last ``-changed``)
    depend on ``seed``, the others on nothing.

    ``sparse`` > 0: instead, version ``seed - 1`` with that fraction of the elements of each of
    those tensors changed (an RL step: every tensor changed, a little)."""
    varied = set(range(changed) if changed >= 0 else range(TENSORS + changed, TENSORS))
    if sparse:
        out = model(seed - 1, changed)
        for i, t in enumerate(out.values()):
            if i not in varied:
                continue
            g = torch.Generator().manual_seed(seed * 1000 + i)
            idx = torch.randperm(t.numel(), generator=g)[: int(sparse * t.numel())]
            t.view(-1)[idx] += 1.0
        return out
    out = {}
    for i in range(TENSORS):
        g = torch.Generator().manual_seed((seed if i in varied else 0) * 1000 + i)
        out[f"layer{i:02d}.weight"] = torch.randn(SHAPE, generator=g)
    return out


def corrupt_served(store: ParamStore, server: object, first: int = 4096) -> int:
    """Flip a byte every MiB (from byte ``first``: 8, the header's first) of every object ``server``
    serves, in this host's shared memory; returns how many objects."""
    for digest in server.served:  # type: ignore[attr-defined]
        with open(store._root.tier.object_path(digest), "r+b") as f:
            for pos in range(first, os.fstat(f.fileno()).st_size, 1 << 20):
                f.seek(pos)
                byte = f.read(1)
                f.seek(pos)
                f.write(bytes([byte[0] ^ 0xFF]))
    return len(server.served)  # type: ignore[attr-defined]


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    if os.environ.get("PEER_HOST_LOG"):
        import logging
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    root, registry, name, role = sys.argv[1:5]
    keep = int(os.environ.get("PEER_HOST_KEEP", 0))
    with ParamStore(root, registry=registry, name=name, shard_size_bytes=int(os.environ.get("PEER_HOST_SHARD", 32 << 20)),
                    retention={"keep_last": keep} if keep else None) as store:
        server = store.serve("127.0.0.1")
        slabs: list[int] = []
        take = store._pool.take

        def recording_take(size: int, **kw: object):  # what a fetch allocates, for the reply
            slabs.append(size)
            return take(size, **kw)

        store._pool.take = recording_take
        read_whole: list[int] = []  # per object fetched by peer._Fetch (read whole, checked at the end):
        fetch_whole = paramstore.peer._Fetch.run  # the failures its retry bookkeeping counted

        def recording_run(self):  # type: ignore[no-untyped-def]
            try:
                return fetch_whole(self)
            finally:
                read_whole.append(sum(n for n, _ in self.retries.failed.values()))

        paramstore.peer._Fetch.run = recording_run  # type: ignore[method-assign]
        say(ready=True, session=server.peer.session, peer=server.peer.id)
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd in ("commit", "commit-quiet"):
                step, seed, changed = map(int, args[:3])
                store.commit(step, model(seed, changed, float(args[3]) if args[3:] else 0.0)).result()
                if cmd == "commit":
                    server.sync()  # announce now rather than on the next rescan
                say(committed=step)
            elif cmd == "prefetch":  # prefetch min_step=STEP now; when it is here, check it out
                step, seed, changed = map(int, args[:3])
                future = store.prefetch(min_step=step, timeout=60)
                say(prefetching=step)
                version = future.result()
                with store.checkout(version.step) as snap:
                    want = model(seed, changed)
                    ok = all(torch.equal(snap[k], v) for k, v in want.items()) and set(snap) == set(want)
                    say(step=version.step, ok=ok, moved=snap.fetch.moved, local=snap.fetch.local)
            elif cmd == "stop-rescans":  # from now on only what the store announces itself is served
                server.sync = lambda: None  # type: ignore[method-assign]
                say(stopped=True)
            elif cmd == "patches":
                store.flush()
                server.sync()
                say(patches=store._write.patcher.last.bytes if store._write.patcher and store._write.patcher.last else 0)
            elif cmd == "checkout":
                step, seed, changed = map(int, args[:3])
                store._pool.wait_prepared(60)  # what the last fetch prepared (in a real host: idle time)
                ready = {os.stat(s.path).st_ino for v in store._pool._free.values() for s in v}
                slabs.clear()
                read_whole.clear()
                try:
                    with store.checkout(step) as snap:
                        want = model(seed, changed, float(args[3]) if args[3:] else 0.0)
                        ok = all(torch.equal(snap[k], v) for k, v in want.items()) and set(snap) == set(want)
                        report = snap.fetch
                except ParamStoreError as e:
                    say(step=step, ok=False, error=f"{type(e).__name__}: {e}", largest_slab=max(slabs, default=0))
                    continue
                prefaulted = sum(os.stat(store._root.tier.object_path(d)).st_ino in ready for d in report.from_peers)
                say(step=step, ok=ok, prefaulted=prefaulted, bytes_from=dict(report.bytes_from),
                    fetched=len(report.from_peers), rejected=dict(report.rejected), failed=dict(report.failed),
                    from_patches=len(report.from_patches), patch_bytes=report.patch_bytes,
                    largest_slab=max(slabs, default=0), read_whole=len(read_whole),
                    read_whole_failed=sum(read_whole))
            elif cmd == "held":  # once retention is done: the versions, and object files no version
                if store._write.maintainer is not None:  # references (or that this host lacks)
                    store._write.maintainer.wait_idle(30)
                versions = [v.step for v in store.versions()]
                referenced = {o for v in versions for o in store._root.registry.get_manifest(v).objects()}
                files = set(store._root.tier.list())
                say(versions=versions, unreferenced=sorted(files - referenced), lacking=sorted(referenced - files))
            elif cmd == "corrupt":  # flip a byte of every object this host serves (its shared memory)
                say(corrupted=corrupt_served(store, server))
            elif cmd == "corrupt-header":  # the same, from the header's first byte on
                say(corrupted=corrupt_served(store, server, 8))
            elif cmd == "quit":
                break


if __name__ == "__main__":
    main()
