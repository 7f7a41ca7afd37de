"""A store knows what it is and who writes it (issue 12, items 1, 5, 6, 9 and 10).

- Metadata deleted or replaced under a running trainer and reader is detected, never re-created.
- Readers never create a store; a wait for one that never comes names the path.
- The root is private; a root owned by someone else, or writable by everyone, is refused.
- A damaged LMDB file ends in CorruptStoreError (never SIGBUS), in the API and in the CLI.
- Two trainers on one root: the second is refused while the first lives; versions name their writer.
- A full filesystem does not stop checkouts of versions that exist.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

import paramstore
from helpers import run_in_small_tmpfs
from paramstore import NotAStoreError, ParamStore, ParamStoreWarning, WaitTimeoutError
from paramstore.errors import CorruptStoreError, MetadataLostError, UnsafeStoreError, WriterConflictError



def weights(x: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 64), x), "b": torch.arange(16, dtype=torch.float32)}


@pytest.fixture
def shm_path(shm_dir):
    """The per-test /dev/shm directory as a Path."""
    return pathlib.Path(shm_dir)


def run_cli(*args: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "paramstore", *args], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


# -- metadata lost ---------------------------------------------------------------------------
def test_metadata_deleted_under_a_running_trainer_and_reader(shm_path):
    root = str(shm_path / "s")
    store = ParamStore(root)
    store.commit(1, weights(1)).result()
    seen: list[object] = []
    reader = ParamStore(root)

    def follow() -> None:
        try:
            for v in reader.subscribe(min_step=1):
                seen.append(v.step)
        except Exception as e:  # noqa: BLE001 -- the test inspects it
            seen.append(e)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    shutil.rmtree(os.path.join(root, "meta"))  # what a /dev/shm cleaner does
    with pytest.raises(MetadataLostError, match="deleted"):
        store.commit(2, weights(2)).result()
    t.join(10)
    assert not t.is_alive() and seen[0] == 1 and isinstance(seen[-1], MetadataLostError), seen
    store.close()
    reader.close()
    # Nothing re-created: not by an open, not by the CLI (which fails with one line).
    for create in (None, True, False):
        with pytest.raises(MetadataLostError, match="pull"):
            ParamStore(root, create=create)
    code, out, err = run_cli("--root", root, "ls")
    assert code != 0 and "metadata" in err and "Traceback" not in err and out == ""
    assert not os.path.exists(os.path.join(root, "meta"))


def test_metadata_replaced_by_another_stores(shm_path):
    a, b = str(shm_path / "a"), str(shm_path / "b")
    for root in (a, b):
        with ParamStore(root) as s:
            s.commit(1, weights()).result()
    shutil.rmtree(os.path.join(a, "meta"))
    shutil.copytree(os.path.join(b, "meta"), os.path.join(a, "meta"))
    with pytest.raises(MetadataLostError, match="another store"):
        ParamStore(a)


# -- readers never create ----------------------------------------------------------------------
def test_a_reader_never_creates_the_store(shm_path):
    typo = str(shm_path / "tpyo")
    reader = ParamStore(typo)
    with pytest.raises(NotAStoreError, match="never creates"):
        reader.versions()
    with pytest.raises(NotAStoreError):
        reader.checkout("latest")
    t0 = time.monotonic()
    with pytest.raises(WaitTimeoutError, match=f"no store exists at {typo}"):
        reader.checkout(min_step=1, timeout=0.3)
    with pytest.raises(WaitTimeoutError, match="no store exists"):
        list(reader.subscribe(min_step=0, timeout=0.2))
    assert time.monotonic() - t0 < 5
    reader.close()
    assert not os.path.exists(typo)


def test_a_reader_that_starts_first_waits_for_the_trainer(shm_path):
    root = str(shm_path / "s")
    reader = ParamStore(root)
    got: list[int] = []

    def rollout() -> None:
        with reader.checkout(min_step=1, timeout=30) as snap:
            got.append(snap.step)
            assert torch.equal(snap["w"], weights(3)["w"])

    t = threading.Thread(target=rollout)
    t.start()
    time.sleep(0.3)
    assert not got and not os.path.exists(root)
    with ParamStore(root) as trainer:
        trainer.commit(1, weights(3)).result()
        t.join(30)
    assert got == [1]
    reader.close()


# -- privacy and ownership ---------------------------------------------------------------------
def test_the_root_is_private_and_other_users_cannot_read_objects(shm_path):
    root = str(shm_path / "s")
    with ParamStore(root) as s:
        s.commit(1, weights()).result()
    assert os.stat(root).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(root, "meta", "data.mdb")).st_mode & 0o077 == 0
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    obj = next(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "objects")) for f in fs)
    os.chmod(shm_path, 0o755)  # let the other user reach the root itself
    pid = os.fork()
    if pid == 0:  # the child becomes user nobody and tries to read the object
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            with open(obj, "rb") as f:
                f.read(1)
            code = 1
        except PermissionError:
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "another user could read the object"


def test_a_root_owned_by_another_user_or_writable_by_all_is_refused(shm_path):
    planted = shm_path / "planted"
    planted.mkdir()
    if os.geteuid() == 0:
        os.chown(planted, 65534, 65534)  # another user made the (empty) root first
        with pytest.raises(UnsafeStoreError, match="owned by uid 65534"):
            ParamStore(str(planted)).commit(1, weights())
        assert os.listdir(planted) == []
    root = str(shm_path / "s")
    with ParamStore(root) as s:
        s.commit(1, weights()).result()
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeStoreError, match="chmod o-w"):
        ParamStore(root)


def test_shared_group_roots_are_group_accessible(shm_path):
    root = str(shm_path / "s")
    with ParamStore(root, shared_group=True) as s:
        s.commit(1, weights()).result()
    assert os.stat(root).st_mode & 0o7777 == 0o3770  # setgid + sticky (tests/test_group_store.py)
    assert os.stat(os.path.join(root, "meta", "data.mdb")).st_mode & 0o777 == 0o660  # whatever the umask


# -- damaged LMDB ------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_registry_is_reported_not_crashed_on(shm_path, damage):
    root = str(shm_path / "s")
    with ParamStore(root) as s:
        for step in range(1, 4):
            s.commit(step, weights(step), metrics={"loss": 1.0 / step}).result()
    data = os.path.join(root, "meta", "data.mdb")
    used = os.path.getsize(data)
    with open(data, "r+b") as f:
        if damage == "truncate":
            f.truncate(3 * 4096)  # the meta pages survive, the tree does not
        else:
            f.seek(2 * 4096)
            f.write(os.urandom(used - 2 * 4096))
    with pytest.raises(CorruptStoreError):
        with ParamStore(root) as s:  # either the open or the first read notices
            s.versions()
            s.manifest(3)
    for cmd in (["ls"], ["verify"]):
        code, _, err = run_cli("--root", root, *cmd)
        assert code not in (0, -signal.SIGBUS) and "Traceback" not in err, (cmd, code, err)
        assert "damaged" in err or "truncated" in err, err


# -- one writer --------------------------------------------------------------------------------
TRAINER = textwrap.dedent("""
    import sys, time, torch, paramstore
    with paramstore.ParamStore(sys.argv[1], run_id=sys.argv[2], takeover=sys.argv[4:] == ["takeover"]) as s:
        s.commit(int(sys.argv[3]), {"w": torch.ones(8)}).result()
        print("committed", flush=True)
        time.sleep(120)
