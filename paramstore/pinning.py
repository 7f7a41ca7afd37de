"""Page-locking ("pinning") host memory for device copies, on any accelerator.

A device-to-host copy runs asynchronously (``non_blocking=True``) and at full bus bandwidth only
into page-locked memory. The staging slabs (:mod:`paramstore.staging`) are shared-memory files
mapped by this process, so they are pinned in place by registering the mapping with the device
runtime (``cudaHostRegister`` on CUDA), not allocated pinned.

Lifecycle: a buffer is registered **once**, when a process that stages accelerator tensors first
takes it, and stays registered for as long as it is mapped (a recycled slab keeps its registration
across commits); it is unregistered exactly when it is unmapped (``Slab.close``, which pool close,
trimming and garbage collection of a dropped slab reach). The process-wide table of registrations
(:func:`registrations`) is the single source of truth.

Rules that keep pinning harmless:

* Nothing here imports ``torch`` or touches a device until :func:`register` is first called for
  an accelerator; a process that only reads never pins, so it never creates a device context.
* Registrations use the *portable* flag (``cudaHostRegisterPortable``): the memory counts as
  pinned for every device and context of the process, whichever device was current.
* A refused registration (typically the memlock limit, ``ulimit -l``) is cleared from the
  runtime's error state at once (``cudaGetLastError``, on the same thread: the error state is per
  thread), reported by one ``RuntimeWarning`` per process, and the buffer stays unpinned: staging
  goes on, with blocking copies.
* Fork: a forked child starts with an empty table; it never unregisters its parent's
  registrations, and if the parent had used a device runtime (or registered anything) the child
  never pins (the runtime cannot be re-initialised in a forked child).

The runtimes: :class:`CudaRuntime` (``torch.cuda.cudart()``; ``cudaGetLastError`` through ctypes
on the libcudart already loaded), and :class:`AscendRuntime` (``aclrtHostRegisterV2`` with
``ACL_HOST_REG_PINNED`` through ctypes on the loaded ``libascendcl``: **written from the CANN
documentation, not verified on hardware**). A device type without a usable runtime stays unpinned,
with one warning. Tests install a stub with :func:`use_runtime`.

Example (a stub runtime that records the calls; real runtimes need a device):

    >>> import mmap
    >>> from paramstore import pinning
    >>> class Stub:
    ...     flags = 1
    ...     def __init__(self): self.calls = []
    ...     def register(self, addr, nbytes, flags): self.calls.append("register"); return 0
    ...     def unregister(self, addr): self.calls.append("unregister"); return 0
    ...     def clear_error(self): self.calls.append("clear"); return 0
    ...     def set_device(self, device): pass
    ...     def in_bad_fork(self): return False
    >>> buf = mmap.mmap(-1, 1 << 16)
    >>> addr = pinning.address_of(buf)
    >>> with pinning.use_runtime("cuda", Stub()) as stub:
    ...     pinning.register(addr, len(buf), "cuda:0"), pinning.register(addr, len(buf), "cuda:0")
    ...     pinning.registered(addr)
    ...     pinning.unregister(addr), pinning.unregister(addr)
    ...     stub.calls
    (True, True)
    (65536, 'cuda')
    (True, False)
    ['register', 'unregister']
    >>> buf.close()
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import warnings
from typing import Any, Iterator, Protocol

__all__ = ["Runtime", "CudaRuntime", "AscendRuntime", "register", "unregister", "registered",
           "registrations", "runtime", "use_runtime", "bind_thread", "can_pin", "address_of",
           "CUDA_HOST_REGISTER_PORTABLE"]

#: ``cudaHostRegisterPortable``: the registration counts for every CUDA context of the process.
CUDA_HOST_REGISTER_PORTABLE = 0x01
#: ``ACL_HOST_REG_PINNED`` (CANN ``aclrtHostRegisterV2``): register pageable memory as page-locked.
ACL_HOST_REG_PINNED = 0x10000000


class Runtime(Protocol):
    """What pinning needs of a device runtime (one object per device type).

    ``register``/``unregister``/``clear_error`` return the runtime's error code (0: success).
    ``flags`` are the flags :func:`register` passes (portable pinning). ``set_device`` makes a
    device current on the calling thread; ``in_bad_fork`` says whether this process is a forked
    child of a process that had initialised the runtime (which must then not be used)."""

    flags: int

    def register(self, addr: int, nbytes: int, flags: int) -> int: ...

    def unregister(self, addr: int) -> int: ...

    def clear_error(self) -> int: ...

    def set_device(self, device: Any) -> None: ...

    def in_bad_fork(self) -> bool: ...


# -- the process-wide state -------------------------------------------------------------------
_lock = threading.RLock()
_table: dict[int, tuple[int, str]] = {}  # address -> (nbytes, device type)
_where: dict[int, str] = {}  # address -> the device it was registered for (unregistered under it)
_runtimes: dict[str, "Runtime | None"] = {}  # device type -> runtime (None: cannot pin there)
_installed: dict[str, "Runtime | None"] = {}  # use_runtime(): overrides _runtimes
_used = False  # a runtime was asked to register in this process (inherited by fork: see below)
_forked_after_use = False  # this process is a fork of one that had used a runtime: never pin
_warned: set[str] = set()
_bound = threading.local()  # .device: the device bind_thread() made current on this thread


def _after_fork_in_child() -> None:
    # The child's table is empty: the parent's registrations are the parent's to undo (and the
    # slabs are MADV_DONTFORK: the child does not even map them). A child of a process that had
    # used a device runtime must not use it again.
    global _lock, _forked_after_use, _used
    _lock = threading.RLock()
    _forked_after_use = _forked_after_use or _used or bool(_table)
    _used = False
    _table.clear()
    _where.clear()
    _runtimes.clear()
    _bound.__dict__.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _device_type(device: Any) -> str:
    return getattr(device, "type", None) or str(device).split(":", 1)[0]


def _warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


# -- public API -------------------------------------------------------------------------------
def runtime(device_type: str) -> "Runtime | None":
    """The runtime that pins host memory for ``device_type`` ("cuda", "npu"), or None when that
    device type cannot pin here (no such device, no host-register call found: one warning).

    Creating it loads the device runtime: call it only in a process that uses the device."""
    with _lock:
        if device_type in _installed:
            return _installed[device_type]
        if device_type not in _runtimes:
            _runtimes[device_type] = _make_runtime(device_type)
        return _runtimes[device_type]


def _make_runtime(device_type: str) -> "Runtime | None":
    try:
        if device_type == "cuda":
            return CudaRuntime()
        if device_type == "npu":
            return AscendRuntime()
        raise RuntimeError("no host-register call known for this device type")
    except Exception as e:  # noqa: BLE001 - pinning is an optimisation: stage unpinned
        _warn_once(f"runtime:{device_type}", f"paramstore: cannot pin host memory for {device_type!r} devices "
                   f"({e}); staging stays unpinned (device copies are blocking)")
        return None


@contextlib.contextmanager
def use_runtime(device_type: str, rt: "Runtime | None") -> Iterator["Runtime | None"]:
    """Use ``rt`` for ``device_type`` within the block (tests: a stub of the device runtime;
    None: that device type cannot pin). Registrations made within the block should be undone
    within it. Also resets the once-per-process warnings, so that a test sees its own."""
    with _lock:
        had, before = device_type in _installed, _installed.get(device_type)
        _installed[device_type] = rt
        warned = set(_warned)
        _warned.clear()
    try:
        yield rt
    finally:
        with _lock:
            if had:
                _installed[device_type] = before
            else:
                _installed.pop(device_type, None)
            _warned.clear()
            _warned.update(warned)


def can_pin(device: Any) -> bool:
    """Whether this process may pin for ``device`` at all: an accelerator, and not a forked child
    of a process that had used a device runtime. Does not load the runtime."""
    dtype = _device_type(device)
    if dtype in ("cpu", "meta") or _forked_after_use:
        return False
    rt = _installed.get(dtype)
    if rt is not None:
        return not _safe_bool(rt.in_bad_fork)
    return not _in_bad_fork(dtype)


def _in_bad_fork(device_type: str) -> bool:
    # Only ask torch if it is loaded: a process without torch has no device runtime to break.
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    mod = getattr(torch, device_type, None)
    check = getattr(mod, "_is_in_bad_fork", None)
    return _safe_bool(check) if check is not None else False


def _safe_bool(f: Any) -> bool:
    try:
        return bool(f())
    except Exception:  # noqa: BLE001
        return False


def bind_thread(device: Any) -> bool:
    """Make ``device`` current on the calling helper thread (once per thread and device), so that
    its device calls do not create a context on device 0; returns whether it is (False: do not
    pin on this thread). Never call it on a thread that is not paramstore's own (it changes the
    thread's current device)."""
    if getattr(_bound, "device", None) == str(device):
        return True
    rt = runtime(_device_type(device)) if can_pin(device) else None
    if rt is None:
        return False
    try:
        rt.set_device(device)
    except Exception as e:  # noqa: BLE001
        _warn_once(f"set_device:{_device_type(device)}", f"paramstore: cannot make {device} current on a "
                   f"staging thread ({e!r}): its buffers stay unpinned")
        return False
    _bound.device = str(device)
    return True


