"""Relay (issue 27, item 3): hosts fetching a version at once form a chain in the order they joined;
each reads every block from the nearest fetcher ahead of it, up to the mark that host publishes
in its progress word, which moves only past blocks it verified (pieces against the manifest, the
header against the object's name). Real processes,
a real redis-server, Mooncake over TCP on 127.0.0.1 (see test_peers.py).

A "slow host" (``block_delay``) holds each block back after it lands, so that the fetches overlap
on loopback (which is far faster than any link) as they do on a real network."""

from __future__ import annotations

import os
import signal
import textwrap
import time

import pytest

from helpers import run_in_small_tmpfs
from test_peers import Host, hosts, stored_bytes  # noqa: F401 - the fixture is used by name

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda and libibverbs1")


def test_a_chain_of_three_hosts_sends_each_block_from_the_trainer_once(hosts):
    """Three hosts join one after another while the first still fetches: the trainer sends the
    model once (egress 1.00x: only the first host reads from it), each host reads every byte once,
    and the later hosts read from the rollout ahead of them, not the trainer."""
    trainer = hosts("trainer")
    rollouts = [hosts("rollout", block_delay=0.05) for _ in range(3)]
    assert trainer.ask("commit 1 1 16") == {"committed": 1}
    v1 = stored_bytes(trainer.root)
    for r in rollouts:
        r.send("checkout 1 1 16")
        time.sleep(0.1)
    replies = [r.expect() for r in rollouts]
    for r, rep in zip(rollouts, replies):
        assert rep["ok"] and rep["rejected"] == {} and rep["fetched"] == 2, rep
        assert sum(rep["bytes_from"].values()) == v1, rep  # every byte once
    egress = sum(rep["bytes_from"].get(trainer.session, 0) for rep in replies)
    from_rollouts = [sum(n for s, n in rep["bytes_from"].items() if s != trainer.session) for rep in replies]
    print(f"chain of 3: trainer egress {egress / v1:.2f} model sizes; read from rollouts "
          f"{[round(x / v1, 2) for x in from_rollouts]}")
    assert egress <= 1.05 * v1, (egress / v1, replies)
    assert from_rollouts[1] > 0.9 * v1 and from_rollouts[2] > 0.9 * v1, replies


def test_a_corrupt_origin_is_blamed_and_nothing_it_served_is_relayed(hosts, redis_url):
    """The trainer's served memory is corrupted after a good host took a copy. The next host reads
    blocks from both; each block of the trainer's fails its piece digest as it lands, so the trainer
    is blamed at once (exact: the block says who served it), the block comes again from the good
    host, and the bad bytes are never served on (the mark does not move past them). The host after it reads from it (a chain) and never
    receives a bad byte from it: it blames nobody but the trainer, whose announced memory is bad."""
    trainer, good = hosts("trainer"), hosts("rollout")
    trainer.ask("commit 1 1 16")
    assert good.ask("checkout 1 1 16")["ok"]
    # restarted, it holds the objects whole (not lingering as a fetcher the next host would chain from)
    good.close()
    good = Host(good.root, redis_url, hosts.name, "rollout")
    assert trainer.ask("corrupt")["corrupted"] == 2  # a wrong byte in every MiB the trainer serves
    v1 = stored_bytes(trainer.root)
    a, b = hosts("rollout", block_delay=0.05), hosts("rollout", block_delay=0.05)
    a.send("checkout 1 1 16")
    time.sleep(0.1)
    b.send("checkout 1 1 16")
    ra, rb = a.expect(), b.expect()
    print(f"corrupt origin: a read {ra['bytes_from']}, rejected {ra['rejected']}; b read {rb['bytes_from']}, "
          f"rejected {rb['rejected']}")
    assert ra["ok"] and rb["ok"], (ra, rb)  # the right bytes (each host compares every tensor)
    assert set(ra["rejected"]) == {trainer.session} and ra["rejected"][trainer.session] <= 2, ra
    assert set(rb["rejected"]) <= {trainer.session}, rb  # never a.session: a relayed nothing unverified
    assert rb["bytes_from"].get(a.session, 0) > 0, rb  # b did read from a
    for rep in (ra, rb):  # the bad blocks were read once, then once more from a good source
        assert sum(rep["bytes_from"].values()) <= 2 * v1, rep
    assert ra["bytes_from"].get(trainer.session, 0) > 0
    good.close()


