"""Compiled loops for the one hot path torch runs as scalar code: the FP8 conversion of recipes.

torch converts float32 to ``float8_e4m3fn`` one element at a time inside its copy kernel (4.5× a
copy on one thread, ``tools/bench_recipes.py --breakdown``), and a block quantizer built from torch
operations passes over every element several times. :data:`SOURCE` is the whole quantizer in a few
lines of C: per 128-row stripe, the block maxima on the input's sign-cleared bits, the scales, and the
rounding to nearest even by integer arithmetic, in loops the compiler vectorises. It is compiled
once per machine by the system's C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) into a cache directory
(``$PARAMSTORE_KERNEL_DIR``, else ``$XDG_CACHE_HOME/paramstore``, else ``~/.cache/paramstore``),
written then renamed, named by a digest of the source, the command and the CPU's flags (so a
directory shared by hosts of different CPUs never hands one another's code), loaded only from a
directory and file this user owns that nobody else may write (else built again in a private
temporary directory), and loaded with
:mod:`ctypes`, which releases the GIL: the callers split the work between threads
(:func:`paramstore.patch.run_all`).

The kernels are a speed path only. Where there is no compiler, the build fails, or
``PARAMSTORE_KERNELS=off``, :func:`fp8` is ``None`` and :mod:`paramstore.recipes` uses its torch
path, **with the same bytes** (both paths are tested against each other and a reference on every
input class: zeros, subnormals, edges, partial blocks, both input dtypes): every step is exact
(integer maxima, one IEEE float32 division, round to nearest even), so the compiler's vector width
and the thread count change nothing. The C is compiled with ``-std=c11`` (no contraction into
fused multiply-adds) and without ``-ffast-math``.

Example:
    >>> from paramstore import kernels
    >>> k = kernels.fp8()
    >>> k is None or sorted(k.block)  # None: no compiler here, and the recipes take torch's path
    ['bf16', 'f32']
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import Callable

import blake3

__all__ = ["SOURCE", "Fp8Kernel", "fp8", "cache_dir"]

log = logging.getLogger(__name__)

#: The C source of the FP8 kernels. ``NAME_block`` quantizes block rows ``[b0, b1)`` of a row-major
#: ``n`` x ``k`` matrix (row stride ``ld`` elements) in ``bn`` x ``bk`` blocks: maxima of the
#: sign-cleared bits, ``scale = (amax < floor ? floor : amax) / 448`` (NaN kept, for the caller to
#: refuse), ``q = e4m3(x / scale)``. ``NAME_scaled`` converts ``rows`` x ``k`` elements with one
#: scale per ``bk`` columns; ``NAME_absmax`` is the largest sign-cleared bits of ``count`` elements. ``e4m3`` is float32 to ``float8_e4m3fn``, round to nearest even, for
#: ``|y| <= 448 * (1 + 2**-23)`` (what the scales guarantee): a normal result by rounding the
#: mantissa bits and rebiasing the exponent, a subnormal one by adding 2**14, whose spacing in
#: float32 is 2**-9, the subnormals' own.
SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float bf16f(uint16_t b) { return u2f((uint32_t)b << 16); }
static inline float f32f(uint32_t b) { return u2f(b); }

static inline uint8_t e4m3(float y) {
    uint32_t u = f2u(y);
    uint32_t sign = (u >> 24) & 0x80u;
    uint32_t a = u & 0x7FFFFFFFu;
    uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    uint32_t sub = f2u(u2f(a) + 16384.0f) - 0x46800000u;
    return (uint8_t)(sign | (a >= 0x3C800000u ? normal : sub));
}

#define KERNELS(NAME, T, TOF, MASK)                                                               \
void NAME##_scaled(const T* x, int64_t rows, int64_t k, int64_t ld, int64_t bk,                    \
                   const float* scales, uint8_t* q, int64_t ldq) {                                 \
    for (int64_t r = 0; r < rows; r++) {                                                           \
        const T* xr = x + r * ld;                                                                  \
        uint8_t* qr = q + r * ldq;                                                                 \
        for (int64_t j0 = 0; j0 < k; j0 += bk) {                                                   \
            int64_t e = j0 + bk < k ? j0 + bk : k;                                                 \
            float s = scales[j0 / bk];                                                             \
            for (int64_t j = j0; j < e; j++) qr[j] = e4m3(TOF(xr[j]) / s);                         \
        }                                                                                          \
    }                                                                                              \
}                                                                                                  \
uint32_t NAME##_absmax(const T* x, int64_t count) {                                               \
    T m = 0;                                                                                       \
    for (int64_t i = 0; i < count; i++) { T v = x[i] & MASK; m = v > m ? v : m; }                   \
    return m;                                                                                      \
}                                                                                                  \
int NAME##_block(const T* x, int64_t n, int64_t k, int64_t ld, int64_t bn, int64_t bk,             \
                 float floor, int64_t b0, int64_t b1, uint8_t* q, int64_t ldq, float* scale) {     \
    int64_t gk = (k + bk - 1) / bk;                                                                \
    T* amax = (T*)malloc(sizeof(T) * gk);                                                          \
    if (!amax) return -1;                                                                          \
    for (int64_t b = b0; b < b1; b++) {                                                            \
        int64_t r0 = b * bn, rows = n - r0 < bn ? n - r0 : bn;                                     \
        memset(amax, 0, sizeof(T) * gk);                                                           \
        for (int64_t r = r0; r < r0 + rows; r++) {                                                 \
            const T* xr = x + r * ld;                                                              \
            for (int64_t j0 = 0; j0 < k; j0 += bk) {                                               \
                int64_t e = j0 + bk < k ? j0 + bk : k;                                             \
                T m = amax[j0 / bk];                                                               \
                for (int64_t j = j0; j < e; j++) { T v = xr[j] & MASK; m = v > m ? v : m; }        \
                amax[j0 / bk] = m;                                                                 \
            }                                                                                      \
        }                                                                                          \
        float* s = scale + b * gk;                                                                 \
        for (int64_t g = 0; g < gk; g++) {                                                         \
            float a = TOF(amax[g]);                                                                \
            s[g] = (a < floor ? floor : a) / 448.0f;                                               \
        }                                                                                          \
        NAME##_scaled(x + r0 * ld, rows, k, ld, bk, s, q + r0 * ldq, ldq);                         \
    }                                                                                              \
    free(amax);                                                                                    \
    return 0;                                                                                      \
}

KERNELS(bf16, uint16_t, bf16f, 0x7FFFu)
KERNELS(f32, uint32_t, f32f, 0x7FFFFFFFu)
"""

