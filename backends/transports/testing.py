"""The transport conformance suites: what every :class:`~paramstore.backends.transports.base.Transport`
and every :class:`~paramstore.backends.transports.collective.Collective` must do.

Shipped with the package so that a new transport is tested by them. Subclass :class:`TransportTests`
in a pytest module and implement :meth:`TransportTests.open_transport`::

    from paramstore.backends.transports.testing import TransportTests

    class TestMyTransport(TransportTests):
        def open_transport(self):
            return MyTransport("127.0.0.1")

The suite reads from real peers: each is a child process (this interpreter, this ``sys.path``) that
imports the subclass's module, opens a transport with ``open_transport``, registers a read-only
mapping of a file of random bytes and serves it until its stdin closes.

Subclass :class:`CollectiveTests` and implement :meth:`CollectiveTests.open_collective` (called in
each member, a fresh process, to join a group of ``world`` members that meet through a directory)::

    from paramstore.backends.transports.testing import CollectiveTests

    class TestGloo(CollectiveTests):
        def open_collective(self, rank, world, rendezvous):
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"file://{rendezvous}/pg", rank=rank, world_size=world)
            return TorchCollective()

Members report JSON on their stdout; nothing is pickled. Both suites require pytest
(``paramstore[dev]``); the collective suite also torch.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, NamedTuple

import pytest

from paramstore.errors import BroadcastError, InvalidArgumentError, StoreClosedError, TransferError

from .base import Transport
from .collective import Collective

__all__ = ["TransportTests", "CollectiveTests", "Served", "random_bytes"]

MiB = 1 << 20

#: A session nobody listens at.
NOBODY = "127.0.0.1:1"

#: The longest any failure may take to reach the caller in these tests (never a hang).
PROMPT_S = 10.0


def random_bytes(nbytes: int, seed: int) -> bytes:
    """``nbytes`` pseudo-random bytes drawn from ``seed``."""
    return random.Random(seed).randbytes(nbytes)


def address_of(buf: Any) -> int:
    """The address of the first byte of a writable buffer (an mmap, a bytearray)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _child_env() -> dict[str, str]:
    """This process's environment, with its ``sys.path`` as the child's PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}


def _load(module: str, qualname: str) -> Any:
    """An instance of the test class ``module.qualname`` (in a child process)."""
    cls: Any = importlib.import_module(module)
    for name in qualname.split("."):
        cls = getattr(cls, name)
    return cls()


class Served(NamedTuple):
    """A peer process serving ``data`` at ``addr`` of its registered memory, at ``session``."""

    proc: subprocess.Popen
    session: str
    addr: int
    data: bytes


# -- one-sided transports ----------------------------------------------------------------------
class TransportTests:
    """Conformance tests for a :class:`Transport`; subclasses implement :meth:`open_transport`."""

    #: Bytes served by the peer of the large read (several slices of most engines).
    large_bytes: int = 8 * MiB

    def open_transport(self) -> Transport:  # pragma: no cover - overridden
        """A new transport of this process, reachable on 127.0.0.1 (also called in peer processes)."""
        raise NotImplementedError("subclass TransportTests and implement open_transport()")

    @pytest.fixture(scope="class")
    @classmethod
    def transport(cls) -> Iterator[Transport]:
        """One transport for the class's tests (each unregisters what it registered)."""
        t = cls().open_transport()
        try:
            yield t
        finally:
            t.close()

    @pytest.fixture
    def serve(self, tmp_path: Any) -> Iterator[Callable[..., Served]]:
        """``serve(nbytes, seed)``: a peer process serving ``nbytes`` random bytes; killed at teardown."""
        procs: list[subprocess.Popen] = []
        cls = type(self)

        def start(nbytes: int, seed: int) -> Served:
            data = random_bytes(nbytes, seed)
            path = os.path.join(str(tmp_path), f"served-{seed}")
            with open(path, "wb") as f:
                f.write(data)
            code = "from paramstore.backends.transports.testing import _serve; _serve()"
            proc = subprocess.Popen([sys.executable, "-c", code, cls.__module__, cls.__qualname__, path],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_child_env())
            procs.append(proc)
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, "the peer did not start"
            info = json.loads(line)
            return Served(proc, info["session"], info["addr"], data)

        yield start
        for p in procs:
            p.kill()
            p.wait()

    @staticmethod
    def destination(transport: Transport, nbytes: int) -> tuple[mmap.mmap, int]:
        """A fresh anonymous mapping of ``nbytes``, registered: ``(mapping, address)``."""
        m = mmap.mmap(-1, nbytes)
        return m, transport.register(m)

    # -- reads ---------------------------------------------------------------------------------
    def test_session_is_an_address(self, transport: Transport) -> None:
        assert isinstance(transport.session, str) and transport.session

    def test_read_the_whole_buffer(self, transport: Transport, serve: Callable[..., Served]) -> None:
        srv = serve(self.large_bytes, seed=1)
        m, dst = self.destination(transport, self.large_bytes)
        transport.read(srv.session, [(dst, srv.addr, self.large_bytes)])
        assert m[:] == srv.data
        transport.unregister(dst)

    def test_read_several_ranges(self, transport: Transport, serve: Callable[..., Served]) -> None:
        """Scattered ranges, 1 byte to 64 KiB, packed front to back into the destination."""
        srv = serve(4 * MiB, seed=2)
        m, dst = self.destination(transport, 64 * MiB)
        rng = random.Random(7)
        reads, at = [], 0
        for _ in range(300):
            n = rng.randint(1, 64 << 10)
            off = rng.randrange(0, 4 * MiB - n)
            reads.append((dst + at, srv.addr + off, n))
            at += n
        transport.read(srv.session, reads)
        for local, remote, n in reads:
            assert m[local - dst:local - dst + n] == srv.data[remote - srv.addr:remote - srv.addr + n]
        transport.unregister(dst)

    def test_nothing_to_read(self, transport: Transport) -> None:
        transport.read(NOBODY, [])  # returns at once, whoever the peer is

    def test_register_returns_the_address_and_is_idempotent(self, transport: Transport,
                                                            serve: Callable[..., Served]) -> None:
        srv = serve(MiB, seed=3)
        m = mmap.mmap(-1, MiB)
        addr = transport.register(m)
        assert addr == address_of(m)
        assert transport.register(m) == addr  # again: the same registration
        transport.read(srv.session, [(addr, srv.addr, MiB)])
        assert m[:] == srv.data
        transport.unregister(addr)

    def test_registered_mapping_stays_open(self, transport: Transport) -> None:
        m, addr = self.destination(transport, MiB)
        with pytest.raises(BufferError):
            m.close()  # the transport keeps it mapped while registered
        transport.unregister(addr)
        m.close()

    # -- failures ------------------------------------------------------------------------------
    def test_unregistered_remote_range_fails(self, transport: Transport, serve: Callable[..., Served]) -> None:
        srv = serve(MiB, seed=4)
        m, dst = self.destination(transport, 2 * MiB)
        for remote in (srv.addr + MiB, srv.addr + MiB // 2):  # outside the peer's buffer; crossing its end
            t0 = time.monotonic()
            with pytest.raises(TransferError):
                transport.read(srv.session, [(dst, remote, MiB)])
            assert time.monotonic() - t0 < PROMPT_S
        transport.read(srv.session, [(dst, srv.addr, MiB)])  # the peer still serves what it registered
        assert m[:MiB] == srv.data
        transport.unregister(dst)

    def test_nobody_listening(self, transport: Transport) -> None:
        _, dst = self.destination(transport, MiB)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            transport.read(NOBODY, [(dst, 1 << 40, MiB)])
        assert time.monotonic() - t0 < PROMPT_S
        transport.unregister(dst)

    def test_read_into_memory_not_registered_fails(self, transport: Transport) -> None:
        m = mmap.mmap(-1, MiB)  # never registered
        for bad in ([(address_of(m), 1 << 40, 4096)], [(1 << 44, 1 << 40, 4096)]):
            with pytest.raises(InvalidArgumentError):
                transport.read(NOBODY, bad)
        addr = transport.register(m)
        with pytest.raises(InvalidArgumentError):
            transport.read(NOBODY, [(addr + MiB // 2, 1 << 40, MiB)])  # runs past the registered buffer
        transport.unregister(addr)
        with pytest.raises(InvalidArgumentError):
            transport.read(NOBODY, [(addr, 1 << 40, 4096)])  # no longer registered
        ro = memoryview(bytes(MiB))
        ro_addr = transport.register(ro)
        with pytest.raises(InvalidArgumentError):
            transport.read(NOBODY, [(ro_addr, 1 << 40, MiB)])  # read-only: cannot be a destination
        transport.unregister(ro_addr)
        m.close()

    def test_what_cannot_be_registered_is_refused(self, transport: Transport) -> None:
        m = mmap.mmap(-1, 2 * MiB)
        addr = transport.register(m)
        with pytest.raises(InvalidArgumentError):
            transport.register(memoryview(m)[MiB:])  # inside the registered buffer: overlaps it
        with pytest.raises(InvalidArgumentError):
            transport.register(bytearray())  # empty
        with pytest.raises(InvalidArgumentError):
            transport.unregister(addr + 4096)  # nothing registered there
        transport.unregister(addr)
        with pytest.raises(InvalidArgumentError):
            transport.unregister(addr)  # twice
        m.close()

    def test_dead_peer_fails_and_the_transport_goes_on(self, transport: Transport,
                                                       serve: Callable[..., Served]) -> None:
        doomed, live = serve(MiB, seed=5), serve(MiB, seed=6)
        m, dst = self.destination(transport, MiB)
        transport.read(doomed.session, [(dst, doomed.addr, MiB)])
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            transport.read(doomed.session, [(dst, doomed.addr, MiB)])
        assert time.monotonic() - t0 < PROMPT_S
        transport.read(live.session, [(dst, live.addr, MiB)])
        assert m[:] == live.data
        transport.unregister(dst)

    def test_frozen_peer_fails_within_the_timeout(self, transport: Transport, serve: Callable[..., Served]) -> None:
        srv = serve(4 * MiB, seed=7)
        _, dst = self.destination(transport, 4 * MiB)
        transport.read(srv.session, [(dst, srv.addr, MiB)])
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferError):
                transport.read(srv.session, [(dst, srv.addr, 4 * MiB)], timeout=0.5)
            assert time.monotonic() - t0 < PROMPT_S
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        transport.unregister(dst)  # (the destination may still be written: it is not reused)

    # -- lifetime ------------------------------------------------------------------------------
    def test_close_is_idempotent_and_final(self) -> None:
        t = self.open_transport()
        m, _ = self.destination(t, 4096)
        t.close()
        t.close()
        m.close()  # every registration was released
        with pytest.raises(StoreClosedError):
            t.read(NOBODY, [])
        with pytest.raises(StoreClosedError):
            t.register(mmap.mmap(-1, 4096))

    def test_not_usable_after_fork(self, transport: Transport) -> None:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                transport.register(mmap.mmap(-1, 4096))
            except StoreClosedError:
                code = 0
            except BaseException:  # noqa: BLE001 - the wrong error: reported by the exit code
                code = 2
            os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _serve() -> None:
    """A peer process (see :meth:`TransportTests.serve`): ``sys.argv[1:]`` is the test class's module
    and qualified name and a file; maps the file read-only, registers it, prints its session and
    address as JSON, and serves until stdin closes."""
    module, qualname, path = sys.argv[1:]
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(fd)
    t = _load(module, qualname).open_transport()
    print(json.dumps({"session": t.session, "addr": t.register(m)}), flush=True)
    sys.stdin.read()
    t.close()


# -- collectives -------------------------------------------------------------------------------
class CollectiveTests:
    """Conformance tests for a :class:`Collective`; subclasses implement :meth:`open_collective`.

    Each test runs :attr:`world` members, each a fresh process, bounded by :attr:`timeout_s`."""

    #: Members of each group (at least 3: a broadcast tree has inner members).
    world: int = 3

    #: Seconds a group's run may take before its members are killed.
    timeout_s: float = 60.0

    def open_collective(self, rank: int, world: int, rendezvous: str) -> Collective:  # pragma: no cover
        """Join a group of ``world`` members as ``rank``, meeting through the directory ``rendezvous``
        (in a member process: no fixtures)."""
        raise NotImplementedError("subclass CollectiveTests and implement open_collective(rank, world, rendezvous)")

    def run_group(self, scenario: str, tmp_path: Any, *, dies: int | None = None) -> dict[int, Any]:
        """Run ``scenario`` (a function of this module named ``_scenario_<name>``) on every member;
        returns ``{rank: what it reported}``. ``dies``: that member exits on its own mid-scenario."""
        cls = type(self)
        rendezvous = tempfile.mkdtemp(prefix="rendezvous-", dir=str(tmp_path))
        code = "from paramstore.backends.transports.testing import _member; _member()"
        procs = [subprocess.Popen([sys.executable, "-c", code, cls.__module__, cls.__qualname__, str(rank),
                                   str(self.world), rendezvous, scenario, str(dies)],
                                  stdout=subprocess.PIPE, text=True, env=_child_env())
                 for rank in range(self.world)]
        deadline = time.monotonic() + self.timeout_s
        out: dict[int, Any] = {}
        try:
            for rank, p in enumerate(procs):
                stdout, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                lines = [line for line in stdout.splitlines() if line.startswith("{")]
                if lines:
                    out[rank] = json.loads(lines[-1])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for rank, got in out.items():
            assert "error" not in got, f"member {rank} failed:\n{got['error']}"
        return out

    def test_identity(self, tmp_path: Any) -> None:
        got = self.run_group("identity", tmp_path)
        assert sorted(got) == list(range(self.world))
        for rank, out in got.items():
            assert (out["rank"], out["size"]) == (rank, self.world)
            assert out["device"], "a member names the device its buffers live on"

    def test_broadcast(self, tmp_path: Any) -> None:
        got = self.run_group("broadcast", tmp_path)
        assert sorted(got) == list(range(self.world))
        for out in got.values():
            assert out["sync"] == [1]  # member 1's bytes everywhere
            assert out["async"] == [[2], [12], [22]]  # three in flight, complete in order
            assert out["bad_src"] == "InvalidArgumentError"

    def test_messages(self, tmp_path: Any) -> None:
        got = self.run_group("messages", tmp_path)
        assert sorted(got) == list(range(self.world))
        for out in got.values():
            assert out["gathered"] == ["x" * (5 * r) for r in range(self.world)]  # lengths differ, one empty
            assert out["empty"] == [""] * self.world
            assert out["bytes"] == b"\x00\xff json or anything".hex()
            assert out["bytes_empty"] == ""
            assert out["long_gathered"] == [True] * self.world  # longer than a frame
            assert out["long_bytes"] is True
            assert out["barrier"] is True

    def test_a_member_that_dies_fails_the_others(self, tmp_path: Any) -> None:
        victim = self.world - 1
        got = self.run_group("death", tmp_path, dies=victim)
        assert victim not in got
        assert sorted(got) == list(range(victim)), "a survivor gave no report (it hung?)"
        for rank, out in got.items():
            assert out["raised"] == "BroadcastError", (rank, out)
            assert out["seconds"] < self.timeout_s / 2


def _scenario_identity(coll: Collective, dies: int | None) -> dict[str, Any]:
    return {"rank": coll.rank, "size": coll.size, "device": str(coll.device)}


def _scenario_broadcast(coll: Collective, dies: int | None) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    buf = torch.full((1000,), coll.rank, dtype=torch.uint8, device=coll.device)
    coll.broadcast(buf, 1).wait()
    out["sync"] = sorted(set(buf.cpu().tolist()))
    bufs = [torch.full((10,), coll.rank + 10 * i, dtype=torch.uint8, device=coll.device) for i in range(3)]
    pending = [coll.broadcast(b, 2, async_op=True) for b in bufs]
    for p in pending:
        p.wait()
        p.wait()  # idempotent
    out["async"] = [sorted(set(b.cpu().tolist())) for b in bufs]
    try:
        coll.broadcast(buf, coll.size)
        out["bad_src"] = "accepted"
    except InvalidArgumentError:
        out["bad_src"] = "InvalidArgumentError"
    return out


def _scenario_messages(coll: Collective, dies: int | None) -> dict[str, Any]:
    rank = coll.rank
    out: dict[str, Any] = {}
    out["gathered"] = [b.decode() for b in coll.all_gather_bytes(("x" * (rank * 5)).encode())]
    out["empty"] = [b.decode() for b in coll.all_gather_bytes(b"")]
    out["bytes"] = coll.broadcast_bytes(b"\x00\xff json or anything" if rank == 0 else None, 0).hex()
    out["bytes_empty"] = coll.broadcast_bytes(b"" if rank == 0 else b"ignored", 0).hex()
    long = bytes(range(256)) * 40  # 10 KiB
    got = coll.all_gather_bytes(long[: 5000 * rank])  # 0, 5000, 10000... bytes
    out["long_gathered"] = [g == long[: 5000 * r] for r, g in enumerate(got)]
    out["long_bytes"] = coll.broadcast_bytes(long if rank == 1 else None, 1) == long
    coll.barrier()
    out["barrier"] = True
    return out


def _scenario_death(coll: Collective, dies: int | None) -> dict[str, Any]:
    import torch

    coll.barrier()
    if coll.rank == dies:
        os._exit(3)  # gone without a word
    buf = torch.zeros(MiB, dtype=torch.uint8, device=coll.device)
    t0 = time.monotonic()
    try:
        for _ in range(50):
            coll.broadcast(buf, 0)
            coll.all_gather_bytes(b"still here")
        return {"raised": None, "seconds": time.monotonic() - t0}
    except BroadcastError:
        return {"raised": "BroadcastError", "seconds": time.monotonic() - t0}


def _member() -> None:
    """A member process (see :meth:`CollectiveTests.run_group`): joins the group, runs the scenario,
    prints its report as one JSON line and exits at once (a broken group's threads may otherwise
    hold up the interpreter's exit)."""
    module, qualname, rank, world, rendezvous, scenario, dies = sys.argv[1:]
    try:
        coll = _load(module, qualname).open_collective(int(rank), int(world), rendezvous)
        run = globals()[f"_scenario_{scenario}"]
        report = run(coll, None if dies == "None" else int(dies))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        report = {"error": "".join(traceback.format_exception(e))}
    print(json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)
