"""``make gpu-check`` (tools/gpu_check.py) on a machine without a GPU, and what it relies on there:
``import paramstore`` from a plain checkout (the GPU machine has no network to install it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: make gpu-check runs the GPU path")
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "gpu_check.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "no CUDA device" in out.stdout
    assert os.listdir(tmp_path) == []  # nothing ran


def test_paramstore_imports_from_a_plain_checkout(tmp_path):
    # Without the editable install's finder: the checkout on sys.path, as on the GPU machine.
    code = ("import sys; sys.meta_path = [f for f in sys.meta_path if 'Editable' not in repr(f)]; "
            f"sys.path.insert(0, {REPO!r}); import paramstore.backends.tiers.local as m, paramstore; "
            "print(m.__file__); print(paramstore.ParamStore.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [os.path.join(REPO, "backends", "tiers", "local.py"), "ParamStore"]