_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-march=native")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@dataclass(frozen=True)
class Fp8Kernel:
    """The loaded FP8 kernels, per input dtype name (``"bf16"``, ``"f32"``): ``block[dtype](x, n, k,
    ld, bn, bk, floor, b0, b1, q, ldq, scale)`` returns 0 (-1: out of memory), ``scaled[dtype](x,
    rows, k, ld, bk, scales, q, ldq)``, and ``absmax[dtype](x, count)``, the largest sign-cleared
    bits of ``count`` contiguous elements; pointers are ints (``tensor.data_ptr()``)."""

    path: str
    block: dict[str, Callable[..., int]]
    scaled: dict[str, Callable[..., None]]
    absmax: dict[str, Callable[..., int]]


_lock = threading.Lock()
_loaded: list[Fp8Kernel | None] = []  # [] until tried once in this process


def cache_dir() -> str:
    """Where compiled kernels are kept (see the module's documentation).

    Example:
        >>> from paramstore.kernels import cache_dir
        >>> cache_dir().endswith("paramstore")
        True
    """
    chosen = os.environ.get("PARAMSTORE_KERNEL_DIR")
    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "paramstore")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _trusted(path: str) -> bool:
    """Whether ``path`` is this user's (or root's) and nobody else may write it: a shared library
    is loaded from there only then."""
    st = os.stat(path)
    return st.st_uid in (os.getuid(), 0) and not st.st_mode & 0o022


def _build(cc: str) -> str:
    key = blake3.blake3("\0".join([SOURCE, cc, *_FLAGS, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:20]
    where = cache_dir()
    path = os.path.join(where, f"fp8-{key}.so")
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
    except OSError:
        where = tempfile.mkdtemp(prefix="paramstore-kernels-")  # unwritable: a private one for this process
        path = os.path.join(where, f"fp8-{key}.so")
    if not (_trusted(where) and (not os.path.exists(path) or _trusted(path))):
        where = tempfile.mkdtemp(prefix="paramstore-kernels-")  # code others could have written: not loaded
        path = os.path.join(where, f"fp8-{key}.so")
    if os.path.exists(path):
        return path
    with tempfile.TemporaryDirectory(dir=where, prefix=".build-") as tmp:
        src, out = os.path.join(tmp, "fp8.c"), os.path.join(tmp, "fp8.so")
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run([cc, *_FLAGS, "-o", out, src], check=True, capture_output=True, timeout=120)
        os.replace(out, path)  # whole, or not there: a concurrent builder's copy is as good
    return path


def _load() -> Fp8Kernel | None:
    if os.environ.get("PARAMSTORE_KERNELS", "").lower() in ("0", "off", "no", "false"):
        return None
    named = os.environ.get("CC")
    cc = named or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), "cc")
    if shutil.which(cc) is None:
        log.info("paramstore: no C compiler (%s): FP8 recipes use torch's conversion (slower, same bytes)", cc)
        return None
    try:
        path = _build(cc)
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("paramstore: the FP8 kernel could not be built (%s%s): recipes use torch's conversion "
                    "(slower, same bytes)", e, (": " + detail.decode(errors="replace")[:500]) if detail else "")
        return None
    block, scaled, absmax = {}, {}, {}
    for dtype in ("bf16", "f32"):
        b = getattr(lib, f"{dtype}_block")
        b.argtypes = [_P, _I, _I, _I, _I, _I, _F, _I, _I, _P, _I, _P]
        b.restype = ctypes.c_int
        s = getattr(lib, f"{dtype}_scaled")
        s.argtypes = [_P, _I, _I, _I, _I, _P, _P, _I]
        s.restype = None
        m = getattr(lib, f"{dtype}_absmax")
        m.argtypes = [_P, _I]
        m.restype = ctypes.c_uint32
        block[dtype], scaled[dtype], absmax[dtype] = b, s, m
    return Fp8Kernel(path, block, scaled, absmax)


def fp8() -> Fp8Kernel | None:
    """The FP8 kernels, built or loaded on the first call in a process; ``None`` where they cannot
    be (no compiler, a failed build: logged once) or ``PARAMSTORE_KERNELS=off``."""
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_load())
    return _loaded[0]
