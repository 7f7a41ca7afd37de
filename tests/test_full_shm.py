"""A full shared-memory filesystem fails the commit cleanly (ENOSPC), never with SIGBUS.

Uses a real 2 MiB tmpfs mounted in a private mount namespace (needs root and `unshare`; skipped
otherwise).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import sys, torch, paramstore
    root = sys.argv[1]
    with paramstore.ParamStore(root, prepare_buffers=False) as store:
        store.commit(1, {"small": torch.ones(16)}).result()
        try:
            store.commit(2, {"big": torch.ones(4 << 20)}).result()  # 16 MiB into a 2 MiB tmpfs
        except OSError as e:  # the package's error, naming this filesystem (not /dev/shm)
            ok = isinstance(e, paramstore.StorageFullError) and e.errno == 28 and root in str(e) and "/dev/shm" not in str(e)
            print("ENOSPC" if ok else repr(e).replace(" ", "_"))
        with store.checkout("latest") as snap:
            print("latest", snap.step, float(snap["small"].sum()))
""")


def test_full_tmpfs_fails_the_commit_not_the_process(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    cmd = (f"mount -t tmpfs -o size=2m tmpfs {mnt} && "
           f"{sys.executable} {script} {mnt}/store")
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and ("mount" in proc.stderr or "unshare" in proc.stderr) \
            and "permi" in proc.stderr.lower():
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"exit {proc.returncode} (135 = SIGBUS): {proc.stderr}"
    assert proc.stdout.split() == ["ENOSPC", "latest", "1", "16.0"], proc.stdout