def test_an_upstream_killed_mid_relay_the_downstream_finishes_from_the_next_one_up(hosts):
    """A (slow) relays to B; A is killed mid-fetch: B's next read from A fails, B re-attaches to
    the next one up (the trainer) and finishes from its own progress, every byte verified."""
    trainer = hosts("trainer")
    a, b = hosts("rollout", block_delay=0.4), hosts("rollout")
    trainer.ask("commit 1 1 16")
    v1 = stored_bytes(trainer.root)
    a.send("checkout 1 1 16")
    time.sleep(0.3)
    b.send("checkout 1 1 16")
    time.sleep(0.5)
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    t0 = time.monotonic()
    rb = b.expect()
    print(f"upstream killed: b read {rb['bytes_from']} ({time.monotonic() - t0:.2f} s after the kill)")
    assert rb["ok"] and rb["rejected"] == {}, rb
    assert sum(rb["bytes_from"].values()) == v1, rb  # nothing read twice: it went on from its own blocks
    assert rb["bytes_from"].get(a.session, 0) > 0 and rb["bytes_from"].get(trainer.session, 0) > 0, rb


FULL_CHILD = textwrap.dedent("""
    import os, sys, traceback, paramstore
    root, registry, name = sys.argv[1:4]
    with paramstore.ParamStore(root, registry=registry, name=name, prepare_buffers=False) as store:
        try:
            store.checkout(1)
            print("fetched")
        except OSError as e:  # the package's error, naming this filesystem
            print("ENOSPC" if isinstance(e, paramstore.StorageFullError) and e.errno == 28 else repr(e).replace(" ", "_"))
            print("in", traceback.extract_tb(e.__traceback__)[-1].name)  # where the space ran out
        tmp = os.path.join(root, "tmp")
        print("leftovers", len([f for f in os.listdir(tmp) if not f.startswith(".")]) if os.path.isdir(tmp) else 0)
""")


def test_a_relay_into_a_full_tmpfs_fails_the_checkout_not_the_process(hosts, redis_url, tmp_path):
    """A relay's destination is reserved block by block, just ahead of the bytes that arrive (not
    all before the first read): a tmpfs too small for the version fails the checkout with
    StorageFullError where the reservation fails, never with SIGBUS in the receiving thread, and
    leaves no partial slab behind."""
    trainer = hosts("trainer")
    assert trainer.ask("commit 1 1 16") == {"committed": 1}  # 64 MiB in two objects
    proc = run_in_small_tmpfs(tmp_path, "40m", FULL_CHILD, redis_url, hosts.name)
    assert proc.returncode == 0, f"exit {proc.returncode} (135 = SIGBUS): {proc.stderr}"
    # reserve: a block's reservation, once the fetch was under way (before: the whole slab's, up front)
    assert proc.stdout.split() == ["ENOSPC", "in", "reserve", "leftovers", "0"], proc.stdout + proc.stderr


def test_the_reservation_stays_ahead_of_the_reads(shm_dir):
    """A fresh relay slab is reserved SPACE_AHEAD past the furthest block a read asked for, also
    when that block was already reserved: no read waits for its own range to be reserved (before,
    the reservation stopped once ahead, and every few blocks a read found its range unreserved and
    waited for it, ~7-50 ms each on the cluster)."""
    from paramstore import peer
    from paramstore.staging import SlabPool

    pool = SlabPool(shm_dir, pin=False)
    slab = pool.take(12 * peer.BLOCK_BYTES, reserve=False)
    space = peer._Space(slab)
    try:
        for block in range(1, 13):
            end = block * peer.BLOCK_BYTES
            assert space.wait(end)
            want = min(slab.size, end + peer.SPACE_AHEAD)
            deadline = time.monotonic() + 10
            while space.upto < want and time.monotonic() < deadline:
                time.sleep(0.005)
            assert space.upto >= want, (block, space.upto, want)  # ahead before the next read asks
        assert space.error is None and os.fstat(slab.fd).st_blocks * 512 >= slab.size
    finally:
        space.close()
        slab.discard()
        pool.close()
