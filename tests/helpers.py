"""Helpers shared by the test modules: bitwise tensor comparison, random bits, file trees, processes.

Test modules import them with ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``;
spawned child processes inherit that path). Not ``from helpers import``: the repository root has a
``conftest.py`` of its own (the doctests' namespace), which a child process would find first.
Helpers compare tensors *bitwise* (NaN payloads, -0.0 and float8 included).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Iterable, Mapping

import pytest
import torch

import paramstore

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

#: Every dtype paramstore promises to store.
ALL_DTYPES: list[torch.dtype] = [
    torch.bfloat16, torch.float16, torch.float32, torch.float64,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.bool, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.complex64,
]


# -- tensors -----------------------------------------------------------------------------------
def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a flat uint8 tensor (row-major, whatever its strides)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape, and the very same bits."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(as_bytes(a), as_bytes(b))


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(as_bytes(got), as_bytes(want)), f"{what}: bits differ"


def assert_state_equal(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """``got`` has exactly ``want``'s names and every tensor is bit-identical."""
    assert sorted(got.keys()) == sorted(want.keys())
    for name, t in want.items():
        assert_bits_equal(got[name], t, name)


def random_tensor(dtype: torch.dtype, shape: Iterable[int], seed: int) -> torch.Tensor:
    """A tensor of random *bits* (NaNs, infinities, subnormals included); bools are 0/1."""
    shape = tuple(shape)
    n = 1
    for d in shape:
        n *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def assert_checkout_equal(store: "paramstore.ParamStore", step: int, want: Mapping[str, torch.Tensor]) -> None:
    """Check out ``step`` afresh (new mappings of the files) and compare every bit with ``want``."""
    with store.checkout(step) as snap:
        assert_state_equal(snap, want)


# -- files -------------------------------------------------------------------------------------
def tree(path: str) -> dict[str, tuple[int, str]]:
    """Every file under ``path``: relative path -> (size, sha256 of the bytes)."""
    out: dict[str, tuple[int, str]] = {}
    if not os.path.isdir(path):
        return out
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                data = fh.read()
            out[os.path.relpath(p, path)] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def objects_bytes(root: str) -> int:
    """Total size of the object files of the store at ``root``."""
    return sum(size for size, _ in tree(os.path.join(root, "objects")).values())


def store_state(store: "paramstore.ParamStore") -> dict:
    """Everything a bad call must not change: versions, tags, registered objects, object and tmp files."""
    reg = store._root.registry
    return {
        "versions": [(v.step, v.digest, v.tags) for v in store.versions()],
        "tags": reg.tags(),
        "objects": reg.objects(),
        "object_files": tree(os.path.join(store.root, "objects")),
        "tmp_files": sorted(os.listdir(os.path.join(store.root, "tmp"))),
        "root_entries": sorted(os.listdir(store.root)),
    }


# -- processes ---------------------------------------------------------------------------------
def gather_and_join(procs: list, gather, join_timeout: float = 60):
    """Return ``gather()`` (which collects the processes' results), then join them; kill any left."""
    try:
        out = gather()
        for p in procs:
            p.join(timeout=join_timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return out


def run_in_small_tmpfs(tmp_path, size: str, child: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the script ``child`` with the store root ``<tmpfs>/store`` and ``args`` in a private
    mount namespace where a fresh tmpfs of ``size`` is mounted (skips the test where that is
    impossible)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = tmp_path / "child.py"
    script.write_text(child)
    cmd = (f"mount -t tmpfs -o size={size} tmpfs {mnt} && "
           f"{sys.executable} {script} {mnt}/store {' '.join(args)}")
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and ("mount" in proc.stderr or "unshare" in proc.stderr) \
            and "permi" in proc.stderr.lower():
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    return proc
