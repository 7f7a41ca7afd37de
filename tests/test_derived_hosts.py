"""Derived objects between hosts (issue 29, item 2): made once in the cluster, moved by peers.

Two host processes with their own store roots share a redis registry and talk through Mooncake
over TCP (see tests/derived_host.py). The first derives a version in FP8 and serves its objects;
the second checks the same version out with the same recipe: it reads the record the first one
wrote, fetches the derived objects from it (verified as any fetched object) and derives nothing.
With patches on both sides, the next version's derived objects move as patches against the
derived objects the reader holds, as committed objects do.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid

import pytest

pytest.importorskip("mooncake.engine", reason="needs the Mooncake transfer engine (pip install 'paramstore[mooncake]')")

HOST = os.path.join(os.path.dirname(__file__), "derived_host.py")


def _start(root: str, redis_url: str, name: str, role: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, HOST, root, redis_url, name, role], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, MC_FORCE_TCP="1"))


def _line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, f"host {proc.pid} said nothing (exit {proc.wait(30)})"
    return json.loads(line)


def test_a_host_reads_what_another_derived_from_it_instead_of_deriving(redis_url, shm_dir):
    name = f"derived-{uuid.uuid4().hex[:8]}"
    maker = _start(os.path.join(shm_dir, "maker"), redis_url, name, "maker")
    try:
        hello = _line(maker)
        assert hello["ready"] and hello["derived"] == 1  # one object with three FP8 weights: one unit
        reader = _start(os.path.join(shm_dir, "reader"), redis_url, name, "reader")
        got = _line(reader)
        assert reader.wait(60) == 0
    finally:
        if maker.poll() is None:
            maker.stdin.write("quit\n")
            maker.stdin.flush()
            maker.wait(30)
    assert got["ok"], got  # every tensor as recipes.derive makes it, bit for bit
    assert got["derived"] == 0 and got["units"] == 1, got  # found, not made
    # what moved (from the maker, the only peer): the committed object and the derived one, once each
    assert got["derived_bytes"] > 0 and got["from_peers"] == 1, got
    # Both relayed by their digests (the manifest's; the record's outputs, with piece digests), so
    # neither had its header read first (a relay whose plan its header gives reads it first: ~its length more)
    want = got["committed_bytes"] + got["derived_bytes"]
    assert sum(got["bytes_from"].values()) == want, got


def _say(proc: subprocess.Popen, line: str = "go") -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def test_the_next_versions_derived_objects_move_as_patches(redis_url, shm_dir):
    name = f"derived-patch-{uuid.uuid4().hex[:8]}"
    maker = _start(os.path.join(shm_dir, "maker"), redis_url, name, "patch-maker")
    reader = None
    try:
        assert _line(maker) == {"ready": 1}
        reader = _start(os.path.join(shm_dir, "reader"), redis_url, name, "patch-reader")
        first = _line(reader)
        _say(maker)
        assert _line(maker) == {"ready": 2}  # step 2 committed, derived, and its derived objects patched
        _say(reader)
        second = _line(reader)
        assert reader.wait(60) == 0
    finally:
        for p in (maker, reader):
            if p is not None and p.poll() is None:
                with contextlib.suppress(OSError):
                    _say(p, "quit")
                p.wait(30)
    assert first["ok"] and first["derived"] == 0 and first["patched"] == 0, first  # step 1 moved whole
    assert second["ok"], second  # bit for bit as recipes.derive makes step 2
    assert second["derived"] == 0, second  # found, not made
    assert second["patched_derived"] == 1 and second["patched"] == 2, second  # the committed and the derived object
    whole = second["committed_bytes"] + second["derived_bytes"]
    moved = sum(second["bytes_from"].values())
    assert second["patch_bytes"] == moved, second  # nothing moved whole
    assert moved < 0.25 * whole, second