def register(addr: int, nbytes: int, device: Any) -> bool:
    """Page-lock ``nbytes`` of host memory at ``addr`` for copies with ``device``; True if it is
    registered (now or already). False: not pinned (CPU, a forked child, no runtime, or refused:
    then the runtime's error is cleared and one RuntimeWarning says so); the memory is usable
    all the same, unpinned. Never raises for a runtime failure.

    The caller must call :func:`unregister` before the memory is unmapped."""
    global _used
    dtype = _device_type(device)
    if nbytes <= 0 or not can_pin(device):
        return False
    with _lock:
        if addr in _table:
            return True
        _used = True
    rt = runtime(dtype)
    if rt is None:
        return False
    flags = getattr(rt, "flags", 0)
    # Not under the lock: registering a GiB takes a while, and other buffers may be unregistered
    # meanwhile. One buffer is registered by one thread (the one that holds the slab).
    try:
        err = int(rt.register(addr, nbytes, flags))
        failure = None if err == 0 else f"error {err}"
    except Exception as e:  # noqa: BLE001 - e.g. "Cannot re-initialize CUDA in forked subprocess"
        failure = repr(e)
    if failure is None:
        with _lock:
            _table[addr] = (nbytes, dtype)
            _where[addr] = str(device)
        return True
    try:  # the failed call left an error on this thread: clear it before anything reads it
        rt.clear_error()
    except Exception:  # noqa: BLE001
        pass
    _warn_once(f"refused:{dtype}", f"paramstore: pinning {nbytes} bytes of staging memory for {dtype} was refused "
               f"({failure}; the memlock limit, ulimit -l?): staging into unpinned memory (blocking device copies)")
    return False


