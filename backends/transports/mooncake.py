"""Peer-to-peer reads through the Mooncake transfer engine (``pip install 'paramstore[mooncake]'``).

Each process runs one engine in P2P-handshake mode: no metadata server, a peer is reached at its
``host:port`` session. RDMA where the caller asks for it (``protocol="rdma", device="mlx5_0"``), TCP
otherwise; ``MC_FORCE_TCP`` in the environment (any value, as the engine reads it) forces TCP.

How a read runs: the ranges are cut into slices of at most ``slice_bytes``; at most ``window``
slices are in flight at once, each submitted as its own one-task batch (the engine's status call
only looks at a batch's first task, so one task per batch is the only way to see every task's
outcome without a busy-spinning wait), and completions are polled with short sleeps. A look costs
~30 us of CPU here (the sleep's wake-up mostly), so a read first sleeps through half the time
its bytes should take at the rate the last reads from that peer ran at (:data:`PACE_SHARE`), then
looks every 50 us, backing off to 1 ms. On TCP the engine spreads slices over 4 connections per
peer (``MC_TCP_LANES_PER_PEER``).

Failures (never a hang): a dead peer fails the read in tens of milliseconds; a frozen peer once
the read has made no progress for ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (whole seconds; set to 1 here
unless the environment says otherwise: the engine's own default, 30 s, is what a hung relay host
would cost every host behind it), or after the read's ``timeout``, whichever comes first; a range
the peer has not registered fails at once. A
peer that failed may fail the next read at once too, then takes ~1 s to reconnect: fail over to
another peer rather than retrying the same one straight away. On the first failure no further
slice is submitted and the read waits for the slices in flight to finish, so that nothing writes
into the destination once it raises. Only when the ``timeout`` runs out (``TransferError.code``
-2) are slices left in flight: they may still write into the destination later, so never reuse,
verify or publish that buffer; it is kept mapped (closing such an mmap raises BufferError) until
the engine lets go of it. Either way the destination holds garbage after a TransferError.

Mooncake's listener binds every interface and has no authentication: run it on a private network.
"""

from __future__ import annotations

import bisect
import ctypes
import operator
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from paramstore.errors import InvalidArgumentError, StoreClosedError, TransferError

from .base import Buffer, Read, Transport

__all__ = ["MooncakeTransport", "DEFAULT_TIMEOUT_S", "DEFAULT_SLICE_BYTES", "DEFAULT_WINDOW"]

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_SLICE_BYTES = 32 << 20
# One slice per TCP lane (MC_TCP_LANES_PER_PEER, default 4): as fast as 16 MiB x 8 or 64 MiB x 4 here
# (tools/bench_transport.py). The engine times slices out one after another on a lane, so a frozen
# peer fails after (window / lanes) progress timeouts: 1 here, 2 with 8, 5 with 16 in flight. The
# price is ~65 us per small read (4000 scattered 16 KiB reads: 0.26 s; 0.13 s with 256 in flight).
DEFAULT_WINDOW = 4
# The engine's deadline slides with every completion that moves bytes: 1 s without one is a
# stopped peer (or a burst of losses: TCP's back-off 0.2 + 0.4 + 0.8 s), which a relay passes over
# (a holder nobody else replaces is asked again after a back-off: paramstore.relay.PEER_RETRIES).
# At 5 s a hung relay host cost the hosts behind it +5.97 s at 100 Mbit/s, at 1 s +1.91 s
# (tools/bench_churn.py; docs/benchmarks.md, its block and the prose under it).
_ENV_DEFAULTS = {"MC_TCP_PROGRESS_TIMEOUT_SEC": "1"}
# glog severities (FLAGS_minloglevel): 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL.
_QUIET_LEVEL, _VERBOSE_LEVEL = 3, 1
_MINLOGLEVEL = "_ZN3fLI17FLAGS_minloglevelE"  # glog's ``int FLAGS_minloglevel``, mangled
_NAP_MIN_S, _NAP_MAX_S = 50e-6, 1e-3
#: The share of a read's expected time (its bytes at the seconds per byte the last reads from that
#: peer took, :attr:`MooncakeTransport._pace`) it sleeps through before it first looks, where all
#: its slices are in flight at once (~30 us of CPU a look here; counted on the 8-host cluster at
#: 1 Gbit/s, a host's looks per version fell from 2,000-2,700 to 1,300-1,750, ~7.4 per 2 MiB block
#: read). A read found done at its first look counts as having taken this share of its time,
#: so after a link got faster the estimate halves with each read (:func:`_pace`).
PACE_SHARE = 0.5
#: Reads of fewer bytes take the time of a round trip, not of their bytes: neither paced nor measured.
PACE_MIN_BYTES = 256 << 10


