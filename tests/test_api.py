"""The public API's conventions: names, keyword-only timeouts, inclusive bounds, exported errors,
one name per concept (no deprecated aliases), the inspection calls (verify/du/diff/export/manifest),
fetch reports and errors that say what to do."""

from __future__ import annotations

import os
import shutil
import threading
import warnings

import pytest
import torch

import paramstore
from helpers import SHM, assert_state_equal
from paramstore import (
    InvalidArgumentError,
    ParamStore,
    ParamStoreError,
    ParamStoreWarning,
    VersionNotFoundError,
    WaitTimeoutError,
)
from paramstore.errors import ObjectUnavailableError


def sd(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(32, generator=g),
            "c": torch.arange(10, dtype=torch.int64) + seed}


@pytest.fixture
def three(store):
    """A store with steps 1, 2, 3 committed (each tensor different per step)."""
    for s in (1, 2, 3):
        store.commit(s, sd(s)).result()
    return store


def test_the_error_roots_and_the_common_errors_are_exported():
    for name in ("NotFoundError", "ConflictError", "CorruptionError", "UnavailableError", "InvalidArgumentError",
                 "StorageError", "CorruptObjectError", "WaitTimeoutError", "VersionNotFoundError", "StepOrderError"):
        cls = getattr(paramstore, name)
        assert issubclass(cls, ParamStoreError), name
        assert name in paramstore.__all__
        assert cls is getattr(paramstore.errors, name)
    for name in ("RemoteError", "RegistryError", "TransferError", "ObjectUnavailableError"):  # in paramstore.errors
        assert name not in paramstore.__all__ and issubclass(getattr(paramstore.errors, name), paramstore.UnavailableError)
    assert issubclass(ObjectUnavailableError, FileNotFoundError)


def test_storage_options(shm_dir, tmp_path):
    url = f"file://{tmp_path}/bucket"
    with ParamStore(os.path.join(shm_dir, "a"), remote=url, storage_options={"auto_mkdir": True}) as store:
        store.commit(1, sd(1)).persisted.result(30)
        assert [v.step for v in store.remote_versions()] == [1]
    with pytest.raises(InvalidArgumentError, match="unknown store option 'remote_options'"):
        ParamStore(os.path.join(shm_dir, "b"), remote=url, remote_options={})  # one name: storage_options


def test_timeouts_are_keyword_only(three):
    with pytest.raises(WaitTimeoutError):
        three.wait_for(10, timeout=0.05)
    for call in (lambda: three.flush(5.0), lambda: three.wait_for(10, 0.05), lambda: three.wait_for_readers(0, 0.05),
                 lambda: three.wait_staged(1.0), lambda: three.wait_persisted(1.0)):
        with pytest.raises(TypeError):
            call()
    assert three.flush(timeout=5.0).step == 3
    assert three.wait_for(2, timeout=1).step == 3


def test_subscribe_min_step_is_inclusive_like_checkout_and_wait_for(three):
    assert [v.step for v in three.subscribe(min_step=2, timeout=0.05)] == [2, 3]
    assert [v.step for v in three.subscribe(min_step=0, timeout=0.05)] == [1, 2, 3]
    assert [v.step for v in three.subscribe(timeout=0.05)] == []  # default: only what comes next
    with pytest.raises(TypeError):
        three.subscribe(2)  # min_step= only
    with three.checkout(min_step=2) as snap:
        assert snap.step == 3
    with pytest.raises(InvalidArgumentError):
        three.subscribe(min_step="2")


def test_retention_composes_with_any_of_only():
    from paramstore import retention

    assert not hasattr(retention, "Any")  # one name: AnyOf (Any shadowed typing.Any)
    assert str(retention.KeepLast(1) | retention.KeepEvery(10)) == "keep the last 1; keep every 10th step"


def test_a_step_given_as_a_string_that_does_not_exist_fails_at_once(three):
    three.prune(paramstore.retention.KeepLast(1))  # steps 1 and 2 are gone
    errors: list[BaseException] = []

    def call() -> None:
        for spec in ("7", "1"):
            try:
                three.checkout(spec)
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "checkout of a missing step given as a string did not return"
    assert [type(e) for e in errors] == [VersionNotFoundError, VersionNotFoundError]
    with pytest.raises(InvalidArgumentError, match="not a step"):
        three.checkout("--5")
    with three.checkout("3") as snap:
        assert snap.step == 3