def unregister(addr: int) -> bool:
    """Undo :func:`register` for ``addr`` (before unmapping it); True if it was registered by this
    process. A failure is cleared from the runtime's error state and ignored. Never raises."""
    with _lock:
        entry = _table.pop(addr, None)
        where = _where.pop(addr, None)
    if entry is None:
        return False
    rt = runtime(entry[1])
    if rt is None:  # pragma: no cover - a registration implies a runtime
        return True
    try:
        # Under the device it was registered for: called from threads that never set one (the
        # publisher, GC, a finalizer), the call would otherwise create a context on device 0.
        from .accel import device_guard

        with device_guard(where):
            if int(rt.unregister(addr)) != 0:
                rt.clear_error()
    except Exception:  # noqa: BLE001 - never fail an unmap for this
        pass
    return True


def registered(addr: int) -> "tuple[int, str] | None":
    """``(nbytes, device type)`` if ``addr`` is registered by this process, else None."""
    with _lock:
        return _table.get(addr)


def registrations() -> dict[int, tuple[int, str]]:
    """A copy of this process's table of registrations: address -> (nbytes, device type)."""
    with _lock:
        return dict(_table)


def address_of(buffer: Any) -> int:
    """The address of the first byte of a writable buffer (an ``mmap``, a ``bytearray``)."""
    c = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(c)
    finally:
        del c


