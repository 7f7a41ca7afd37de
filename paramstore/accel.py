"""Accelerators: one code path for CUDA, Ascend NPU and any other ``torch.accelerator`` backend.

Everything device-specific that paramstore does (side streams, events, the device a helper thread
works on) goes through this module and through PyTorch's device-agnostic API
(``torch.accelerator``, ``torch.Stream``, ``torch.Event``), so that CUDA and Ascend share one
path. ``torch_npu`` is imported only when an ``"npu"`` device is named (it registers the
backend); nothing here imports it otherwise. The CPU is not an accelerator: copies to and from it
are synchronous and need no stream.

Pinning host memory (page-locking a shared-memory slab so that a device copy is asynchronous) is
in :mod:`paramstore.pinning`.

Verified: CPU paths (every test here). CUDA paths are written against PyTorch's generic stream
API; Ascend (``torch_npu``) is **not verified** on hardware.

Example:
    >>> from paramstore import accel
    >>> accel.as_device("cpu"), accel.is_accelerator("cpu")
    (device(type='cpu'), False)
    >>> accel.as_device("tpu:0")
    Traceback (most recent call last):
    ...
    paramstore.errors.DeviceError: device 'tpu:0': no such device type in this PyTorch build ...
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

import torch

from .errors import DeviceError, InvalidArgumentError

__all__ = ["as_device", "is_accelerator", "set_device", "device_guard", "new_stream", "current_stream", "on_stream",
           "record_event", "synchronize"]

#: Device types whose backend is a separate package, imported when such a device is named.
_PLUGINS = {"npu": "torch_npu"}


def _backend(device_type: str) -> Any:
    """The ``torch.<type>`` module of a device type (``torch.cuda``, ``torch.npu``...)."""
    if device_type in _PLUGINS and not hasattr(torch, device_type):
        try:
            importlib.import_module(_PLUGINS[device_type])
        except ImportError as e:
            raise DeviceError(f"device type {device_type!r} needs the {_PLUGINS[device_type]} package "
                              f"(pip install 'paramstore[{device_type}]')") from e
    return getattr(torch, device_type, None)


def as_device(device: "str | torch.device | None") -> torch.device:
    """Parse and check a device argument; an accelerator without an index gets the current one.

    Raises:
        DeviceError: the device type does not exist here, is not available in this process, or
            the index is out of range.
        InvalidArgumentError: ``device`` is not a string or a ``torch.device``.
    """
    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise InvalidArgumentError(f"device must be a string such as 'cuda:0' or a torch.device, got {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise DeviceError(f"device {device!r}: no such device type in this PyTorch build ({e})") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "meta":
        raise DeviceError(f"device {device!r}: a meta tensor holds no bytes; name a real device")
    mod = _backend(dev.type)
    if mod is None or not hasattr(mod, "is_available") or not mod.is_available():
        raise DeviceError(f"device {device!r} is not available in this process (torch {torch.__version__}; "
                          f"is_available() is False): check the driver, the visible devices, or pass device='cpu'")
    index = mod.current_device() if dev.index is None else dev.index
    if not 0 <= index < mod.device_count():
        raise DeviceError(f"device {device!r}: index {index} out of range ({mod.device_count()} visible)")
    return torch.device(dev.type, index)


def is_accelerator(device: "str | torch.device") -> bool:
    """Whether ``device`` is an accelerator (anything but the CPU and ``meta``)."""
    return torch.device(device).type not in ("cpu", "meta")


def set_device(device: torch.device) -> None:
    """Make ``device`` the current device of the calling thread (a helper thread must, else its
    first device call creates a context on device 0). No-op for the CPU."""
    if is_accelerator(device):
        _backend(device.type).set_device(device)


@contextlib.contextmanager
def device_guard(device: "torch.device | str | None") -> Iterator[None]:
    """Make ``device`` the calling thread's current device for the block, and restore the previous
    one after (``set_device`` for a thread's lifetime, this for a call made on a caller's thread).
    No-op for the CPU, a device without an index, or where no accelerator is available."""
    dev = None if device is None else torch.device(device)
    if dev is None or not is_accelerator(dev) or dev.index is None or not torch.accelerator.is_available():
        yield
        return
    with torch.accelerator.device_index(dev.index):
        yield


def new_stream(device: torch.device) -> "torch.Stream | None":
    """A new side stream on ``device`` (None for the CPU: copies there are synchronous)."""
    if not is_accelerator(device):
        return None
    return torch.Stream(device=device)


def current_stream(device: torch.device) -> "torch.Stream | None":
    """The calling thread's current stream on ``device`` (None for the CPU)."""
    if not is_accelerator(device):
        return None
    return _backend(device.type).current_stream(device)


@contextlib.contextmanager
def on_stream(stream: "torch.Stream | None") -> Iterator[None]:
    """Run the block's device work on ``stream`` (None: as is)."""
    if stream is None:
        yield
        return
    with stream:
        yield


def record_event(stream: "torch.Stream | None") -> "torch.Event | None":
    """An event recorded on ``stream`` now (None for None)."""
    if stream is None:
        return None
    event = torch.Event(device=stream.device)
    event.record(stream)
    return event


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (no-op for the CPU)."""
    if is_accelerator(device):
        _backend(device.type).synchronize(device)
