"""Shared fixtures for the paramstore test suite (the helpers are in ``helpers.py``).

Every store lives on /dev/shm (tmpfs, what paramstore is designed for) in a per-test directory that
is removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

import paramstore
from helpers import SHM

# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture
def shm_dir():
    """A fresh directory on /dev/shm, removed after the test."""
    d = tempfile.mkdtemp(prefix="paramstore-test-", dir=SHM)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def store_root(shm_dir):
    """Path of a store root that does not exist yet (inside a per-test /dev/shm directory)."""
    return os.path.join(shm_dir, "store")


@pytest.fixture
def store(store_root):
    """A new, empty store with default settings (created now); closed after the test."""
    s = paramstore.ParamStore(store_root, create=True)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def gloo_group(tmp_path):
    """A one-process gloo group (``torch.distributed`` initialized in this process), destroyed after."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch built without distributed")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- a real S3 API (moto's server on 127.0.0.1) -----------------------------------------------
@pytest.fixture(scope="session")
def s3_server():
    # Installed by paramstore's dev extra; an integration environment may lack them (its tests skip).
    pytest.importorskip("moto", reason="moto is not installed (pip install -e '.[dev]')")
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'paramstore[s3]')")
    from s3_server import S3Server

    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_remote(s3_server):
    """(url, options) of an empty prefix in a fresh bucket."""
    bucket = s3_server.new_bucket()
    return f"s3://{bucket}/store", s3_server.options()


@pytest.fixture(scope="session")
def redis_url():
    """``redis://127.0.0.1:<port>/0`` of a redis-server started for this session (skips without one)."""
    pytest.importorskip("redis", reason="redis-py is not installed (pip install 'paramstore[redis]')")
    import redis_server

    if not os.path.exists(redis_server.BINARY):
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    with redis_server.running() as url:
        yield url