def _pace(last: float | None, took: float, first_look: bool) -> float:
    """The seconds per byte to expect of a peer's next read, after one that ``took`` that many
    (``first_look``: found done at its first look, so it may have taken much less: counted as
    :data:`PACE_SHARE` of it). A faster read is taken at once; a slower one moves the estimate an
    eighth of the way: a peer stalled once (a loss burst, a busy moment) must not make the next
    reads oversleep, while a link that really got slower only costs a few more looks.

        >>> _pace(None, 8e-9, False), _pace(8e-9, 4e-9, False), _pace(8e-9, 80e-9, False)
        (8e-09, 4e-09, 1.7e-08)
        >>> _pace(8e-9, 8e-9, True)  # done when first looked at: at most half that
        4e-09
    """
    if first_look:
        took *= PACE_SHARE
    if last is None or took <= last:
        return took
    return last + (took - last) / 8
# transfer_check_status: 1 done, 0 in flight, -1 failed; both 1 and -1 free the batch.
_DONE, _PENDING, _FAILED = 1, 0, -1


def _engine_class() -> Any:
    """Import Mooncake (once its environment defaults are set: it reads them at import and start),
    and set its log level (see :class:`MooncakeTransport`)."""
    for name, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        import mooncake.engine as module
    except ImportError as e:  # not installed, or libibverbs.so.1 missing
        raise TransferError("the Mooncake transport needs the transfer engine: pip install "
                            "'paramstore[mooncake]' and Debian's libibverbs1 (linked even for TCP); "
                            f"import failed: {e}") from e
    _set_log_level(module.__file__)
    return module.TransferEngine


def _log_level() -> int | None:
    """The glog level to set, or None to leave Mooncake's own (``MC_LOG_LEVEL`` set by the user)."""
    if "MC_LOG_LEVEL" in os.environ:
        return None
    glog = os.environ.get("GLOG_minloglevel", "").strip()
    if glog.isdigit():
        return int(glog)
    verbose = os.environ.get("PARAMSTORE_VERBOSE", "").strip().lower()
    return _QUIET_LEVEL if verbose in ("", "0", "false", "no", "off") else _VERBOSE_LEVEL


#: Where Linux lists the host's RDMA devices (one directory per device).
RDMA_SYSFS = "/sys/class/infiniband"


def _check_rdma(device: str) -> None:
    """TransferError unless this host has the RDMA devices ``device`` names (a comma-separated list;
    empty: any). Asked for RDMA on a host without them, the engine logs a warning and quietly
    listens on TCP instead, so a run would go at TCP speed thinking it has RDMA."""
    try:
        have = sorted(os.listdir(RDMA_SYSFS))
    except OSError:
        have = []
    wanted = [d.strip() for d in device.split(",") if d.strip()]
    missing = [d for d in wanted if d not in have]
    if not have or missing:
        raise TransferError(f"protocol 'rdma' asks for RDMA device(s) {missing or 'any'} but this host has "
                            f"{have or 'none'} ({RDMA_SYSFS}): Mooncake would fall back to TCP without a "
                            "word; use protocol 'tcp' (or MC_FORCE_TCP=1), or name a device this host has")


