"""Lazy checkouts (issue 27, item 5): ``checkout(v, fetch="lazy")`` moves only the pieces reads touch.

Real parts throughout: two or more "hosts" (store roots) share a real redis-server registry; the
bytes come from a shared-filesystem remote (``file://``, ranged reads) in this process, or from
peers (separate processes with Mooncake transfer engines over TCP, ``lazy_host.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
import torch

import lazy_host
from lazy_host import COLS, ROWS, model
from paramstore import ParamStore
from paramstore.errors import InvalidArgumentError, ObjectUnavailableError
from paramstore.format import PIECE_SIZE

ROW = COLS * 4  # bytes per row of big.weight
MIB = 1 << 20
PIECE_ROWS = PIECE_SIZE // ROW  # rows of big.weight per piece (128 of 2 MiB pieces)


def piece_bytes(r0: int, r1: int) -> int:
    """Bytes of the pieces of big.weight that rows ``[r0, r1)`` touch."""
    return ((r1 - 1) // PIECE_ROWS - r0 // PIECE_ROWS + 1) * PIECE_SIZE


def bound(rows: int) -> int:
    """What reading ``rows`` rows of big.weight may move: 1.25x the slice, plus one piece per
    boundary of the slice (two), plus the object header."""
    return int(1.25 * rows * ROW) + 2 * PIECE_SIZE + 64 * 1024


@pytest.fixture
def hosts_with_remote(redis_url, shm_dir, tmp_path):
    """``(trainer, open_host)``: a trainer that committed version 1 (written through to a
    ``file://`` remote) and serves nothing; ``open_host(remote=True)`` opens another host's store."""
    name, url = f"lazy-{uuid.uuid4().hex[:8]}", f"file://{tmp_path}/bucket"
    opened: list[ParamStore] = []

    def open_host(remote: bool = True) -> ParamStore:
        opened.append(ParamStore(os.path.join(shm_dir, f"h{len(opened)}"), registry=redis_url, name=name,
                                 remote=url if remote else None))
        return opened[-1]

    trainer = open_host()
    trainer.commit(1, model(1)).persisted.result(120)
    try:
        yield trainer, open_host
    finally:
        for s in reversed(opened):
            s.close()


def test_a_quarter_of_a_tensor_moves_about_a_quarter_and_a_second_read_moves_nothing(hosts_with_remote):
    trainer, open_host = hosts_with_remote
    want = model(1)["big.weight"]
    rollout = open_host()
    with rollout.checkout(1, fetch="lazy") as snap:
        assert snap.lazy and snap.fetch.lazy and snap.fetch.lazy_bytes == 0 and snap.fetch.local == 0
        assert not snap.fetch.moved
        # a rank's quarter, not aligned with the pieces: rows [1000, 2024), and the pieces they touch
        rows = snap.read("big.weight", (1000, 0), (1024, COLS))
        assert torch.equal(rows, want[1000:2024])
        moved = snap.fetch.lazy_bytes
        print(f"quarter, unaligned: {moved / MIB:.0f} MiB moved for a {1024 * ROW / MIB:.0f} MiB slice "
              f"(bound {bound(1024) / MIB:.0f} MiB)")
        assert moved == piece_bytes(1000, 2024) <= bound(1024)
        assert dict(snap.fetch.bytes_from) == {rollout.remote.url: moved} and snap.fetch.moved
        # the same rows again, and rows inside those pieces: nothing moves
        assert torch.equal(snap.read("big.weight", (1000, 0), (1024, COLS)), want[1000:2024])
        r0 = 1000 // PIECE_ROWS * PIECE_ROWS  # the first row of the first of those pieces
        assert torch.equal(snap.read("big.weight", (r0, 7), (900, 3)), want[r0 : r0 + 900, 7:10])
        assert snap.fetch.lazy_bytes == moved
        # an aligned quarter: exactly its slice
        assert torch.equal(snap.read("big.weight", (2048, 0), (1024, COLS)), want[2048:3072])
        assert snap.fetch.lazy_bytes - moved == 1024 * ROW
        # a small tensor is one piece: snap[name] moves it whole, verified
        before = snap.fetch.lazy_bytes
        assert torch.equal(snap["big.bias"], model(1)["big.bias"])
        assert snap.fetch.lazy_bytes - before == ROWS * 4
        assert snap.verify() == {}  # the pieces that arrived hash right
    # a fresh lazy snapshot starts with nothing (pieces are kept per snapshot)
    with rollout.checkout(1, fetch="lazy") as snap:
        assert snap.fetch.lazy_bytes == 0
    assert rollout.leases() == []


def test_concurrent_reads_of_the_same_pieces_fetch_them_once(hosts_with_remote):
    trainer, open_host = hosts_with_remote
    want = model(1)["big.weight"]
    rollout = open_host()
    with rollout.checkout(1, fetch="lazy") as snap:
        results: list[bool] = []
        go = threading.Barrier(6)

        def reader(i: int) -> None:
            go.wait()
            r0 = 3000 + 10 * i  # rows [3000, 3150) and their pieces, from all six threads at once
            results.append(torch.equal(snap.read("big.weight", (r0, 0), (100, COLS)), want[r0 : r0 + 100]))

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [True] * 6
        assert snap.fetch.lazy_bytes == piece_bytes(3000, 3150)


def test_load_into_a_module_on_a_lazy_snapshot(hosts_with_remote):
    trainer, open_host = hosts_with_remote
    rollout = open_host()
    policy = lazy_host.Policy()
    want = model(1)
    with rollout.checkout(1, fetch="lazy") as snap:
        assert snap.load_into(policy) == ([], [])
        assert torch.equal(policy.big.weight, want["big.weight"]) and torch.equal(policy.big.bias, want["big.bias"])
        assert torch.equal(policy.head.weight, want["head.weight"])
        tensors = sum(t.numel() * t.element_size() for t in want.values())
        assert snap.fetch.lazy_bytes == tensors  # every piece once, no header, nothing twice
        assert all(torch.equal(snap[k], v) for k, v in want.items()) and snap.fetch.lazy_bytes == tensors
        assert not [f for f in os.listdir(rollout._root.tier.tmp_dir) if f.startswith("lazy-")]  # unlinked at once
    assert not rollout._root.tier.exists(snap.manifest.entry("big.weight").object)  # nothing published


def test_eager_checkout_is_unchanged(hosts_with_remote):
    trainer, open_host = hosts_with_remote
    rollout = open_host()
    with rollout.checkout(1) as snap:
        assert not snap.lazy and not snap.fetch.lazy and snap.fetch.lazy_bytes == 0
        assert len(snap.fetch.from_remote) == len(snap.manifest.objects())
        assert snap.fetch.bytes == sum(rollout._root.registry.object_sizes(snap.manifest.objects()).values())
        assert all(torch.equal(snap[k], v) for k, v in model(1).items())
    # a lazy checkout of a version this host holds maps it as today: nothing to move
    with rollout.checkout(1, fetch="lazy") as snap:
        assert snap.fetch.local == len(snap.manifest.objects())
        assert torch.equal(snap["big.weight"], model(1)["big.weight"]) and snap.fetch.lazy_bytes == 0


def test_no_source_names_the_tensor_and_a_bad_remote_piece_is_never_handed_out(hosts_with_remote, tmp_path):
    trainer, open_host = hosts_with_remote
    alone = open_host(remote=False)  # no remote, and nobody serves
    with alone.checkout(1, fetch="lazy") as snap:  # returns at once, leased
        assert len(alone.leases()) == 1
        with pytest.raises(ObjectUnavailableError, match="'big.weight'.*paramstore serve"):
            snap.read("big.weight", (0, 0), (1, COLS))
    assert alone.leases() == []

    # damage piece 4 of big.weight in the remote (a real file of the bucket)
    entry = trainer.manifest(1).entry("big.weight")
    path = os.path.join(tmp_path, "bucket", "objects", entry.object[:2], entry.object + ".safetensors")
    with open(path, "r+b") as f:
        f.seek(entry.offset + 4 * PIECE_SIZE + 100)
        byte = f.read(1)
        f.seek(entry.offset + 4 * PIECE_SIZE + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    rollout = open_host()
    with rollout.checkout(1, fetch="lazy") as snap:
        assert torch.equal(snap.read("big.weight", (0, 0), (PIECE_ROWS, COLS)), model(1)["big.weight"][:PIECE_ROWS])
        r0 = 4 * PIECE_ROWS - PIECE_ROWS // 4  # the last quarter of piece 3, the first of the bad piece 4
        with pytest.raises(ObjectUnavailableError, match="'big.weight'.*fail verification"):
            snap.read("big.weight", (r0, 0), (PIECE_ROWS // 2, COLS))
        # piece 3 arrived intact and stays; piece 4 never lands
        before = snap.fetch.lazy_bytes
        r0 = 3 * PIECE_ROWS
        assert torch.equal(snap.read("big.weight", (r0, 0), (PIECE_ROWS, COLS)), model(1)["big.weight"][r0:r0 + PIECE_ROWS])
        assert snap.fetch.lazy_bytes == before


def test_lazy_refuses_what_it_does_not_support(hosts_with_remote):
    trainer, _ = hosts_with_remote
    for kw, what in [({"verify": True}, "verify"), ({"device": "cuda:0"}, "device"),
                     ({"recipe": "fp8-block128"}, "recipe"), ({"fetch": "sometimes"}, "eager' or 'lazy")]:
        with pytest.raises(InvalidArgumentError, match=what):
            trainer.checkout(1, **({"fetch": "lazy"} | kw))
    assert [lease for lease in trainer.leases() if lease.holder != "paramstore push"] == []  # none taken


# -- peers (separate processes, Mooncake over TCP) ------------------------------------------------
@pytest.fixture
def hosts(redis_url, shm_dir, tmp_path):
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda and libibverbs1")
    import subprocess
    import sys

    from test_peers import Host  # its send/expect/ask/close, for a lazy_host.py process

    class LazyHost(Host):
        def __init__(self, root: str, remote: str | None) -> None:  # noqa: D107 - not Host's script
            self.root = root
            self.proc = subprocess.Popen(
                [sys.executable, os.path.join(os.path.dirname(__file__), "lazy_host.py"), root, redis_url, name,
                 *([remote] if remote else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ, MC_FORCE_TCP="1"))
            hello = self.expect(60)
            self.session, self.peer = hello["session"], hello["peer"]

    name = f"lazy-{uuid.uuid4().hex[:8]}"
    made: list[Host] = []

    def start(remote: str | None = None) -> Host:
        made.append(LazyHost(os.path.join(shm_dir, f"host{len(made)}"), remote))
        return made[-1]

    start.url = f"file://{tmp_path}/bucket"  # type: ignore[attr-defined]
    yield start
    for h in made:  # all at once (see test_peers.hosts)
        h.quit()
    for h in made:
        h.close()


def test_a_rank_reading_a_quarter_from_a_peer_moves_its_slice(hosts):
    trainer, rollout = hosts(), hosts()
    assert trainer.ask("commit 1") == {"committed": 1}
    first = rollout.ask("lazy 1 1000 2024")  # a quarter, unaligned
    assert first["ok"] and first["lazy"] and first["rejected"] == {}, first
    assert first["lazy_bytes"] == piece_bytes(1000, 2024) <= bound(1024), first
    assert first["bytes_from"] == {trainer.session: piece_bytes(1000, 2024)}, first
    print(f"peer, quarter unaligned: {first['lazy_bytes'] / MIB:.0f} MiB moved for a {1024 * ROW / MIB:.0f} MiB "
          f"slice (bound {bound(1024) / MIB:.0f} MiB)")
    again = rollout.ask("lazy 1 1000 2024")
    assert again["ok"] and again["lazy_bytes"] == first["lazy_bytes"], again
    aligned = rollout.ask("lazy 1 3072 4096")  # the last quarter, aligned: exactly its slice
    assert aligned["ok"] and aligned["lazy_bytes"] - first["lazy_bytes"] == 1024 * ROW, aligned

    loaded = rollout.ask("load 1")  # a fresh lazy snapshot loaded into a module: every piece once
    tensors = sum(t.numel() * t.element_size() for t in model(1).values())
    assert loaded["ok"] and loaded["lazy_bytes"] == tensors and loaded["bytes_from"] == {trainer.session: tensors}, loaded

    eager = rollout.ask("eager 1")  # unchanged: whole objects, verified, placed
    assert eager["ok"] and not eager["lazy"] and eager["lazy_bytes"] == 0 and eager["fetched"] >= 1, eager
    assert tensors < sum(eager["bytes_from"].values()) < tensors + (64 << 10), eager


def test_the_only_holder_hung_for_longer_than_the_progress_timeout_is_asked_again(hosts):
    """No remote, and the only peer holding the version hangs for 1.6 s (SIGSTOP, then SIGCONT)
    as a lazy read starts: the read fails after the transfer engine's progress timeout (1 s), is
    asked again after a back-off (``relay.RETRY_S``), and the caller's read succeeds, with nothing
    blamed (before, it raised ObjectUnavailableError at the first failure)."""
    trainer, rollout = hosts(), hosts()
    assert trainer.ask("commit 1") == {"committed": 1}
    assert rollout.ask("lazy 1 0 512")["ok"]  # connected (a stopped peer's handshake just waits)
    trainer.proc.send_signal(signal.SIGSTOP)
    try:
        rollout.send("lazy 1 1000 2024")
        time.sleep(1.6)
    finally:
        trainer.proc.send_signal(signal.SIGCONT)
    got = rollout.expect()
    assert got["ok"] and got["rejected"] == {} and set(got["failed"]) == {trainer.session}, got
    assert got["bytes_from"] == {trainer.session: piece_bytes(0, 512) + piece_bytes(1000, 2024)}, got  # a failed read is not counted


def test_a_corrupt_peer_is_rejected_and_the_piece_comes_from_the_remote(hosts):
    """The only peer holding the version serves bad bytes (its shared memory was damaged after it
    checked out): it is named in ``rejected``, asked nothing more by that snapshot, and every
    byte handed out is right, from the remote."""
    url = hosts.url
    trainer, holder, rollout = hosts(url), hosts(url), hosts(url)
    assert trainer.ask("commit 1") == {"committed": 1}
    assert holder.ask("eager 1")["ok"]
    trainer.close()  # withdraws: the holder is the only peer now
    assert holder.ask("corrupt")["corrupted"] >= 1
    first = rollout.ask("lazy 1 1000 2024")
    assert first["ok"], first
    assert first["rejected"] == {holder.session: 1}, first
    assert first["bytes_from"] == {holder.session: piece_bytes(1000, 2024), url: piece_bytes(1000, 2024)}, first
    more = rollout.ask("lazy 1 0 512")  # other pieces: the holder is not asked again
    assert more["ok"] and more["bytes_from"][holder.session] == piece_bytes(1000, 2024), more
    assert more["bytes_from"][url] == piece_bytes(1000, 2024) + piece_bytes(0, 512), more
