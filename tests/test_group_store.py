"""Group stores (``shared_group=True``) against their own members (issue 25, item 8).

The trainer (the root's owner) writes; a member of the root's group reads, leases and opens the
trainer's CUDA IPC descriptors, and nothing more: it cannot rename or replace what the trainer
made (the root is setgid + sticky, ``3770``), cannot add files where the trainer writes
(``objects/``, ``tmp/``, ``device/``, ``meta/`` are ``2750``), and a link it plants under a name
the trainer writes through (``*.partial``) is never followed.

Every test runs a real member: a forked child that becomes user ``nobody`` in group ``nogroup``
(65534), the store's group here. They need root (to become another user), as does the trainer's
side, which runs as root in the test process: root's writes ignore permissions, so whatever a
planted link reaches would be overwritten unless the write refuses to follow it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import stat
from typing import Any, Callable

import pytest
import torch

from paramstore import ParamStore
from paramstore import device as device_mod
from paramstore import root as root_mod
from paramstore.errors import UnsafeStoreError

#: The member: user nobody, whose primary group nogroup is the group of every store made here.
MEMBER, GROUP = 65534, 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")


def weights(x: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 64), x), "b": torch.arange(16, dtype=torch.float32)}


@pytest.fixture
def group_root(shm_dir):
    """Where a group store is made: inside a directory of group nogroup (setgid, so the store
    inherits the group) that the member may enter; the trainer's umask is the documented ``007``."""
    os.chown(shm_dir, 0, GROUP)
    os.chmod(shm_dir, 0o2755)
    umask = os.umask(0o007)
    try:
        yield os.path.join(shm_dir, "g")
    finally:
        os.umask(umask)


def as_member(fn: Callable[[], Any]) -> tuple[str, Any]:
    """Run ``fn`` in a child process of the member (uid and gid 65534, umask 007).

    Returns ``("ok", its result)`` or ``(the name of the exception it raised, the message)``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(GROUP)
            os.setuid(MEMBER)
            os.umask(0o007)
            out: tuple[str, Any] = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = (type(e).__name__, str(e))
        try:
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


def make_store(root: str) -> None:
    with ParamStore(root, shared_group=True) as s:
        s.commit(1, weights()).result()


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def an_object_dir(root: str) -> str:
    objects = os.path.join(root, "objects")
    return os.path.join(objects, sorted(os.listdir(objects))[0])


def remove_dir(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def victim(root: str) -> str:
    """A file of the trainer's next to the store: what a planted link points at."""
    path = os.path.join(os.path.dirname(root), "victim")
    with open(path, "wb") as f:
        f.write(b"the trainer's own file")
    return path


# -- what a member cannot do --------------------------------------------------------------------
def test_a_member_cannot_rename_the_trainers_directories_or_marker(group_root):
    root = group_root
    make_store(root)
    for name in ("meta", "objects", "tmp", "device", "paramstore.json"):
        got = as_member(lambda: os.rename(os.path.join(root, name), os.path.join(root, name + ".mine")))
        assert got[0] == "PermissionError", f"a member renamed {name}: {got}"
    assert mode(root) == 0o3770  # setgid + sticky: members create, only owners rename or delete
    assert sorted(os.listdir(root)) == ["device", "meta", "objects", "paramstore.json", "quarantine", "tmp"]


def test_a_member_cannot_add_files_where_the_trainer_writes(group_root):
    root = group_root
    make_store(root)
    # an object planted under a digest the trainer later commits would be deduplicated into its
    # versions unchecked: objects/ and its folders are the trainer's alone
    for d in ("objects", an_object_dir(root), "tmp", "device", "meta", "quarantine"):
        path = os.path.join(root, d, "planted")
        got = as_member(lambda: os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o660)))
        assert got[0] == "PermissionError", f"a member created a file in {d}: {got}"
        assert mode(os.path.join(root, d)) == 0o2750


def test_a_member_cannot_commit_to_a_group_store(group_root):
    root = group_root
    make_store(root)

    def commit() -> None:
        with ParamStore(root) as s:
            s.commit(2, weights(2.0)).result()

    kind, message = as_member(commit)
    assert kind == "UnsafeStoreError", message
    assert "owner" in message
    with ParamStore(root) as s:
        assert [v.step for v in s.versions()] == [1]


# -- what a member can do -----------------------------------------------------------------------
def test_a_member_reads_and_leases_a_group_store(group_root):
    root = group_root
    make_store(root)

    def read() -> tuple[int, float, int]:
        with ParamStore(root) as s:
            with s.checkout("latest") as snap:
                leased = len(s.leases())
                return snap.step, float(snap["w"].sum()), leased

    assert as_member(read) == ("ok", (1, 4096.0, 1))
    with ParamStore(root) as s:
        assert s.leases() == []  # released by the member's close


def test_a_member_reads_device_descriptors_but_cannot_write_them(group_root):
    root = group_root
    make_store(root)
    path = os.path.join(root, device_mod.DESCRIPTOR_DIR, "cuda-GPU-test.json")
    device_mod._write_atomic(path, b'{"format": 1}')  # what LatestExporter writes after each commit

    def read() -> bytes:
        with open(path, "rb") as f:
            return f.read()

    assert as_member(read) == ("ok", b'{"format": 1}')
    assert mode(os.path.dirname(path)) == 0o2750
    assert as_member(lambda: open(path, "wb").close())[0] == "PermissionError"


