"""No silent failures for a new user (issue 24): roots and remotes that look empty, advice that
loops, and the CLI's smaller edges. Real parts only: LMDB, a real redis-server, moto's S3 server
over HTTP, the CLI as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import paramstore
from paramstore import ParamStore
from paramstore.errors import MetadataLostError, RemoteError


def cli(root: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``paramstore --root ROOT ARGS...`` as a subprocess (no check: the tests read the exit status)."""
    return subprocess.run([sys.executable, "-m", "paramstore.cli", "--root", root, *args],
                          capture_output=True, text=True, env=env)


def model(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


# -- 5. roots and remotes that look empty -----------------------------------------------------------
def test_cache_root_of_a_shared_registry_store_names_its_registry(redis_url, store_root):
    with ParamStore(store_root, registry=redis_url, name="cache-a") as s:
        s.commit(1, model(1)).result()
    proc = cli(store_root, "ls")  # no --registry: the LMDB registry here is empty
    assert proc.returncode == 2, proc.stdout
    address = redis_url.rsplit("@", 1)[1]  # 127.0.0.1:PORT/0
    assert address in proc.stderr and "--name cache-a" in proc.stderr
    assert f"paramstore --root {store_root} --registry redis://" in proc.stderr
    assert "test-secret" not in proc.stderr  # the password is never written to the marker or shown
    # with the registry named, it lists the version
    ok = cli(store_root, "--registry", redis_url, "--name", "cache-a", "ls", "--json")
    assert ok.returncode == 0, ok.stderr
    assert [r["step"] for r in json.loads(ok.stdout)] == [1]


def test_a_single_host_store_never_joins_a_shared_registry(redis_url, store_root):
    with ParamStore(store_root) as s:
        s.commit(1, model(1)).result(timeout=60)
    with pytest.raises(paramstore.InvalidArgumentError, match="single-host store .* cannot join a shared registry"):
        ParamStore(store_root, registry=redis_url, name="joined").versions()
    proc = cli(store_root, "--registry", redis_url, "--name", "joined", "ls")
    assert proc.returncode != 0 and "cannot join a shared registry" in proc.stderr
    with ParamStore(store_root) as s:  # its versions are still its own
        assert [v.step for v in s.versions()] == [1]


def test_a_mistyped_store_name_lists_the_stores_there(redis_url, store_root):
    with ParamStore(store_root, registry=redis_url, name="typo-real") as s:
        s.commit(1, model(1)).result()
    proc = cli(store_root, "--registry", redis_url, "--name", "typo-rael", "ls")
    assert proc.returncode == 2
    assert "no store named 'typo-rael'" in proc.stderr and "typo-real" in proc.stderr
    assert "flushed" not in proc.stderr  # not a hint at data loss


def test_ls_of_a_mistyped_file_remote_creates_nothing(store_root, tmp_path):
    ParamStore(store_root, create=True).close()
    typo = tmp_path / "remote-typo"
    for args in (["ls", "--tier", "remote"], ["pull", "1"], ["gc", "--tier", "remote"]):
        proc = cli(store_root, "--remote", f"file://{typo}", *args)
        assert proc.returncode == 2, (args, proc.stdout)
        assert "paramstore-remote.json" in proc.stderr and "no paramstore remote" in proc.stderr, proc.stderr
        assert not typo.exists(), args


def test_reading_a_mistyped_s3_prefix_creates_nothing_and_a_missing_bucket_says_so(s3_server, store_root):
    ParamStore(store_root, create=True).close()
    env = dict(os.environ, AWS_ENDPOINT_URL=s3_server.endpoint)
    bucket = s3_server.new_bucket()
    proc = cli(store_root, "--remote", f"s3://{bucket}/typo", "ls", "--tier", "remote", env=env)
    assert proc.returncode == 2 and "no paramstore remote" in proc.stderr, proc.stderr
    assert s3_server.keys(bucket) == {}  # no paramstore-remote.json written by a read
    proc = cli(store_root, "--remote", "s3://no-such-bucket-paramstore/x", "ls", "--tier", "remote", env=env)
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr


def test_only_a_write_creates_the_remote(s3_server, s3_remote, store_root):
    url, options = s3_remote
    bucket = url.split("/")[2]
    with ParamStore(store_root, remote=url, storage_options=options) as s:
        assert s3_server.keys(bucket) == {}  # opening it is not a write
        with pytest.raises(RemoteError, match="no paramstore remote"):
            s.remote_versions()
        s.commit(1, model(1)).persisted.result()  # the first commit with remote= creates it
        assert "store/paramstore-remote.json" in s3_server.keys(bucket)
        assert [v.step for v in s.remote_versions()] == [1]


def test_a_bucket_deleted_after_use_is_not_an_empty_remote(s3_server, s3_remote, store_root):
    url, options = s3_remote
    bucket = url.split("/")[2]
    with ParamStore(store_root, remote=url, storage_options=options) as s:
        s.commit(1, model(1)).persisted.result()
        client = s3_server.client()
        for key in s3_server.keys(bucket):
            client.delete_object(Bucket=bucket, Key=key)
        client.delete_bucket(Bucket=bucket)
        with pytest.raises(RemoteError, match="does not exist"):
            s.remote_versions()
    env = dict(os.environ, AWS_ENDPOINT_URL=s3_server.endpoint)
    proc = cli(store_root, "--remote", url, "ls", "--tier", "remote", env=env)
    assert proc.returncode == 2 and f"bucket {bucket} does not exist" in proc.stderr, proc.stderr


# -- 6. advice that loops or cannot work ------------------------------------------------------------
def test_verify_after_a_repair_without_a_remote_does_not_advise_repair_again(store_root):
    with ParamStore(store_root) as s:
        s.commit(1, model(1)).result()
        s.commit(2, model(2)).result()
        digest = next(iter(s.manifest(1).objects()))
    path = os.path.join(store_root, "objects", digest[:2], f"{digest}.safetensors")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 10)
        f.write(b"\xff" * 4)
    assert cli(store_root, "verify", "--repair").returncode == 1
    proc = cli(store_root, "verify")
    assert proc.returncode == 1
    assert "run `paramstore verify --repair`" not in proc.stdout, proc.stdout  # it would loop: no new source
    assert "quarantined" in proc.stdout and "paramstore rm 1" in proc.stdout
    assert f"paramstore --root {store_root} --remote URL verify --repair" in proc.stdout


