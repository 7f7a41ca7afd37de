"""The device tier: objects held whole in one device's memory (a GPU, an NPU), in this process.

A device checkout (``store.checkout(v, device="cuda:0")``) makes the version's objects present in
the shared-memory tier as usual, then in the device tier of that device: each object becomes one
``uint8`` buffer on the device, a byte-for-byte copy of the object file, and the snapshot's tensors
are views of those buffers (offsets from the manifest, as for the shared-memory views). Objects are
content-addressed and immutable here too: an object already on the device is never copied again,
so a version that shares most objects with the last one moves only the ones that changed.

How bytes get onto the device (:meth:`DeviceTier.load`): in buckets of ``bucket_bytes``, each
copied by the CPU into one of two pinned bounce buffers and then to the device with
``non_blocking=True`` on a side stream; the CPU fills one bounce buffer (split across up to
``COPY_THREADS`` threads: one thread's memcpy out of a fresh mapping, page faults included, is
several times slower than the DMA) while the other one's DMA runs (an event per bounce buffer says when it may be refilled). One synchronisation at the end of
a load, none per tensor. The copies run on a side stream (which first waits for the work queued on
the caller's stream, whose memory pool the destinations come from), so a load can overlap compute.

On the CPU (``device="cpu"``) the tier keeps private copies in process memory; it exists there so
that the conformance suite (:class:`~paramstore.backends.tiers.testing.TierTests`) runs on any
machine. (A CPU checkout never uses it: it maps the shared-memory objects with no copy at all.)

The tier is not mappable in the :meth:`Tier.map` sense (no ``mmap`` of device memory);
:meth:`DeviceTier.buffer` returns an object's device buffer.

Verified: every path on the CPU. The CUDA path (pinned bounce buffers, side stream, events) is
written against PyTorch's device-agnostic stream API and is covered by ``gpu``-marked tests that
run only where a GPU is present; Ascend (``torch_npu``) is not verified.

Example:
    >>> import torch
    >>> tier = DeviceTier("cpu")
    >>> data = bytes(range(256)) * 16
    >>> digest = "ab" * 32
    >>> tier.load({digest: memoryview(data)})  # bytes moved
    4096
    >>> tier.exists(digest), tier.size(digest), tier.get(digest, 1, 4)
    (True, 4096, b'\\x01\\x02\\x03')
    >>> tier.buffer(digest).device, tier.load({digest: memoryview(data)})  # already there: nothing moves
    (device(type='cpu'), 0)
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Mapping

import torch

from paramstore import accel
from paramstore.validate import check_digest

from .base import Tier, check_range

__all__ = ["DeviceTier", "DEFAULT_BUCKET_BYTES"]

#: Size of one host-to-device copy (and of each of the two pinned bounce buffers).
DEFAULT_BUCKET_BYTES = 64 << 20
#: Threads that fill a bounce buffer together (each copies one part of the bucket).
COPY_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
_MIN_PART = 4 << 20  # below this a part is not worth a thread

#: The buffers a load copies from: an object's bytes in host memory.
HostBytes = memoryview | mmap.mmap | bytes | torch.Tensor


class DeviceTier(Tier):
    """Objects as ``uint8`` buffers on ``device``, in this process's memory.

    Args:
        device: a torch device (``"cuda:0"``, ``"npu:1"``, ``"cpu"``).
        bucket_bytes: size of one host-to-device copy.

    Raises:
        DeviceError: ``device`` is not available in this process.
    """

    mappable = False
    ranged_reads = True
    atomic_put = True

    def __init__(self, device: "str | torch.device", *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.device = accel.as_device(device)
        self.url = f"device://{self.device}"
        self.bucket_bytes = int(bucket_bytes)
        self._objects: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._bounce: list[torch.Tensor] = []  # two pinned host buffers, made on first use
        self._load_lock = threading.Lock()
        self._stream: "torch.Stream | None" = None
        self._copiers: "ThreadPoolExecutor | None" = None  # fill the bounce buffers, made on first use

    # -- the primitives ------------------------------------------------------------------------
    def exists(self, digest: str) -> bool:
        return check_digest(digest) in self._objects

    def size(self, digest: str) -> int:
        return self.buffer(digest).numel()

    def list(self) -> Iterator[str]:
        return iter(list(self._objects))

    def get(self, digest: str, start: int = 0, end: int | None = None) -> bytes:
        check_range(start, end)
        buf = self.buffer(digest)
        return bytes(buf[start:end].cpu().numpy().tobytes())

    def put(self, digest: str, path: str, *, move: bool = False) -> bool:
        check_digest(digest)
        if digest in self._objects:
            if move:
                os.unlink(path)
            return False
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else _Empty() as m:
                self.load({digest: m})
        if move:
            os.unlink(path)
        return True

    def delete(self, digest: str) -> None:
        with self._lock:
            self._objects.pop(check_digest(digest), None)

    # -- device-specific ---------------------------------------------------------------------------
    def buffer(self, digest: str) -> torch.Tensor:
        """Object ``digest``'s bytes on the device (a 1-D ``uint8`` tensor; do not write to it).
        Raises FileNotFoundError."""
        try:
            return self._objects[check_digest(digest)]
        except KeyError:
            raise FileNotFoundError(f"object {digest} is not on {self.device}") from None

    def adopt(self, digest: str, buf: torch.Tensor) -> None:
        """Hold ``buf`` (already on this device: opened from another process's memory, say) as
        object ``digest``. The caller has checked its bytes or trusts their source."""
        if buf.device != self.device or buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"adopt({digest[:12]}…): want a 1-D uint8 tensor on {self.device}, got "
                             f"{buf.dtype} {tuple(buf.shape)} on {buf.device}")
        with self._lock:
            self._objects.setdefault(check_digest(digest), buf)

    def keep_only(self, digests: "set[str] | frozenset[str]") -> int:
        """Drop every object not in ``digests``; returns the bytes dropped. Tensors a caller still
        holds keep their memory until they go (the tier only stops holding it)."""
        with self._lock:
            gone = [d for d in self._objects if d not in digests]
            return sum(self._objects.pop(d).numel() for d in gone)

    @property
    def nbytes(self) -> int:
        """Bytes of device memory the tier holds."""
        return sum(b.numel() for b in list(self._objects.values()))

    def load(self, sources: Mapping[str, HostBytes]) -> int:
        """Copy the objects of ``sources`` (digest -> bytes in host memory) that are not on the
        device yet; returns the bytes copied.

        Bucketed and overlapped: see the module docstring. Every copy has finished when this
        returns (a host buffer may be unmapped afterwards). The bytes are not checked: callers
        load verified objects (the shared-memory tier's).
        """
        todo = {check_digest(d): src for d, src in sources.items() if d not in self._objects}
        if not todo:
            return 0
        moved = 0
        if not accel.is_accelerator(self.device):
            for d, src in todo.items():
                host = _as_uint8(src)
                dst = torch.empty(host.numel(), dtype=torch.uint8)
                dst.copy_(host)
                self.adopt(d, dst)
                moved += host.numel()
            return moved
        # One load at a time per tier: loads share the bounce buffers and the side stream. The
        # caller's current device is restored afterwards.
        with self._load_lock, accel.device_guard(self.device):
            return self._load_on_device(todo)

    def _load_on_device(self, todo: Mapping[str, HostBytes]) -> int:
        moved = 0
        stream = self._side_stream()
        bounce = self._bounce_buffers()
        events: list["torch.Event | None"] = [None, None]
        turn = 0
        made: dict[str, torch.Tensor] = {}
        # The destinations come from the caller's stream's pool: blocks that stream freed may still be
        # read by kernels queued on it, so the side stream waits for what is queued there first.
        hosts = {d: _as_uint8(src) for d, src in todo.items()}
        dsts = {d: torch.empty(h.numel(), dtype=torch.uint8, device=self.device) for d, h in hosts.items()}
        stream.wait_stream(accel.current_stream(self.device))  # type: ignore[union-attr]
        try:
            for d, host in hosts.items():
                dst = dsts[d]
                for start in range(0, host.numel(), self.bucket_bytes):
                    n = min(self.bucket_bytes, host.numel() - start)
                    if events[turn] is not None:
                        events[turn].synchronize()  # type: ignore[union-attr]  # its last DMA is done
                    self._fill(bounce[turn][:n], host[start : start + n])
                    with accel.on_stream(stream):
                        dst[start : start + n].copy_(bounce[turn][:n], non_blocking=True)
                    events[turn] = accel.record_event(stream)
                    turn ^= 1
                made[d] = dst
                moved += host.numel()
        finally:
            stream.synchronize()  # type: ignore[union-attr]  # no DMA may outlive the host buffers
        for d, dst in made.items():
            self.adopt(d, dst)
        return moved

    def _side_stream(self) -> "torch.Stream | None":
        if self._stream is None:
            self._stream = accel.new_stream(self.device)
        return self._stream

    def _fill(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` (host to host), split across the copy threads when it is large."""
        parts = min(COPY_THREADS, src.numel() // _MIN_PART)
        if parts <= 1:
            dst.copy_(src)
            return
        if self._copiers is None:
            self._copiers = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="paramstore-h2d")
        step = -(-src.numel() // parts)
        list(self._copiers.map(lambda a: dst[a : a + step].copy_(src[a : a + step]), range(0, src.numel(), step)))

    def _bounce_buffers(self) -> list[torch.Tensor]:
        if not self._bounce:
            try:
                self._bounce = [torch.empty(self.bucket_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            except RuntimeError:  # page-locking refused (memlock limit): correct, but each copy is synchronous
                self._bounce = [torch.empty(self.bucket_bytes, dtype=torch.uint8) for _ in range(2)]
        return self._bounce

    def close(self) -> None:
        with self._lock:
            self._objects.clear()
        self._bounce = []
        self._stream = None
        if self._copiers is not None:
            self._copiers.shutdown(wait=False)
            self._copiers = None


def _as_uint8(src: HostBytes) -> torch.Tensor:
    if isinstance(src, torch.Tensor):
        return src.view(torch.uint8).reshape(-1)
    if len(src) == 0:  # type: ignore[arg-type]
        return torch.empty(0, dtype=torch.uint8)
    import warnings

    with warnings.catch_warnings():  # a read-only mapping: we only read from it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(src, dtype=torch.uint8)


class _Empty(bytes):
    """An empty object's bytes (``mmap`` refuses length 0), usable as a context manager."""

    def __enter__(self) -> "_Empty":
        return self

    def __exit__(self, *exc: object) -> None:
        return None