def test_inspection_is_public_api(three, tmp_path):
    assert three.verify()["ok"] and three.verify(2)["versions_checked"] == 1
    du = three.du()
    assert du["versions"] == 3 and du["stored_bytes"] > 0
    d = three.diff(1, "latest")
    assert {c["name"] for c in d["changed"]} == {"a.weight", "b.bias", "c"}
    assert three.diff(2, 2)["changed"] == []
    man = three.manifest(2)
    assert sorted(man.names()) == sorted(sd(2))
    out = three.export(3, tmp_path / "hf", weights_only=True)
    from safetensors.torch import load_file

    got = {}
    for f in out["files"]:
        if f.endswith(".safetensors"):
            got.update(load_file(os.path.join(out["directory"], f)))
    assert_state_equal(got, sd(3))


def test_fetch_report_is_returned_with_the_snapshot(three):
    with three.checkout("latest") as snap:
        report = snap.fetch
        assert report.step == 3 and report.local == len(snap.manifest.objects()) and not report.moved
        assert report.bytes == 0
    assert not hasattr(three, "last_fetch")  # one place: snap.fetch


def test_a_missing_object_says_what_to_do(three):
    obj = three.manifest(2).entry("a.weight").object
    os.unlink(three._root.tier.object_path(obj))
    with pytest.raises(ObjectUnavailableError, match=r"paramstore --root \S+ verify"):
        three.checkout(2)
    assert three.leases() == []  # the lease taken for it was released


def test_a_version_no_host_serves_says_to_start_a_server(redis_url, shm_dir):
    name = f"api-{os.getpid()}"
    with ParamStore(os.path.join(shm_dir, "h1"), registry=redis_url, name=name) as trainer:
        trainer.commit(1, sd(1)).result()
        with ParamStore(os.path.join(shm_dir, "h2"), registry=redis_url, name=name) as rollout:
            with pytest.raises(ObjectUnavailableError, match="paramstore serve"):
                rollout.checkout(1)
            assert rollout.leases() == []


def test_a_root_on_a_disk_filesystem_warns_once(tmp_path):
    disk = os.path.join(os.path.dirname(os.path.abspath(__file__)), f".tmp-root-{os.getpid()}")
    from paramstore.opening import _fstype

    if _fstype(os.path.dirname(disk)) in ("tmpfs", "ramfs", None):
        pytest.skip("the checkout is itself on a memory filesystem here")
    try:
        with pytest.warns(ParamStoreWarning, match="not tmpfs"):
            ParamStore(disk, create=True).close()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ParamStoreWarning)
            ParamStore(disk, create=True).close()  # once per root
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParamStoreWarning)
        ParamStore(os.path.join(SHM, f"ps-api-{os.getpid()}")).close()
    shutil.rmtree(os.path.join(SHM, f"ps-api-{os.getpid()}"), ignore_errors=True)


# -- found in review -------------------------------------------------------------------------
def test_a_failed_peer_fetch_falls_back_to_the_remote(redis_url, shm_dir, tmp_path):
    """A host whose transfer engine cannot start still gets the version from the remote."""
    from paramstore.backends.registries.base import Peer
    from paramstore.checkout import Fetcher

    name, url = f"fallback-{os.getpid()}", f"file://{tmp_path}/bucket"
    with ParamStore(os.path.join(shm_dir, "h1"), registry=redis_url, name=name, remote=url) as trainer:
        trainer.commit(1, sd(1)).persisted.result(30)
        with ParamStore(os.path.join(shm_dir, "h2"), registry=redis_url, name=name, remote=url) as rollout:
            reg = rollout._root.registry
            reg.announce_peer(Peer("live-peer", "127.0.0.1:1", "h1", os.getpid(), 0.0))  # a peer is listed...

            def no_engine():  # ...but this host cannot start a transfer engine (e.g. no libibverbs)
                raise paramstore.errors.TransferError("cannot start the transfer engine")

            fetcher = Fetcher(rollout._root, rollout._pool, remote=rollout.remote, transport=no_engine,
                              server=lambda: None)
            report = fetcher.fetch(1, rollout.manifest(1))
            assert report.from_remote and not report.from_peers and report.bytes > 0
            with rollout.checkout(1) as snap:
                assert_state_equal(snap, sd(1))


