"""One "host" of the lazy-read tests (tests/test_lazy.py): its own store root, peer server and
Mooncake transfer engine (TCP), a shared redis registry, and optionally a remote.

Run as ``python lazy_host.py ROOT REGISTRY NAME [REMOTE_URL]``; it serves, prints one JSON line per
event and reads commands from stdin:

* ``commit STEP``: commit :func:`model` (pushed to the remote, if any, before the reply).
* ``eager STEP``: an eager checkout, every tensor compared with :func:`model`; what it moved.
* ``lazy STEP R0 R1``: rows ``[R0, R1)`` of ``big.weight`` read from a lazy snapshot of STEP (one
  snapshot per step, kept open between commands: pieces read stay), compared with :func:`model`.
* ``load STEP``: a fresh lazy checkout loaded into a module (``load_into``), compared.
* ``corrupt``: flip a byte in every MiB of every object this host serves (its shared memory).
"""

from __future__ import annotations

import json
import os
import sys

import torch

os.environ.setdefault("MC_FORCE_TCP", "1")

from paramstore import ParamStore, ParamStoreError  # noqa: E402
from peer_host import corrupt_served  # noqa: E402  (this directory is on sys.path: the script runs from it)

ROWS, COLS = 4096, 4096  # big.weight: 64 MiB of float32, 32 pieces of 2 MiB (128 rows each)


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"big.weight": torch.randn(ROWS, COLS, generator=g),
            "big.bias": torch.randn(ROWS, generator=g),
            "head.weight": torch.randn(256, 512, generator=g).to(torch.bfloat16)}


class Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(COLS, ROWS)
        self.head = torch.nn.Linear(512, 256, bias=False, dtype=torch.bfloat16)


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def report(snap) -> dict:
    f = snap.fetch
    return {"lazy": f.lazy, "lazy_bytes": f.lazy_bytes, "bytes_from": dict(f.bytes_from),
            "rejected": dict(f.rejected), "failed": dict(f.failed), "fetched": len(f.fetched), "local": f.local}


def main() -> None:
    root, registry, name = sys.argv[1:4]
    remote = sys.argv[4] if len(sys.argv) > 4 else None
    snaps = {}
    with ParamStore(root, registry=registry, name=name, remote=remote) as store:
        server = store.serve("127.0.0.1")
        say(ready=True, session=server.peer.session, peer=server.peer.id)
        for line in sys.stdin:
            cmd, *args = line.split()
            try:
                if cmd == "commit":
                    step = int(args[0])
                    handle = store.commit(step, model(step))
                    handle.result()
                    if remote is not None:
                        handle.persisted.result(120)
                    server.sync()  # announce now rather than on the next rescan
                    say(committed=step)
                elif cmd == "eager":
                    step = int(args[0])
                    with store.checkout(step) as snap:
                        ok = all(torch.equal(snap[k], v) for k, v in model(step).items())
                        say(ok=ok, **report(snap))
                    server.sync()
                elif cmd == "lazy":
                    step, r0, r1 = map(int, args)
                    if step not in snaps:
                        snaps[step] = store.checkout(step, fetch="lazy")
                    snap = snaps[step]
                    rows = snap.read("big.weight", (r0, 0), (r1 - r0, COLS))
                    say(ok=torch.equal(rows, model(step)["big.weight"][r0:r1]), **report(snap))
                elif cmd == "load":
                    step = int(args[0])
                    policy = Policy()
                    with store.checkout(step, fetch="lazy") as snap:
                        result = snap.load_into(policy, strict=False)
                        want = model(step)
                        ok = (torch.equal(policy.big.weight, want["big.weight"]) and torch.equal(policy.big.bias, want["big.bias"])
                              and torch.equal(policy.head.weight, want["head.weight"]) and not result.missing_keys)
                        say(ok=ok, **report(snap))
                elif cmd == "corrupt":
                    say(corrupted=corrupt_served(store, server))
                elif cmd == "quit":
                    break
            except ParamStoreError as e:
                say(ok=False, error=f"{type(e).__name__}: {e}")
        for snap in snaps.values():
            snap.close()


if __name__ == "__main__":
    main()
