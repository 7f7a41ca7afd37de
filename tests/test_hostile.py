"""No trust in what another host, a bucket or a shared registry says (issue 12, items 3 and 4).

An attacker (or a bug) with write access to the bucket or the Redis registry rewrites what other
hosts read: manifests, version records, object and index entries. Every such record is checked
(against the version digest, its own consistency, the object bytes, size limits) before it is
used, and a name or digest read from outside never reaches a filesystem call. The bucket is a real
S3 API (moto) tampered with through s3fs; the registry a real redis-server.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import redis
import s3fs
import torch

import paramstore.remote
from helpers import assert_checkout_equal, random_tensor, tree
from paramstore import Manifest, ParamStore
from paramstore.errors import CorruptObjectError

SHAPE = (64, 64)  # 16 KiB in float32: every tensor of a model lies in one object


def model(seed: int = 1) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": random_tensor(torch.float32, SHAPE, seed * 100 + i) for i in range(4)}


def manifest_key(url: str, step: int) -> str:
    return f"{url.split('://', 1)[1]}/manifests/{step:020d}.json"


def record_key(url: str, step: int) -> str:
    return f"{url.split('://', 1)[1]}/versions/{step:020d}.json"


@pytest.fixture
def bucket(s3_server, s3_remote, shm_dir):
    """(url, options, s3fs filesystem): a bucket holding version 1 of ``model()``, pushed by a trainer."""
    url, opts = s3_remote
    with ParamStore(os.path.join(shm_dir, "trainer"), remote=url, storage_options=opts) as trainer:
        trainer.commit(1, model()).persisted.result(60)
    return url, opts, s3fs.S3FileSystem(endpoint_url=s3_server.endpoint, skip_instance_cache=True)


def tamper(fs: s3fs.S3FileSystem, key: str, change) -> None:
    """Rewrite the JSON at ``key`` with ``change(doc)``, as an attacker with write access would."""
    doc = json.loads(fs.cat_file(key))
    change(doc)
    fs.pipe_file(key, json.dumps(doc).encode())


def fresh(shm_dir: str, url: str, opts: dict, name: str = "host") -> ParamStore:
    return ParamStore(os.path.join(shm_dir, name), remote=url, storage_options=opts, create=True)


def objects_placed(store: ParamStore) -> list[str]:
    return [p for p in tree(store.root) if p.startswith("objects/")]


# -- manifests in the bucket ----------------------------------------------------------------------
def test_manifest_with_swapped_names_is_refused_before_anything_moves(bucket, shm_dir):
    url, opts, fs = bucket

    def swap(doc):
        t = doc["tensors"]
        t["layer0.weight"], t["layer1.weight"] = t["layer1.weight"], t["layer0.weight"]

    tamper(fs, manifest_key(url, 1), swap)
    with fresh(shm_dir, url, opts) as host:
        with pytest.raises(CorruptObjectError, match=r"manifests/0+1\.json") as ei:
            host.pull(1)
        assert "version 1" in str(ei.value) and "digest" in str(ei.value)
        with pytest.raises(CorruptObjectError):
            host.checkout(1)  # a checkout that pulls on demand refuses it too
        assert host.versions() == [] and objects_placed(host) == []


@pytest.mark.parametrize("objects_here", [False, True], ids=["downloaded", "already-local"])
def test_manifest_with_swapped_offsets_is_refused_and_cannot_poison_dedup(bucket, shm_dir, objects_here):
    url, opts, fs = bucket
    sd = model()

    def swap(doc):  # same digests, names, shapes: the version digest still matches
        a, b = doc["tensors"]["layer0.weight"], doc["tensors"]["layer1.weight"]
        assert a["object"] == b["object"]
        a["offset"], b["offset"] = b["offset"], a["offset"]

    tamper(fs, manifest_key(url, 1), swap)
    with fresh(shm_dir, url, opts) as host:
        if objects_here:  # the same weights committed here first: the pull downloads nothing
            host.commit(0, sd).result(60)
        with pytest.raises(CorruptObjectError, match=r"tensor 'layer[01]\.weight'.*tampered manifest"):
            host.pull(1)
        assert [v.step for v in host.versions()] == ([0] if objects_here else [])
        # the pulled index was never registered: a later commit of the same weights stores true bytes
        host.commit(2, sd).result(60)
        assert_checkout_equal(host, 2, sd)
        assert host.verify(2)["ok"]


def test_manifest_entry_naming_a_path_is_refused(bucket, shm_dir):
    url, opts, fs = bucket
    good = json.loads(fs.cat_file(manifest_key(url, 1)))
    bad = json.loads(json.dumps(good))
    bad["tensors"]["layer0.weight"]["object"] = "../../../../etc/passwd"
    with pytest.raises(CorruptObjectError, match="64 lowercase hex"):
        Manifest.from_json(bad)  # refused when parsed: checkout could never map an outside file
    fs.pipe_file(manifest_key(url, 1), json.dumps(bad).encode())
    with fresh(shm_dir, url, opts) as host:
        with pytest.raises(CorruptObjectError, match="64 lowercase hex"):
            host.pull(1)
        assert host.versions() == []


# -- version records in the bucket ----------------------------------------------------------------
@pytest.mark.parametrize("lie, says", [
    ("step", r"versions/0+7\.json holds the record of step 1, not 7"),
    ("digest", r"manifests/0+1\.json\) hashes to \w+…, but the version's digest is abab"),
    ("size", r"is \d+ bytes; its record says \d+"),
    ("object-path", r"versions/0+1\.json is malformed: .*64 lowercase hex digits, got '\.\./\.\./evil'"),
], ids=["step", "digest", "size", "object-path"])
def test_record_that_lies_is_refused(bucket, shm_dir, lie, says):
    url, opts, fs = bucket
    step = 1
    if lie == "step":  # the record (and manifest) of step 1 copied to the key of step 7
        step = 7
        fs.pipe_file(record_key(url, 7), fs.cat_file(record_key(url, 1)))
        fs.pipe_file(manifest_key(url, 7), fs.cat_file(manifest_key(url, 1)))
    elif lie == "digest":
        tamper(fs, record_key(url, 1), lambda r: r["version"].__setitem__("digest", "ab" * 32))
    elif lie == "size":
        tamper(fs, record_key(url, 1), lambda r: r.__setitem__("objects", {o: n + 64 for o, n in r["objects"].items()}))
    else:
        tamper(fs, record_key(url, 1), lambda r: r.__setitem__("objects", {"../../evil": 10, **r["objects"]}))
    with fresh(shm_dir, url, opts) as host:
        with pytest.raises(CorruptObjectError, match=says):
            host.pull(step)
        assert host.versions() == [] and objects_placed(host) == []


# -- size limits ------------------------------------------------------------------------------------
def test_oversized_manifest_and_record_are_refused_unread(bucket, shm_dir, monkeypatch):
    url, opts, fs = bucket
    doc = json.loads(fs.cat_file(manifest_key(url, 1)))
    entry = doc["tensors"]["layer0.weight"]
    doc["tensors"].update({f"junk{i}": entry for i in range(20_000)})  # ~4 MiB of JSON
    fs.pipe_file(manifest_key(url, 1), json.dumps(doc).encode())
    monkeypatch.setattr(paramstore.remote, "MAX_MANIFEST_BYTES", 1 << 20)
    reads: list[str] = []
    original = s3fs.S3FileSystem._cat_file

    async def spy(self, path, *args, **kwargs):
        reads.append(path)
        return await original(self, path, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", spy)
    with fresh(shm_dir, url, opts) as host:
        with pytest.raises(CorruptObjectError, match=r"manifests/0+1\.json is \d+ bytes, over the limit of 1048576"):
            host.pull(1)
        assert not [p for p in reads if "/manifests/" in p]  # refused on its size alone
        assert host.versions() == []

    monkeypatch.setattr(paramstore.remote, "MAX_RECORD_BYTES", 64)
    with pytest.raises(CorruptObjectError, match=r"versions/0+1\.json is \d+ bytes, over the limit of 64"):
        paramstore.remote.Remote(url, opts).get_version(1)


# -- a shared Redis registry ------------------------------------------------------------------------
@pytest.fixture
def shared(redis_url, shm_dir):
    """(store on a Redis registry holding version 1 of ``model()``, a raw client of that Redis)."""
    store = ParamStore(os.path.join(shm_dir, "store"), registry=redis_url, name=f"hostile-{os.getpid()}-{time.time()}",
                       create=True)
    store.commit(1, model()).result(60)
    try:
        yield store, redis.Redis.from_url(redis_url, decode_responses=True)
    finally:
        store.close()


def test_redis_objects_entry_naming_a_path_never_reaches_the_filesystem(shared, shm_dir):
    store, r = shared
    digest = "../canary"
    path = os.path.normpath(os.path.join(store.root, "objects", digest[:2], digest + ".safetensors"))
    assert os.path.dirname(path) == shm_dir  # where the sweep would have unlinked, outside the root
    with open(path, "w") as f:
        f.write("not yours")
    r.hset(store._root.registry._k["objects"], digest, json.dumps({"size": 9, "tensors": []}))
    with pytest.raises(CorruptObjectError, match=r"objects field '\.\./canary'"):
        store.gc()
    assert open(path).read() == "not yours"


def test_redis_manifest_that_does_not_match_its_version_is_refused(shared):
    store, r = shared
    key, field = store._root.registry._k["manifests"], f"{1:020d}"
    doc = json.loads(r.hget(key, field))
    t = doc["tensors"]
    t["layer0.weight"], t["layer1.weight"] = t["layer1.weight"], t["layer0.weight"]
    r.hset(key, field, json.dumps(doc))
    with pytest.raises(CorruptObjectError, match="version 1"):
        store.checkout(1)
    t["layer0.weight"]["object"] = "../" + t["layer0.weight"]["object"][3:]
    r.hset(key, field, json.dumps(doc))
    with pytest.raises(CorruptObjectError, match="64 lowercase hex"):
        store.checkout(1)


def test_redis_index_entry_naming_a_path_is_refused(shared):
    store, r = shared
    digest = store.manifest(1).tensors["layer0.weight"].digest
    r.hset(store._root.registry._k["tensors"], digest, json.dumps(["../../../../etc/passwd", 64, 16384]))
    with pytest.raises(CorruptObjectError, match="tensors field"):
        store._root.registry.locate_tensors([digest])