""")


def test_a_second_trainer_is_refused_while_the_first_lives(shm_path):
    root = str(shm_path / "s")
    first = subprocess.Popen([sys.executable, "-c", TRAINER, root, "run-a", "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "committed"
        second = ParamStore(root, run_id="run-b")
        with pytest.raises(WriterConflictError, match="run-a"):
            second.commit(2, weights())
        assert [v.step for v in second.versions()] == [1]
        first.kill()
        first.wait(30)
        with pytest.warns(ParamStoreWarning, match="taking over from run run-a"):
            second.commit(2, weights()).result()
        assert [(v.step, v.writer) for v in second.versions()] == [(1, "run-a"), (2, "run-b")]
        # Another live trainer takes over only on purpose; the one it replaced is refused from then on.
        third = subprocess.Popen([sys.executable, "-c", TRAINER, root, "run-c", "3", "takeover"],
                                 stdout=subprocess.PIPE, text=True)
        assert third.stdout.readline().strip() == "committed"
        with pytest.raises(WriterConflictError, match="run-c"):
            second.commit(4, weights())
        third.kill()
        third.wait(30)
        second.close()
        # A trainer that closed its store gave it up: the next one starts without a warning.
        with ParamStore(root, run_id="run-d") as fourth, pytest.warns(ParamStoreWarning, match="run-c"):
            fourth.commit(4, weights()).result()  # run-c was killed, not closed
        with ParamStore(root, run_id="run-e") as fifth, warnings.catch_warnings():
            warnings.simplefilter("error")
            fifth.commit(5, weights()).result()
    finally:
        first.kill()
        first.wait()
    code, out, _ = run_cli("--root", root, "ls")
    assert code == 0 and "WRITER" in out and "run-a" in out and "run-c" in out


# -- full filesystem -----------------------------------------------------------------------------
READ_WHEN_FULL = textwrap.dedent("""
    import os, sys, torch, paramstore
    root = sys.argv[1]
    with paramstore.ParamStore(root, prepare_buffers=False) as s:
        s.commit(1, {"w": torch.arange(1024, dtype=torch.float32)}).result()
    filler = os.path.join(os.path.dirname(root), "filler")
    with open(filler, "wb", buffering=0) as f:  # fill the filesystem to the last byte
        try:
            while True:
                f.write(b"\\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\\0")
        except OSError:
            pass
    reader = paramstore.ParamStore(root)
    for _ in range(50):  # leases are written and released each time
        with reader.checkout("latest") as snap:
            total = float(snap["w"].sum())
    print("read", total)
    reader.close()