# -- links a member plants ----------------------------------------------------------------------
def test_a_planted_marker_partial_link_is_not_followed(group_root):
    root = group_root
    make_store(root)
    target = victim(root)
    marker = os.path.join(root, root_mod.MARKER)
    planted = f"{marker}.{os.getpid()}.partial"  # the name the trainer's next marker write uses
    assert as_member(lambda: os.symlink(target, planted)) == ("ok", None)  # the root is group-writable
    info = root_mod._read_marker(root, marker)
    root_mod._write_json(marker, {**info, "name": "rewritten"})  # joining a shared registry rewrites it
    with open(target, "rb") as f:
        assert f.read() == b"the trainer's own file"
    assert root_mod._read_marker(root, marker)["name"] == "rewritten"
    assert not os.path.lexists(planted)


def test_a_planted_device_partial_link_is_not_followed(group_root):
    root = group_root
    make_store(root)
    target = victim(root)
    path = os.path.join(root, device_mod.DESCRIPTOR_DIR, "cuda-GPU-test.json")
    planted = f"{path}.{os.getpid()}.partial"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(target, planted)  # members cannot write device/: as if planted before it was locked
    device_mod._write_atomic(path, b'{"format": 1}')
    with open(target, "rb") as f:
        assert f.read() == b"the trainer's own file"
    with open(path, "rb") as f:
        assert f.read() == b'{"format": 1}'


def test_a_device_folder_made_by_a_member_is_refused(group_root):
    # A store from before device/ was made with the root: a member made it first, with a link in it.
    root = group_root
    make_store(root)
    remove_dir(os.path.join(root, "device"))
    target = victim(root)
    path = os.path.join(root, device_mod.DESCRIPTOR_DIR, "cuda-GPU-test.json")
    planted = f"{path}.{os.getpid()}.partial"  # the trainer's pid: the name its next write uses

    def plant() -> None:
        os.mkdir(os.path.dirname(path), 0o777)
        os.symlink(target, planted)

    assert as_member(plant) == ("ok", None)
    with pytest.raises(UnsafeStoreError, match="uid 65534"):
        device_mod._write_atomic(path, b'{"format": 1}')
    with pytest.raises(UnsafeStoreError, match="device"):
        ParamStore(root).close()  # the owner's open refuses it too: remove it, then reopen
    with open(target, "rb") as f:
        assert f.read() == b"the trainer's own file"


def test_a_link_a_member_left_in_meta_is_refused_by_the_owners_open(group_root):
    # A store from before meta/ was locked (2770, no sticky bit): a member swapped the events file,
    # which every commit writes, for a link to a file of the trainer's.
    root = group_root
    make_store(root)
    os.chmod(root, 0o2770)
    os.chmod(os.path.join(root, "meta"), 0o2770)
    target = victim(root)
    events = os.path.join(root, "meta", "events")

    def swap() -> None:
        os.rename(events, events + ".old")
        os.symlink(target, events)

    assert as_member(swap) == ("ok", None)
    with pytest.raises(UnsafeStoreError, match="events"):
        with ParamStore(root) as s:
            s.commit(2, weights(2.0)).result()
    with open(target, "rb") as f:
        assert f.read() == b"the trainer's own file"


# -- stores made before the sticky bit ----------------------------------------------------------
def test_a_group_root_without_the_sticky_bit_is_fixed_by_its_owner_and_refused_to_members(group_root):
    root = group_root
    make_store(root)
    os.chmod(root, 0o2770)  # as 0.2 made it, with the umask 007 the docs asked for
    for d in ("objects", "tmp", "meta"):
        os.chmod(os.path.join(root, d), 0o2770)
    remove_dir(os.path.join(root, "device"))
    remove_dir(os.path.join(root, "quarantine"))

    def read() -> int:
        with ParamStore(root) as s:
            return len(s.versions())

    kind, message = as_member(read)
    assert kind == "UnsafeStoreError" and "sticky" in message, message
    with ParamStore(root) as s:  # its owner opens it: fixed
        assert [v.step for v in s.versions()] == [1]
    assert mode(root) == 0o3770
    for d in ("objects", an_object_dir(root), "tmp", "meta", "device", "quarantine"):
        assert mode(os.path.join(root, d)) == 0o2750, d
    assert as_member(read) == ("ok", 1)


def test_a_private_root_keeps_its_modes(shm_dir):
    root = os.path.join(shm_dir, "p")
    with ParamStore(root) as s:
        s.commit(1, weights()).result()
    assert mode(root) == 0o700
    assert not os.path.exists(os.path.join(root, "device"))  # made by the first export, 0700
    path = os.path.join(root, device_mod.DESCRIPTOR_DIR, "cuda-GPU-test.json")
    device_mod._write_atomic(path, b"{}")
    assert mode(os.path.dirname(path)) == 0o700
