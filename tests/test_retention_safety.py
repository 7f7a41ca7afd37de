"""Retention never drops what it was asked to keep (issue 24, items 2 and 3). Real parts only: real
LMDB stores on /dev/shm, real ``file://`` remotes, real commits of small models.

* **One metric does not switch retention off.** A ``KeepBest`` whose metric no version carries
  (yet) ranks nothing; the policy's other members still apply. A metric name that looks like a
  typo of one the commit passes is refused by ``commit()`` itself, on the trainer's thread.
* **A committed version is never lost from both tiers.** Local retention keeps what the remote
  policy wants and the remote has not received; a full upload backlog skips only versions the
  remote policy would not keep; the skip warning says what is happening.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

from helpers import random_tensor
from paramstore import InvalidArgumentError, ParamStore
from paramstore.errors import RemoteError, StepOrderError
from paramstore.maintenance import Maintainer
from paramstore.manifest import Version
from paramstore.remote import Remote
from paramstore.retention import AnyOf, KeepBest, KeepEvery, KeepLast, decide


def model(seed: int) -> dict[str, torch.Tensor]:
    """~64 KiB, different per seed (no dedup between steps)."""
    return {f"w{i}": random_tensor(torch.float32, (64, 64), seed * 10 + i) for i in range(4)}


def settle(store: ParamStore) -> None:
    """Run background retention over every version committed so far and wait for it (a commit's
    own request for a run comes after its ``result()``)."""
    store._write.maintainer.poke()
    assert store._write.maintainer.wait_idle(30)


def steps(store: ParamStore) -> list[int]:
    return [v.step for v in store.versions()]


# -- item 2: one metric switches retention off -------------------------------------------------
def test_keep_best_of_a_metric_no_version_has_does_not_disable_the_other_members():
    versions = [Version(s, created_at=0.0, nbytes=0, digest="", num_tensors=0, metrics={"reward": 0.1 * s})
                for s in range(1, 6)]
    policy = AnyOf(KeepLast(2), KeepBest(2, "rewrd", mode="max"))
    assert policy.keep(versions, now=0.0) == {4: ["one of the last 2"], 5: ["one of the last 2"]}
    assert decide(policy, versions, [], now=0.0).remove == [1, 2, 3]


def test_background_retention_prunes_before_the_first_version_with_the_metric(shm_dir):
    # The right name, before the first version that carries it (evaluation every 5 steps):
    # KeepLast(2) still applies, and nothing is reported as failed.
    policy = AnyOf(KeepLast(2), KeepBest(1, "eval_reward"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ParamStore(os.path.join(shm_dir, "s"), retention=policy) as store:
            for step in range(1, 7):
                metrics = {"eval_reward": 0.5} if step == 5 else None
                store.commit(step, model(step), metrics=metrics).result()
                settle(store)
            assert store._write.maintainer.last_error is None
            assert steps(store) == [5, 6]  # 5: best by eval_reward (and one of the last 2)
    assert not [w for w in caught if "retention failed" in str(w.message)]


def test_a_misspelt_metric_is_refused_at_commit_with_nothing_written(shm_dir):
    root = os.path.join(shm_dir, "s")
    with ParamStore(root, retention=AnyOf(KeepLast(2), KeepBest(2, "rewrd", mode="max"))) as store:
        with pytest.raises(InvalidArgumentError, match="'rewrd'.*did you mean 'reward'"):
            store.commit(1, model(1), metrics={"reward": 0.5, "loss": 1.0})
        assert not os.path.exists(root)  # nothing written: not even the store
    remote = f"file://{shm_dir}/remote"
    retention = {"local": KeepLast(2), "remote": KeepBest(1, "los", mode="min")}
    with ParamStore(root, remote=remote, retention=retention) as store:
        store.commit(1, model(1)).result()  # no metrics: nothing to compare with
        with pytest.raises(InvalidArgumentError, match="did you mean 'loss'"):
            store.commit(2, model(2), metrics={"loss": 0.5})
        assert steps(store) == [1]


def test_a_metric_no_commit_passes_warns_once_on_the_trainer_thread(shm_dir):
    with ParamStore(os.path.join(shm_dir, "s"), retention=AnyOf(KeepLast(1), KeepBest(1, "win_rate", mode="max"))) \
            as store:
        with pytest.warns(RuntimeWarning, match="'win_rate'.*not ranked") as record:
            store.commit(1, model(1), metrics={"loss": 1.0}).result()
        assert record[0].filename == __file__  # the trainer's own line
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only
            store.commit(2, model(2), metrics={"loss": 0.9}).result()
            store.commit(3, model(3), metrics={"loss": 0.8, "win_rate": 0.3}).result()
            store.commit(4, model(4), metrics={"loss": 0.7}).result()
            settle(store)
        assert steps(store) == [3, 4]


def test_a_metric_some_version_has_is_not_questioned(shm_dir):
    root = os.path.join(shm_dir, "s")
    with ParamStore(root) as store:
        store.commit(1, model(1), metrics={"eval/reward": 0.5}).result()
    with ParamStore(root, retention=AnyOf(KeepLast(1), KeepBest(1, "eval/reward"))) as store:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            store.commit(2, model(2), metrics={"eval/rewards": 0.1}).result()  # close, but 1 has the metric
            settle(store)
        assert steps(store) == [1, 2]


# -- item 3: a committed version lost from both tiers -------------------------------------------
@pytest.fixture
def stalled_remote(shm_dir):
    """A ``file://`` remote whose exclusive (GC) lock is held, for real, by another client: every
    push waits until the test releases it."""
    url = f"file://{shm_dir}/remote"
    gc = Remote(url)
    gc.create()
    lock = gc.exclusive_lock(timeout=10)
    lock.__enter__()
    held = [True]

    def release() -> None:
        if held[0]:
            held[0] = False
            lock.__exit__(None, None, None)

    yield url, release
    release()


def test_a_milestone_the_remote_keeps_is_never_skipped_nor_pruned(shm_dir, stalled_remote):
    url, release = stalled_remote
    retention = {"local": KeepLast(1), "remote": AnyOf(KeepLast(3), KeepEvery(5))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ParamStore(os.path.join(shm_dir, "s"), remote=url, retention=retention, persist_backlog=2) as store:
            handles = {}
            try:
                for step in range(1, 8):
                    handles[step] = store.commit(step, model(step))
                    handles[step].result(30)
                    settle(store)
                    if step >= 5:
                        assert 5 in steps(store)  # the milestone waits for upload: never pruned meanwhile
            finally:
                release()  # else close() would wait for the stalled uploads forever
            assert store._write.persister.wait(60)
            settle(store)
            remote_steps = [v.step for v in store.remote_versions()]
            assert handles[5].persisted.result(30).step == 5
            assert 5 in remote_steps, remote_steps
            for step in (2, 3, 4):  # skipped: the remote policy does not keep them
                with pytest.raises(RemoteError, match="backlog"):
                    handles[step].persisted.result(30)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    skips = [m for m in messages if "skipped" in m]
    assert len(skips) == 1, skips  # versions the remote policy does not keep: said once, not once each
    assert "slow or unreachable" not in skips[0]  # a local directory, just slower than the commits
    assert "commits come faster than uploads" in skips[0] and "the remote retention policy does not keep it" in skips[0]


def test_local_retention_keeps_what_the_remote_wants_and_has_not_received(shm_dir):
    # Another run already holds a different step 5 in the remote: this run's step 5 cannot be
    # uploaded (StepOrderError, a refusal). The remote policy keeps every 5th step, so local
    # retention must not delete the only copy.
    url = f"file://{shm_dir}/remote"
    with ParamStore(os.path.join(shm_dir, "other"), remote=url) as other:
        other.commit(5, model(500)).persisted.result(30)
    retention = {"local": KeepLast(1), "remote": AnyOf(KeepLast(1), KeepEvery(5))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ParamStore(os.path.join(shm_dir, "s"), remote=url, retention=retention) as store:
            handles = {}
            for step in range(1, 8):
                handles[step] = store.commit(step, model(step))
                handles[step].result(30)
                assert store._write.persister.wait(60)  # one upload at a time: nothing is skipped
                settle(store)
            with pytest.raises(StepOrderError, match="another version at step 5"):
                handles[5].persisted.result(30)
            # Refused for good: not queued again after each later push (it was, leased meanwhile, so a
            # prune could find it leased after wait() had returned).
            assert store._write.persister.resumed == []
            assert steps(store) == [5, 7]
            report = store.prune(KeepLast(1), dry_run=True)  # an explicit prune is the user's choice
            assert report.removed == [5]


def test_wait_covers_a_milestone_queued_again_after_a_push(shm_dir, monkeypatch):
    """A push that goes through queues again the milestone whose upload was given up before it is
    counted done: ``persisted`` resolving and ``wait()`` returning mean the milestone is uploaded too,
    however long it takes to find which versions the remote still lacks."""
    url = f"file://{shm_dir}/remote"
    retention = {"local": KeepLast(1), "remote": AnyOf(KeepLast(1), KeepEvery(5))}
    push, awaiting = Remote.push, Maintainer.awaiting_remote
    failed = []

    def flaky_push(self, root, step, **kw):
        if step == 5 and not failed:  # one transient failure: given up at once (persist_retry_for)
            failed.append(step)
            raise RemoteError("the endpoint is down", transient=True)
        return push(self, root, step, **kw)

    def slow_awaiting(self):
        time.sleep(0.2)  # widens the window between a push's end and the queueing of what it leaves behind
        return awaiting(self)

    monkeypatch.setattr(Remote, "push", flaky_push)
    monkeypatch.setattr(Maintainer, "awaiting_remote", slow_awaiting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with ParamStore(os.path.join(shm_dir, "s"), remote=url, retention=retention, persist_retry_for=0.1) as store:
            with pytest.raises(RemoteError, match="endpoint is down"):
                store.commit(5, model(5)).persisted.result(30)
            store.commit(6, model(6)).persisted.result(30)
            assert store._write.persister.wait(60)
            assert store._write.persister.resumed == [5]
            assert 5 in [v.step for v in store.remote_versions()]


def test_a_milestone_given_up_in_an_outage_is_uploaded_once_the_remote_is_back(s3_server, s3_remote, shm_dir):
    """An outage longer than ``persist_retry_for`` gives up the upload of a milestone the remote
    keeps; local retention keeps it meanwhile, and the first push that goes through afterwards
    queues it again: it reaches the remote, and only then may local retention prune it."""
    url, opts = s3_remote
    retention = {"local": KeepLast(1), "remote": AnyOf(KeepLast(1), KeepEvery(5))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the outage's own warnings
        with ParamStore(os.path.join(shm_dir, "s"), remote=url, storage_options=opts, retention=retention,
                        persist_retry_for=1.0) as store:
            store.commit(4, model(4)).persisted.result(60)
            s3_server.stop()
            try:
                milestone = store.commit(5, model(5))
                with pytest.raises(RemoteError):  # given up after retry_for: the remote is down
                    milestone.persisted.result(60)
                settle(store)
                assert 5 in steps(store)  # kept locally for the remote
            finally:
                s3_server.start()
            store.commit(6, model(6)).persisted.result(60)  # the remote works again
            assert store._write.persister.wait(60)
            settle(store)
            assert 5 in [v.step for v in store.remote_versions()]
            assert steps(store) == [6]  # uploaded, so local KeepLast(1) let it go
