"""Relay (issue 27, item 3): hosts fetching a version at once form a chain in the order they joined;
each reads every block from the nearest fetcher ahead of it, up to the mark that host publishes
in its progress word, which moves only past blocks it verified (pieces against the manifest, the
header against the object's name). Real processes,
a real redis-server, Mooncake over TCP on 127.0.0.1 (see test_peers.py).

A "slow host" (``block_delay``) holds each block back after it lands, so that the fetches overlap
on loopback (which is far faster than any link) as they do on a real network."""

from __future__ import annotations

import importlib.util
import os
import signal
import textwrap
import time

import pytest

from helpers import run_in_small_tmpfs
from paramstore.relay import FANOUT_ENV, MAX_FANOUT, RELAY_ASK, relay_depth, relay_fanout, relay_order
from test_peers import Host, hosts, stored_bytes  # noqa: F401 - the fixture is used by name


def _has_mooncake() -> bool:
    try:
        return importlib.util.find_spec("mooncake.engine") is not None
    except ImportError:
        return False


needs_mooncake = pytest.mark.skipif(not _has_mooncake(), reason="needs mooncake-transfer-engine-non-cuda and libibverbs1")


@needs_mooncake
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


@needs_mooncake
def test_hosts_that_start_at_once_read_each_object_from_the_trainer_once(hosts):
    """Four hosts check a version of 8 small objects out at the same moment. The registry
    orders each object's fetchers (``announce_in_order``), so exactly one of them reads it from
    the trainer however close their announcements are. (Ordered by each host's clock, taken
    before its announcement was visible, two hosts announcing within ms each saw nobody ahead and
    both read the object whole from the trainer: 1.2-1.44x egress at 16 hosts, session 16.)"""
    shard = 8 << 20  # 2 tensors of 4 MiB per object: a few blocks each
    trainer = hosts("trainer", shard=shard)
    rollouts = [hosts("rollout", shard=shard, block_delay=0.02) for _ in range(4)]
    assert trainer.ask("commit 1 1 16") == {"committed": 1}
    v1 = stored_bytes(trainer.root)
    for r in rollouts:
        r.send("checkout 1 1 16")
    replies = [r.expect() for r in rollouts]
    for rep in replies:
        assert rep["ok"] and rep["rejected"] == {} and rep["fetched"] == 8, rep
        assert sum(rep["bytes_from"].values()) == v1, rep  # every byte once
    egress = sum(rep["bytes_from"].get(trainer.session, 0) for rep in replies)
    print(f"4 hosts at once, 8 objects: trainer egress {egress / v1:.2f} model sizes")
    assert egress <= 1.02 * v1, (egress / v1, replies)


@needs_mooncake
@pytest.mark.parametrize("fraction", [0.01, 0.3])
def test_patch_objects_are_relayed_and_leave_the_trainer_about_once(hosts, fraction):
    """Patch objects are relayed too: three hosts updating by patches at the same moment read each
    patch from the trainer about once between them. At 1% changed each patch is at most a block,
    relayed as one block checked whole against the object's name; at 30% each 32 MiB object's
    patch is ~9 MiB, over a block, and its header lists its own piece digests (checked against its
    name), so it is relayed block by block like an object a manifest lists. (Fetched whole from a
    holder by each host, as until sessions 17 and 18: ~3x here, n x at n hosts.)"""
    trainer = hosts("trainer")
    rollouts = [hosts("rollout", block_delay=0.05) for _ in range(3)]
    assert trainer.ask("commit 1 1 16") == {"committed": 1}
    for r in rollouts:
        assert r.ask("checkout 1 1 16")["ok"]
    trainer.ask(f"commit 2 2 16 {fraction}")
    made = trainer.ask("patches")["patches"]
    if fraction > 0.1:
        assert made > 2 * (8 << 20), made  # two patch objects, each over a block
    for r in rollouts:
        r.send(f"checkout 2 2 16 {fraction}")  # at once: each waits for the patches, then all fetch them
    replies = [r.expect() for r in rollouts]
    for rep in replies:
        assert rep["ok"] and rep["from_patches"] == 2 and rep["fetched"] == 0 and rep["rejected"] == {}, rep
        # every patch byte once, and each header's length field once more (read before the header)
        assert rep["patch_bytes"] == made + 2 * 8, rep
    egress = sum(rep["bytes_from"].get(trainer.session, 0) for rep in replies)
    print(f"3 hosts, patches of {made / 2**20:.2f} MiB: trainer egress {egress / made:.2f}x the patches "
          f"(+{egress - made} bytes)")
    # the headers are relayed too: only the first fetcher of each patch reads from the origin (before,
    # every host read each header from it first: 2 x 3 x 4 KiB), and the origin serves each block about once
    assert sum(1 for rep in replies if rep["bytes_from"].get(trainer.session)) <= 2, replies
    assert made + 2 * 8 <= egress <= 1.05 * made, (egress - made, replies)