""")


def test_checkouts_work_on_a_full_filesystem(tmp_path):
    proc = run_in_small_tmpfs(tmp_path, "32m", READ_WHEN_FULL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["read", str(float(sum(range(1024))))], proc.stdout


def test_verify_says_when_unexplained_objects_look_like_lost_metadata(shm_path):
    root = str(shm_path / "s")
    with ParamStore(root) as s:
        for step in range(1, 5):
            s.commit(step, {"w": torch.full((64, 64), float(step))}).result()  # one object per version
        ok = s.verify()
        assert ok["ok"] and not ok["metadata_suspect"]
        s._root.registry.remove_versions([1, 2, 3])  # what a registry that lost its records looks like
        r = s.verify()
        assert r["metadata_suspect"] and "do not run gc" in r["advice"] and len(r["orphans"]) > 1


def test_a_subscriber_that_starts_before_the_store_sees_its_first_commit(shm_path):
    root = str(shm_path / "s")
    reader = ParamStore(root)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.extend(v.step for v in reader.subscribe(timeout=3)))
    t.start()
    time.sleep(0.3)
    with ParamStore(root) as trainer:
        trainer.commit(1, weights()).result()
        trainer.commit(2, weights(2)).result()
    t.join(30)
    assert got == [1, 2]
    reader.close()


def test_a_group_store_of_another_member_is_accepted(shm_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give the root to another user")
    root = str(shm_path / "g")
    with ParamStore(root, shared_group=True) as s:
        s.commit(1, weights()).result()
    os.chown(root, 65534, os.getegid())  # made by another member of our group
    with ParamStore(root) as s:
        assert [v.step for v in s.versions()] == [1]
    os.chmod(root, 0o700)  # not a group store: someone else's private directory
    with pytest.raises(UnsafeStoreError):
        ParamStore(root)


def test_warnings_raised_deep_in_the_package_name_the_callers_line(shm_dir):
    """The writer-takeover warning is raised four calls below ParamStore.commit; it still names the
    line of the caller that committed (paramstore.text.warn), not a line of the package."""
    import dataclasses
    import subprocess
    import sys
    import warnings

    import torch

    from paramstore import ParamStore, ParamStoreWarning
    from paramstore.writer import Writer

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with ParamStore(os.path.join(shm_dir, "s")) as store:
        store.commit(1, {"w": torch.ones(2)}).result()
        gone = dataclasses.replace(Writer.this_process("gone-run"), pid=dead.pid, start=None)
        reg = store._root.registry
        reg.swap_meta("writer", reg.get_meta("writer"), gone.to_text())
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            store.commit(2, {"w": torch.zeros(2)}).result()
    [w] = [w for w in record if issubclass(w.category, ParamStoreWarning)]
    assert "taking over from run gone-run" in str(w.message) and w.filename == __file__
