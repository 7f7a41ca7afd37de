"""A throwaway redis-server for tests: loopback only, a free port, no persistence.

``running()`` starts one and yields its URL; the test session that starts it stops it. Tests skip
(with the reason) where no ``redis-server`` binary is installed.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Iterator

import redis

__all__ = ["running", "free_port", "BINARY"]

BINARY = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(*extra: str, timeout: float = 10.0, password: str | None = "test-secret") -> Iterator[str]:
    """Start redis-server on 127.0.0.1 (``--save "" --appendonly no``); yield ``redis://:<password>@127.0.0.1:<port>/0``.

    ``password``: the server's ``requirepass`` (as a deployment would set; None for none).
    ``extra``: more server arguments.
    """
    if password is not None:
        extra = (*extra, "--requirepass", password)
    for _ in range(5):  # another process may take the port between free_port() and the bind
        port = free_port()
        with tempfile.TemporaryDirectory(prefix="paramstore-redis-") as work:
            proc = subprocess.Popen(
                [BINARY, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                 "--dir", work, *extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            try:
                url = f"redis://{'' if password is None else f':{password}@'}127.0.0.1:{port}/0"
                if _ready(url, proc, time.monotonic() + timeout):
                    yield url
                    return
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    raise RuntimeError("could not start redis-server on a free port")


def _ready(url: str, proc: subprocess.Popen, deadline: float) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                return bool(client.ping())
            except redis.AuthenticationError:
                return True  # up, and asking for a password
            except redis.ConnectionError:
                time.sleep(0.02)
        return False
    finally:
        client.close()
