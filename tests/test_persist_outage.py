"""Write-through when the remote misbehaves (issue 12, items 11 and 12), against a real S3 API
(moto's server on 127.0.0.1, stopped to simulate an outage):

* an outage does not switch local retention off: the upload backlog is bounded
  (``ParamStore(persist_backlog=)``), the oldest waiting versions are skipped with a clear error,
  and the newest are uploaded once the endpoint is back;
* a store opened with a remote resumes the uploads a killed run left unfinished (the newest
  ``persist_backlog`` of them), in the background;
* remote locks of a killed process on this host are released at once (pid + start time), so
  remote GC runs without waiting for the lock TTL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from helpers import assert_checkout_equal, random_tensor
from paramstore import ParamStore
from paramstore.errors import InvalidArgumentError, RemoteError, WaitTimeoutError
from paramstore.maintenance import gc_remote
from paramstore.persist import DEFAULT_BACKLOG
from paramstore.remote import Remote
from paramstore.retention import KeepLast

HERE = os.path.dirname(os.path.abspath(__file__))


def model(seed: int) -> dict[str, torch.Tensor]:
    """~1 MiB, every tensor different per seed (no dedup between steps)."""
    return {f"layer{i}.weight": random_tensor(torch.float32, (128, 256), seed * 100 + i) for i in range(8)}


def spawn(script: str) -> subprocess.Popen[str]:
    code = f"import sys; sys.path.insert(0, {HERE!r})\n" + textwrap.dedent(script)
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def expect(proc: subprocess.Popen[str], line: str) -> None:
    got = proc.stdout.readline().strip()
    assert got == line, f"child said {got!r}, expected {line!r}"


def push_leases(store: ParamStore) -> set[int]:
    return {lease.step for lease in store.leases() if lease.holder.startswith("paramstore push")}


# -- item 11: a bounded backlog ---------------------------------------------------------------------
def test_outage_keeps_local_retention_working(s3_server, s3_remote, shm_dir):
    url, opts = s3_remote
    backlog = 2
    with ParamStore(os.path.join(shm_dir, "a"), remote=url, storage_options=opts, retention=KeepLast(2),
                    persist_backlog=backlog) as s:
        s.commit(0, model(0)).persisted.result(60)
        handles = {}
        most_versions = most_leases = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s3_server.stop()
            try:
                for step in range(1, 13):
                    handles[step] = s.commit(step, model(step))
                    handles[step].result(30)
                    s._write.maintainer.wait_idle(30)
                    most_versions = max(most_versions, len(s.versions()))
                    most_leases = max(most_leases, len(push_leases(s)))
                # Steady state during the outage: the newest `backlog` versions wait (with their
                # leases), the rest were skipped, released and pruned.
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and (push_leases(s) != {11, 12} or len(s.versions()) > 2):
                    time.sleep(0.05)
                    s._write.maintainer.wait_idle(10)
                assert push_leases(s) == {11, 12}
                assert [v.step for v in s.versions()] == [11, 12]
                assert s._write.persister.pending == backlog
                assert not handles[12].persisted.done()
            finally:
                s3_server.start()
            s.wait_persisted(timeout=60)
        # Without the bound every version committed in the outage stayed (13 versions, 12 leases).
        assert most_versions <= 2 + backlog  # KeepLast(2), the waiting ones, the one being tried
        assert most_leases <= backlog + 1
        for step in range(1, 11):  # skipped, with an error that says why
            with pytest.raises(RemoteError, match="backlog") as info:
                handles[step].persisted.result(0)
            assert not info.value.transient  # a decision, not a fault: retrying it is the caller's call
            # what is happening: the remote failing (with its error), or uploads not keeping up yet
            assert "the remote is failing (last error:" in str(info.value) or \
                "commits come faster than uploads" in str(info.value)
        assert [handles[step].persisted.result(0).step for step in (11, 12)] == [11, 12]
        assert s._write.persister.skipped == 10
        assert [v.step for v in s.remote_versions()] == [0, 11, 12]
        assert sorted(s.persisted()) == [11, 12]
        assert push_leases(s) == set()
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert sum("retrying" in m for m in messages) == 1  # one retry loop, reported once
        assert sum("skipped because the upload backlog" in m for m in messages) == 10  # each skip is reported
    with ParamStore(os.path.join(shm_dir, "b"), remote=url, storage_options=opts, create=True) as b:
        assert_checkout_equal(b, 12, model(12))


def test_backlog_must_be_a_positive_int(s3_remote, shm_dir):
    url, opts = s3_remote
    assert DEFAULT_BACKLOG == 2
    remote = Remote(url, opts)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidArgumentError, match="persist_backlog"):
            ParamStore(os.path.join(shm_dir, "a"), remote=remote, persist_backlog=bad)


# -- item 12: resuming unfinished uploads ------------------------------------------------------------
def test_reopened_store_resumes_the_uploads_a_killed_trainer_left(s3_server, s3_remote, shm_dir):
    url, opts = s3_remote
    root = os.path.join(shm_dir, "trainer")
    proc = spawn(f"""
        import json, time
        from test_persist_outage import model
        from paramstore import ParamStore
        s = ParamStore({root!r}, remote={url!r}, storage_options=json.loads({json.dumps(json.dumps(opts))}),
                       create=True)
        s.commit(1, model(1)).persisted.result(60)
        print("open", flush=True)
        input()  # the endpoint goes down now
        for step in range(2, 8):  # no local retention: every version stays
            s.commit(step, model(step)).result(30)
        print("committed", flush=True)
        time.sleep(600)
    """)
    try:
        expect(proc, "open")
        s3_server.stop()
        try:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            expect(proc, "committed")
            kill(proc)  # the uploads of 2..7 never finished
        finally:
            s3_server.start()
    finally:
        proc.kill()
        proc.wait()
    assert [v.step for v in Remote(url, opts).versions()] == [1]

    t0 = time.monotonic()
    with ParamStore(root, remote=url, storage_options=opts) as s:
        opened = time.monotonic() - t0
        assert [v.step for v in s.versions()] == list(range(1, 8))
        s.wait_persisted(timeout=60)
        assert s._write.persister.resumed == []  # opening (as a reader or a CLI command does) uploads nothing
        s.commit(8, model(8)).result(30)  # the restarted trainer's first commit resumes, by itself
        s.wait_persisted(timeout=60)
        assert s._write.persister.resumed == [6, 7]  # the newest `persist_backlog` left behind
        # 6 goes up unless 8 was still waiting when 6 and 7 were queued (the oldest is then skipped)
        assert {1, 7, 8} <= {v.step for v in s.remote_versions()} <= {1, 6, 7, 8}
        assert push_leases(s) == set()
    assert opened < 5  # the resume runs in the background (the open is not a listing plus pushes)
    with ParamStore(root, remote=url, storage_options=opts) as again:  # nothing left to resume
        again.commit(9, model(9)).result(30)
        again.wait_persisted(timeout=60)
        assert again._write.persister.resumed == []
    with ParamStore(os.path.join(shm_dir, "fresh"), remote=url, storage_options=opts, create=True) as fresh:
        assert_checkout_equal(fresh, 7, model(7))


def test_resume_leaves_versions_another_live_uploader_holds(s3_remote, shm_dir):
    url, opts = s3_remote
    root = os.path.join(shm_dir, "a")
    with ParamStore(root, create=True) as s:  # committed before there was a remote
        for step in (1, 2, 3):
            s.commit(step, model(step)).result(30)
    holder = spawn(f"""
        import time
        from paramstore import ParamStore
        s = ParamStore({root!r})
        s._root.registry.acquire_lease(3, "paramstore push")  # as a live trainer's uploader does
        print("leased", flush=True)
        time.sleep(600)
    """)
    try:
        expect(holder, "leased")
        with ParamStore(root, remote=url, storage_options=opts, persist_backlog=1) as s:
            s.commit(4, model(4)).result(30)  # resumes
            s.wait_persisted(timeout=60)
            assert s._write.persister.resumed == [2]  # the newest one not being uploaded by a live process
            assert {4} <= {v.step for v in s.remote_versions()} <= {2, 4}  # never 3: the live uploader's
    finally:
        holder.kill()
        holder.wait()


# -- item 12: locks of killed processes ---------------------------------------------------------------
def test_remote_gc_runs_at_once_after_a_lock_holder_is_killed(s3_remote, shm_dir):
    url, opts = s3_remote
    root = os.path.join(shm_dir, "a")
    opts_json = json.dumps(json.dumps(opts))
    holder = spawn(f"""
        import json, time
        from paramstore.remote import Remote
        r = Remote({url!r}, json.loads({opts_json}))
        with r.shared_lock("push"):
            print("locked", flush=True)
            time.sleep(600)
    """)
    try:
        expect(holder, "locked")
        r = Remote(url, opts)
        r.create()  # a remote exists once written (GC of a URL that holds none is refused)
        [key] = r.live_shared_locks()
        body = json.loads(r.tier.get_record(f"locks/{key}"))
        assert body["pid"] == holder.pid and body["start"] > 0 and body["node"] and body["host"]
        with pytest.raises(WaitTimeoutError):  # alive: GC waits for it
            gc_remote(r, timeout=0.5)
        kill(holder)
    finally:
        holder.kill()
        holder.wait()
    with ParamStore(root, remote=url, storage_options=opts, create=True) as s:
        s.commit(1, model(1)).persisted.result(60)
        t0 = time.monotonic()
        s.gc(tier="remote")  # the lock TTL is 600 s: without the liveness rule this waits 60 s, then fails
        assert time.monotonic() - t0 < 5
    assert Remote(url, opts).tier.records("locks") == {}


def test_locks_of_other_nodes_keep_the_ttl_rule(s3_remote):
    url, opts = s3_remote
    r = Remote(url, opts, lock_ttl=600)
    r.create()
    elsewhere = {"purpose": "push", "host": "other", "node": "other/boot/pid:[1]", "pid": 999_999_999, "start": 1}
    r.tier.put_record("locks/shared-elsewhere.json", json.dumps(elsewhere).encode())
    r.tier.put_record("locks/shared-old-format.json", json.dumps({"purpose": "push", "pid": 1}).encode())
    assert sorted(r.live_shared_locks()) == ["shared-elsewhere.json", "shared-old-format.json"]
    with pytest.raises(WaitTimeoutError):
        gc_remote(r, timeout=0.5)
    assert r.stale_locks() == []
    r.tier.delete_records(["locks/shared-elsewhere.json", "locks/shared-old-format.json"])


def test_push_proceeds_at_once_after_a_gc_holding_the_exclusive_lock_is_killed(s3_remote):
    url, opts = s3_remote
    gc = spawn(f"""
        import json, time
        from paramstore.remote import Remote
        r = Remote({url!r}, json.loads({json.dumps(json.dumps(opts))}))
        r.create()
        with r.exclusive_lock(timeout=10):
            print("locked", flush=True)
            time.sleep(600)
    """)
    try:
        expect(gc, "locked")
        kill(gc)
    finally:
        gc.kill()
        gc.wait()
    r = Remote(url, opts)
    assert "exclusive.json" in r.tier.records("locks")
    t0 = time.monotonic()
    with r.shared_lock("push"):
        assert time.monotonic() - t0 < 5
    assert r.tier.records("locks") == {}