@needs_mooncake
def test_a_host_relaying_a_corrupt_patch_is_blamed_and_the_update_completes(hosts):
    """A host that fetched version 2's patches serves them corrupted (a byte of each flipped):
    the next host, which follows it (its fetch is still announced), finds each patch's bytes do
    not make its name, names it in ``rejected``, reads the patches from the trainer and rebuilds
    version 2 bit for bit; the trainer is not blamed."""
    trainer, bad, good = hosts("trainer"), hosts("rollout"), hosts("rollout")
    assert trainer.ask("commit 1 1 16") == {"committed": 1}
    for r in (bad, good):
        assert r.ask("checkout 1 1 16")["ok"]
    trainer.ask("commit 2 2 16 0.01")
    first = bad.ask("checkout 2 2 16 0.01")
    assert first["ok"] and first["from_patches"] == 2, first
    assert bad.ask("corrupt")["corrupted"] > 0
    reply = good.ask("checkout 2 2 16 0.01")  # within the first's linger: it follows that host
    assert reply["ok"] and reply["from_patches"] == 2, reply  # the right bytes (the host compares every tensor)
    assert set(reply["rejected"]) == {bad.session}, reply
    assert reply["bytes_from"].get(bad.session, 0) > 0 and reply["bytes_from"].get(trainer.session, 0) > 0, reply


@needs_mooncake
def test_a_holder_serving_a_corrupt_header_does_not_stop_a_patch_update(hosts):
    """A host that fetched version 2's patches serves them with their headers corrupted: the next
    host's relay, reading the header first (it must say the recorded size), moves on to another holder
    instead of giving the patches up (before, when the corrupt host was the one asked, the update
    fell back to whole objects), and the relay blames the host for what it served."""
    trainer, bad, good = hosts("trainer"), hosts("rollout"), hosts("rollout")
    assert trainer.ask("commit 1 1 16") == {"committed": 1}
    for r in (bad, good):
        assert r.ask("checkout 1 1 16")["ok"]
    trainer.ask("commit 2 2 16 0.01")
    assert bad.ask("checkout 2 2 16 0.01")["from_patches"] == 2
    assert bad.ask("corrupt-header")["corrupted"] > 0
    reply = good.ask("checkout 2 2 16 0.01")
    assert reply["ok"] and reply["from_patches"] == 2 and reply["fetched"] == 0, reply
    assert set(reply["rejected"]) <= {bad.session}, reply  # the trainer is never blamed


@needs_mooncake
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


@needs_mooncake
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
    assert rb["ok"] and rb["rejected"] == {} and set(rb["failed"]) == {a.session}, rb
    assert sum(rb["bytes_from"].values()) == v1, rb  # nothing read twice: it went on from its own blocks
    assert rb["bytes_from"].get(a.session, 0) > 0 and rb["bytes_from"].get(trainer.session, 0) > 0, rb


