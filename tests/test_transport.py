"""MooncakeTransport between real processes on 127.0.0.1 over TCP (``MC_FORCE_TCP=1``).

The transport contract's shipped suite (``paramstore.backends.transports.testing.TransportTests``)
runs on it first; then what only Mooncake does (its error codes, slices abandoned on a timeout,
overlapping registrations, its logs). For the latter a server is this file run as a script: it maps a /dev/shm file the test filled with random bytes
(read-only, ``MAP_SHARED``), registers it, prints its session and address, and serves until its
stdin closes. The test process reads from it into its own registered memory and compares bytes.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator, NamedTuple

import numpy as np
import pytest

from paramstore.backends.transports import MooncakeTransport
from paramstore.backends.transports.mooncake import _engine_class
from paramstore.backends.transports.testing import TransportTests
from paramstore.errors import InvalidArgumentError, TransferError

os.environ.setdefault("MC_FORCE_TCP", "1")
try:
    _engine_class()  # sets Mooncake's environment defaults (quiet logs), then imports it
except TransferError as e:
    pytest.skip(str(e), allow_module_level=True)

MiB = 1 << 20
SHM = "/dev/shm"


class TestMooncakeTransport(TransportTests):
    """The contract's suite (peers: this module's class opened in other processes)."""

    large_bytes = 64 * MiB  # two slices of 32 MiB, read in parallel

    def open_transport(self) -> MooncakeTransport:
        return MooncakeTransport("127.0.0.1", timeout=20)


# -- Mooncake only -------------------------------------------------------------------------------
class Server(NamedTuple):
    proc: subprocess.Popen
    session: str
    addr: int
    data: np.ndarray  # the bytes it serves


def _serve(path: str) -> None:
    """Server process: map ``path`` read-only, register it, announce, serve until stdin closes."""
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(fd)
    t = MooncakeTransport("127.0.0.1")
    print(json.dumps({"session": t.session, "addr": t.register(m)}), flush=True)
    sys.stdin.read()
    t.close()


@pytest.fixture
def spawn(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Start servers of ``nbytes`` random bytes; all are killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(nbytes: int, seed: int, *, env: dict[str, str] | None = None, stderr=None) -> Server:
        path = f"{SHM}/ps-transport-test-{os.getpid()}-{seed}"
        data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        data.tofile(path)
        proc = subprocess.Popen([sys.executable, __file__, path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr, env=env, text=True)
        procs.append(proc)
        try:
            line = proc.stdout.readline()  # type: ignore[union-attr]
        finally:
            os.unlink(path)  # the server's mapping keeps the bytes
        assert line, "server did not start"
        info = json.loads(line)
        return Server(proc, info["session"], info["addr"], data)

    yield start
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def transport() -> Iterator[MooncakeTransport]:
    with MooncakeTransport("127.0.0.1", timeout=20) as t:
        yield t


def _dest(t: MooncakeTransport, nbytes: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, nbytes)
    return m, t.register(m)


def test_out_of_range_fails_fast(transport: MooncakeTransport, spawn) -> None:
    srv = spawn(1 * MiB, seed=2)
    _, dst = _dest(transport, 2 * MiB)
    for remote in (srv.addr + MiB, srv.addr + MiB // 2):  # outside; crossing the end
        t0 = time.monotonic()
        with pytest.raises(TransferError) as e:
            transport.read(srv.session, [(dst, remote, MiB)])
        assert time.monotonic() - t0 < 2
        assert e.value.peer == srv.session and e.value.code == -1
    transport.unregister(dst)


def test_nobody_listening_names_the_peer(transport: MooncakeTransport) -> None:
    _, dst = _dest(transport, MiB)
    t0 = time.monotonic()
    with pytest.raises(TransferError) as e:
        transport.read("127.0.0.1:1", [(dst, 1 << 40, MiB)])
    assert time.monotonic() - t0 < 5 and e.value.peer == "127.0.0.1:1" and e.value.code == 0
    transport.unregister(dst)


def test_peer_killed_mid_read_then_another_peer(transport: MooncakeTransport, spawn) -> None:
    doomed, live = spawn(128 * MiB, seed=3), spawn(8 * MiB, seed=4)
    m, dst = _dest(transport, 128 * MiB)
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        doomed.proc.send_signal(signal.SIGKILL)

    threading.Timer(0.3, kill).start()
    deadline = time.monotonic() + 10
    with pytest.raises(TransferError) as e:
        while time.monotonic() < deadline:  # 128 MiB takes ~50-100 ms: the kill lands mid-read
            transport.read(doomed.session, [(dst, doomed.addr, 128 * MiB)])
    assert killed_at and time.monotonic() - killed_at[0] < 3, "no prompt failure after the kill"
    assert e.value.peer == doomed.session

    transport.read(live.session, [(dst, live.addr, 8 * MiB)])  # (f) the same transport still works
    assert np.array_equal(np.frombuffer(m, np.uint8)[:8 * MiB], live.data)
    transport.unregister(dst)


def test_frozen_peer_times_out_and_its_buffer_stays_mapped(transport: MooncakeTransport, spawn) -> None:
    srv = spawn(64 * MiB, seed=5)
    m, dst = _dest(transport, 64 * MiB)
    transport.read(srv.session, [(dst, srv.addr, MiB)])
    srv.proc.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(TransferError) as e:
        transport.read(srv.session, [(dst, srv.addr, 64 * MiB)], timeout=0.5)
    assert e.value.code == -2 and time.monotonic() - t0 < 2
    transport.unregister(dst)
    with pytest.raises(BufferError):
        m.close()  # slices still in flight would write into it: kept mapped
    srv.proc.send_signal(signal.SIGCONT)
    _, small_dst = _dest(transport, MiB)
    deadline = time.monotonic() + 10
    while True:  # each read lets the transport forget the slices the engine has finished
        try:
            transport.read(srv.session, [(small_dst, srv.addr, MiB)])
            m.close()
            break
        except (TransferError, BufferError):
            assert time.monotonic() < deadline, "the abandoned slices never finished"
            time.sleep(0.1)
    transport.unregister(small_dst)


def test_a_read_is_paced_by_the_last_reads_from_its_peer(spawn) -> None:
    """A read whose slices are all in flight at once first sleeps through half the time its bytes
    took at the pace of the last reads from that peer, then looks. An estimate left from a slower
    link halves with each read found done at its first look; small reads are never paced."""
    srv = spawn(4 * MiB, seed=7)
    with MooncakeTransport("127.0.0.1", timeout=20) as t:
        m, dst = _dest(t, 4 * MiB)
        assert srv.session not in t._pace
        t.read(srv.session, [(dst, srv.addr, 4 * MiB)])
        assert 0 < t._pace[srv.session]
        slow = 0.4 / (4 * MiB)  # as if these 4 MiB had taken 0.4 s
        t._pace[srv.session] = slow
        t0 = time.monotonic()
        t.read(srv.session, [(dst, srv.addr, 4 * MiB)])
        assert time.monotonic() - t0 >= 0.2  # it slept through half of that first
        assert np.array_equal(np.frombuffer(m, np.uint8), srv.data)
        assert t._pace[srv.session] <= 0.75 * slow  # done at the first look: the estimate falls
        t._pace[srv.session] = 1.0  # a second per byte: a paced small read would sleep until its timeout
        t0 = time.monotonic()
        t.read(srv.session, [(dst, srv.addr, 4096)], timeout=10)
        assert time.monotonic() - t0 < 5 and t._pace[srv.session] == 1.0  # neither paced nor measured
        t.unregister(dst)


def test_registration_rules(transport: MooncakeTransport) -> None:
    m = mmap.mmap(-1, 4 * MiB)
    addr = transport.register(m)
    assert transport.register(m) == addr  # idempotent
    with pytest.raises(InvalidArgumentError):
        transport.register(memoryview(m)[MiB:])  # overlaps
    with pytest.raises(BufferError):
        m.close()  # kept mapped while registered
    with pytest.raises(InvalidArgumentError):
        transport.read("127.0.0.1:1", [(addr + 3 * MiB, 0, 2 * MiB)])  # destination runs past the buffer
    ro = memoryview(bytes(MiB))
    ro_addr = transport.register(ro)
    with pytest.raises(InvalidArgumentError):
        transport.read("127.0.0.1:1", [(ro_addr, 0, MiB)])  # read-only: cannot be a destination
    transport.read("127.0.0.1:1", [])  # nothing to do
    for a in (addr, ro_addr):
        transport.unregister(a)
    with pytest.raises(InvalidArgumentError):
        transport.unregister(addr)
    m.close()


GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+:\d+\]", re.M)


@pytest.mark.parametrize("setting, logs", [({}, False), ({"PARAMSTORE_VERBOSE": "1"}, True),
                                           ({"MC_LOG_LEVEL": "ERROR"}, True)])
def test_mooncake_logs_quiet_unless_asked(transport: MooncakeTransport, spawn, tmp_path,
                                          setting: dict[str, str], logs: bool) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MC_LOG_LEVEL", "GLOG_minloglevel", "PARAMSTORE_VERBOSE")}
    err_path = tmp_path / "server.err"
    with open(err_path, "w") as err:
        srv = spawn(MiB, seed=6, env={**env, **setting}, stderr=err)
    m, dst = _dest(transport, MiB)
    transport.read(srv.session, [(dst, srv.addr, MiB)])  # the handshake: "Local segment descriptor not found"
    assert np.array_equal(np.frombuffer(m, np.uint8), srv.data)
    with pytest.raises(TransferError):  # the server logs an E line for a range it refuses
        transport.read(srv.session, [(dst, srv.addr + MiB // 2, MiB)])
    transport.unregister(dst)
    srv.proc.stdin.close()  # type: ignore[union-attr]
    assert srv.proc.wait(30) == 0
    lines = GLOG_LINE.findall(err_path.read_text())
    if logs:
        assert any(line.startswith("E") for line in lines), err_path.read_text()
    else:
        assert not lines, err_path.read_text()


def test_missing_mooncake_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(TransferError, match=r"pip install 'paramstore\[mooncake\]'.*libibverbs1"):
        MooncakeTransport()


if __name__ == "__main__":
    _serve(sys.argv[1])
