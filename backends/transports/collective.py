"""The collective contract: every member of a process group takes part in each transfer.

Where :class:`~paramstore.backends.transports.base.Transport` is one-sided (a reader pulls ranges
of a peer's registered memory), a :class:`Collective` moves bytes among the members of a group,
all of them calling the same operations in the same order: :meth:`Collective.broadcast` (one
member's buffer to every other one, in place), :meth:`Collective.all_gather_bytes` (every member's
short message to every member) and :meth:`Collective.broadcast_bytes`. Buffers are ``uint8``
tensors on :attr:`Collective.device` (CUDA for NCCL, NPU for HCCL, CPU for gloo): bf16 and fp8
travel as bytes (gloo refuses float8 and uint16 tensors). Messages are bytes (JSON, say): nothing
is pickled.

A member that dies, or a collective that fails, raises
:class:`~paramstore.errors.BroadcastError` on the members that notice; an implementation makes
sure the others notice too (it tears the group down) rather than leaving them waiting.

:class:`TorchCollective` implements it over ``torch.distributed`` (torch is imported only when one
is created).

Example (a group of one: gloo, this process)::

    >>> import torch, torch.distributed as dist
    >>> dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
    >>> coll = TorchCollective()
    >>> coll.rank, coll.size, coll.device.type
    (0, 1, 'cpu')
    >>> coll.all_gather_bytes(b'{"lack": []}')
    [b'{"lack": []}']
    >>> buf = torch.arange(4, dtype=torch.uint8)
    >>> coll.broadcast(buf, 0).wait(); buf.tolist()
    [0, 1, 2, 3]
    >>> coll.broadcast_bytes(b"hello", 0)
    b'hello'
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import abc
import re
import time
from typing import TYPE_CHECKING, Any, Callable

from paramstore.errors import BroadcastError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["Collective", "Pending", "TorchCollective"]

#: The most bytes :meth:`Collective.broadcast_bytes` and :meth:`Collective.all_gather_bytes` accept
#: in one message (a manifest of a few hundred thousand tensors fits): the default and the ceiling
#: of their ``limit``. A caller passes the ``limit`` its protocol needs (a few MiB for a short JSON
#: reply), so that a member announcing more makes nobody allocate it.
MAX_MESSAGE_BYTES = 1 << 30

#: The key of a group's rendezvous store under which the first member that fails writes
#: ``rank <r>: <why>`` (see :class:`TorchCollective`).
FAILED_KEY = "paramstore/collective/failed"

#: How often a member waiting for a transfer looks for another member's failure (seconds).
POLL_S = 0.05

#: Short messages travel in one collective of this many bytes (8 of them the length); longer
#: ones take a second collective for the rest.
FRAME_BYTES = 4096


def _frame(data: bytes) -> "torch.Tensor":
    """A CPU ``uint8`` tensor of :data:`FRAME_BYTES`: ``len(data)`` (8 bytes, little-endian), then
    as much of ``data`` as fits, zero-padded."""
    import torch

    head = len(data).to_bytes(8, "little") + data[: FRAME_BYTES - 8]
    return torch.frombuffer(bytearray(head.ljust(FRAME_BYTES, b"\0")), dtype=torch.uint8)


def _limit(limit: object) -> int:
    """A message ``limit`` checked: an int in [0, :data:`MAX_MESSAGE_BYTES`]."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= MAX_MESSAGE_BYTES:
        raise InvalidArgumentError(f"a message limit must be an int in [0, {MAX_MESSAGE_BYTES}], got {limit!r}")
    return limit


class Pending:
    """A transfer in flight: :meth:`wait` returns once it is complete on this member (its buffer
    may then be read or reused), or raises BroadcastError."""

    def __init__(self, wait: Callable[[], None] | None = None) -> None:
        self._wait = wait

    def wait(self) -> None:
        """Block until the transfer is complete here. Raises BroadcastError (then the buffer holds
        garbage). Idempotent."""
        w, self._wait = self._wait, None
        if w is not None:
            w()


