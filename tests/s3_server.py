"""A real S3 API for the tests: moto's server over HTTP on 127.0.0.1, one per test session.

``S3Server`` can be stopped and started again on the same port (the buckets live in this process
and survive), which is how the tests take the endpoint away in the middle of an upload.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
logging.getLogger("werkzeug").setLevel(logging.ERROR)


class S3Server:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._cls = ThreadedMotoServer
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: Any = None
        self.start()

    def start(self) -> None:
        for _ in range(50):  # the port may linger briefly after a stop
            try:
                self._server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
                self._server.start()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"cannot restart moto on port {self.port}")

    def stop(self) -> None:
        self._server.stop()

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)

    def new_bucket(self) -> str:
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def options(self, **fast: Any) -> dict[str, Any]:
        """s3fs options for this endpoint; failures surface within about a second."""
        return {"endpoint_url": self.endpoint,
                "config_kwargs": {"connect_timeout": 1, "read_timeout": 10, "retries": {"max_attempts": 1}}, **fast}

    def keys(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every key under ``prefix`` and its size (read through the S3 API)."""
        out: dict[str, int] = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        return out