def test_metadata_lost_advice_names_the_remote_option(store_root):
    with ParamStore(store_root) as s:
        s.commit(1, model(1)).result()
    os.unlink(os.path.join(store_root, "meta", "data.mdb"))
    with pytest.raises(MetadataLostError, match=r"--remote URL pull"):
        ParamStore(store_root).versions()
    proc = cli(store_root, "ls")
    assert proc.returncode == 2 and f"paramstore --root {store_root} --remote URL pull" in proc.stderr


def test_verify_counts_patch_objects_not_as_unreferenced(store_root):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64 * 1024, generator=g).to(torch.bfloat16)
    with ParamStore(store_root, patches=True) as s:
        s.commit(1, {"w": w})
        w2 = w.clone()
        w2[:10] += 1
        s.commit(2, {"w": w2})
        s.flush()
        patches = {p for pairs in s._root.registry.patches().values() for p in pairs.values()}
        assert patches, "no patch was made"
        r = s.verify()
    assert r["orphans"] == [] and r["patch_objects"] == len(patches)
    proc = cli(store_root, "verify")
    assert proc.returncode == 0 and "0 unreferenced objects" in proc.stdout and "1 patch object" in proc.stdout


# -- 7. the CLI's smaller edges ----------------------------------------------------------------------
def test_no_tmpfs_warning_for_a_path_that_is_no_store(shm_dir):
    proc = cli("/proc", "ls")
    assert proc.returncode == 2 and "tmpfs" not in proc.stderr, proc.stderr
    proc = cli("/nonexistent/paramstore", "ls")
    assert proc.returncode == 2 and "tmpfs" not in proc.stderr, proc.stderr