class Collective(abc.ABC):
    """A process group as paramstore uses it: members numbered ``0 .. size - 1``, each calling
    the same operations in the same order."""

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This member's rank in the group (0-based)."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """The number of members."""

    @property
    @abc.abstractmethod
    def device(self) -> "torch.device":
        """Where the buffers handed to :meth:`broadcast` must live (``cuda:i`` for NCCL, ``npu:i``
        for HCCL, ``cpu`` for gloo)."""

    @abc.abstractmethod
    def broadcast(self, tensor: "torch.Tensor", src: int, *, async_op: bool = False) -> Pending:
        """Copy member ``src``'s ``tensor`` into every other member's ``tensor``, in place.

        Args:
            tensor: a contiguous 1-D ``uint8`` tensor on :attr:`device`, of the same length on
                every member (read on ``src``, written on the others).
            src: the sending member's rank in this group.
            async_op: return at once; the caller then calls ``wait()`` on the result before it
                touches ``tensor`` (transfers started complete in the order they were started).

        Returns:
            A :class:`Pending` (already complete unless ``async_op``).

        Raises:
            BroadcastError: the transfer failed (a member died or left): ``tensor`` holds garbage.
        """

    @abc.abstractmethod
    def all_gather_bytes(self, payload: bytes, *, limit: int = MAX_MESSAGE_BYTES) -> list[bytes]:
        """Every member's ``payload``, in rank order, on every member.

        Payloads may differ in length (empty ones included).

        Args:
            payload: this member's message (at most ``limit`` bytes).
            limit: the longest message the caller's protocol allows (at most
                :data:`MAX_MESSAGE_BYTES`; every member passes the same). A member that announces a
                longer one fails the exchange before anything of that length is allocated.

        Returns:
            ``size`` byte strings; entry ``r`` is member ``r``'s payload.

        Raises:
            BroadcastError: the exchange failed, or a payload is longer than ``limit``.
        """

    def broadcast_bytes(self, payload: bytes | None, src: int, *, limit: int = MAX_MESSAGE_BYTES) -> bytes:
        """Member ``src``'s ``payload`` on every member (others pass None, or anything: ignored).

        Note for implementers: the default makes one :meth:`broadcast` of a :data:`FRAME_BYTES`
        frame (the length, 8 bytes little-endian, then the payload's head) and a second one for
        the rest of a longer payload; override it where the group has something better.

        Args:
            payload: the message, on ``src`` (at most ``limit`` bytes).
            src: the sending member's rank.
            limit: the longest message the caller's protocol allows (see :meth:`all_gather_bytes`).

        Returns:
            ``src``'s payload.

        Raises:
            BroadcastError: the transfer failed, or the payload is longer than ``limit``.
        """
        import torch

        limit = _limit(limit)
        mine = self.rank == src
        data = bytes(payload or b"") if mine else b""
        if mine and len(data) > limit:
            raise BroadcastError(f"a message of {len(data)} bytes is larger than {limit}", rank=self.rank)
        frame = _frame(data) if mine else torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        frame = frame.to(self.device)
        self.broadcast(frame, src)
        head = frame.cpu().numpy().tobytes()
        n = int.from_bytes(head[:8], "little")
        if n > limit:
            self.abort(f"rank {src} announced a message of {n} bytes")
            raise BroadcastError(f"rank {src} announced a message of {n} bytes (more than {limit})", rank=src)
        if n <= FRAME_BYTES - 8:
            return data if mine else head[8:8 + n]
        rest = (torch.frombuffer(bytearray(data[FRAME_BYTES - 8:]), dtype=torch.uint8) if mine
                else torch.empty(n - (FRAME_BYTES - 8), dtype=torch.uint8)).to(self.device)
        self.broadcast(rest, src)
        return data if mine else head[8:] + rest.cpu().numpy().tobytes()

    def barrier(self) -> None:
        """Return once every member called it. Raises BroadcastError.

        Note for implementers: the default is an empty :meth:`all_gather_bytes`."""
        self.all_gather_bytes(b"")

    def abort(self, reason: str = "") -> None:
        """Give up on the group: make every member waiting in a transfer with this one fail (with
        BroadcastError naming this rank and ``reason``) instead of waiting for it. Called after a
        transfer failed or the caller met an unexpected error mid-protocol; the group is unusable
        afterwards.

        Note for implementers: the default does nothing; override it where the group can be
        aborted (idempotent). A transfer not complete when the group fails may still be read or
        written by the group's own threads after its wait raised: keep every buffer handed to one
        alive and mapped for the life of the process (:func:`abandon`), never free it."""


#: Buffers (and work handles) of transfers given up before they completed: see :func:`abandon`.
_abandoned: list[Any] = []


def abandon(*things: Any) -> None:
    """Keep ``things`` (tensors handed to a transfer, its work handle) for the rest of the process.

    Aborting a gloo group ends the waits on its transfers while its transport thread may still
    have a ``writev``/``readv`` of their buffers queued; freeing one then (a bounce buffer, a
    mapping of an object) made that thread fail with ``EFAULT`` ("Bad address") and gloo abort the
    whole process (CI, once in ~1,000 runs of a test that interrupts a member mid-stream), or could
    let it write into memory reused for something else. The cost is the buffers in flight when one
    group failed (two buckets of a collective checkout), once per failed group."""
    _abandoned.append(things)


