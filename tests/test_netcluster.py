"""The simulated cluster (tools/netcluster.py): hosts in network namespaces, links limited by tc.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import netcluster  # noqa: E402

why = netcluster.available()
pytestmark = pytest.mark.skipif(why is not None, reason=str(why))

SINK = """if True:
    import socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 9000)); s.listen(); print("ready", flush=True)
    for _ in range(2):
        c, _ = s.accept(); n = 0
        while (b := c.recv(1 << 16)):
            n += len(b)
        c.sendall(str(n).encode()); c.close()
"""
SEND = """if True:
    import socket, sys, time
    n = int(sys.argv[2]); t0 = time.monotonic()
    c = socket.create_connection((sys.argv[1], 9000), timeout=30)
    c.sendall(b"x" * n); c.shutdown(socket.SHUT_WR); got = int(c.recv(64)); print(got, time.monotonic() - t0)
"""


def test_hosts_reach_each_other_only_through_the_limited_links():
    with netcluster.Cluster(3, rate="100mbit", timeout=120) as c:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(c.namespace(i) in names for i in range(3))
        routes = c.run(2, ["ip", "route"]).stdout.strip().splitlines()
        assert routes == [f"10.231.{c.net}.0/24 dev eth0 proto kernel scope link src {c.address(2)}"]  # nowhere else
        sink = c.popen(1, [sys.executable, "-c", SINK, c.address(1)], stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline().strip() == "ready"
        small = c.run(2, [sys.executable, "-c", SEND, c.address(1), "1"]).stdout.split()
        assert small[0] == "1"
        big = c.run(2, [sys.executable, "-c", SEND, c.address(1), str(4 << 20)]).stdout.split()
        assert int(big[0]) == 4 << 20
        assert float(big[1]) >= 0.8 * (4 << 20) * 8 / 100e6  # the 100 Mbit/s link is the limit
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert c.tag not in names  # removed on exit
    assert sink.poll() is not None


def test_a_failed_set_up_leaves_nothing_behind():
    c = netcluster.Cluster(2, rate="1gbit", delay="not-a-delay", timeout=60)
    with pytest.raises(RuntimeError, match="tc"):
        c.__enter__()
    assert c.tag not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_a_patch_update_across_three_hosts_is_bit_identical_and_moves_less_than_the_model():
    """1 trainer + 2 rollout hosts, each in its own namespace with its own store, peer server and
    Mooncake engine (TCP), redis in the trainer's namespace; links at 1 Gbit/s. Version 1 changes 1%
    of every tensor's elements: the rollouts, holding version 0, rebuild it from patches."""
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda and libibverbs1")
    if not os.path.exists("/usr/bin/redis-server"):
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    from cluster_host import running_cluster

    with running_cluster(2, rate="1gbit", mib=16, tensors=8, timeout=240) as run:
        run.open_all("t", patches=True)
        v0 = run.commit(0, seed=1, digests=True)
        first = run.checkout_all(0, check=v0["tensor_digests"])
        assert all(r["ok"] and r["fetch"]["from_patches"] == 0 for r in first), first
        v1 = run.commit(1, seed=2, fraction=0.01, digests=True)
        replies = run.checkout_all(1, check=v1["tensor_digests"])
        model = v1["model_bytes"]
        for r in replies:
            fetch = r["fetch"]
            assert r["ok"], r  # every tensor's bytes hash as the trainer's
            assert fetch["from_patches"] > 0 and fetch["from_peers"] == 0 and fetch["rejected"] == {}, fetch
            assert 0 < fetch["bytes"] == fetch["patch_bytes"] < 0.05 * model, fetch  # ~1.3%, not the model
