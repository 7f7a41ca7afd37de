"""Damaged objects: detection (checkout(verify=True), verify), quarantine, repair from a remote,
removal of what cannot be repaired, and truncated objects failing with the package's errors.

Issue 12, items 2 and 5. A flipped byte inside a tensor is served by a plain checkout (by design:
checkout reads no byte), and used to spread: dedup made the next commit of the correct weights
point at the damaged object.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from helpers import assert_state_equal, bits_equal, random_tensor
from paramstore import ParamStore
from paramstore.errors import CorruptObjectError, CorruptStoreError, InvalidArgumentError, ObjectUnavailableError


def weights(seed: int) -> dict[str, torch.Tensor]:
    return {"layer.weight": random_tensor(torch.float32, (64, 64), seed),
            "layer.bias": random_tensor(torch.bfloat16, (64,), seed + 1),
            "step": torch.tensor(seed, dtype=torch.int64)}


def object_files(root: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "objects", "*", "*.safetensors")))


def object_of(store: ParamStore, step: int) -> str:
    (digest,) = store.manifest(step).objects()
    return digest


def path_of(root: str, digest: str) -> str:
    return os.path.join(root, "objects", digest[:2], f"{digest}.safetensors")


def flip_byte(path: str, from_end: int = 1000) -> bytes:
    """Flip one bit of a byte of "layer.weight" (1000 bytes from the end: the bias is 128 bytes); returns
    the damaged file's bytes."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - from_end)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    with open(path, "rb") as f:
        return f.read()


def truncate(path: str, size: int) -> None:
    os.truncate(path, size)


def cli(root: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paramstore.cli", "--root", root, *args],
                          capture_output=True, text=True, env=env, check=False)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The CLI failed the way a user should see it: exit 2, one line, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paramstore: error: "), proc.stderr
    return lines[0]


# -- a flipped byte ---------------------------------------------------------------------------
def test_checkout_verify_raises_and_quarantines(store_root):
    sd = weights(1)
    with ParamStore(store_root) as store:
        store.commit(1, sd).result()
        digest = object_of(store, 1)
        damaged = flip_byte(path_of(store_root, digest))
        with store.checkout(1) as snap:  # by design: a local checkout does not re-hash
            assert not bits_equal(snap["layer.weight"], sd["layer.weight"])
        with pytest.raises(CorruptObjectError) as info:
            store.checkout(1, verify=True)
        assert not isinstance(info.value, ObjectUnavailableError)
        assert digest in str(info.value) and "version 1" in str(info.value)
        assert "verify --repair" in str(info.value)
        assert store.leases() == []  # the failed checkout released its lease
        (kept,) = glob.glob(os.path.join(store_root, "quarantine", f"{digest}.*.safetensors"))
        with open(kept, "rb") as f:
            assert f.read() == damaged  # moved, not deleted or changed: kept for forensics
        assert not os.path.exists(path_of(store_root, digest))
        # the next commit of the correct weights writes fresh bytes instead of reusing the damaged object
        store.commit(2, sd).result()
        with store.checkout(2, verify=True) as snap:
            assert_state_equal(snap, sd)