class TorchCollective(Collective):
    """:class:`Collective` over a ``torch.distributed`` process group (gloo, NCCL, HCCL, ...).

    Args:
        group: the process group (None: the default one). Ranks given to :meth:`broadcast` are
            ranks in this group (``group_src``), not global ranks.
        device: where buffers must live; by default from the group's backend: the current CUDA
            device for ``nccl``, the current NPU for ``hccl``, else the CPU.
        timeout: seconds one transfer may take before it counts as failed (None: the group's
            own timeout, given when it was created; 30 minutes by default).

    Raises:
        InvalidArgumentError: ``torch.distributed`` is not initialized, or this process is not a
            member of ``group``.

    **Failures reach every member.** A member that dies closes its connections, but only the
    members exchanging bytes with it directly notice: gloo's broadcast is a tree, and the others
    would wait for the group's timeout. So a member whose transfer fails (or that calls
    :meth:`abort`) writes ``rank r: why`` under :data:`FAILED_KEY` in the group's rendezvous store
    (the ``init_method``'s file or TCP store), and every member waits for its transfers in a
    polling loop that looks at that key every :data:`POLL_S` seconds: each raises
    BroadcastError naming the failed rank within about that. A store that cannot be reached (its
    host, rank 0, died) counts as a failure too. A transfer abandoned this way may still write
    into its buffer later: the caller never reuses nor frees it (:mod:`paramstore.collective` keeps
    it for the life of the process).
    After a failure the group is broken for good: make a new one. With gloo, transfers abandoned
    while their peers live on stay queued on gloo's threads until the group's timeout, which can
    hold up ``destroy_process_group`` and the interpreter's exit for that long (measured here: a
    process left with such a transfer did not exit within 40 s); a member that ends after a
    BroadcastError may prefer ``os._exit``, or a group made with a short ``timeout``.
    """

    def __init__(self, group: Any = None, *, device: "torch.device | str | None" = None,
                 timeout: float | None = None) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgumentError("a collective checkout needs torch.distributed initialized "
                                       "(dist.init_process_group) and a process group")
        self._dist = dist
        self._group = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(self._group)
        if rank < 0:
            raise InvalidArgumentError("this process is not a member of the process group given")
        self._rank, self._size = rank, dist.get_world_size(self._group)
        self.backend = str(dist.get_backend(self._group))
        self._device = torch.device(device) if device is not None else _backend_device(self.backend, self._group)
        self._timeout = timeout
        self._aborted = False
        self._in_flight: dict[int, tuple[Any, ...]] = {}  # id(work) -> (work, its tensors), until complete
        try:
            self._store: Any = distributed_c10d._get_process_group_store(self._group)
        except Exception:  # noqa: BLE001 - private API: without it, failures are noticed by neighbours only
            self._store = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self) -> "torch.device":
        return self._device

    def broadcast(self, tensor: "torch.Tensor", src: int, *, async_op: bool = False) -> Pending:
        self._check_src(src)
        self._check_not_failed()
        try:
            work = self._dist.broadcast(tensor, group=self._group, group_src=src, async_op=True)
        except RuntimeError as e:
            raise self._failed("a broadcast", e) from e
        self._in_flight[id(work)] = (work, tensor)
        pending = Pending(lambda: self._wait(work, "a broadcast"))
        if not async_op:
            pending.wait()
        return pending

    def all_gather_bytes(self, payload: bytes, *, limit: int = MAX_MESSAGE_BYTES) -> list[bytes]:
        import torch

        limit = _limit(limit)
        data = bytes(payload)
        if len(data) > limit:
            raise BroadcastError(f"a message of {len(data)} bytes is larger than {limit}", rank=self.rank)
        # One all_gather of FRAME_BYTES frames (length + head) carries short messages whole; only if
        # some member's is longer, a second one carries every member's rest (padded to the longest).
        frames = [torch.empty(FRAME_BYTES, dtype=torch.uint8, device=self._device) for _ in range(self._size)]
        self._all_gather(frames, _frame(data).to(self._device))
        heads = [f.cpu().numpy().tobytes() for f in frames]
        lengths = [int.from_bytes(h[:8], "little") for h in heads]
        top = max(lengths)
        if top > limit:  # before anything of that length is allocated (every member: size x top)
            liar = lengths.index(top)
            self.abort(f"rank {liar} announced a message of {top} bytes")
            raise BroadcastError(f"rank {liar} announced a message of {top} bytes (more than {limit})", rank=liar)
        room = FRAME_BYTES - 8
        if top <= room:
            return [h[8:8 + n] for h, n in zip(heads, lengths)]
        mine = torch.zeros(top - room, dtype=torch.uint8)
        if len(data) > room:
            mine[: len(data) - room] = torch.frombuffer(bytearray(data[room:]), dtype=torch.uint8)
        rests = [torch.empty(top - room, dtype=torch.uint8, device=self._device) for _ in range(self._size)]
        self._all_gather(rests, mine.to(self._device))
        return [h[8:8 + min(n, room)] + r.cpu().numpy()[: max(0, n - room)].tobytes()
                for h, n, r in zip(heads, lengths, rests)]

    def abort(self, reason: str = "") -> None:
        if self._aborted:
            return
        self._aborted = True
        if self._in_flight:  # their buffers outlive the group (abandon): its threads may still use them
            abandon(*self._in_flight.values())
            self._in_flight.clear()
        if self._store is not None:
            try:
                if not self._store.check([FAILED_KEY]):
                    self._store.set(FAILED_KEY, f"rank {self._rank}: {reason or 'gave up'}"[:2000])
            except Exception:  # noqa: BLE001 - the store's host died: the others notice that themselves
                pass
        try:
            self._group.abort()  # NCCL/HCCL: frees the communicator; gloo: stops its work
        except Exception:  # noqa: BLE001 - best effort: the group is broken anyway
            pass

    # -- internals ---------------------------------------------------------------------------
    def _all_gather(self, out: list[Any], tensor: Any) -> None:
        self._check_not_failed()
        try:
            work = self._dist.all_gather(out, tensor, group=self._group, async_op=True)
        except RuntimeError as e:
            raise self._failed("an all_gather", e) from e
        self._in_flight[id(work)] = (work, tensor, *out)
        self._wait(work, "an all_gather")

    def _wait(self, work: Any, what: str) -> None:
        """Wait for ``work``; meanwhile look for another member's failure every :data:`POLL_S`.

        Polls ``is_completed()`` with sleeps growing to 1 ms (a blocking ``wait()`` on another
        thread costs more per transfer: small messages are latency-bound)."""
        start = time.monotonic()
        look = start + POLL_S
        nap = 2e-5
        while not work.is_completed():
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)
            now = time.monotonic()
            if now >= look:
                look = now + POLL_S
                other = self._other_failed()
                if other is not None:
                    raise self._failed(what, None, other)
                if self._timeout is not None and now - start > self._timeout:
                    raise self._failed(what, TimeoutError(f"not complete after {self._timeout} s"))
        try:
            work.wait()
        except RuntimeError as e:
            raise self._failed(what, e, self._other_failed()) from e
        self._in_flight.pop(id(work), None)  # complete: its buffers are the caller's again

    def _other_failed(self) -> str | None:
        """What another member wrote under :data:`FAILED_KEY` (or why the store cannot be read)."""
        if self._store is None:
            return None
        try:
            if not self._store.check([FAILED_KEY]):
                return None
            return bytes(self._store.get(FAILED_KEY)).decode(errors="replace")
        except Exception as e:  # noqa: BLE001 - the store's host (rank 0) died
            return f"the group's rendezvous store cannot be reached ({' '.join(str(e).split())[:200]})"

    def _check_not_failed(self) -> None:
        if self._aborted:
            raise BroadcastError(f"the {self.backend} group was aborted on rank {self._rank} after a failure",
                                 rank=self._rank)
        other = self._other_failed()
        if other is not None:
            raise self._failed("a transfer", None, other)

    def _failed(self, what: str, e: BaseException | None, other: str | None = None) -> BroadcastError:
        """The error to raise (after telling the others, and aborting the group)."""
        why = " ".join(str(e).split())[:300] if e is not None else ""
        rank = self._rank
        if other is not None:  # another member failed first: name it
            m = re.match(r"rank (\d+): ", other)
            rank = int(m.group(1)) if m else rank
            message = (f"{what} over the {self.backend} group stopped on rank {self._rank} of {self._size}: "
                       f"{other}" if m else f"{what} over the {self.backend} group failed on rank {self._rank} "
                       f"of {self._size}: {other}")
        else:
            message = (f"{what} over the {self.backend} group failed on rank {self._rank} of {self._size} "
                       f"(a member died, left or stalled?): {why}")
        self.abort(f"{what} failed here: {why}" if other is None else f"stopped after {other}")
        return BroadcastError(message, rank=rank)

    def _check_src(self, src: int) -> None:
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self._size:
            raise InvalidArgumentError(f"src must be a rank of the group (0..{self._size - 1}), got {src!r}")


def _backend_device(backend: str, group: Any = None) -> "torch.device":
    """The device a group's buffers live on, from its backend name (``"nccl"``, ``"gloo"``,
    ``"cpu:gloo,cuda:nccl"`` ...): accelerator backends first. A group bound to a device
    (``init_process_group(..., device_id=)``, which does not make it current) uses that one."""
    import torch

    names = {part.rsplit(":", 1)[-1] for part in backend.lower().split(",")}
    bound = getattr(group, "bound_device_id", None)
    if bound is not None and bound.type in ("cuda", "npu") and ({"nccl", "hccl"} & names):
        return torch.device(bound)
    if "nccl" in names:
        return torch.device("cuda", torch.cuda.current_device())
    if "hccl" in names:
        import torch_npu  # noqa: F401 - registers the npu device

        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")