def test_no_store_error_gives_shell_advice(shm_dir):
    proc = cli(os.path.join(shm_dir, "typo"), "ls")
    assert proc.returncode == 2
    assert "ParamStore(" not in proc.stderr and "create=True" not in proc.stderr and "min_step" not in proc.stderr
    assert "--root" in proc.stderr


def test_counts_are_plural_correct(store_root):
    with ParamStore(store_root) as s:
        s.commit(1, {"w": torch.ones(4)}).result()
    out = cli(store_root, "du").stdout
    assert out.startswith("1 version, 1 object\n"), out
    out = cli(store_root, "verify").stdout
    assert out.startswith("checked 1 version, 1 object,"), out


def test_show_counts_tensors_as_ls_does(store_root):
    t = torch.ones(8)
    with ParamStore(store_root) as s:
        s.commit(1, {"a": t, "tied": t, "b": torch.zeros(4)}).result()
        assert s.get(1).num_tensors == 3
    out = cli(store_root, "show", "1").stdout
    assert "in 3 tensors (1 alias)," in out, out


def test_tag_refuses_to_move_without_force(store_root):
    with ParamStore(store_root) as s:
        s.commit(1, model(1), tags=["best"]).result()
        s.commit(2, model(2)).result()
    proc = cli(store_root, "tag", "2", "best")
    assert proc.returncode == 2 and "already points at step 1" in proc.stderr and "--force" in proc.stderr
    assert cli(store_root, "show", "best", "--json").stdout.count('"step": 1') >= 1
    proc = cli(store_root, "tag", "2", "best", "--force")
    assert proc.returncode == 0 and "moved from step 1" in proc.stdout, proc.stderr
    assert cli(store_root, "tag", "2", "best").returncode == 0  # already there: nothing moves


def test_show_of_a_missing_step_names_the_steps_there(store_root):
    with ParamStore(store_root) as s:
        for step in (3, 5, 9):
            s.commit(step, model(step)).result()
    proc = cli(store_root, "show", "99")
    assert proc.returncode == 2 and "3, 5, 9" in proc.stderr, proc.stderr


def test_every_argument_has_help():
    from paramstore.cli import _parser

    p = _parser()
    sub = next(a for a in p._actions if a.choices and isinstance(a.choices, dict))
    missing = [f"{name} {a.dest}" for name, sp in sub.choices.items() for a in sp._actions
               if a.help is None]
    assert missing == []


def test_a_remote_is_listed_and_pulled_from_a_new_root(store_root, shm_dir, tmp_path):
    url = f"file://{tmp_path}/remote"
    with ParamStore(store_root, remote=url) as s:
        s.commit(1, model(1)).persisted.result(30)
    fresh = os.path.join(shm_dir, "restored")
    proc = cli(fresh, "--remote", url, "ls", "--tier", "remote", "--json")
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in json.loads(proc.stdout)] == [1] and not os.path.exists(fresh)  # a read: nothing made
    proc = cli(fresh, "--remote", url, "pull", "1")  # the restore the lost-metadata advice names
    assert proc.returncode == 0 and "pulled step 1: " in proc.stdout, proc.stderr
    assert cli(fresh, "verify").returncode == 0


def test_timeouts_are_written_round(store_root):
    from paramstore.errors import WaitTimeoutError

    with ParamStore(store_root) as s:
        s.commit(1, model(1)).result()
        with pytest.raises(WaitTimeoutError, match=r"within 0\.2 s \(latest: 1\)"):
            s.wait_for(5, timeout=0.2000000001)