@needs_mooncake
def test_an_upstream_hung_mid_relay_costs_the_engines_progress_timeout_not_a_hang(hosts):
    """A (slow) relays to B; A hangs mid-fetch (SIGSTOP: its connections stay open, nothing it
    serves moves). B's read in flight from A, or of A's progress word, fails after the transfer
    engine's progress timeout (``MC_TCP_PROGRESS_TIMEOUT_SEC``, 1 s here); B then passes over A and
    finishes from the next one up (the trainer), from its own verified blocks. Continued, A
    finishes too. Every byte verified, none read twice."""
    trainer = hosts("trainer")
    a, b = hosts("rollout", block_delay=0.4), hosts("rollout")
    trainer.ask("commit 1 1 16")
    v1 = stored_bytes(trainer.root)
    a.send("checkout 1 1 16")
    time.sleep(0.3)
    b.send("checkout 1 1 16")
    time.sleep(0.8)
    a.proc.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        rb = b.expect()
        took = time.monotonic() - t0
    finally:
        a.proc.send_signal(signal.SIGCONT)
    ra = a.expect()
    print(f"upstream hung: b read {rb['bytes_from']}, done {took:.2f} s after the stop")
    assert rb["ok"] and rb["rejected"] == {} and set(rb["failed"]) == {a.session}, rb
    assert sum(rb["bytes_from"].values()) == v1, rb  # nothing read twice: it went on from its own blocks
    assert rb["bytes_from"].get(a.session, 0) > 0 and rb["bytes_from"].get(trainer.session, 0) > 0, rb
    assert took < 4.0, took  # the engine's 1 s, then the rest from the trainer (not STALL_S, nor a hang)
    assert ra["ok"] and ra["rejected"] == {}, ra


@needs_mooncake
def test_an_upstream_that_answers_but_makes_no_progress_is_passed_over(hosts):
    """A (slow: each block held back 1 s after it lands) relays to B, whose ``STALL_S`` is 0.1 s:
    A's progress word answers, but its mark stays put for longer than B waits (``STALL_S`` plus a
    few blocks' time), so B passes over A and reads the rest from the trainer, going on from its
    own verified blocks. A stall is not a failed read: nothing failed, nobody blamed, nothing read
    twice. Following A would take ~1 s per block (17 blocks of each object): B is done long before."""
    trainer = hosts("trainer")
    a, b = hosts("rollout", block_delay=1.0), hosts("rollout", stall_s=0.1)
    trainer.ask("commit 1 1 16")
    v1 = stored_bytes(trainer.root)
    a.send("checkout 1 1 16")
    a.wait_fetching()  # A announced itself a fetcher: B, after it, follows it
    t0 = time.monotonic()
    rb = b.ask("checkout 1 1 16")
    took = time.monotonic() - t0
    a.proc.kill()  # it would go on for ~17 s
    print(f"upstream stalled: b read {rb['bytes_from']} in {took:.2f} s")
    assert rb["ok"] and rb["rejected"] == {} and rb["failed"] == {}, rb
    assert sum(rb["bytes_from"].values()) == v1, rb  # nothing read twice
    assert rb["bytes_from"].get(trainer.session, 0) > v1 // 2, rb
    assert took < 8.0, took


@needs_mooncake
def test_the_only_holder_hung_for_longer_than_the_progress_timeout_is_asked_again(hosts):
    """The trainer, the only holder, hangs for 1.6 s mid-fetch (SIGSTOP, then SIGCONT): the read
    in flight to it fails after the engine's progress timeout (1 s), and with nobody else to ask
    the fetch waits out a back-off (``RETRY_S``) and asks it again, instead of giving the object
    up (the checkout then failed: no remote tier here). Every byte once, nobody blamed."""
    trainer, a = hosts("trainer"), hosts("rollout", block_delay=0.3)
    trainer.ask("commit 1 1 16")
    v1 = stored_bytes(trainer.root)
    ra = a.ask_while_stopped("checkout 1 1 16", trainer)
    print(f"only holder hung 1.6 s: a read {ra['bytes_from']}, failed {ra['failed']}")
    assert ra["ok"] and ra["rejected"] == {} and ra["fetched"] == 2, ra
    assert set(ra["failed"]) == {trainer.session}, ra  # the stop did land on reads (and they were retried)
    assert sum(ra["bytes_from"].values()) == v1, ra  # a failed read is not counted; nothing twice


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


