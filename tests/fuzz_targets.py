"""Fuzz targets for every parser of untrusted bytes (issue 25): shared by ``tests/test_fuzz.py``
(a bounded number of inputs per target, in ``make test``) and ``tools/fuzz.py`` (a time budget per
target, in ``make fuzz``).

Each :class:`Target` has a hypothesis strategy of *structured but hostile* inputs (valid encodings,
then mutated: flipped bytes, truncations, spliced garbage, huge length fields, type swaps and huge
numbers in JSON, deep nesting, wrong lengths) and a function that feeds one input to the parser.
:func:`run_one` runs it and classifies the outcome:

* ``ok``: the parser returned (and the result passed the target's own check, if any);
* ``package``: it raised one of the target's *allowed* exceptions: a
  :class:`paramstore.errors.ParamStoreError`, or the documented ``ValueError`` of the low-level
  parsers (``paramstore.format``);
* ``other``: anything else (KeyError, IndexError, TypeError, RecursionError, OverflowError,
  struct.error, a result that fails the check...): a bug.

It also measures the peak of memory allocated while the parser ran (tracemalloc: Python objects,
numpy arrays, zstd output) against the target's bound: twice the size of the object the input
names plus one chunk (2 MiB) where the input names one (patch frames, patch objects), a small
fixed bound elsewhere.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
import tracemalloc
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from paramstore.errors import ParamStoreError  # noqa: E402

CHUNK = 2 << 20
#: The bound for parsers that name no object: 4 MiB plus 8 bytes per byte of input (the Python
#: objects a JSON record makes take several times its text).
SMALL = 4 << 20
PER_BYTE = 8
#: The largest JSON tree a mutation makes (in :func:`input_size` bytes): large enough for every
#: length check, small enough for thousands of inputs a minute under tracemalloc.
MAX_TREE = 256 << 10


def input_size(inp: Any) -> int:
    """The bytes an input carries: its byte strings, texts and tensors, and 8 per container item."""
    total, stack = 0, [inp]
    while stack:
        v = stack.pop()
        if isinstance(v, (bytes, bytearray, str)):
            total += len(v)
        elif isinstance(v, dict):
            total += 8 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            total += 8 * len(v)
            stack.extend(v)
        elif hasattr(v, "nbytes"):
            total += int(v.nbytes)
        else:
            total += 8
    return total


def small_bound(inp: Any) -> int:
    return SMALL + PER_BYTE * input_size(inp)


@dataclass
class Target:
    name: str
    """``module.function``: what is fuzzed."""
    strategy: st.SearchStrategy
    feed: Callable[[Any], Any]
    """Feeds one input to the parser; returns what the parser returned."""
    allowed: tuple[type[BaseException], ...] = (ParamStoreError,)
    bound: Callable[[Any], int] = small_bound
    """The peak-memory bound for one input, in bytes."""


@dataclass
class Outcome:
    kind: str  # "ok", "package" or "other"
    error: BaseException | None
    peak: int
    bound: int


_WARM: set[str] = set()


def run_one(target: Target, inp: Any) -> Outcome:
    """Feed ``inp`` to ``target`` under tracemalloc; classify what happened. (The first input of a
    target is fed twice, the first time unmeasured: imports and caches are not the parser's.)"""
    if not tracemalloc.is_tracing():
        tracemalloc.start()
    if target.name not in _WARM:
        _WARM.add(target.name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                target.feed(inp)
        except Exception:  # noqa: BLE001 - classified on the measured run
            pass
    bound = target.bound(inp)
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    error: BaseException | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            target.feed(inp)
        kind = "ok"
    except target.allowed as e:
        kind, error = "package", e
    except Exception as e:  # noqa: BLE001 - RecursionError, MemoryError, OverflowError... all bugs here
        kind, error = "other", e
    peak = tracemalloc.get_traced_memory()[1] - before
    error = _detach(error)
    return Outcome(kind, error, peak, bound)


def _detach(e: BaseException | None) -> BaseException | None:
    """``e`` without its traceback frames (they hold the input's buffers)."""
    if e is not None:
        e.__traceback__ = None
    return e


class Rejected(AssertionError):
    """A parser returned something it should have refused (raised by a target's check)."""


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise Rejected(what)


# -- mutations -------------------------------------------------------------------------------------
_HUGE_INTS = [-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, 10**300]
_ODD_VALUES = [None, True, False, "", "x" * 300, "\0", "../../etc/passwd", "ab" * 32, [], {}, [[]], 1.5,
               float("nan"), float("inf"), -float("inf"), 1e308, -0.0]


def hostile_scalars() -> st.SearchStrategy:
    return st.one_of(st.sampled_from(_HUGE_INTS), st.sampled_from(_ODD_VALUES), st.integers(), st.floats(),
                     st.text(max_size=20), st.booleans(), st.none())


def deep(depth: int, kind: str = "list") -> Any:
    """A value nested ``depth`` levels (lists or dicts)."""
    v: Any = []
    for _ in range(depth):
        v = [v] if kind == "list" else {"a": v}
    return v


@st.composite
def mutated_bytes(draw: Any, data: bytes, *, max_ops: int = 4) -> bytes:
    """``data`` with a few byte-level mutations (or none)."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(0, max_ops))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "splice", "u64", "u32", "delete", "dup"]))
        n = len(buf)
        i = draw(st.integers(0, max(n, 1) - 1)) if n else 0
        if op == "flip" and n:
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "splice" and n:
            j = draw(st.integers(i, n))
            buf[i:j] = draw(st.binary(max_size=32))
        elif op == "u64":
            buf[i:i + 8] = struct.pack("<Q", draw(st.sampled_from([0, 1, 7, 8, 2**31, 2**32 - 1, 2**63, 2**64 - 1,
                                                                    n, n - 8, n + 1, 99_999_999])) % 2**64)
        elif op == "u32":
            buf[i:i + 4] = struct.pack("<I", draw(st.sampled_from([0, 1, 2**16, 2**31, 2**32 - 1, n, n + 1])) % 2**32)
        elif op == "delete" and n:
            del buf[i:i + draw(st.integers(1, 8))]
        elif op == "dup" and n:
            j = draw(st.integers(i, n))
            buf[j:j] = buf[i:j]
    return bytes(buf)


def _paths(v: Any, path: tuple = ()) -> list[tuple]:
    """Every path into a JSON tree (keys and indices)."""
    out = [path]
    if isinstance(v, dict):
        for k, x in v.items():
            out.extend(_paths(x, path + (k,)))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out.extend(_paths(x, path + (i,)))
    return out


def _set(v: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    v = dict(v) if isinstance(v, dict) else list(v)
    v[path[0]] = _set(v[path[0]], path[1:], new)
    return v


def _get(v: Any, path: tuple) -> Any:
    for p in path:
        v = v[p]
    return v


@st.composite
def mutated_json(draw: Any, tree: Any, *, max_ops: int = 3) -> Any:
    """A JSON tree with a few structural mutations: values swapped for hostile ones, keys dropped
    or added, lists shortened or lengthened, deep nesting. (Or none: the valid tree.)"""
    for _ in range(draw(st.integers(0, max_ops))):
        before = tree
        path = draw(st.sampled_from(_paths(tree)))
        old = _get(tree, path)
        op = draw(st.sampled_from(["value", "value", "drop", "add", "wrap", "deep", "num", "str", "len"]))
        if op == "value":
            tree = _set(tree, path, draw(hostile_scalars()))
        elif op == "drop" and path:
            parent = _get(tree, path[:-1])
            parent = {k: x for k, x in parent.items() if k != path[-1]} if isinstance(parent, dict) else \
                [x for i, x in enumerate(parent) if i != path[-1]]
            tree = _set(tree, path[:-1], parent)
        elif op == "add" and isinstance(old, dict):
            tree = _set(tree, path, {**old, draw(st.text(max_size=8)): draw(hostile_scalars())})
        elif op == "add" and isinstance(old, list):
            tree = _set(tree, path, [*old, draw(hostile_scalars())])
        elif op == "wrap":
            tree = _set(tree, path, draw(st.sampled_from([[old], {"x": old}, [old, old], str(old)])))
        elif op == "deep":
            tree = _set(tree, path, deep(draw(st.sampled_from([50, 500, 900, 990])), draw(st.sampled_from(["list",
                                                                                                          "dict"]))))
        elif op == "num":
            tree = _set(tree, path, draw(st.sampled_from(_HUGE_INTS + [float("inf"), float("nan"), 1e308])))
        elif op == "str" and isinstance(old, (int, float)) and not isinstance(old, bool):
            tree = _set(tree, path, str(old))
        elif op == "len" and isinstance(old, list) and old:
            tree = _set(tree, path, draw(st.sampled_from([old[:-1], old * 2, old[:1] * 300])))
        if op in ("len", "wrap") and input_size(tree) > MAX_TREE:  # (repeated, these would grow without end)
            tree = before
    return tree


def to_json_bytes(tree: Any) -> bytes:
    """``tree`` as JSON text (NaN and Infinity allowed, as Python's json reads them)."""
    try:
        return json.dumps(tree).encode()
    except (RecursionError, ValueError):
        return b"[" * 5000


@st.composite
def hostile_json_text(draw: Any, tree: Any) -> bytes:
    """JSON text of a mutated ``tree``, then maybe mutated as bytes (or text no parser likes)."""
    raw = to_json_bytes(draw(mutated_json(tree)))
    how = draw(st.sampled_from(["json", "json", "json", "bytes", "deep", "junk", "utf"]))
    if how == "bytes":
        return draw(mutated_bytes(raw))
    if how == "deep":
        return draw(st.sampled_from([b"[" * 100_000, b'{"a":' * 50_000, b"[" * 990 + b"]" * 990,
                                     b"[" * 5000 + b"]" * 5000, b"1" * 5000, b"-" + b"9" * 4400]))
    if how == "junk":
        return draw(st.binary(max_size=64))
    if how == "utf":
        return raw[: len(raw) // 2] + b"\xff\xfe" + raw[len(raw) // 2:]
    return raw


def _digest(draw: Any) -> str:
    return draw(st.binary(min_size=32, max_size=32)).hex()


# -- paramstore.patch --------------------------------------------------------------------------------
_PATCH_DTYPES = ["U8", "BF16", "F16", "F32", "I32", "F64", "I64"]


@st.composite
def _tensor_pair(draw: Any) -> tuple[str, bytes, bytes]:
    """A dtype, a base tensor's bytes and a target differing in a few elements."""
    from paramstore.format import ITEMSIZE

    dtype = draw(st.sampled_from(_PATCH_DTYPES))
    size = ITEMSIZE[dtype]
    n = draw(st.sampled_from([0, 1, 3, 64, 1000, 5000, 20_000])) // size * size
    base = np.frombuffer(draw(st.binary(min_size=16, max_size=16)) * (n // 16 + 1), dtype=np.uint8)[:n].copy()
    target = base.copy()
    if n:
        for i in draw(st.lists(st.integers(0, n - 1), max_size=20)):
            target[i] ^= draw(st.integers(1, 255))
    return dtype, base.tobytes(), target.tobytes()


@st.composite
def patch_frames(draw: Any) -> dict[str, Any]:
    """Inputs of ``decode_into``: a base, a frame (mutated), and the changed count and gap width."""
    from paramstore.patch import _HEAD, encode

    dtype, base, target = draw(_tensor_pair())
    enc = encode(base, target, dtype)
    frame, changed, width = enc.frame, enc.changed, enc.gap_width
    if draw(st.booleans()) and len(frame) >= _HEAD.size:  # another chunk length in the head
        head = bytearray(frame)
        head[4] = draw(st.sampled_from([0, 1, 5, 9, 10, 11, 12, 19, 20, 21, 22, 40, 63, 64, 255]))
        frame = bytes(head)
    frame = draw(mutated_bytes(frame))
    if draw(st.integers(0, 4)) == 0:
        changed = draw(st.sampled_from([0, 1, -1, changed + 1, changed - 1, 2**40, 2**64]))
    if draw(st.integers(0, 6)) == 0:
        width = draw(st.sampled_from([0, 4, 8, 16]))
    if draw(st.integers(0, 8)) == 0:
        base = base[: len(base) // 2]
    return {"dtype": dtype, "base": base, "frame": frame, "changed": changed, "width": width}


def _feed_decode_into(i: dict[str, Any]) -> None:
    from paramstore.patch import decode_into

    out = i["out"] if "out" in i else bytearray(len(i["base"]))
    decode_into(out, i["base"], i["frame"], i["dtype"], i["changed"], i["width"])


@st.composite
def patches(draw: Any) -> dict[str, Any]:
    """Inputs of ``apply_patch`` and ``patch_info``: a base and a patch (mutated as bytes, or its
    metadata mutated as JSON and the header rebuilt)."""
    from paramstore.patch import make_patch

    dtype, base, target = draw(_tensor_pair())
    patch = make_patch(base, target, dtype, max_ratio=1000.0) or b""
    if patch and draw(st.booleans()):
        n = struct.unpack_from("<Q", patch, 0)[0]
        tree = json.loads(patch[8:8 + n])
        raw = to_json_bytes(draw(mutated_json(tree)))
        patch = struct.pack("<Q", len(raw)) + raw + patch[8 + n:]
    patch = draw(mutated_bytes(patch))
    if draw(st.integers(0, 8)) == 0:
        base = base[: len(base) // 2]
    return {"base": base, "patch": patch}


def _feed_apply_patch(i: dict[str, Any]) -> None:
    from paramstore.format import tensor_digest
    from paramstore.patch import apply_patch, patch_info

    info = patch_info(i["patch"])
    _expect(isinstance(info["nbytes"], int) and info["nbytes"] >= 0, f"patch_info nbytes {info['nbytes']!r}")
    out = apply_patch(i["base"], i["patch"])
    _expect(tensor_digest(out) == info["target"], "apply_patch returned bytes that are not the target")


# -- paramstore.delta: patch objects -----------------------------------------------------------------
@st.composite
def patch_objects(draw: Any) -> dict[str, Any]:
    """A patch object (``delta._make_one``'s layout) rebuilding a target object from a base object,
    mutated; and the base objects the reader has."""
    from paramstore.delta import PATCH_OBJECT_FORMAT
    from paramstore.format import DIGESTS_KEY, ITEMSIZE, TensorSpec, layout, tensor_digest
    from paramstore.patch import encode

    dtype, base, target = draw(_tensor_pair())
    head = layout([TensorSpec("w", dtype, (len(target) // ITEMSIZE[dtype],))]).header  # the target's real header
    base_obj = head + base
    target_obj = head + target
    bobj = "ab" * 32
    enc = encode(base, target, dtype)
    spans = [[len(head), len(target_obj), dtype, bobj, len(head), enc.changed, enc.gap_width]] if base else []
    blobs = [head] + ([enc.frame] if base else [])
    meta = {"paramstore_patch": PATCH_OBJECT_FORMAT, "target": "cd" * 32, "base": "1", "size": str(len(target_obj)),
            "spans": json.dumps(draw(mutated_json(spans, max_ops=2)) if draw(st.booleans()) else spans)}
    if draw(st.integers(0, 3)) == 0:
        meta = draw(mutated_json(meta, max_ops=2))
    try:
        plan = layout([TensorSpec("head", "U8", (len(blobs[0]),)),
                       *(TensorSpec(f"t{i}", "U8", (len(b),)) for i, b in enumerate(blobs[1:]))], meta)
        obj = plan.header + b"".join(blobs)
    except Exception:  # noqa: BLE001 - metadata the writer cannot lay out: hostile bytes instead
        obj = to_json_bytes(meta)
    return {"object": draw(mutated_bytes(obj)), "bases": {bobj: base_obj}, "into_file": draw(st.booleans())}


class _BaseFiles:
    """The base objects of a fuzzed patch as ``delta._apply`` reads them: (descriptor, size) by digest
    (memfds, closed together)."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self._objects, self._fds = objects, []

    def open(self, digest: str) -> tuple[int, int]:
        from paramstore.backends.tiers.base import object_key

        object_key(digest)  # what the tier checks (InvalidArgumentError for a name that is not a digest)
        if digest not in self._objects:
            raise FileNotFoundError(digest)
        fd = os.memfd_create("base")
        self._fds.append(fd)
        os.write(fd, self._objects[digest])
        return fd, len(self._objects[digest])

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)


def _feed_patch_object(i: dict[str, Any]) -> None:
    from paramstore.delta import _apply, _read_patch

    got = _read_patch(memoryview(i["object"]))
    _expect(isinstance(got.size, int) and got.size >= 0 and isinstance(got.target, str), "bad size or target")
    if got.size <= 1 << 20:  # what rebuild() does next, into a new file or a slab of the size its record names
        bases, fd = _BaseFiles(i["bases"]), os.memfd_create("rebuilt")
        try:
            _apply(bases, got, fd if i["into_file"] else memoryview(bytearray(got.size)))
        except (ValueError, FileNotFoundError) as e:  # documented by rebuild(): a malformed patch, a base not here
            raise _Documented(str(e)) from None
        finally:
            bases.close()
            os.close(fd)


def _patch_object_bound(i: dict[str, Any]) -> int:
    return 2 * len(i["object"]) + 2 * (1 << 20) + CHUNK


# -- paramstore.format: safetensors headers and objects ---------------------------------------------
@st.composite
def safetensors_objects(draw: Any) -> bytes:
    """An object (header + tensors), mutated as bytes or as header JSON."""
    from paramstore.format import DIGESTS_KEY, ITEMSIZE, TensorSpec, layout, tensor_digest

    specs = [TensorSpec(f"t{i}", draw(st.sampled_from(sorted(ITEMSIZE))),
                        tuple(draw(st.lists(st.integers(0, 5), max_size=3))))
             for i in range(draw(st.integers(0, 4)))]
    meta = draw(st.one_of(st.none(), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)))
    if draw(st.booleans()):  # it lists its own piece digests, as a patch object does (then mutated)
        order = [p.spec for p in sorted(layout(specs, meta).placements, key=lambda p: p.offset)]
        meta = {**(meta or {}), DIGESTS_KEY: json.dumps([[tensor_digest(bytes(s.nbytes))] for s in order])}
    plan = layout(specs, meta)
    data = plan.header + bytes(sum(s.nbytes for s in specs))
    if draw(st.booleans()):
        n = struct.unpack_from("<Q", data, 0)[0]
        raw = to_json_bytes(draw(mutated_json(json.loads(data[8:8 + n]))))
        if draw(st.integers(0, 5)) == 0:
            raw = draw(hostile_json_text({}))
        data = struct.pack("<Q", len(raw)) + raw + data[8 + n:]
    return draw(mutated_bytes(data))


def _feed_safetensors(buf: bytes) -> None:
    from paramstore.format import ObjectHasher, listed_digests, parse_header, read_header, rehash, tensor_spans

    mv = memoryview(buf)
    start, entries, meta = read_header(mv)
    _expect(isinstance(entries, dict) and isinstance(meta, dict) and 8 <= start <= len(buf), "bad header result")
    parse_header(mv)
    spans = tensor_spans(mv)[1]
    _expect(all(start <= b <= e <= len(buf) for b, e in spans), "spans outside the object")
    digest, digests = rehash(mv)
    listed = listed_digests(mv, len(buf), digest)  # what a receiver would relay it by, checked by its name
    _expect(listed is None or listed[0] == digests, "a listed digest that makes the name differs from the bytes'")
    h = ObjectHasher(mv)  # bytes arriving out of order
    half = len(buf) // 2
    h.arrived(half, len(buf))
    h.arrived(0, half)
    _expect(h.digest() == digest, "ObjectHasher and rehash disagree")


def _feed_loads(raw: bytes) -> None:
    from paramstore.format import loads

    v = loads(raw, dict if raw[:1] != b"[" else list, "fuzz")
    _expect(isinstance(v, (dict, list)), "loads returned another kind")


# -- paramstore.manifest -----------------------------------------------------------------------------
@st.composite
def manifests(draw: Any) -> tuple[Any, Any]:
    """A valid manifest and version (as JSON trees) of a few tensors, chunked ones and assets."""
    from paramstore.manifest import Chunk, Manifest, TensorEntry, Version

    entries: dict[str, Any] = {}
    for i in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            entries[f"w{i}"] = TensorEntry("F32", (2, 3), _digest(draw), _digest(draw), 64, 24)
        else:
            chunks = [Chunk((0, 0), (1, 3), _digest(draw), _digest(draw), 64, 12),
                      Chunk((1, 0), (1, 3), _digest(draw), _digest(draw), 128, 12)]
            entries[f"w{i}"] = TensorEntry.chunked("F32", (2, 3), chunks)
    assets = {"config.json": TensorEntry("U8", (10,), _digest(draw), _digest(draw), 8, 10)} if draw(st.booleans()) \
        else {}
    aliases = {"tied": "w0"} if "w0" in entries and draw(st.booleans()) else {}
    m = Manifest(entries, aliases, assets)
    v = Version(step=draw(st.integers(0, 10)), created_at=1.5, nbytes=m.nbytes, digest=m.digest(),
                num_tensors=len(entries) + len(aliases), metrics={"loss": 0.5}, metadata={"k": [1]},
                writer=draw(st.sampled_from(["", "run-1"])))
    return m.to_json(), v.to_json()


@st.composite
def manifest_inputs(draw: Any) -> dict[str, Any]:
    m, v = draw(manifests())
    how = draw(st.sampled_from(["tree", "text"]))
    if how == "tree":
        return {"manifest": draw(mutated_json(m)), "version": draw(mutated_json(v))}
    return {"manifest_text": draw(hostile_json_text(m)), "version": draw(mutated_json(v))}


def _feed_manifest(i: dict[str, Any]) -> None:
    from paramstore.manifest import Manifest, Version, check_manifest

    if "manifest_text" in i:
        try:
            m = Manifest.parse(i["manifest_text"])
        except ValueError as e:  # documented: what json.loads raises (bad JSON or UTF-8)
            if isinstance(e, ParamStoreError):
                raise
            raise _Documented(str(e)) from None
    else:
        m = Manifest.from_json(i["manifest"])
    v = Version.from_json(i["version"], ("tag",))
    _expect(isinstance(v.step, int) and isinstance(v.digest, str), "bad version")
    sizes = {o: 1 << 20 for o in m.objects()}
    check_manifest(m, v)
    check_manifest(m, v, sizes, where="fuzz")


class _Documented(ParamStoreError):
    """(The fuzz's marker for a documented ValueError: ``json.loads``' from Manifest.parse, a vLLM
    info's from its checks, ``delta._apply``'s, which ``delta.rebuild`` reports as CorruptObjectError.)"""


# -- registries --------------------------------------------------------------------------------------
@st.composite
def redis_entries(draw: Any) -> tuple[str, str]:
    """A Redis registry field of some kind (as other hosts write it), mutated."""
    m, v = draw(manifests())
    d = "ab" * 32
    valid = {
        "version": v,
        "manifest": m,
        "peer": {"session": "h:1", "host": "h", "pid": 12, "started_at": 1.5},
        "size": {"size": 100},
        "address": 4096,
        "patch_pairs": {d: "cd" * 32},
        "refs": [d, "cd" * 32],
        "location": [d, 64, 128],
    }
    kind = draw(st.sampled_from(sorted(valid)))
    return kind, draw(hostile_json_text(valid[kind])).decode("utf-8", "surrogateescape")


def _feed_redis(i: tuple[str, str]) -> None:
    import functools

    from paramstore.backends.registries import redis as r
    from paramstore.manifest import Manifest

    kind, raw = i
    if kind == "version":
        r._version(raw, ["t"])
    elif kind == "manifest":  # stored as JSON, or zlib-compressed (whole, or cut short)
        data = raw.encode("utf-8", "surrogateescape")
        packed = zlib.compress(data, 1)
        for stored in (data, packed, packed[:-3]):
            r._read("a manifest", lambda stored=stored: Manifest.parse(r.unpack_manifest(stored)))
    elif kind == "peer":
        r._peer("p1", raw)
    elif kind == "address":
        r._address("ab" * 32, raw)
    else:
        r._read(kind, functools.partial(getattr(r, f"_{kind}"), raw))


_LMDB: dict[str, Any] = {}


def _lmdb_registry() -> Any:
    """One LMDB registry for the whole run (in a temporary directory)."""
    if "reg" not in _LMDB:
        from paramstore.root import open_root

        _LMDB["dir"] = tempfile.TemporaryDirectory(prefix="paramstore-fuzz-")
        _LMDB["root"] = open_root(os.path.join(_LMDB["dir"].name, "store"), create=True)
        _LMDB["reg"] = _LMDB["root"].registry
    return _LMDB["reg"]


@st.composite
def lmdb_records(draw: Any) -> tuple[str, bytes]:
    m, v = draw(manifests())
    valid = {
        "versions": v,
        "manifests": m,
        "leases": {"step": 1, "holder": "x", "pid": os.getpid(), "host": "h", "start": 1, "acquired_at": 1.0},
        "peers": {"session": "h:1", "host": "h", "node": "n", "pid": 12, "start": 1, "started_at": 1.5},
    }
    kind = draw(st.sampled_from(sorted(valid)))
    return kind, draw(hostile_json_text(valid[kind]))


def _feed_lmdb(i: tuple[str, bytes]) -> None:
    from paramstore.backends.registries.lmdb import _step_key

    reg = _lmdb_registry()
    kind, raw = i
    key = _step_key(1) if kind in ("versions", "manifests") else b"fuzz-key"
    with reg.env.begin(write=True) as txn:
        for db in ("versions", "manifests", "leases", "peers"):
            txn.drop(reg._dbs[db], delete=False)
        if kind == "manifests":
            txn.put(key, json.dumps(_VALID_VERSION).encode(), db=reg._dbs["versions"])
        txn.put(key, raw, db=reg._dbs[kind])
    if kind == "versions":
        reg.get_version(1)
        list(reg.versions())
    elif kind == "manifests":
        reg.get_manifest(1)
    elif kind == "leases":
        reg.leases()
    else:
        reg.peers()


_VALID_VERSION = {"step": 1, "created_at": 1.0, "nbytes": 0, "digest": "ab" * 32, "num_tensors": 0, "metrics": {},
                  "metadata": {}}


# -- paramstore.remote: version records, manifests, lock bodies --------------------------------------
@st.composite
def remote_records(draw: Any) -> dict[str, Any]:
    m, v = draw(manifests())
    objects = {"ab" * 32: 4096, "cd" * 32: 100}
    record = {"format": draw(st.sampled_from([1, 2])), "version": v, "tags": ["best"], "objects": objects}
    if record["format"] == 2:
        record["patches"] = {"ab" * 32: ["ef" * 32, 0, 200]}
    kind = draw(st.sampled_from(["record", "record", "manifest", "lock"]))
    tree = {"record": record, "manifest": m,
            "lock": {"purpose": "gc", "host": "h", "node": "n", "pid": 1, "start": 2}}[kind]
    return {"kind": kind, "step": v["step"], "raw": draw(hostile_json_text(tree))}


def _feed_remote(i: dict[str, Any]) -> None:
    from paramstore import remote as r
    from paramstore.manifest import Manifest

    if i["kind"] == "lock":
        h = r._parse_holder(i["raw"])
        _expect(isinstance(h, dict), "lock holder is not a dict")
        r._dead(h)
        return
    raw = r._parse(i["raw"], "s3://fuzz/key")
    if i["kind"] == "manifest":
        Manifest.from_json(raw)
    else:
        rec = r._check_record(raw, i["step"], "s3://fuzz/key")
        _expect(all(isinstance(n, int) and n > 0 for n in rec.objects.values()), "bad object sizes")


# -- paramstore.collective: messages between ranks -------------------------------------------------
@st.composite
def collective_messages(draw: Any) -> tuple[str, bytes]:
    m, v = draw(manifests())
    sizes = {o: 1 << 20 for o in {e["object"] for e in m["tensors"].values() if "object" in e}
             | {c["object"] for e in m["tensors"].values() for c in e.get("chunks", [])}
             | {e["object"] for e in m.get("assets", {}).values()}}
    valid = {
        "offer": {"version": v, "manifest": m, "sizes": sizes, "bucket_bytes": 1 << 20},
        "status": {"lack": sorted(sizes)[:1], "error": "", "bad": {}},
        "outcome": {"bad": {"ab" * 32: "bytes hash to x"}, "error": "boom"},
    }
    kind = draw(st.sampled_from(sorted(valid)))
    return kind, draw(hostile_json_text(valid[kind]))


class _Stub:
    src = 0
    rank = 1


def _feed_collective(i: tuple[str, bytes]) -> None:
    from paramstore.collective import _Broadcast, _decode, _parse_offer, _reply

    kind, raw = i
    msg = _decode(raw, f"rank 0's {kind}")
    _expect(isinstance(msg, dict), "a message that is not a dict")
    if kind == "offer":
        _parse_offer(msg, 0)
        return
    msgs = [_reply(msg, 0, kind), {}]  # what _exchange returns; then what the round reads of it:
    _Broadcast._raise_errors(_Stub(), msgs, 3, "failed")  # type: ignore[arg-type]
    wanted = {"ab" * 32}
    sorted({o for s in msgs for o in s.get("lack", []) if o in wanted})


# -- paramstore.sharded: a sharded commit's parts ----------------------------------------------------
@st.composite
def sharded_parts(draw: Any) -> list[bytes]:
    d1, d2, o = "ab" * 32, "cd" * 32, "ef" * 32
    parts = [{"names": {"w": ["F32", [2, 3]]}, "step": 1, "store": "s",
              "blocks": {"w": [{"offsets": [r, 0], "sizes": [1, 3], "digest": d, "object": o, "offset": 64 + 12 * r,
                                "nbytes": 12}]},
              "objects": {o: [4096, [d]]}, "tensors": {d: [o, 64, 12]}, "reused": {}} for r, d in ((0, d1), (1, d2))]
    return [draw(hostile_json_text(p)) for p in parts]


def _feed_sharded(raws: list[bytes]) -> None:
    from paramstore.sharded import check_part, decode, merge_parts

    parts = [decode(p) for p in raws]  # every rank; then the lead:
    for rank, part in enumerate(parts):
        check_part(part, rank)
    entries = merge_parts(parts, (0, 1))
    _expect(isinstance(entries, dict), "merge_parts returned another kind")


# -- integrations: engine requests -----------------------------------------------------------------
@st.composite
def sglang_requests(draw: Any) -> Any:
    import torch

    body = {"root": "/dev/shm/run", "version": "latest", "min_step": None, "timeout": None, "registry": None,
            "name": None, "check": draw(st.booleans()), "recipe": draw(st.sampled_from([None, "fp8-block128"]))}
    raw = draw(hostile_json_text(body))
    how = draw(st.sampled_from(["u8", "u8", "u8", "2d", "f32", "big"]))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if how == "2d" and t.numel() % 2 == 0:
        t = t.view(2, -1)
    elif how == "f32":
        t = t.float()
    elif how == "big":
        t = torch.zeros(65 << 10, dtype=torch.uint8)
    return t


def _feed_sglang(t: Any) -> None:
    from paramstore.integrations.sglang import _body

    body = _body(t)
    _expect(isinstance(body, dict) and isinstance(body.get("check"), bool)
            and set(body) == {"root", "version", "min_step", "timeout", "registry", "name", "check", "recipe"},
            "bad body")


_ENGINE_DIR: dict[str, str] = {}


def _engine_roots() -> str:
    """A listed directory (PARAMSTORE_ENGINE_ROOTS) no request may leave; nothing is under it."""
    if "dir" not in _ENGINE_DIR:
        _ENGINE_DIR["tmp"] = tempfile.mkdtemp(prefix="paramstore-fuzz-engine-")
        _ENGINE_DIR["dir"] = os.path.join(_ENGINE_DIR["tmp"], "allowed")
        os.mkdir(_ENGINE_DIR["dir"])
    return _ENGINE_DIR["dir"]


@st.composite
def vllm_infos(draw: Any) -> dict[str, Any]:
    allowed = _engine_roots()
    init = {"root": draw(st.sampled_from([allowed + "/../outside", "/etc", "relative", "", "a\0b", allowed + "\0",
                                          "/dev/shm/../../etc"])),
            "registry": None, "name": None}
    update = {"version": "latest", "min_step": None, "timeout": None}
    return {"init": draw(mutated_json(init, max_ops=2)), "update": draw(mutated_json(update, max_ops=2))}


def _feed_vllm(i: dict[str, Any]) -> None:
    from paramstore.integrations import _stores
    from paramstore.integrations.vllm import ParamStoreInitInfo, ParamStoreUpdateInfo

    init, update = i["init"], i["update"]
    if isinstance(update, dict) and set(update) <= {"version", "min_step", "timeout"}:
        try:
            u = ParamStoreUpdateInfo(**update)
        except ValueError as e:  # documented: __post_init__ refuses a bad combination
            raise _Documented(str(e)) from None
        _expect((type(u.version) is int or isinstance(u.version, str))
                and (u.min_step is None or type(u.min_step) is int)
                and (u.timeout is None or (type(u.timeout) in (int, float) and u.timeout >= 0)),
                f"update_info accepted {update!r}")
    if isinstance(init, dict) and set(init) <= {"root", "registry", "name"} and "root" in init:
        try:
            info = ParamStoreInitInfo(**init)
        except ValueError as e:
            raise _Documented(str(e)) from None
        old = os.environ.get(_stores.ROOTS_ENV)
        os.environ[_stores.ROOTS_ENV] = _engine_roots()
        try:
            store = _stores.request_store(info.root, info.registry, info.name, shared=False)
        finally:
            if old is None:
                del os.environ[_stores.ROOTS_ENV]
            else:
                os.environ[_stores.ROOTS_ENV] = old
        store.close()
        raise Rejected(f"a request opened a store at {info.root!r}")


# -- small local files: writer claim, device descriptor, store marker ------------------------------
@st.composite
def writer_claims(draw: Any) -> bytes:
    from paramstore.liveness import HOST

    host = draw(st.sampled_from(["h", HOST]))  # this host's: its liveness is checked
    return draw(hostile_json_text({"run_id": "run-1", "host": host, "pid": 12, "start": 1.5, "since": 2.5}))


def _feed_writer(raw: bytes) -> None:
    from paramstore.writer import Writer

    w = Writer.from_text(raw.decode("utf-8", "surrogateescape"))
    if w is not None:
        _expect(isinstance(w.pid, int) and isinstance(w.since, float) and isinstance(w.run_id, str), "bad writer")
        w.describe()
        w.alive()


@st.composite
def device_descriptors(draw: Any) -> bytes:
    from paramstore.liveness import start_time

    owner = [os.getppid(), start_time(os.getppid())]  # a live owner: its handles are opened
    handle = {"handle": "eA==", "size": 4096, "offset": 0, "ref": "eA==", "ref_offset": 0, "event": "eA==",
              "sync": True, "view": [0, 4096]}
    return draw(hostile_json_text({"format": 1, "step": 1, "owner": owner, "objects": {"ab" * 32: handle}}))


def _feed_device(raw: bytes) -> None:
    import torch

    from paramstore.device import DESCRIPTOR_DIR, open_exported

    d = _engine_roots()
    os.makedirs(os.path.join(d, DESCRIPTOR_DIR), exist_ok=True)
    with open(os.path.join(d, DESCRIPTOR_DIR, "cpu-None.json"), "wb") as f:
        f.write(raw)

    class _Root:
        path = d

    got = open_exported(_Root(), 1, torch.device("cpu"), {"ab" * 32})  # type: ignore[arg-type]
    _expect(got is None or isinstance(got, dict), "descriptor result")


@st.composite
def store_markers(draw: Any) -> bytes:
    return draw(hostile_json_text({"format": 1, "store_id": "ab" * 16}))


def _feed_marker(raw: bytes) -> None:
    from paramstore.root import _read_marker

    d = _engine_roots()
    marker = os.path.join(d, "paramstore.json")
    with open(marker, "wb") as f:
        f.write(raw)
    info = _read_marker(d, marker)
    _expect(isinstance(info, dict) and isinstance(info["store_id"], str), "bad marker info")


# -- the targets -------------------------------------------------------------------------------------
def _decode_bound(i: dict[str, Any]) -> int:
    return 2 * len(i["base"]) + CHUNK


def _patch_bound(i: dict[str, Any]) -> int:
    return 2 * len(i["base"]) + CHUNK


TARGETS: list[Target] = [
    Target("patch.decode_into", patch_frames(), _feed_decode_into, bound=_decode_bound),
    Target("patch.apply_patch+patch_info", patches(), _feed_apply_patch, bound=_patch_bound),
    Target("delta._read_patch+_apply", patch_objects(), _feed_patch_object, bound=_patch_object_bound),
    Target("format.read_header+rehash", safetensors_objects(), _feed_safetensors, allowed=(ParamStoreError, ValueError)),
    Target("format.loads", hostile_json_text({"a": [1, {"b": None}]}), _feed_loads, allowed=(ParamStoreError, ValueError)),
    Target("manifest.Manifest+Version", manifest_inputs(), _feed_manifest),
    Target("registries.redis entries", redis_entries(), _feed_redis),
    Target("registries.lmdb records", lmdb_records(), _feed_lmdb),
    Target("remote records+locks", remote_records(), _feed_remote),
    Target("collective messages", collective_messages(), _feed_collective),
    Target("sharded.decode+merge_parts", sharded_parts(), _feed_sharded),
    Target("sglang._body", sglang_requests(), _feed_sglang),
    Target("vllm infos+request_store", vllm_infos(), _feed_vllm),
    Target("writer.Writer.from_text", writer_claims(), _feed_writer),
    Target("device.open_exported", device_descriptors(), _feed_device),
    Target("root._read_marker", store_markers(), _feed_marker),
]

BY_NAME = {t.name: t for t in TARGETS}


def describe(e: BaseException | None) -> str:
    if e is None:
        return ""
    text = str(e).replace("\n", " ")
    return f"{type(e).__name__}: {text[:200]}"

