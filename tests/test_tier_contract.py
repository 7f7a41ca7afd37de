"""The tier contract (``backends/tiers/base.py``), run against every tier through the shipped
conformance suite (``paramstore.backends.tiers.testing.TierTests``): the shared-memory tier, a
``file://`` remote and a real S3 API (moto's server on 127.0.0.1)."""

from __future__ import annotations

import uuid

import pytest

from paramstore.backends.tiers import LocalTier, RemoteTier
from paramstore.backends.tiers.testing import TierTests


class TestLocalTier(TierTests):
    @pytest.fixture
    def tier(self, shm_dir):
        with LocalTier(shm_dir, create=True) as t:
            yield t


class TestFileRemoteTier(TierTests):
    @pytest.fixture
    def tier(self, tmp_path):
        with RemoteTier(f"file://{tmp_path}/remote") as t:
            yield t


class TestS3RemoteTier(TierTests):
    @pytest.fixture
    def tier(self, s3_server):
        bucket = s3_server.new_bucket()
        with RemoteTier(f"s3://{bucket}/{uuid.uuid4().hex[:8]}", s3_server.options()) as t:
            yield t


class TestDeviceTierOnCpu(TierTests):
    """The device tier's bookkeeping and copies, on the CPU (its CUDA copies: the class below)."""

    @pytest.fixture
    def tier(self):
        from paramstore.backends.tiers.device import DeviceTier

        with DeviceTier("cpu", bucket_bytes=4096) as t:  # objects of several buckets
            yield t


@pytest.mark.gpu
class TestDeviceTierOnCuda(TierTests):
    @pytest.fixture
    def tier(self):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device in this process")
        from paramstore.backends.tiers.device import DeviceTier

        with DeviceTier("cuda", bucket_bytes=4096) as t:  # bounce buffers reused many times per object
            yield t