def test_a_warning_turned_into_an_error_leaks_nothing(tmp_path):
    disk = os.path.join(os.path.dirname(os.path.abspath(__file__)), f".tmp-leak-{os.getpid()}")
    from paramstore.opening import _fstype

    if _fstype(os.path.dirname(disk)) in ("tmpfs", "ramfs", None):
        pytest.skip("the checkout is itself on a memory filesystem here")
    fds = len(os.listdir("/proc/self/fd"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ParamStoreWarning)
            with pytest.raises(ParamStoreWarning):
                ParamStore(disk)
        assert len(os.listdir("/proc/self/fd")) == fds
        assert not os.path.exists(disk), "nothing is created before the warning"
    finally:
        shutil.rmtree(disk, ignore_errors=True)


def test_export_and_diff_of_a_missing_object_say_what_to_do(three, tmp_path):
    obj = three.manifest(2).entry("a.weight").object
    os.unlink(three._root.tier.object_path(obj))
    with pytest.raises(ObjectUnavailableError, match="verify"):
        three.export(2, tmp_path / "out", weights_only=True)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ObjectUnavailableError, match="verify"):
        three.diff(2, 3)
    assert three.leases() == []


def test_export_needs_a_new_or_empty_directory(three, tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgumentError, match="not empty"):
        three.export(1, busy, weights_only=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgumentError, match="is a file"):
        three.export(1, tmp_path / "file", weights_only=True)
    with pytest.raises(InvalidArgumentError):
        three.export(1, tmp_path / "x", shard_size_bytes=1.5)
    assert three.export(1, tmp_path / "empty", weights_only=True)["step"] == 1


def test_a_remote_url_with_no_bucket_is_refused(shm_dir):
    for url in ("s3://", "s3:///", "file://"):
        with pytest.raises(InvalidArgumentError, match="names no bucket or path"):
            ParamStore(os.path.join(shm_dir, "r"), remote=url)


def test_bad_waits_and_bounds_fail_clearly(three):
    with pytest.raises(InvalidArgumentError, match="timeout"):
        three.checkout(1, timeout="x")
    with pytest.raises(InvalidArgumentError, match="timeout"):
        three.wait_for(5, timeout="1")
    with pytest.raises(InvalidArgumentError, match="min_step"):
        three.wait_for_readers("5")
    with pytest.raises(InvalidArgumentError, match="min_step"):
        three.subscribe(min_step=2**64)
    with pytest.raises(InvalidArgumentError, match="min_step"):
        three.subscribe(min_step="1")
    with pytest.raises(InvalidArgumentError, match="grace"):
        three.gc(grace=10)
    with pytest.raises(InvalidArgumentError, match="storage_options"):
        ParamStore(three.root, storage_options={"key": "x"})
    # a negative lower bound (t - eta before step eta) admits every version
    with three.checkout(min_step=-2) as snap:
        assert snap.step == 3
    assert [v.step for v in three.subscribe(min_step=-5, timeout=0.05)] == [1, 2, 3]


def test_a_subscription_dropped_unused_frees_its_watch(three):
    import gc

    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(30):
        three.subscribe(timeout=1)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds + 1


def test_a_root_that_cannot_be_created_is_the_package_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ParamStoreWarning)
        with pytest.raises(paramstore.StorageError, match="cannot create a store at /proc/"):
            ParamStore("/proc/paramstore-cannot-be-here", create=True)
        with pytest.raises(paramstore.StorageError, match="cannot create a store at /proc/"):
            ParamStore("/proc/paramstore-cannot-be-here").commit(1, sd(1))  # the first commit creates it
    with pytest.raises(InvalidArgumentError):
        ParamStore("")


def test_metrics_from_numpy_and_torch_are_numbers(store):
    import numpy as np

    v = store.commit(1, sd(1), metrics={"loss": torch.tensor(0.25), "reward": np.float32(1.5),
                                        "tokens": np.int64(7)}).result()
    assert dict(v.metrics) == {"loss": 0.25, "reward": 1.5, "tokens": 7.0}
    for bad, why in [(torch.ones(2), "one-element tensor"), (True, "number"), (float("inf"), "finite")]:
        with pytest.raises(InvalidArgumentError, match=why):
            store.commit(2, sd(2), metrics={"m": bad})
