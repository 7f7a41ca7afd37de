"""The registry contract (``backends/registries/base.py``), run against every implementation
through the shipped conformance suite (``paramstore.backends.registries.testing.RegistryTests``).

LMDB runs in ``tmp_path``; Redis on a real redis-server started once per session on a free loopback
port (conftest's ``redis_url``, see ``redis_server.py``), each test in its own namespace. A third
class runs the suite on LMDB with the contract's default methods instead of LMDB's faster ones, so
the defaults are held to the same suite. Below them: what only one implementation does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import lmdb
import pytest
import redis

import redis_server
from paramstore.backends.registries import LmdbRegistry, RedisRegistry, Registry, open_registry
from paramstore.backends.registries.testing import Forked, RegistryTests
from paramstore.backends.registries.testing import digest as D
from paramstore.backends.registries.testing import peer as PEER
from paramstore.backends.registries.testing import publish
from paramstore.errors import InvalidArgumentError, ParamStoreWarning, RegistryError

needs_server = pytest.mark.skipif(not os.path.exists(redis_server.BINARY),
                                  reason="redis-server is not installed (Debian: apt-get install redis-server)")


# -- the suite, on each implementation ---------------------------------------------------------
class TestLmdbRegistry(RegistryTests):
    @pytest.fixture
    def registry_spec(self, tmp_path):
        return {"path": str(tmp_path / "meta")}

    def open_registry(self, spec, ttl_s):
        return LmdbRegistry(spec["path"], create=True)

    def test_peer_of_a_dead_process_is_refused(self, reg):
        """LMDB: a peer's process must run on this host (its pid is how readers find it dead)."""
        gone = subprocess.Popen([sys.executable, "-c", ""])
        gone.wait()
        with pytest.raises(InvalidArgumentError):
            reg.announce_peer(PEER("gone", pid=gone.pid))
        assert reg.peers() == []


class LmdbWithDefaults(LmdbRegistry):
    """LMDB with the contract's default methods in place of its own faster ones."""

    latest_step = Registry.latest_step
    get_version = Registry.get_version
    tags = Registry.tags
    object_sizes = Registry.object_sizes
    referenced_objects = Registry.referenced_objects


class TestRegistryDefaults(TestLmdbRegistry):
    def open_registry(self, spec, ttl_s):
        return LmdbWithDefaults(spec["path"], create=True)


class TestRedisRegistry(RegistryTests):
    expires = True

    @pytest.fixture
    def registry_spec(self, redis_url):
        return {"url": redis_url, "namespace": uuid.uuid4().hex}

    def open_registry(self, spec, ttl_s):
        return RedisRegistry(spec["url"], spec["namespace"], lease_ttl_s=ttl_s)

    def leftovers(self, spec):
        client = redis.Redis.from_url(spec["url"])
        try:
            return [k.decode() for k in client.keys(f"ps:{{{spec['namespace']}}}:*")]
        finally:
            client.close()

    def test_forked_child_cannot_release_its_parents_lease(self, opened):
        """Redis: a forked child's release of a lease its parent took is ignored (the parent's
        heartbeat goes on renewing it)."""
        reg = opened(ttl_s=1.0)
        publish(reg, 1)
        lease = reg.acquire_lease(1, "parent")

        def child() -> None:
            reg.release_lease(lease.id)
            reg.close()

        Forked(child).join()
        time.sleep(1.3)  # past the TTL: the parent's heartbeat still renews it
        assert [x.id for x in reg.leases()] == [lease.id]
        reg.release_lease(lease.id)
        assert reg.leases() == []


# -- LMDB only ---------------------------------------------------------------------------------
def test_lmdb_store_from_before_peers_opens(tmp_path):
    """A store created before the peer databases existed opens; they are created on the way."""
    path = str(tmp_path / "meta")
    env = lmdb.open(path, max_dbs=8, subdir=True, create=True)
    for name in ("versions", "manifests", "tags", "tensors", "objects", "refs", "leases", "persisted"):
        env.open_db(name.encode())
    env.close()
    reg = LmdbRegistry(path)
    try:
        publish(reg, 1)
        reg.announce_peer(PEER("a"))
        reg.announce_objects("a", {D("o"): 1})
        assert reg.latest_step() == 1 and reg.holders([D("o")]) == {D("o"): [(PEER("a"), 1)]}
    finally:
        reg.close()