# -- runtimes ---------------------------------------------------------------------------------
def _loaded_library(names: tuple[str, ...], marker: str) -> "ctypes.CDLL | None":
    """A handle on a shared library this process has already loaded (never loads one): by soname,
    else by the path in ``/proc/self/maps`` that contains ``marker``."""
    mode = getattr(os, "RTLD_NOLOAD", 4) | getattr(os, "RTLD_LAZY", 1)
    candidates = list(names)
    try:
        with open("/proc/self/maps") as f:
            candidates += sorted({line.split()[-1] for line in f if marker in line and "/" in line})
    except OSError:
        pass
    for name in candidates:
        try:
            return ctypes.CDLL(name, mode=mode)
        except OSError:
            continue
    return None


class CudaRuntime:
    """``cudaHostRegister(addr, n, cudaHostRegisterPortable)`` / ``cudaHostUnregister`` through
    ``torch.cuda.cudart()``; ``cudaGetLastError`` (to clear a failed call's error) from the
    libcudart torch loaded, found with ctypes (guarded: without it errors are not cleared)."""

    flags = CUDA_HOST_REGISTER_PORTABLE

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        self._torch = torch
        self._cudart = torch.cuda.cudart()
        get = getattr(self._cudart, "cudaGetLastError", None)
        if get is None:
            major = (torch.version.cuda or "").split(".")[0]
            names = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")
            mine = tuple(n for n in names if major and n.startswith(f"libcudart.so.{major}"))
            # torch's own runtime first: clearing another library's cudart would leave torch's error set
            lib = _loaded_library(mine + tuple(n for n in names if n not in mine), "libcudart")
            try:
                get = lib.cudaGetLastError if lib is not None else None
            except AttributeError:
                get = None
            if get is not None:
                get.restype, get.argtypes = ctypes.c_int, []
        self._get_last_error = get

    def register(self, addr: int, nbytes: int, flags: int) -> int:
        return int(self._cudart.cudaHostRegister(addr, nbytes, flags))

    def unregister(self, addr: int) -> int:
        return int(self._cudart.cudaHostUnregister(addr))

    def clear_error(self) -> int:
        return int(self._get_last_error()) if self._get_last_error is not None else -1

    def set_device(self, device: Any) -> None:
        self._torch.cuda.set_device(device)

    def in_bad_fork(self) -> bool:
        return bool(self._torch.cuda._is_in_bad_fork())


class AscendRuntime:
    """Ascend NPU (CANN): ``aclrtHostRegisterV2(ptr, size, ACL_HOST_REG_PINNED)`` and
    ``aclrtHostUnregister(ptr)`` from the ``libascendcl`` that ``torch_npu`` loaded, through ctypes;
    ``aclrtGetLastError`` clears an error where it exists. **Unverified**: written from the CANN
    documentation, never run on an NPU. Raises (then staging stays unpinned, with one warning)
    if torch_npu or the calls are missing."""

    flags = ACL_HOST_REG_PINNED

    def __init__(self) -> None:
        import torch
        import torch_npu  # noqa: F401 - registers torch.npu

        self._npu = torch.npu
        lib = _loaded_library(("libascendcl.so",), "libascendcl")
        if lib is None:
            raise RuntimeError("libascendcl is not loaded")
        try:
            self._register, self._unregister = lib.aclrtHostRegisterV2, lib.aclrtHostUnregister
        except AttributeError as e:
            raise RuntimeError(f"no host-register call in libascendcl ({e})") from None
        self._register.restype, self._register.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint64,
                                                                         ctypes.c_uint32]
        self._unregister.restype, self._unregister.argtypes = ctypes.c_int, [ctypes.c_void_p]
        self._last = getattr(lib, "aclrtGetLastError", None)
        if self._last is not None:
            self._last.restype, self._last.argtypes = ctypes.c_int, [ctypes.c_int]

    def register(self, addr: int, nbytes: int, flags: int) -> int:
        return int(self._register(addr, nbytes, flags))

    def unregister(self, addr: int) -> int:
        return int(self._unregister(addr))

    def clear_error(self) -> int:
        return int(self._last(0)) if self._last is not None else -1  # 0: ACL_RT_THREAD_LEVEL

    def set_device(self, device: Any) -> None:
        self._npu.set_device(device)

    def in_bad_fork(self) -> bool:
        check = getattr(self._npu, "_is_in_bad_fork", None)
        return bool(check()) if check is not None else False