def test_plain_checkout_in_a_new_process_serves_the_flipped_byte(store_root):
    """By design a local checkout re-hashes nothing (it reads no byte): a flipped bit is served,
    silently, to a process that checks out and loads. ``verify=True`` catches it."""
    sd = weights(2)
    with ParamStore(store_root) as store:
        store.commit(1, sd).result()
        flip_byte(path_of(store_root, object_of(store, 1)))
    code = textwrap.dedent(f"""
        import torch
        from paramstore import ParamStore
        from paramstore.errors import CorruptObjectError
        with ParamStore({store_root!r}) as store:
            module = torch.nn.Module()
            module.layer = torch.nn.Linear(64, 64).to(torch.float32)
            module.layer.bias.data = module.layer.bias.data.to(torch.bfloat16)
            module.register_buffer("step", torch.tensor(0))
            with store.checkout(1) as snap:
                snap.load_into(module)
            print("loaded", module.layer.weight.detach().clone().numpy().tobytes().hex())
            try:
                store.checkout(1, verify=True)
            except CorruptObjectError as e:
                print("verify raised", type(e).__name__)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    loaded = bytes.fromhex(lines["loaded"])
    want = sd["layer.weight"].numpy().tobytes()
    assert len(loaded) == len(want) and loaded != want  # wrong weights, no error: by design
    assert sum(a != b for a, b in zip(loaded, want)) == 1
    assert lines["verify"] == "raised CorruptObjectError"


def test_verify_says_what_to_do_and_repair_quarantines(store_root):
    sd = weights(3)
    with ParamStore(store_root) as store:
        store.commit(1, sd).result()
        digest = object_of(store, 1)
        damaged = flip_byte(path_of(store_root, digest))
        r = store.verify()
        assert not r["ok"] and list(r["corrupt"]) == [digest] and r["damaged_versions"] == [1]
        assert "paramstore verify --repair" in r["advice"]

        r = store.verify(repair=True)  # no remote, no peer: quarantined, not restored
        assert list(r["quarantined"]) == [digest]
        with open(r["quarantined"][digest], "rb") as f:
            assert f.read() == damaged
        assert r["restored"] == [] and list(r["unrepaired"]) == [1] and not r["ok"]
        assert "paramstore rm 1" in r["advice"]
        with pytest.raises(ObjectUnavailableError, match="quarantined"):
            store.checkout(1)

        # a re-commit of the correct weights is correct (dedup no longer points at the damaged bytes)
        store.commit(2, sd).result()
        assert store.verify(2)["ok"]
        with store.checkout(2) as snap:
            assert_state_equal(snap, sd)


def test_cli_repair_without_a_good_copy_then_rm(store_root):
    a, b = weights(4), weights(5)
    with ParamStore(store_root) as store:
        store.commit(1, a).result()
        store.commit(2, b).result()  # nothing shared with 1
        digest = object_of(store, 1)
    flip_byte(path_of(store_root, digest))

    proc = cli(store_root, "verify")
    assert proc.returncode == 1 and f"CORRUPT {digest}" in proc.stdout
    assert "paramstore verify --repair" in proc.stdout

    proc = cli(store_root, "verify", "--repair")
    assert proc.returncode == 1, proc.stderr
    assert f"quarantined {digest}" in proc.stdout and "still damaged: step 1" in proc.stdout
    assert "paramstore rm 1" in proc.stdout and proc.stdout.strip().splitlines()[-2] == "DAMAGED"

    # refused while leased (naming the holder), and for the latest version
    with ParamStore(store_root) as store, store.checkout(2, holder="rollout-7"):
        line = one_error_line(cli(store_root, "rm", "2"))
        assert "rollout-7" in line and "latest" not in line
    assert "latest" in one_error_line(cli(store_root, "rm", "2"))

    proc = cli(store_root, "rm", "1")
    assert proc.returncode == 0, proc.stderr
    assert "removed step 1" in proc.stdout and "paramstore gc" in proc.stdout
    proc = cli(store_root, "verify")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout
    cli(store_root, "gc")
    assert glob.glob(os.path.join(store_root, "quarantine", f"{digest}.*"))  # GC leaves quarantine alone
    with ParamStore(store_root) as store:
        with store.checkout(2, verify=True) as snap:
            assert_state_equal(snap, b)


def test_remove_api(store_root):
    with ParamStore(store_root) as store:
        for step in (1, 2, 3):
            store.commit(step, weights(10 + step)).result()
        with store.checkout(2, holder="evaluator") as snap:
            with pytest.raises(InvalidArgumentError, match="evaluator"):
                store.remove(2)
            assert snap.step == 2
        with pytest.raises(InvalidArgumentError, match="latest"):
            store.remove("latest")
        assert store.remove(2).step == 2
        assert [v.step for v in store.versions()] == [1, 3]
        with pytest.raises(KeyError):
            store.remove(2)
        assert store.gc().objects  # its object goes at the next GC


def test_repair_from_a_remote_restores_the_object(s3_server, s3_remote, store_root):
    url, opts = s3_remote
    sd = weights(6)
    with ParamStore(store_root, remote=url, storage_options=opts) as store:
        store.commit(1, sd).persisted.result(60)
        digest = object_of(store, 1)
        flip_byte(path_of(store_root, digest))
        r = store.verify(repair=True)
        assert list(r["quarantined"]) == [digest] and r["restored"] == [digest]
        assert r["ok"] and r["unrepaired"] == {} and r["advice"] == ""
        assert store.verify() == {**store.verify(), "ok": True}
        with store.checkout(1, verify=True) as snap:
            assert_state_equal(snap, sd)
        # the remote's copy is registered for dedup no more, but a re-commit stays correct
        store.commit(2, sd).result()
        with store.checkout(2, verify=True) as snap:
            assert_state_equal(snap, sd)

    # the same through the CLI (the remote named by --remote / $PARAMSTORE_REMOTE)
    flip_byte(path_of(store_root, digest), from_end=2000)
    env = dict(os.environ, AWS_ENDPOINT_URL=s3_server.endpoint)
    proc = cli(store_root, "verify", "--repair", "--remote", url, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"restored {digest}" in proc.stdout and proc.stdout.strip().endswith("REPAIRED")
    proc = cli(store_root, "verify", env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK")


# -- truncated objects and damaged metadata --------------------------------------------------------
@pytest.mark.parametrize("keep", [0, 20, -300])  # empty; inside the header; inside the data
def test_truncated_object_raises_corrupt_object_error_at_checkout(store_root, keep):
    sd = weights(7)
    with ParamStore(store_root) as store:
        store.commit(1, sd).result()
        path = path_of(store_root, object_of(store, 1))
        truncate(path, keep if keep >= 0 else os.path.getsize(path) + keep)
        with pytest.raises(CorruptObjectError) as info:  # before any tensor view is made
            store.checkout(1)
        assert path in str(info.value) and "version 1" in str(info.value)
        assert not isinstance(info.value, ObjectUnavailableError)
        assert store.leases() == []
        with pytest.raises(CorruptObjectError, match="truncated"):  # mapped without the registry's sizes
            store.diff(1, 1)
        assert not store.verify()["ok"]


def test_truncated_object_in_the_cli(store_root):
    with ParamStore(store_root) as store:
        store.commit(1, weights(8)).result()
        store.commit(2, weights(9)).result()
        path = path_of(store_root, object_of(store, 1))
    truncate(path, os.path.getsize(path) - 1000)
    proc = cli(store_root, "verify")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "CORRUPT" in proc.stdout and "paramstore verify --repair" in proc.stdout
    line = one_error_line(cli(store_root, "diff", "1", "2"))  # maps the objects: was a bare torch RuntimeError
    assert "CorruptObjectError" not in line and path in line
    proc = cli(store_root, "show", "1")  # show reads no object byte: it still works
    assert proc.returncode == 0 and "step       1" in proc.stdout


def test_checkout_of_a_truncated_object_in_a_new_process(store_root):
    with ParamStore(store_root) as store:
        store.commit(1, weights(10)).result()
        path = path_of(store_root, object_of(store, 1))
    truncate(path, os.path.getsize(path) // 2)
    code = textwrap.dedent(f"""
        from paramstore import ParamStore
        from paramstore.errors import CorruptObjectError
        with ParamStore({store_root!r}) as store:
            try:
                snap = store.checkout(1)
                print("no error", float(snap["layer.weight"].sum()))
            except CorruptObjectError as e:
                print("CorruptObjectError")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr  # no SIGBUS, no RuntimeError
    assert proc.stdout.strip() == "CorruptObjectError"


def test_unparsable_manifest_is_a_corrupt_store_error(store_root):
    with ParamStore(store_root) as store:
        store.commit(1, weights(11)).result()
        store.commit(2, weights(12)).result()
    # overwrite version 1's manifest in the LMDB registry with bytes that are not JSON
    code = textwrap.dedent(f"""
        import lmdb, struct
        env = lmdb.open({os.path.join(store_root, "meta")!r}, max_dbs=32, subdir=True)
        db = env.open_db(b"manifests", create=False)
        with env.begin(write=True) as txn:
            assert txn.get(struct.pack(">Q", 1), db=db) is not None
            txn.put(struct.pack(">Q", 1), b'{{"format": 1, "tensors": {{', db=db)
        env.close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
    with ParamStore(store_root) as store:
        with pytest.raises(CorruptStoreError, match=os.path.join(store_root, "meta")):
            store.checkout(1)
        r = store.verify()
        assert not r["ok"] and 1 in r["unreadable_manifests"] and r["damaged_versions"] == [1]
        r = store.verify(repair=True)
        assert list(r["unrepaired"]) == [1] and "paramstore rm 1" in r["advice"]
        store.remove(1)
        assert store.verify()["ok"]


def test_background_scrub_quarantines_a_damaged_object(shm_dir):
    """scrub_rate: damage in place is found without anyone reading the version."""
    import warnings as _warnings

    from paramstore import ParamStore, ParamStoreWarning

    root = os.path.join(shm_dir, "scrubbed")
    with ParamStore(root) as s:
        s.commit(1, {"w": torch.arange(4096, dtype=torch.float32)}).result()
        s.commit(2, {"w": torch.ones(4096)}).result()
        digest = sorted(s.manifest(1).objects())[0]
        path = s._root.tier.object_path(digest)
    with open(path, "r+b") as f:  # one flipped byte in the data of version 1's object
        f.seek(os.path.getsize(path) - 3)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        with ParamStore(root, scrub_rate=64 << 20) as s:
            deadline = time.monotonic() + 30
            while not s._open.scrubber.quarantined and time.monotonic() < deadline:
                time.sleep(0.05)
            assert s._open.scrubber.quarantined == [digest]
            assert s.verify()["missing"] == [digest]  # gone from objects/, kept in quarantine/
    msgs = [str(w.message) for w in caught if issubclass(w.category, ParamStoreWarning)]
    assert any(digest in m and "[1]" in m and "verify --repair" in m for m in msgs), msgs