# -- Redis only: URLs, errors, namespaces ------------------------------------------------------
def test_open_registry(tmp_path, redis_url):
    lmdb_reg = open_registry(None, str(tmp_path / "meta"), "ns")
    redis_reg = open_registry(redis_url, str(tmp_path / "unused"), uuid.uuid4().hex)
    try:
        assert isinstance(lmdb_reg, LmdbRegistry) and isinstance(redis_reg, RedisRegistry)
    finally:
        lmdb_reg.close()
        redis_reg.close()
    for bad in ("http://127.0.0.1:6379/0", "127.0.0.1:6379", "unix:///tmp/redis.sock"):
        with pytest.raises(InvalidArgumentError):
            open_registry(bad, str(tmp_path / "meta"), "ns")
    for namespace in ("", "a{b}"):
        with pytest.raises(InvalidArgumentError):
            RedisRegistry(redis_url, namespace)


def test_unreachable_server_raises_registry_error():
    port = redis_server.free_port()
    with pytest.raises(RegistryError) as e:
        RedisRegistry(f"redis://:hunter2@127.0.0.1:{port}/0", "ns", connect_timeout_s=1)
    assert f"redis://:***@127.0.0.1:{port}/0" in str(e.value) and "hunter2" not in str(e.value)
    assert isinstance(e.value, ConnectionError)


@needs_server
def test_password_in_url_and_server_going_away():
    with redis_server.running(password=None) as bare, redis_server.running(password="s3cret") as url:
        with pytest.warns(ParamStoreWarning, match="no password"):  # open_registry warns for a bare URL
            open_registry(bare, "unused", "ns").close()
        url = url.replace(":s3cret@", "")
        with pytest.raises(RegistryError) as e:
            RedisRegistry(url.replace("redis://", "redis://:wrong@"), "ns")
        assert "wrong" not in str(e.value)
        reg = RedisRegistry(url.replace("redis://", "redis://:s3cret@"), "ns")
        publish(reg, 1)
        assert reg.latest_step() == 1
    with pytest.raises(RegistryError) as e:  # the server is gone
        reg.latest_step()
    assert "s3cret" not in str(e.value) and ":***@127.0.0.1" in str(e.value)
    reg.close()


def test_namespaces_are_separate(redis_url):
    a, b = RedisRegistry(redis_url, uuid.uuid4().hex), RedisRegistry(redis_url, uuid.uuid4().hex)
    try:
        with b.watch() as w:
            publish(a, 1, tags=("t",))
            lease = a.acquire_lease(1, "reader")
            assert not w.wait(0.1)
        assert (b.latest_step(), b.tags(), b.leases(), b.objects()) == (None, {}, [], {})
        a.release_lease(lease.id)
    finally:
        a.close()
        b.close()


def test_lapsed_peer_gets_its_positions_back(redis_url):
    """A peer announced again after a lapse (here by its next announcement, synchronously) takes its
    positions back, unless another peer took one meanwhile (it was the top one), and not those of
    keys it withdrew."""
    namespace = uuid.uuid4().hex
    reg, other = RedisRegistry(redis_url, namespace, lease_ttl_s=60), RedisRegistry(redis_url, namespace)
    client = redis.Redis.from_url(redis_url)
    try:
        a, b, c = PEER("a"), PEER("b"), PEER("c")
        reg.announce_peer(a)
        other.announce_peer(b)
        other.announce_peer(c)
        assert [other.announce_in_order(b.id, D("k1"), 5), reg.announce_in_order(a.id, D("k1"), 6),
                other.announce_in_order(c.id, D("k1"), 7), reg.announce_in_order(a.id, D("k2"), 8),
                reg.announce_in_order(a.id, D("k3"), 9)] == [0, 1, 2, 0, 0]
        reg.withdraw_objects(a.id, [D("k3")])
        client.delete(f"ps:{{{namespace}}}:peer:{a.id}")  # as if it had expired
        assert other.in_order(D("k1"), [0, 1, 2]) == (3, {0: (b, 5), 2: (c, 7)})  # a reader dropped it
        assert other.in_order(D("k2"), [0]) == (0, {}) and other.announce_in_order(b.id, D("k2"), 10) == 0
        with pytest.warns(RuntimeWarning, match="announced again"):
            reg.announce_objects(a.id, {D("o"): 1})
        assert other.in_order(D("k1"), [1]) == (3, {1: (a, 6)})  # back at its position
        assert other.in_order(D("k2"), [0]) == (1, {0: (b, 10)})  # b's now: a holds k2 without one
        assert other.holders([D("k2"), D("k3"), D("o")]) == {D("k2"): [(a, 8), (b, 10)], D("o"): [(a, 1)]}
    finally:
        client.close()
        reg.close()
        other.close()


