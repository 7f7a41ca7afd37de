"""Device checkouts: a version's tensors in a device's memory, copied or mapped from a colocated owner.

``store.checkout(v, device="cuda:0")`` obtains the version's objects on this host exactly as a CPU
checkout does (shared memory, peers, the remote, a collective group), under the same lease and
staleness rules, then gives a snapshot whose tensors live on the device:

* **Mapped from the owner (CUDA IPC).** A store opened with ``device_latest=`` keeps the latest
  version it committed in its device tier (:class:`LatestExporter`, on a thread of its own) and
  writes a small JSON descriptor, ``<root>/device/<device uuid>.json``, naming the step, the owner
  process (pid and start time) and, per object, the CUDA IPC handle of its device buffer. Another
  process of the node that checks out that step on that GPU opens those handles
  (:func:`open_exported`) instead of copying: no byte moves. The reader's lease on the version is
  what keeps the owner's buffers alive: the owner drops an older version's buffers only once no
  live lease is on it (checked after the next descriptor is written, so a reader that leased the
  step before it read the descriptor is always seen). A dead owner is detected by the usual
  liveness rule (pid + start time): its descriptor is ignored. Buffers are never overwritten: each
  version's objects are new allocations (content-addressed, immutable).
* **Copied (any device).** Otherwise the objects are copied from the mapped shared memory into the
  process's :class:`~paramstore.backends.tiers.device.DeviceTier` for that device (bucketed,
  overlapped host-to-device copies); an object already on the device (an unchanged shard of the
  previous version) is not copied again.

Tensors taken from a device snapshot are views of whole-object device buffers. A copied buffer
lives as long as a tensor views it; a mapped (IPC) one only as long as the lease, and only while
the owner's store is open (its ``close()`` frees what it exported): read or copy what you need
before ``close()``.

Verified here: the copy path on the CPU code path only (no GPU on the development hosts). The
CUDA copy, IPC export and import are covered by ``gpu``-marked tests that have not run yet.
Ascend has no IPC path here (the copy path only; unverified).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Mapping

import torch

from . import accel, liveness, safefs
from .errors import DeviceError, InvalidArgumentError
from .format import loads
from .objects import read_manifest
from .snapshot import Snapshot

from paramstore.backends.tiers.device import DEFAULT_BUCKET_BYTES, DeviceTier

if TYPE_CHECKING:
    from .root import StoreRoot

__all__ = ["DeviceCache", "LatestExporter", "open_exported", "check_device_latest", "DESCRIPTOR_DIR"]

#: Folder of the store root holding the IPC descriptors of exported versions.
DESCRIPTOR_DIR = "device"
_FORMAT = 1
_MAX_DESCRIPTOR_BYTES = 64 << 20


class DeviceCache:
    """This process's device tiers, one per device, and what they must keep.

    A device tier keeps the objects of every open device snapshot and of the version it loaded
    last (so that the next version copies only the objects that changed); the rest is dropped at
    the next load.
    """

    def __init__(self, bucket_bytes: int | None = None) -> None:
        self._bucket = bucket_bytes or DEFAULT_BUCKET_BYTES
        self._tiers: dict[torch.device, DeviceTier] = {}
        self._open: "dict[int, weakref.ref[Snapshot]]" = {}  # device snapshots handed out (a Mapping: unhashable)
        self._lock = threading.Lock()
        self._placing = threading.Lock()

    def tier(self, device: torch.device) -> DeviceTier:
        with self._lock:
            if device not in self._tiers:
                self._tiers[device] = DeviceTier(device, bucket_bytes=self._bucket)
            return self._tiers[device]

    def place(self, snap: "Snapshot", device: torch.device, root: "StoreRoot") -> "Snapshot":
        """Turn the CPU snapshot ``snap`` into one whose tensors are on ``device``: mapped from a
        colocated owner when it exports this version on this device, else copied."""
        objects = set(snap.manifest.objects())
        shared = open_exported(root, snap.step, device, objects) if device.type == "cuda" else None
        if shared is not None:
            return self._track(snap._on_device(shared, "ipc", 0))
        tier = self.tier(device)
        # One device checkout at a time per process: another's keep_only must not drop what this
        # one loaded before its snapshot is tracked.
        with self._placing:
            with self._lock:
                snaps = [s for s in (r() for r in self._open.values()) if s is not None and s._bufs is not None]
                self._open = {id(s): weakref.ref(s) for s in snaps}
                live = {o for s in snaps if s.device == device for o in s.manifest.objects()}
            tier.keep_only(objects | live)
            moved = tier.load({o: snap._maps[o] for o in sorted(objects)})
            return self._track(snap._on_device({o: tier.buffer(o) for o in objects}, "copy", moved))

    def _track(self, snap: "Snapshot") -> "Snapshot":
        with self._lock:
            self._open[id(snap)] = weakref.ref(snap)
        return snap

    def close(self) -> None:
        with self._lock:
            for t in self._tiers.values():
                t.close()
            self._tiers.clear()


# -- CUDA IPC: the owner --------------------------------------------------------------------------
class LatestExporter:
    """Keeps the latest version this process committed in a device tier and exports its buffers
    to the other processes of the node (CUDA IPC); see the module docstring.

    ``submit(step)`` is called after each commit is visible; the work runs on a thread of its own
    (bursts coalesce to the newest step), never on the training or publishing thread.
    """

    def __init__(self, root: "StoreRoot", device: torch.device, *, bucket_bytes: int | None = None) -> None:
        if device.type != "cuda":
            raise DeviceError(f"device_latest={device}: sharing device buffers between processes needs CUDA IPC; "
                              "other devices check out by copying (checkout(device=...))")
        # A tier of its own: this thread's loads and drops must not touch the buffers of this
        # process's own device checkouts (nor theirs these).
        self._root, self.device = root, device
        self._tier = DeviceTier(device, bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES)
        self._exported: dict[int, set[str]] = {}  # step -> its objects, still held for leases
        self._handles: dict[str, dict[str, Any]] = {}  # object -> its IPC handle (shared once per buffer)
        self._queue: "queue.Queue[int | None]" = queue.Queue()
        self._dir = os.path.join(root.path, DESCRIPTOR_DIR)
        self.path = os.path.join(self._dir, f"{_uuid(device)}.json")
        self.error: BaseException | None = None
        self._done = threading.Condition()
        self.exported_step: int | None = None
        self._thread = threading.Thread(target=self._run, name="paramstore-device-export", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        self._queue.put(step)

    def wait(self, step: int, timeout: float | None = None) -> bool:
        """Wait until ``step`` (or a newer one) is exported; False on timeout."""
        with self._done:
            return self._done.wait_for(
                lambda: (self.exported_step is not None and self.exported_step >= step) or self.error is not None, timeout)

    def _run(self) -> None:
        accel.set_device(self.device)
        while True:
            step = self._queue.get()
            while step is not None and not self._queue.empty():  # coalesce a burst to its newest
                nxt = self._queue.get()
                step = nxt if nxt is None or step is None else max(step, nxt)
            if step is None:
                return
            try:
                self._export(step)
            except BaseException as e:  # noqa: BLE001 - kept for wait() and warned once
                if self.error is None:
                    warnings.warn(f"device_latest: exporting version {step} to {self.device} failed: {e}",
                                  RuntimeWarning, stacklevel=1)
                self.error = e
            with self._done:
                self._done.notify_all()

    def _export(self, step: int) -> None:
        reg = self._root.registry
        lease = reg.acquire_lease(step, f"device export pid {os.getpid()}")
        try:
            manifest = read_manifest(self._root, step)
            snap = Snapshot(reg.get_version(step), manifest, self._root.tier)
            try:
                objects = set(manifest.objects())
                self._tier.load({o: snap._maps[o] for o in sorted(objects)})  # new allocations only
            finally:
                snap.close()
            for o in sorted(objects - set(self._handles)):
                self._handles[o] = _share(self._tier.buffer(o))
            pid, start = liveness.this_process()
            descriptor = {"format": _FORMAT, "step": step, "digest": reg.get_version(step).digest,
                          "owner": [pid, start], "device": str(self.device),
                          "objects": {o: self._handles[o] for o in sorted(objects)}}
            _write_atomic(self.path, json.dumps(descriptor).encode())
            self._exported[step] = objects
        finally:
            reg.release_lease(lease.id)
        self._drop_unleased(step)
        with self._done:
            self.exported_step = step

    def _drop_unleased(self, newest: int) -> None:
        """Drop the buffers of exported versions older than ``newest`` that no live lease holds.
        Runs after the newest descriptor is written: a reader leases a step before it reads the
        descriptor, so a reader of an older descriptor holds a lease this sees."""
        leased = {lease.step for lease in self._root.registry.leases()}
        for step in [s for s in self._exported if s < newest and s not in leased]:
            del self._exported[step]
        keep = set().union(*self._exported.values()) if self._exported else set()
        self._tier.keep_only(keep)
        for o in set(self._handles) - keep:
            del self._handles[o]

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        try:
            os.unlink(self.path)  # from now on readers copy
        except FileNotFoundError:
            pass
        # Frees the exported buffers: tensors readers mapped from them are no longer valid. Close
        # the trainer's store after its readers are done with what they mapped (or let them copy).
        self._tier.close()


# -- CUDA IPC: readers -----------------------------------------------------------------------------
def open_exported(root: "StoreRoot", step: int, device: torch.device,
                  objects: "set[str]") -> dict[str, torch.Tensor] | None:
    """The device buffers of version ``step``'s ``objects`` exported by a live owner on ``device``
    (the same physical GPU), opened through CUDA IPC; None when there are none to open (then the
    caller copies). The caller holds a lease on ``step``."""
    try:
        path = os.path.join(root.path, DESCRIPTOR_DIR, f"{_uuid(device)}.json")
        with open(path, "rb") as f:
            raw = f.read(min(os.fstat(f.fileno()).st_size, _MAX_DESCRIPTOR_BYTES) + 1)  # (read(n) allocates n)
    except (FileNotFoundError, DeviceError):
        return None
    try:
        d = loads(raw, dict, "the descriptor")
        if d.get("format") != _FORMAT or d.get("step") != step or set(d["objects"]) != objects:
            return None
        pid, start = d["owner"]
        if pid == os.getpid() or not liveness.alive(int(pid), int(start)):
            return None  # our own export (the copy cache has it) or a dead owner's
        return {o: _open(h, device) for o, h in d["objects"].items()}
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        warnings.warn(f"{path}: unreadable device descriptor ({e}); copying to {device} instead",
                      RuntimeWarning, stacklevel=2)
        return None
    except RuntimeError as e:  # the driver refused (another IPC namespace, no pidfd_getfd rights...)
        warnings.warn(f"version {step}: opening the owner's buffers on {device} through CUDA IPC failed ({e}); "
                      "copying instead (are both processes allowed to share GPU memory?)", RuntimeWarning, stacklevel=2)
        return None


def _uuid(device: torch.device) -> str:
    """A stable name for the physical device (indices differ between processes with different
    ``CUDA_VISIBLE_DEVICES``)."""
    if device.type == "cuda":
        try:
            return f"cuda-{torch.cuda.get_device_properties(device).uuid}"
        except (RuntimeError, AttributeError) as e:
            raise DeviceError(f"{device}: cannot read the device's uuid ({e})") from e
    return f"{device.type}-{device.index}"


def _share(buf: torch.Tensor) -> dict[str, Any]:
    """The CUDA IPC handle of ``buf``'s storage, as JSON (what ``torch.multiprocessing`` pickles).

    Shared once per buffer. torch counts the consumers of each share in a ref-counter file and,
    while the count is above 0, parks a freed block instead of freeing it (its "limbo"): a share
    nobody opens would keep its block forever. The count is released at once here, so the lease
    protocol alone (see the module docstring) decides when the owner frees a buffer."""
    storage = buf.untyped_storage()
    (dev, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    torch.UntypedStorage._release_ipc_counter(ref_handle, ref_offset, device=buf.device)
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return {"handle": b64(handle), "size": int(size), "offset": int(offset), "ref": b64(ref_handle),
            "ref_offset": int(ref_offset), "event": b64(event_handle), "sync": bool(event_sync),
            "view": [buf.storage_offset(), buf.numel()]}


def _open(h: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    raw = lambda k: base64.b64decode(h[k])  # noqa: E731
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index, raw("handle"), int(h["size"]), int(h["offset"]), raw("ref"), int(h["ref_offset"]),
        raw("event"), bool(h["sync"]))
    begin, n = h["view"]
    t = torch.empty(0, dtype=torch.uint8, device=device)
    t.set_(storage, int(begin), (int(n),), (1,))
    return t


def _write_atomic(path: str, data: bytes) -> None:
    """Write the descriptor ``path`` into ``device/``: readable by the group (a group store's
    ``device/`` is ``2750``, made with the root; a private store's is made ``0700`` here), through
    a ``*.partial`` made new, so that a link planted under that name is never followed. A
    ``device/`` that is a link or someone else's is refused (UnsafeStoreError)."""
    safefs.own_directory(os.path.dirname(path), 0o700)
    safefs.write_atomic(path, data, mode=0o640)


def check_device_latest(value: object) -> "torch.device | None":
    """The device of ``ParamStore(device_latest=)``: None/False (off), True (this process's current
    CUDA device), or a CUDA device. Raises DeviceError where that device is not available (no
    GPU) or is not a CUDA device (IPC is CUDA's), InvalidArgumentError for anything else.

    Example:
        >>> check_device_latest(False) is None
        True
        >>> check_device_latest("cpu")
        Traceback (most recent call last):
        ...
        paramstore.errors.DeviceError: device_latest=cpu: sharing device buffers between processes needs CUDA IPC; ...
    """
    if value is None or value is False:
        return None
    if value is True:
        value = "cuda"
    if not isinstance(value, (str, torch.device)):
        raise InvalidArgumentError(f"device_latest must be True, False, None or a device such as 'cuda:0', got {value!r}")
    device = accel.as_device(value)
    if device.type != "cuda":
        raise DeviceError(f"device_latest={device}: sharing device buffers between processes needs CUDA IPC; "
                          "other devices check out by copying (checkout(device=...))")
    return device