def _set_log_level(library: str | None) -> None:
    """Write glog's ``FLAGS_minloglevel`` as seen by Mooncake's engine library.

    The engine reads ``MC_LOG_LEVEL`` when it is imported (a static initializer) and assigns
    ``FLAGS_minloglevel`` from it, INFO when unset, so glog's own ``GLOG_minloglevel`` is overwritten;
    and ``MC_LOG_LEVEL`` stops at ERROR. Nothing reads the flag again, so it is set here, after the
    import and before any engine exists. Best effort: a build that hides the symbol keeps its logs.
    """
    level = _log_level()
    if level is None or not library:
        return
    try:
        lib = ctypes.CDLL(library, mode=os.RTLD_NOLOAD)  # already loaded: lookups include its libglog
        ctypes.c_int.in_dll(lib, _MINLOGLEVEL).value = level
    except (OSError, ValueError):
        pass


@dataclass(frozen=True)
class _Region:
    """A registered buffer; ``pin`` holds a buffer export, so its mapping cannot be closed."""

    addr: int
    nbytes: int
    writable: bool
    pin: np.ndarray


@dataclass(frozen=True)
class _Slice:
    local: int
    remote: int
    nbytes: int


class MooncakeTransport(Transport):
    """A Mooncake ``TransferEngine`` behind the :class:`Transport` contract.

    Args:
        host: the address peers reach this process at (the engine listens on every interface).
        protocol: ``"tcp"`` or ``"rdma"`` (ignored when ``MC_FORCE_TCP`` is set). ``"rdma"`` on a
            host without the RDMA device(s) asked for raises TransferError (the engine itself
            would fall back to TCP silently). RDMA transfers are not verified here (no RDMA NIC).
        device: the RDMA device(s), e.g. ``"mlx5_0"`` (comma-separated; empty: any); empty for TCP.
        timeout: default limit in seconds for one :meth:`read`.
        slice_bytes: the largest range submitted as one transfer.
        window: how many slices are in flight at once.

    Registered buffers may be read-only (objects this process serves over TCP; RDMA registration
    may need writable ones) or writable (destinations). ``TransferError.code`` is the engine's
    status: -1 failed, -2 timed out (this class's ``timeout``, or the engine's; slices may still be
    writing), 0 refused at submission (nobody listening, or not a session), other values from
    initialize/register_memory. ``close()`` takes ~1 s (the engine stops its threads).

    Logs: Mooncake logs through glog on stderr, including ``E`` lines for events this class
    handles itself (a peer that is gone, a range it refused, "Local segment descriptor not found"
    at every handshake). They are off by default: the first transport of a process sets glog's
    ``FLAGS_minloglevel`` to FATAL in the engine's library (Mooncake's ``MC_LOG_LEVEL`` only goes
    down to ERROR, and it overwrites ``GLOG_minloglevel`` when imported). ``PARAMSTORE_VERBOSE=1``
    in the environment keeps warnings and errors; ``MC_LOG_LEVEL`` (``TRACE``, ``INFO``,
    ``WARNING``, ``ERROR``) set by the user is left to Mooncake and wins over both; a numeric
    ``GLOG_minloglevel`` is applied as given. Failures still reach the caller as TransferError.

    Example (between two hosts; shown, not run)::

        t = MooncakeTransport("10.0.0.7")
        addr = t.register(dst_mmap)
        t.read(peer_session, [(addr, remote_addr, len(dst_mmap))])
    """

    def __init__(self, host: str = "127.0.0.1", *, protocol: str = "tcp", device: str = "",
                 timeout: float = DEFAULT_TIMEOUT_S, slice_bytes: int = DEFAULT_SLICE_BYTES,
                 window: int = DEFAULT_WINDOW) -> None:
        if timeout <= 0 or slice_bytes <= 0 or window <= 0:
            raise InvalidArgumentError("timeout, slice_bytes and window must be positive")
        if "MC_FORCE_TCP" in os.environ:
            protocol = "tcp"
        if protocol == "rdma":
            _check_rdma(device)
        engine = _engine_class()()
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(f"cannot start the Mooncake transfer engine on {host} "
                                f"({protocol} {device!r}): code {rc}", code=rc)
        self._engine: Any = engine
        self.session = f"{host}:{engine.get_rpc_port()}"
        self.protocol = protocol
        self.timeout = float(timeout)
        self.slice_bytes = int(slice_bytes)
        self.window = int(window)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._regions: dict[int, _Region] = {}
        self._starts: list[int] = []  # sorted addresses of self._regions
        self._abandoned: list[tuple[int, int]] = []  # (batch id, local address) left in flight
        self._graveyard: list[_Region] = []  # unregistered, but an abandoned slice may still write
        self._pace: dict[str, float] = {}  # peer -> seconds per byte of its recent reads (running)

    # -- registration ---------------------------------------------------------------------------
    def register(self, buf: Buffer) -> int:
        engine = self._live()
        try:
            pin = np.frombuffer(buf, np.uint8)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"cannot register {type(buf).__name__}: {e}") from e
        addr, nbytes = pin.ctypes.data, pin.size
        if nbytes == 0:
            raise InvalidArgumentError("cannot register an empty buffer")
        with self._lock:
            old = self._regions.get(addr)
            if old is not None and old.nbytes == nbytes:
                return addr
            if old is not None or self._overlaps(addr, nbytes):
                raise InvalidArgumentError(f"buffer {addr:#x}+{nbytes} overlaps a registered one")
            rc = engine.register_memory(addr, nbytes)
            if rc != 0:
                raise TransferError(f"register_memory({addr:#x}, {nbytes}) failed: code {rc}", code=rc)
            self._regions[addr] = _Region(addr, nbytes, pin.flags.writeable, pin)
            bisect.insort(self._starts, addr)
        return addr

    def unregister(self, addr: int) -> None:
        engine = self._live()
        with self._lock:
            region = self._regions.pop(addr, None)
            if region is None:
                raise InvalidArgumentError(f"no buffer is registered at {addr:#x}")
            self._starts.remove(addr)
            rc = engine.unregister_memory(addr)
            self._reap()
            if any(region.addr <= local < region.addr + region.nbytes for _, local in self._abandoned):
                self._graveyard.append(region)
        if rc != 0:
            raise TransferError(f"unregister_memory({addr:#x}) failed: code {rc}", code=rc)

    def _overlaps(self, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr + nbytes)`` meets a registered buffer (lock held)."""
        i = bisect.bisect_left(self._starts, addr)
        if i < len(self._starts) and self._starts[i] < addr + nbytes:
            return True
        prev = self._regions[self._starts[i - 1]] if i else None
        return prev is not None and prev.addr + prev.nbytes > addr

    def _region_at(self, addr: int, nbytes: int) -> _Region | None:
        """The registered buffer holding ``[addr, addr + nbytes)``, if any (lock held)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        region = self._regions[self._starts[i]]
        return region if addr + nbytes <= region.addr + region.nbytes else None

    # -- reads ----------------------------------------------------------------------------------
    def read(self, peer: str, reads: Sequence[Read], *, timeout: float | None = None) -> None:
        """See :meth:`Transport.read`; ``timeout`` defaults to the transport's."""
        engine = self._live()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        if self._abandoned:
            with self._lock:
                self._reap()
        todo = self._slices(reads)[::-1]  # popped from the end
        pending: dict[int, _Slice] = {}
        failure: TransferError | None = None
        nbytes = sum(s.nbytes for s in todo)
        paced = nbytes >= PACE_MIN_BYTES and len(todo) <= self.window  # all in flight at once
        pace = self._pace.get(peer) if paced else None
        looks = 0
        t0 = time.monotonic()
        nap = _NAP_MIN_S
        while True:
            while failure is None and todo and len(pending) < self.window:
                s = todo.pop()
                batch = engine.batch_transfer_async_read(peer, [s.local], [s.remote], [s.nbytes])
                if batch == 0:
                    failure = TransferError(f"{peer} refused a read (nobody listening, or not a session)",
                                            peer=peer, code=0)
                else:
                    pending[batch] = s
            if not pending:
                break
            if pace is not None:  # the first look: after PACE_SHARE of the time the bytes should take
                time.sleep(min(PACE_SHARE * pace * nbytes, max(0.0, deadline - time.monotonic())))
                pace = None
            looks += 1
            progressed = False
            for batch, s in list(pending.items()):
                rc = engine.transfer_check_status(batch)
                if rc == _PENDING:
                    continue
                progressed = True
                del pending[batch]
                if rc not in (_DONE, _FAILED):  # a timeout status does not free the batch
                    self._abandon(batch, s)
                if rc != _DONE and failure is None:
                    failure = TransferError(f"read of {s.nbytes} bytes at {s.remote:#x} from {peer} "
                                            f"failed: code {rc}", peer=peer, code=rc)
            if time.monotonic() >= deadline:
                for batch, s in pending.items():
                    self._abandon(batch, s)
                failure = failure or TransferError(f"read from {peer} timed out ({len(pending)} slices "
                                                   "left in flight)", peer=peer, code=-2)
                break
            nap = _NAP_MIN_S if progressed else min(2 * nap, _NAP_MAX_S)
            time.sleep(nap)
        if failure is not None:
            raise failure
        if paced:
            self._pace[peer] = _pace(self._pace.get(peer), (time.monotonic() - t0) / nbytes, looks == 1)
            if len(self._pace) > 4096:  # peers come and go: forget the oldest
                for old in list(self._pace)[:2048]:
                    self._pace.pop(old, None)

    def _slices(self, reads: Sequence[Read]) -> list[_Slice]:
        """Validate ``reads`` against the registered destinations and cut them into slices."""
        out: list[_Slice] = []
        step = self.slice_bytes
        with self._lock:
            for r in reads:
                try:
                    local, remote, nbytes = (operator.index(x) for x in r)
                except (TypeError, ValueError) as e:
                    raise InvalidArgumentError(f"a read is (local_addr, remote_addr, nbytes), got {r!r}") from e
                if nbytes < 0 or local < 0 or remote < 0:
                    raise InvalidArgumentError(f"negative address or length in read {r!r}")
                if nbytes == 0:
                    continue
                region = self._region_at(local, nbytes)
                if region is None or not region.writable:
                    raise InvalidArgumentError(f"local range {local:#x}+{nbytes} is not inside a "
                                               "registered writable buffer")
                out.extend(_Slice(local + o, remote + o, min(step, nbytes - o))
                           for o in range(0, nbytes, step))
        return out

    def _abandon(self, batch: int, s: _Slice) -> None:
        with self._lock:
            self._abandoned.append((batch, s.local))

    def _reap(self) -> None:
        """Forget abandoned slices the engine has finished, and buffers kept only for them (lock held)."""
        check = self._engine.transfer_check_status
        self._abandoned = [(b, a) for b, a in self._abandoned if check(b) not in (_DONE, _FAILED)]
        self._graveyard = [g for g in self._graveyard
                           if any(g.addr <= a < g.addr + g.nbytes for _, a in self._abandoned)]

    # -- lifetime -------------------------------------------------------------------------------
    def _live(self) -> Any:
        if self._pid != os.getpid():
            raise StoreClosedError(f"this MooncakeTransport belongs to process {self._pid}; after fork, "
                                   "create a new transport in the child")
        if self._engine is None:
            raise StoreClosedError("the transport is closed")
        return self._engine

    def close(self) -> None:
        """Stop the engine, then release every buffer (idempotent; in a forked child, only forgets)."""
        with self._lock:
            self._engine = None  # the engine stops (and stops writing) before the buffers are let go
            self._regions.clear()
            self._starts.clear()
            self._abandoned.clear()
            self._graveyard.clear()

    def __repr__(self) -> str:
        state = "closed" if self._engine is None else f"{len(self._regions)} buffers"
        return f"MooncakeTransport({self.session!r}, {self.protocol}, {state})"
