"""The remote tier against a real S3 API (moto's server over HTTP on 127.0.0.1) and a shared
filesystem: write-through, restore on a fresh root, dedup, faults, per-tier retention, remote GC."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import boto3
import pytest
import torch

from helpers import assert_checkout_equal, random_tensor, tree
from paramstore import ParamStore
from paramstore.errors import (
    CorruptObjectError,
    InvalidArgumentError,
    RemoteError,
    StepOrderError,
    VersionNotFoundError,
    WaitTimeoutError,
)
from paramstore.maintenance import gc_remote, prune_remote
from paramstore.remote import Remote
from paramstore.retention import AnyOf
from paramstore.retention import KeepEvery, KeepLast

TENSOR_SHAPE = (256, 256)  # 256 KiB in float32


def model(seed: int, n: int = 10) -> dict[str, torch.Tensor]:
    sd = {f"layer{i}.weight": random_tensor(torch.float32, TENSOR_SHAPE, seed * 100 + i) for i in range(n)}
    sd["norm.bias"] = random_tensor(torch.bfloat16, (256,), seed)
    sd["step"] = torch.tensor(seed, dtype=torch.int64)
    return sd


def changed(sd: dict[str, torch.Tensor], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    out = dict(sd)
    for n in names:
        out[n] = random_tensor(out[n].dtype, tuple(out[n].shape), 10_000 + seed)
    return out


def bucket_of(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


def objects_under(server, url: str) -> dict[str, int]:
    return {k: n for k, n in server.keys(bucket_of(url)).items() if "/objects/" in k}


def records_under(server, url: str) -> list[str]:
    return sorted(k for k in server.keys(bucket_of(url)) if "/versions/" in k)


# -- round trip ---------------------------------------------------------------------------------
def test_write_through_and_restore_on_a_fresh_root(s3_remote, shm_dir):
    url, opts = s3_remote
    models = {1: model(1), 2: changed(model(1), ["layer3.weight"], 2), 5: model(5)}
    with ParamStore(os.path.join(shm_dir, "a"), remote=url, storage_options=opts, shard_size_bytes=1 << 20) as a:
        for step, sd in models.items():
            handle = a.commit(step, sd, tags=["best"] if step == 2 else [], metrics={"reward": step / 10})
            assert handle.persisted.result(60).step == step
        assert sorted(a.persisted()) == [1, 2, 5]
        digests = {v.step: v.digest for v in a.versions()}

    with ParamStore(os.path.join(shm_dir, "b"), remote=url, storage_options=opts) as b:
        assert b.versions() == []
        assert [v.step for v in b.remote_versions()] == [1, 2, 5]
        with b.checkout("latest") as snap:  # empty local store: the remote's latest
            assert snap.step == 5
        with b.checkout("best") as snap:  # a tag known only to the remote
            assert snap.step == 2
        for step, sd in models.items():
            assert_checkout_equal(b, step, sd)
        assert {v.step: v.digest for v in b.versions()} == digests
        assert b.get(2).metrics == {"reward": 0.2}
        assert sorted(b.persisted()) == [1, 2, 5]
        from paramstore.ops import verify
        assert verify(b._root, show_progress=False)["ok"]
        with pytest.raises(VersionNotFoundError):
            b.checkout(3)


def test_shared_filesystem_remote(shm_dir, tmp_path):
    url = f"file://{tmp_path}/remote"
    sd = model(3)
    with ParamStore(os.path.join(shm_dir, "a"), remote=url) as a:
        a.commit(7, sd).persisted.result(30)
    assert not [p for p in tree(str(tmp_path)) if ".tmp-" in p]  # written under temporary names, renamed
    with ParamStore(os.path.join(shm_dir, "b"), remote=url) as b:
        assert_checkout_equal(b, 7, sd)
    r = Remote(url)
    with pytest.raises(FileExistsError):  # create-only, as the version records need
        r.tier.put_record(f"versions/{7:020d}.json", b"{}", create=True)


def test_a_host_that_pulls_versions_keeps_to_its_retention(shm_dir, tmp_path):
    """``retention=`` on a host that only reads: each checkout or prefetch that pulled a version
    from the remote runs prune + gc there, as a commit does on the trainer; a leased version stays."""
    url = f"file://{tmp_path}/remote"
    with ParamStore(os.path.join(shm_dir, "a"), remote=url) as a:
        for step in range(1, 6):
            a.commit(step, model(step)).persisted.result(30)
    with ParamStore(os.path.join(shm_dir, "b"), remote=url, retention=KeepLast(2)) as b:
        held = b.checkout(1)  # leased until closed
        for step in (2, 3, 4):
            assert b.prefetch(step).result(30).step == step
        with b.checkout(5) as snap:
            assert snap.fetch.from_remote
        assert b._write.maintainer.wait_idle(30)
        reg = b._root.registry
        assert [v.step for v in reg.versions()] == [1, 4, 5]
        referenced = {o for v in (1, 4, 5) for o in reg.get_manifest(v).objects()}
        assert set(b._root.tier.list()) == referenced
        assert torch.equal(held["layer0.weight"].view(torch.int32), model(1)["layer0.weight"].view(torch.int32))
        held.close()


# -- dedup ---------------------------------------------------------------------------------------
def test_unchanged_push_uploads_no_object_and_changes_upload_only_themselves(s3_server, s3_remote, shm_dir):
    url, opts = s3_remote
    sd = model(1)
    with ParamStore(os.path.join(shm_dir, "a"), remote=url, storage_options=opts, shard_size_bytes=1 << 20) as a:
        a.commit(1, sd).persisted.result(60)
        before = objects_under(s3_server, url)
        a.commit(2, sd).persisted.result(60)  # unchanged
        assert objects_under(s3_server, url) == before
        names = ["layer4.weight"]  # 1 of 12 tensors, ~10% of the bytes
        a.commit(3, changed(sd, names, 3)).persisted.result(60)
        after = objects_under(s3_server, url)
    new = {k: n for k, n in after.items() if k not in before}
    changed_bytes = sum(sd[n].numel() * sd[n].element_size() for n in names)
    assert len(new) == 1
    assert changed_bytes <= sum(new.values()) <= 1.1 * changed_bytes
    assert len(records_under(s3_server, url)) == 3


def test_stores_sharing_a_bucket_share_objects(s3_server, s3_remote, shm_dir):
    url, opts = s3_remote
    sd = model(2)
    with ParamStore(os.path.join(shm_dir, "a"), remote=url, storage_options=opts) as a:
        a.commit(1, sd).persisted.result(60)
    before = objects_under(s3_server, url)
    with ParamStore(os.path.join(shm_dir, "b"), remote=url, storage_options=opts) as b:
        assert b.commit(1, sd).persisted.result(60).step == 1  # the same version: nothing to do
        report = b.push(1)
        assert (report.objects, report.bytes) == (0, 0)
        assert b.commit(2, sd).persisted.result(60)
        other = b.commit(3, model(9))
        other.persisted.result(60)
    assert objects_under(s3_server, url).keys() - before.keys()  # model(9) was new
    with ParamStore(os.path.join(shm_dir, "c"), remote=url, storage_options=opts) as c:
        # another store's different step 3 is refused, not overwritten
        with pytest.raises(StepOrderError):
            c.commit(3, model(4)).persisted.result(60)
    with ParamStore(os.path.join(shm_dir, "d"), remote=url, storage_options=opts) as d:
        assert_checkout_equal(d, 3, model(9))


# -- bad input -----------------------------------------------------------------------------------
def test_bad_remotes_fail_at_open_and_leave_the_local_store_alone(s3_server, shm_dir):
    root = os.path.join(shm_dir, "a")
    with ParamStore(root) as s:
        s.commit(1, model(1)).result()
    with pytest.raises(RemoteError, match="bucket") as info:
        ParamStore(root, remote="s3://no-such-bucket/x", storage_options=s3_server.options())
    assert not info.value.transient
    with pytest.raises(RemoteError, match="nope"):
        ParamStore(root, remote="nope://x/y")
    with pytest.raises(InvalidArgumentError):
        ParamStore(root, remote="just-a-bucket")
    with pytest.raises(InvalidArgumentError, match="remote"):
        ParamStore(root, retention={"remote": KeepLast(1)})
    with ParamStore(root) as s:  # untouched, and not left locked
        assert [v.step for v in s.versions()] == [1]
        s.commit(2, model(2)).result()
        with pytest.raises(InvalidArgumentError, match="no remote"):
            s.push(2)


def test_access_denied_is_a_clear_error(shm_dir):
    # A separate moto server that checks credentials (after the first action, which creates the bucket).
    script = textwrap.dedent("""
        import sys, time, logging
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        from moto.server import ThreadedMotoServer
        s = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        s.start()
        print(s.get_host_and_port()[1], flush=True)
        time.sleep(60)
    """)
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="1")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        endpoint = f"http://127.0.0.1:{proc.stdout.readline().strip()}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="locked")
        opts = {"endpoint_url": endpoint, "key": "AKIAWRONG", "secret": "wrong"}
        with pytest.raises(RemoteError) as info:
            ParamStore(os.path.join(shm_dir, "a"), remote="s3://locked/x", storage_options=opts)
        assert not info.value.transient
        assert "denied" in str(info.value).lower() or "access" in str(info.value).lower()
    finally:
        proc.kill()
        proc.wait()


# -- faults ---------------------------------------------------------------------------------------
def test_endpoint_down_mid_upload_is_retried_and_never_half_visible(s3_server, s3_remote, shm_dir):
    url, opts = s3_remote
    big = {f"w{i}": random_tensor(torch.float32, (1024, 1024), i) for i in range(12)}  # 48 MiB, 12 objects
    with ParamStore(os.path.join(shm_dir, "a"), remote=url, storage_options=opts, shard_size_bytes=4 << 20) as a:
        a.commit(1, model(1)).persisted.result(60)
        handle = a.commit(2, big)
        handle.result(30)
        deadline = time.monotonic() + 30
        while len(objects_under(s3_server, url)) < 2 + 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # wait until the upload of step 2 is under way
        with pytest.warns(RuntimeWarning, match="retrying"):  # reported, and retried
            s3_server.stop()
            try:
                time.sleep(1.5)
                assert not handle.persisted.done()
                assert 2 not in a.persisted()
                assert_checkout_equal(a, 2, big)  # usable locally meanwhile
            finally:
                s3_server.start()
            assert handle.persisted.result(60).step == 2
        assert 2 in a.persisted()
    with ParamStore(os.path.join(shm_dir, "b"), remote=url, storage_options=opts) as b:
        assert_checkout_equal(b, 2, big)


def test_killed_pusher_leaves_no_partial_version(s3_server, s3_remote, shm_dir):
    url, opts = s3_remote
    root = os.path.join(shm_dir, "a")
    script = textwrap.dedent(f"""
        import json, sys, time, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_remote import big_model
        from paramstore import ParamStore
        s = ParamStore({root!r}, remote={url!r}, storage_options=json.loads({json.dumps(json.dumps(opts))}),
                       shard_size_bytes=4 << 20)
        s.commit(1, big_model()).result()
        print("committed", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "committed"
        deadline = time.monotonic() + 60
        while not objects_under(s3_server, url) and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert records_under(s3_server, url) == []  # objects maybe, but no version
    assert len(objects_under(s3_server, url)) < 12
    with ParamStore(root, remote=url, storage_options=opts) as a:
        assert 1 not in a.persisted()
        report = a.push(1)  # resumes: what is already there is not sent again
        assert report.skipped >= 1 and report.objects >= 1
    with ParamStore(os.path.join(shm_dir, "b"), remote=url, storage_options=opts) as b:
        assert_checkout_equal(b, 1, big_model())


def big_model() -> dict[str, torch.Tensor]:
    return {f"w{i}": random_tensor(torch.float32, (1024, 1024), i) for i in range(12)}


@pytest.mark.parametrize("damage", ["flip", "garbage"])
def test_corrupt_remote_object_is_never_delivered(s3_server, s3_remote, shm_dir, damage):
    url, opts = s3_remote
    sd = model(4)
    with ParamStore(os.path.join(shm_dir, "a"), remote=url, storage_options=opts) as a:
        a.commit(1, sd).persisted.result(60)
    s3 = s3_server.client()
    key = next(iter(objects_under(s3_server, url)))
    body = bytearray(s3.get_object(Bucket=bucket_of(url), Key=key)["Body"].read())
    if damage == "flip":
        body[-100] ^= 0x01  # one bit of tensor data; the header still parses
    else:
        body = bytearray(b"not an object")
    s3.put_object(Bucket=bucket_of(url), Key=key, Body=bytes(body))
    root_b = os.path.join(shm_dir, "b")
    with ParamStore(root_b, remote=url, storage_options=opts) as b:
        with pytest.raises(CorruptObjectError):
            b.checkout(1)
        assert b.versions() == []
    assert not [p for p in tree(root_b) if p.startswith(("objects/", "tmp/"))]  # nothing placed


# -- locks and remote GC ----------------------------------------------------------------------------
def test_gc_waits_for_pushes_and_pushes_wait_for_gc(s3_remote):
    url, opts = s3_remote
    r = Remote(url, opts, grace=0)
    r.create()  # a remote exists only once written (GC of a URL that holds none is refused)
    with r.shared_lock("push"):
        t0 = time.monotonic()
        with pytest.raises(WaitTimeoutError):
            gc_remote(r, timeout=0.5)
        assert time.monotonic() - t0 >= 0.5
    assert "exclusive.json" not in r.tier.records("locks")  # withdrawn on timeout
    held = threading.Event()

    def gc_holding() -> None:
        with r.exclusive_lock(timeout=5):
            held.set()
            time.sleep(1.0)

    t = threading.Thread(target=gc_holding)
    t.start()
    held.wait(5)
    t0 = time.monotonic()
    with r.shared_lock("push"):
        waited = time.monotonic() - t0
    t.join()
    assert waited >= 0.5
    assert r.tier.records("locks") == {}


def test_stale_locks_are_ignored_and_cleaned(s3_remote):
    url, opts = s3_remote
    r = Remote(url, opts, lock_ttl=0.5, grace=0)
    r.create()
    r.tier.put_record("locks/shared-dead.json", b"{}")  # a pusher that died
    time.sleep(1.2)
    report = gc_remote(r, timeout=2)
    assert "locks/shared-dead.json" in report.temporary_files
    assert r.tier.records("locks") == {}


def test_remote_gc_is_safe_with_concurrent_pushes(s3_server, s3_remote, shm_dir):
    url, opts = s3_remote
    expected: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(parity: int) -> None:
        try:
            with ParamStore(os.path.join(shm_dir, f"w{parity}"), remote=Remote(url, opts, grace=0),
                            retention=KeepLast(1)) as s:
                for i in range(6):
                    step = 2 * i + parity
                    sd = changed(model(parity), [f"layer{i}.weight", "layer9.weight"], step)
                    expected[step] = sd
                    s.commit(step, sd).persisted.result(120)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    gc_runs = []

    def collector() -> None:
        r = Remote(url, opts, grace=0)
        r.create()  # started before the first push: a GC of a URL that holds no remote is refused
        while not stop.is_set():
            try:
                prune_remote(r, KeepLast(2))
                gc_runs.append(gc_remote(r, timeout=60))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    writers = [threading.Thread(target=writer, args=(p,)) for p in (0, 1)]
    gc_thread = threading.Thread(target=collector)
    gc_thread.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    gc_thread.join()
    assert not errors, errors
    assert sum(len(g.objects) for g in gc_runs) > 0  # GC did delete while pushes ran
    r = Remote(url, opts, grace=0)
    present = set(r.tier.objects())
    steps = r.steps()
    assert steps and set(steps) <= set(expected)
    for step in steps:
        assert r.get_manifest(step).objects() <= present
    with ParamStore(os.path.join(shm_dir, "fresh"), remote=url, storage_options=opts) as fresh:
        for step in steps:
            assert_checkout_equal(fresh, step, expected[step])


def test_per_tier_retention(s3_server, s3_remote, shm_dir):
    url, opts = s3_remote
    remote = Remote(url, opts, grace=0)
    policy = {"local": KeepLast(1), "remote": AnyOf(KeepLast(2), KeepEvery(3))}
    with ParamStore(os.path.join(shm_dir, "a"), remote=remote, retention=policy, persist_backlog=8) as s:
        sd = model(1)
        for step in range(8):
            sd = changed(sd, [f"layer{step}.weight"], step)
            s.commit(step, sd)
        s.wait_persisted(timeout=120)
        s._write.maintainer.wait_idle(60)  # the last runs after the last push
        s._write.maintainer.poke_remote()
        s._write.maintainer.poke()
        s._write.maintainer.wait_idle(60)
        assert [v.step for v in s.versions()] == [7]
        assert [v.step for v in s.remote_versions()] == [0, 3, 6, 7]
        assert set(remote.tier.objects()) == remote.referenced()  # unreferenced objects collected
        assert s.prune(KeepLast(1), tier="remote", dry_run=True).removed == [0, 3, 6]
        with pytest.raises(InvalidArgumentError):
            s.gc(tier="attic")


# -- CLI ------------------------------------------------------------------------------------------
def test_cli_push_pull_ls_prune_gc(s3_server, s3_remote, shm_dir):
    url, _ = s3_remote
    env = dict(os.environ, AWS_ENDPOINT_URL=s3_server.endpoint, PARAMSTORE_REMOTE=url)

    def cli(root: str, *args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "paramstore.cli", "--root", root, *args],
                              capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc

    a, b = os.path.join(shm_dir, "a"), os.path.join(shm_dir, "b")
    with ParamStore(a) as s:  # no remote: nothing persisted yet
        for step in (1, 2, 3):  # nothing shared: pruning 1 and 2 orphans their objects
            s.commit(step, model(step)).result()
    rows = json.loads(cli(a, "ls", "--json").stdout)
    assert [r["persisted"] for r in rows] == [None, None, None]
    pushed = json.loads(cli(a, "push", "--json").stdout)
    assert [p["step"] for p in pushed] == [1, 2, 3]
    assert "yes" in cli(a, "ls").stdout
    assert cli(a, "push").stdout.strip() == "nothing to push"
    assert [r["step"] for r in json.loads(cli(a, "ls", "--tier", "remote", "--json").stdout)] == [1, 2, 3]
    ParamStore(b, create=True).close()
    pulled = json.loads(cli(b, "pull", "2", "--json").stdout)
    assert pulled["step"] == 2 and pulled["objects"] >= 1
    assert json.loads(cli(b, "verify", "--json").stdout)["ok"]
    assert json.loads(cli(b, "prune", "--tier", "remote", "--keep-last", "1", "--json").stdout)["removed"] == [1, 2]
    gc = json.loads(cli(b, "gc", "--tier", "remote", "--grace", "0", "--json").stdout)
    assert gc["objects_deleted"] >= 1
    with ParamStore(os.path.join(shm_dir, "c"), remote=url, storage_options={"endpoint_url": s3_server.endpoint}) as c:
        with c.checkout(3) as snap:
            assert snap.step == 3


# -- hosts sharing a Redis registry and a remote ---------------------------------------------------
def test_shared_registry_host_fetches_missing_bytes_from_the_remote(redis_url, s3_remote, shm_dir):
    url, opts = s3_remote
    sd = model(6)
    common = dict(remote=url, storage_options=opts, registry=redis_url, name=f"run-{os.getpid()}-{time.time()}")
    with ParamStore(os.path.join(shm_dir, "trainer"), **common) as trainer:
        trainer.commit(4, sd).persisted.result(60)
        with ParamStore(os.path.join(shm_dir, "rollout"), **common) as rollout:
            assert [v.step for v in rollout.versions()] == [4]  # registered once, for every host
            assert_checkout_equal(rollout, 4, sd)  # bytes fetched from the remote, verified
            assert rollout.latest().step == 4