def test_lapsed_peer_is_announced_again(redis_url):
    """A peer whose key expired while its process lives (a stall) comes back with its objects."""
    namespace = uuid.uuid4().hex
    reg, other = RedisRegistry(redis_url, namespace, lease_ttl_s=0.6), RedisRegistry(redis_url, namespace)
    client = redis.Redis.from_url(redis_url)
    try:
        a = PEER("a")
        reg.announce_peer(a)
        reg.announce_objects(a.id, {D("o1"): 1, D("o2"): 2})
        reg.withdraw_objects(a.id, [D("o2")])
        client.delete(f"ps:{{{namespace}}}:peer:{a.id}")  # as if it had expired
        assert other.peers() == [] and other.holders([D("o1")]) == {}  # and a reader dropped its objects

        def relisted() -> None:
            deadline = time.monotonic() + 3
            while not other.peers():
                assert time.monotonic() < deadline, "the heartbeat did not announce the lapsed peer again"
                time.sleep(0.05)

        with pytest.warns(RuntimeWarning, match="announced again"):
            relisted()
        assert other.holders([D("o1"), D("o2")]) == {D("o1"): [(a, 1)]}
    finally:
        client.close()
        reg.close()
        other.close()


def test_a_large_manifest_is_stored_compressed_and_read_back_whole(redis_url, monkeypatch):
    """Redis: a manifest of at least MANIFEST_ZLIB_BYTES of JSON (most of it piece digests) is
    stored zlib-compressed and read back equal; what is stored there and is neither JSON nor a
    zlib stream, or inflates beyond the manifest cap, is a CorruptObjectError naming where."""
    import json
    import zlib

    import blake3

    import paramstore.backends.registries.redis as redis_registry
    from paramstore.errors import CorruptObjectError
    from paramstore.format import PIECE_SIZE, pieces_root
    from paramstore.backends.registries.base import ObjectInfo, TensorLocation
    from paramstore.manifest import Manifest, TensorEntry, Version

    obj, entries, placement, offset = D("object"), {}, {}, 64
    for i in range(8):  # 8 tensors of 200 pieces: ~110 KB of JSON
        nbytes = 200 * PIECE_SIZE
        pieces = tuple(blake3.blake3(f"{i}/{k}".encode()).hexdigest() for k in range(200))
        digest = pieces_root(pieces, nbytes)
        entries[f"t{i}"] = TensorEntry("uint8", (nbytes,), digest, obj, offset, nbytes, (), pieces)
        placement[digest] = TensorLocation(obj, offset, nbytes)
        offset += nbytes
    manifest = Manifest(entries)
    version = Version(1, time.time(), manifest.nbytes, manifest.digest(), len(entries), (), {}, {})
    text = json.dumps(manifest.to_json())
    assert len(text) >= redis_registry.MANIFEST_ZLIB_BYTES
    reg = RedisRegistry(redis_url, uuid.uuid4().hex)
    client = redis.Redis.from_url(redis_url)
    key, field = reg._k["manifests"], f"{1:020d}"
    try:
        reg.publish(version, manifest, {obj: ObjectInfo(offset, tuple(placement))}, placement)
        raw = client.hget(key, field)
        assert raw[:1] != b"{" and len(raw) < 0.7 * len(text)
        assert reg.get_manifest(1).to_json() == manifest.to_json()
        client.hset(key, field, b"\x78\x01 not a zlib stream")
        with pytest.raises(CorruptObjectError, match="manifests.*neither JSON nor a zlib stream"):
            reg.get_manifest(1)
        monkeypatch.setattr(redis_registry, "MAX_MANIFEST_BYTES", len(text) - 1)
        client.hset(key, field, zlib.compress(text.encode(), 1))
        with pytest.raises(CorruptObjectError, match="inflates beyond"):
            reg.get_manifest(1)
        monkeypatch.undo()
        client.hset(key, field, text)  # as a paramstore that stored JSON left it: still read
        assert reg.get_manifest(1).to_json() == manifest.to_json()
    finally:
        client.close()
        reg.close()