@needs_mooncake
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
    from paramstore import relay
    from paramstore.staging import SlabPool

    pool = SlabPool(shm_dir, pin=False)
    slab = pool.take(12 * relay.BLOCK_BYTES, reserve=False)
    space = relay._Space(slab)
    try:
        for block in range(1, 13):
            end = block * relay.BLOCK_BYTES
            assert space.wait(end)
            want = min(slab.size, end + relay.SPACE_AHEAD)
            deadline = time.monotonic() + 10
            while space.upto < want and time.monotonic() < deadline:
                time.sleep(0.005)
            assert space.upto >= want, (block, space.upto, want)  # ahead before the next read asks
        assert space.error is None and os.fstat(slab.fd).st_blocks * 512 >= slab.size
    finally:
        space.close()
        slab.discard()
        pool.close()


@pytest.mark.parametrize("unit, n", [(256 << 10, 44), (4 << 20, 8), (8 << 20, 32), (100_000, 7)])
def test_a_small_objects_units_are_grouped_into_small_blocks(unit, n):
    """Units (pieces, small tensors) are grouped into blocks of up to ``relay_block_bytes`` of the
    object: a piece for a large object, about a sixteenth (at least 1 MiB) for a small one such as
    an 11 MiB patch of 256 KiB frames, so that it crosses a chain in small blocks; a unit larger
    than that stays whole, and none is ever cut."""
    from paramstore.relay import BLOCK_BYTES, MIN_BLOCK_BYTES, Relay, relay_block_bytes

    start, obj = 64, "cd" * 32
    units = {(start + i * unit, start + (i + 1) * unit): f"{i:064x}" for i in range(n)}
    size = start + n * unit
    _, blocks, _ = Relay.plan(obj, size, {obj: units}, {obj: units})
    most = relay_block_bytes(size)
    assert MIN_BLOCK_BYTES <= most <= BLOCK_BYTES
    got = [(b, e) for _, _, us in blocks for b, e, _ in us]
    assert got == [(0, start), *sorted(units)]  # every unit once, in order, none cut
    for b, e, us in blocks:
        assert e - b <= most or len(us) == 1, (e - b, len(us))
    if unit < most:  # small units: about size / most blocks, not a piece's worth each
        assert len(blocks) <= -(-size // most) + 1
    print(f"{n} units of {unit} B: {len(blocks)} blocks of at most {most >> 10} KiB")


# -- the plan: a chain or a tree, whichever reaches the last fetcher first ------------------------
@pytest.mark.parametrize("n", range(301))
def test_the_relay_order_of_a_chain_is_the_nearest_first(n):
    """Fan-out 1: exactly the chain, the nearest fetcher ahead first, as many as asked for."""
    assert relay_order(n, 1, limit=n + 1) == list(range(n - 1, -1, -1))
    assert relay_order(n, 1) == list(range(n - 1, -1, -1))[:RELAY_ASK]


@pytest.mark.parametrize("fanout", [2, 3])
def test_the_relay_order_of_a_tree_is_parent_ancestors_then_nearest(fanout):
    """Fan-out 2 and 3, 1 to 300 fetchers ahead: the parent ``(i - 1) // f`` first, then its
    ancestors up to the first fetcher, then every other fetcher ahead, nearest first, each once;
    cut at ``limit``, and positions to skip left out wherever they stand."""
    for i in range(1, 301):
        idx = relay_order(i, fanout, limit=i)
        assert sorted(idx) == list(range(i)), (fanout, i)  # every fetcher ahead, once: a fallback for each
        want, k = [], i
        while k:
            k = (k - 1) // fanout
            want.append(k)
        assert idx[: len(want)] == want and want[-1] == 0, (fanout, i, idx)
        rest = idx[len(want):]
        assert rest == sorted(rest, reverse=True), (fanout, i, idx)  # the others: nearest first
        assert len(want) == relay_depth(i, fanout)
        assert relay_order(i, fanout) == idx[:RELAY_ASK]
        skip = set(idx[::2])
        assert relay_order(i, fanout, skip, limit=i) == [q for q in idx if q not in skip]
    # concrete: the 5th fetcher (position 4) of a binary tree reads from the 2nd, then the 1st
    assert relay_order(4, 2) == [1, 0, 3, 2]
    assert relay_order(10, 3) == [3, 0, 9, 8, 7, 6, 5, 4, 2, 1]
    assert relay_order(0, 2) == [] and relay_order(500, 2, limit=0) == []


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_a_relay_tree_gives_each_fetcher_at_most_fanout_children_and_log_depth(fanout):
    """All n fetchers' first choices form a tree: one root (reads the origin), at most ``fanout``
    children each, depth ceil(log_f) (the chain: n - 1)."""
    for n in (1, 2, 8, 16, 17, 64, 256, 300):
        parents = [relay_order(i, fanout)[0] for i in range(1, n)]
        assert all(p < i + 1 for i, p in enumerate(parents))  # always someone ahead
        assert max((parents.count(p) for p in set(parents)), default=0) <= fanout
        depth = max(relay_depth(i, fanout) for i in range(n))
        if fanout == 1:
            assert depth == n - 1
        else:
            full, levels = 1, 0  # the levels a complete tree of n nodes has below its root
            while full < n:
                levels += 1
                full += fanout ** levels
            assert depth == levels, (fanout, n, depth)
    assert relay_depth(255, 2) == 8 and relay_depth(255, 3) == 5


def test_the_fanout_is_the_one_that_reaches_the_last_fetcher_first(monkeypatch):
    """A chain where the object has many blocks next to its fetchers (8 hosts and 32 blocks, as the
    cluster benchmark's 256 MiB object), a tree where it has few (one-block objects from 16 hosts,
    many hosts): f minimizes f * (blocks + the last fetcher's depth), checked against every f by
    brute force; the environment fixes it whatever the numbers; a value that is not an int >= 1 is
    ignored."""
    monkeypatch.delenv(FANOUT_ENV, raising=False)
    assert [relay_fanout(n, 32) for n in (1, 2, 8, 16, 17)] == [1, 1, 1, 1, 1]
    assert relay_fanout(16, 1) == relay_fanout(24, 4) == relay_fanout(256, 32) == 2
    assert relay_fanout(1, 1) == relay_fanout(3, 1) == 1  # ties: the chain
    for n in (1, 2, 5, 8, 16, 17, 40, 64, 100, 256, 512):
        for b in (1, 2, 4, 8, 32, 128):
            cost = {f: f * (b + relay_depth(n - 1, f)) for f in range(1, MAX_FANOUT + 1)}
            f = relay_fanout(n, b)
            assert cost[f] == min(cost.values()) and all(g >= f for g, c in cost.items() if c == cost[f]), (n, b)
    monkeypatch.setenv(FANOUT_ENV, "3")
    assert relay_fanout(2, 32) == relay_fanout(300, 1) == 3
    for bad in ("0", "x", "-2", ""):
        monkeypatch.setenv(FANOUT_ENV, bad)
        assert relay_fanout(4, 32) == 1 and relay_fanout(300, 32) == 2


@needs_mooncake
def test_five_hosts_relay_along_a_binary_tree(hosts, monkeypatch):
    """PARAMSTORE_RELAY_FANOUT=2, five (slow) hosts joining one after another: the tree 0 <- 1, 2
    and 1 <- 3, 4. Every host gets the bytes right (each compares every tensor) and reads each byte
    once; the trainer serves the model about once (only host 0 reads it); hosts 2 and 4 read from
    their parents (0 and 1), not from the nearest fetcher ahead (1 and 3): the tree, not the chain."""
    monkeypatch.setenv(FANOUT_ENV, "2")  # the hosts' processes inherit it
    trainer = hosts("trainer")
    rollouts = [hosts("rollout", block_delay=0.05) for _ in range(5)]
    assert trainer.ask("commit 1 1 16") == {"committed": 1}
    v1 = stored_bytes(trainer.root)
    for r in rollouts:  # 0.25 s apart: the join order is the order sent, also on a busy machine
        r.send("checkout 1 1 16")  # (a fetcher that finished lingers: the later ones still read from it)
        time.sleep(0.25)
    replies = [r.expect() for r in rollouts]
    for rep in replies:
        assert rep["ok"] and rep["rejected"] == {} and rep["fetched"] == 2, rep
        assert sum(rep["bytes_from"].values()) == v1, rep  # every byte once
    frm = [{s: n / v1 for s, n in rep["bytes_from"].items()} for rep in replies]
    names = {trainer.session: "trainer", **{r.session: f"r{k}" for k, r in enumerate(rollouts)}}
    print("tree of 5:", [{names[s]: round(x, 2) for s, x in f.items()} for f in frm])
    egress = sum(f.get(trainer.session, 0) for f in frm)
    assert egress <= 1.05, egress  # the origin served each block about once
    for child, parent in ((1, 0), (2, 0), (3, 1), (4, 1)):
        assert frm[child].get(rollouts[parent].session, 0) > 0.9, (child, parent, frm[child])
    assert frm[2].get(rollouts[1].session, 0) < 0.1 and frm[4].get(rollouts[3].session, 0) < 0.1, frm


# -- a plan from the object's own header; reads that fail (no processes) -------------------------
def test_a_plan_its_header_gives_has_the_header_as_a_block_of_its_own():
    """A relay that reads the header first (a patch object) has it verified, alone, before any
    other block: its plan cuts the header apart, where a manifest's groups it with the first
    pieces; and its fetch key names the cut, so hosts cutting an object otherwise never follow
    each other (a block count read from one would mean other bytes to the other)."""
    from paramstore.relay import Relay, _fetch_key

    d = "e" * 64
    spans = {(100, 1100): "a" * 64, (1100, 1200): "b" * 64}
    pieces = {(100, 1100): "c" * 64, (1100, 1200): "d" * 64}
    grouped = Relay.plan(d, 1200, {d: spans}, {d: pieces})
    alone = Relay.plan(d, 1200, {d: spans}, {d: pieces}, header_alone=True)
    assert grouped is not None and alone is not None
    assert [(b, e) for b, e, _ in grouped[1]] == [(0, 1200)]
    assert [(b, e) for b, e, _ in alone[1]] == [(0, 100), (100, 1200)] and alone[1][0][2] == [(0, 100, None)]
    keys = {_fetch_key(d, grouped[1]), _fetch_key(d, alone[1]), _fetch_key(d, None)}
    assert len(keys) == 3
    # the same cut, however each block is checked (by its pieces, or whole against the name): one key
    assert _fetch_key(d, Relay.whole(1200)[1]) == _fetch_key(d, grouped[1])


def test_a_holder_that_failed_reads_is_asked_again_after_a_back_off_a_few_times(monkeypatch):
    """The reads in flight to a holder that stalls fail together: one failure. With nobody else
    to ask it is asked again after RETRY_S, then 2x, 4x: PEER_RETRIES times, then given up. A
    peer caught serving bad bytes, or a fetcher ahead passed over, is never asked again."""
    import threading

    import paramstore.relay as relay
    from paramstore.backends.registries.base import Peer
    from paramstore.errors import TransferError
    from paramstore.reports import FetchReport

    now = [100.0]
    monkeypatch.setattr(relay.time, "monotonic", lambda: now[0])
    r = relay.Relay(None, None, None, "e" * 64, 1200, None, FetchReport(1), threading.Lock(), set(),  # type: ignore[arg-type]
                    relay.Relay.whole(1200))
    origin, caught, upstream = (Peer(n, f"{n}:1", "h", 1, 0.0) for n in ("origin", "caught", "up"))
    for p in (origin, caught, upstream):
        r._read_failed(p, TransferError("stalled", code=-1))
    for _ in range(3):  # the other reads that were in flight to it
        r._read_failed(origin, TransferError("stalled", code=-1))
    r.excluded.add(caught.id)
    r._put_aside(upstream, 1)
    assert r.retries.failed == {"origin": (1, 100.0), "caught": (1, 100.0)} and not r.tainted
    waits = []
    for n in range(1, relay.PEER_RETRIES + 1):
        assert r._retry() and "origin" in r.bad  # backing off
        waits.append(r.retry_at - now[0])
        now[0] = r.retry_at
        assert r._retry() and "origin" not in r.bad  # asked again
        r._read_failed(origin, TransferError("stalled", code=-1))
        assert r.retries.failed["origin"][0] == n + 1
    assert waits == [relay.RETRY_S * 2 ** k for k in range(relay.PEER_RETRIES)]
    assert not r._retry() and {"origin", "caught", "up"} <= r.bad  # given up
    r._read_failed(origin, TransferError("timed out", code=-2))
    assert r.tainted  # a read that timed out may still write: nothing here is trusted


def test_a_whole_object_read_waits_out_the_back_off_of_a_holder_whose_reads_failed(monkeypatch):
    """peer._Fetch with nobody else to ask: a holder whose reads failed is re-admitted after
    RETRY_S, 2x, 4x (the fetch sleeps until then), PEER_RETRIES times, then given up; one caught
    serving bad bytes is never re-admitted. A fake clock: the sleeps advance it."""
    import threading

    import paramstore.peer as peer
    import paramstore.relay as relay
    from paramstore.reports import FetchReport

    now = [100.0]
    slept: list[float] = []
    monkeypatch.setattr(relay.time, "monotonic", lambda: now[0])

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    monkeypatch.setattr(peer.time, "sleep", sleep)
    f = peer._Fetch(None, None, None, "e" * 64, 1200, None, FetchReport(1), threading.Lock(), None, set())  # type: ignore[arg-type]
    for _ in range(relay.PEER_RETRIES):
        f.bad.add("origin")
        f.retries.failed_read("origin")
        assert f._back_off() and "origin" not in f.bad  # slept, then asked again
    f.bad.add("origin")
    f.retries.failed_read("origin")
    assert not f._back_off() and "origin" in f.bad  # given up
    assert slept == [relay.RETRY_S * 2 ** k for k in range(relay.PEER_RETRIES)]
    f.bad.add("caught")
    f.retries.failed_read("caught")
    f.excluded.add("caught")
    assert not f._back_off() and len(slept) == relay.PEER_RETRIES  # never re-admitted, no wait


@needs_mooncake
def test_a_mark_read_less_than_a_second_ago_stands_for_the_blocks_it_covers(monkeypatch):
    """A follower reads its upstream's progress word (over the real transport) only when the mark
    it last read does not cover the next block, or is over MARK_TTL_S old; the blocks below a
    fresh mark are read straight away (a mark only grows)."""
    import struct
    import threading

    import paramstore.relay as relay
    from paramstore.backends.registries.base import Peer
    from paramstore.backends.transports import MooncakeTransport
    from paramstore.reports import FetchReport

    now = [100.0]
    monkeypatch.setattr(relay.time, "monotonic", lambda: now[0])
    with MooncakeTransport("127.0.0.1", timeout=20) as up_t, MooncakeTransport("127.0.0.1", timeout=20) as t:
        word = memoryview(bytearray(16))
        struct.pack_into("<QQ", word, 0, 0x1000, 3)  # the upstream's slab at 0x1000, blocks 0-2 verified
        up = Peer("up", up_t.session, "h", 1, 0.0)
        r = relay.Relay(None, t, None, "e" * 64, 6 << 20, None, FetchReport(1), threading.Lock(), set(),  # type: ignore[arg-type]
                        (0, [(i << 20, (i + 1) << 20, []) for i in range(6)], {}))
        r.scratch = memoryview(bytearray(16))
        r.saddr = t.register(r.scratch)
        r.position, r.end, r.found_at, r.relook_s = 1, 2, now[0], 60.0  # the registry's last answer: fresh
        r.ahead = {0: (up, up_t.register(word))}
        reads: list[int] = []
        real = t.read
        monkeypatch.setattr(t, "read", lambda peer, rs, **kw: (reads.append(len(rs)), real(peer, rs, **kw))[1])
        assert r._choose([0, 1, 2, 3, 4, 5], 1)[0] == [(up, 0, 0x1000)] and len(reads) == 1
        assert r._choose([1, 2, 3, 4, 5], 1)[0] == [(up, 1, 0x1000)] and len(reads) == 1  # mark 3 covers it
        assert r._choose([3, 4, 5], 1)[0] is None and len(reads) == 2  # not verified there yet: asked again
        struct.pack_into("<Q", word, 8, 5)
        assert r._choose([3, 4, 5], 1)[0] == [(up, 3, 0x1000)] and len(reads) == 3
        now[0] += relay.MARK_TTL_S
        assert r._choose([4, 5], 1)[0] == [(up, 4, 0x1000)] and len(reads) == 4  # too old: read again
        r._put_aside(up, 0)
        assert "up" not in r.marks
