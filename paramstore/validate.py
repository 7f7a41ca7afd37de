"""Checks on user input that need no torch: names, tags, metrics, metadata, object digests.

Each returns the checked (normalized) value or raises a :class:`~paramstore.ParamStoreError` leaf.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from typing import Any, Mapping

from .errors import InvalidArgumentError, InvalidNameError

__all__ = ["check_digest", "is_digest", "check_name", "check_asset_name", "REFUSED_ASSET_SUFFIXES", "check_tag", "check_metrics", "check_metadata", "check_timeout", "check_step", "check_bound",
           "MAX_TAG_BYTES", "MAX_STEP"]

_DIGEST = re.compile(r"[0-9a-f]{64}\Z")


def is_digest(value: object) -> bool:
    """Whether ``value`` is an object digest: 64 lowercase hex digits (see :mod:`paramstore.format`)."""
    return isinstance(value, str) and _DIGEST.match(value) is not None


def check_digest(digest: object) -> str:
    """``digest`` if it is an object digest (64 lowercase hex digits), else InvalidArgumentError.

    Every digest read from another host, a registry or a bucket passes here before it names a file
    or a key (:func:`paramstore.backends.tiers.base.object_key`).

    Example:
        >>> check_digest("ab" * 32) == "ab" * 32
        True
        >>> check_digest("../../etc/passwd")
        Traceback (most recent call last):
        ...
        paramstore.errors.InvalidArgumentError: an object digest is 64 lowercase hex digits, got '../../etc/passwd'
    """
    if not is_digest(digest):
        raise InvalidArgumentError(f"an object digest is 64 lowercase hex digits, got {digest!r}")
    return digest  # type: ignore[return-value]


#: Steps are in [0, MAX_STEP): registry keys are 8-byte big-endian.
MAX_STEP = 1 << 63

#: Tags are registry keys (LMDB allows 511 bytes).
MAX_TAG_BYTES = 400


def check_name(name: Any, what: str = "tensor name") -> str:
    """Raise InvalidNameError unless ``name`` is a non-empty string without NUL."""
    if not isinstance(name, str):
        raise InvalidNameError(f"{what} must be a string, got {type(name).__name__}: {name!r}")
    if not name or "\0" in name:
        raise InvalidNameError(f"{what} must be non-empty and contain no NUL character, got {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidNameError(f"{what} {name!r} is not valid Unicode text: {e}") from e
    return name


#: The index file an export writes (``paramstore.export.INDEX_NAME``), which no asset may take.
EXPORT_INDEX = "model.safetensors.index.json"


#: Names no asset may have: code a loader could run (``trust_remote_code``) and pickles or other weight
#: formats (weights are the store's tensors). Checked for names a caller gives and names read from a
#: pulled manifest alike, so a bucket cannot ship code next to the weights.
REFUSED_ASSET_SUFFIXES = (".py", ".pyc", ".pyo", ".pyd", ".so", ".dylib", ".dll", ".sh", ".exe",
                          ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib", ".npy", ".npz", ".h5",
                          ".msgpack", ".gguf", ".onnx")


def check_asset_name(name: Any) -> str:
    """An asset is a file written beside an export's shards: a plain file name (no directory part,
    at most 240 bytes: an export writes it as ``NAME.partial`` first), not one the export writes
    itself (``*.safetensors``, the index, ``*.partial``), and not code or a pickle
    (:data:`REFUSED_ASSET_SUFFIXES`)."""
    check_name(name, "asset name")
    if "/" in name or "\\" in name or name in (".", "..") or len(name.encode("utf-8")) > 240:
        raise InvalidNameError(f"asset name {name!r} must be a plain file name (no directory part, at most 240 bytes)")
    if name.endswith((".safetensors", ".partial")) or name == EXPORT_INDEX:
        raise InvalidNameError(f"asset name {name!r} is a weights or temporary file name, which an export writes "
                               "itself")
    if name.lower().endswith(REFUSED_ASSET_SUFFIXES):
        raise InvalidNameError(f"asset name {name!r} is code or a pickle, which paramstore never stores or writes")
    return name


def check_tag(name: Any) -> str:
    """A tag is a name that cannot be mistaken for a step or for ``"latest"``."""
    check_name(name, "tag")
    if name == "latest" or name.lstrip("-").isdigit():
        raise InvalidNameError(f"tag {name!r} would be ambiguous with a step or 'latest'; choose another name")
    if len(name.encode("utf-8")) > MAX_TAG_BYTES:
        raise InvalidNameError(f"tag is longer than {MAX_TAG_BYTES} bytes: {name[:40]!r}...")
    return name


def check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    """Metrics are finite numbers keyed by name."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentError(f"metrics must be a mapping of names to numbers, got {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        check_name(k, "metric name")
        x = _scalar(v)
        if x is None:
            raise InvalidArgumentError(f"metric {k!r} must be a number (int, float, a NumPy scalar or a one-element "
                                       f"tensor), got {type(v).__name__}: {v!r}")
        if not math.isfinite(x):
            raise InvalidArgumentError(f"metric {k!r} must be finite, got {x!r}")
        out[k] = x
    return out


def _scalar(v: Any) -> float | None:
    """``v`` as a float if it is a real number: Python, NumPy (``np.float32``...) or a one-element
    tensor (``loss.detach()``); None otherwise (bools and complex numbers included)."""
    if isinstance(v, bool) or type(v).__name__ in ("bool_", "bool"):
        return None
    if isinstance(v, numbers.Real):  # int, float, NumPy scalars
        return float(v)
    item, numel = getattr(v, "item", None), getattr(v, "numel", None)
    if callable(item) and callable(numel) and numel() == 1 and not getattr(v, "is_complex", lambda: False)():
        x = item()
        return None if isinstance(x, bool) else float(x)
    return None


#: Largest commit metadata, as JSON: a version record must stay well under the remote's record
#: limit (``paramstore.remote.MAX_RECORD_BYTES``) so that every version pushed can be pulled.
MAX_METADATA_BYTES = 1 << 20


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metadata is any JSON-serializable mapping of at most :data:`MAX_METADATA_BYTES` as JSON
    (returned as a JSON round-tripped copy)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidArgumentError(f"metadata must be a mapping, got {type(metadata).__name__}")
    try:
        text = json.dumps(dict(metadata), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"metadata must be JSON-serializable: {e}") from e
    if len(text) > MAX_METADATA_BYTES:
        raise InvalidArgumentError(f"metadata is {len(text)} bytes as JSON, over the {MAX_METADATA_BYTES} allowed: "
                                   "keep large data in files and record their paths")
    return json.loads(text)


def check_timeout(timeout: Any, what: str = "timeout") -> float | None:
    """``timeout`` if it is None or a non-negative number of seconds, else InvalidArgumentError.

    Example:
        >>> check_timeout(None), check_timeout(2)
        (None, 2.0)
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout < 0:
        raise InvalidArgumentError(f"{what} must be None or a non-negative number of seconds, got {timeout!r}")
    return float(timeout)


def check_step(step: Any, what: str = "step") -> int:
    """``step`` if it is an int in [0, 2**63), else InvalidArgumentError.

    Example:
        >>> check_step(5)
        5
    """
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < MAX_STEP:
        raise InvalidArgumentError(f"{what} must be an int in [0, 2**63), got {step!r}")
    return step


def check_bound(bound: Any, what: str = "min_step") -> int:
    """``bound`` if it is an int below 2**63 (a lower bound on steps: a negative one admits every
    version, as ``t - eta`` is before step ``eta``), else InvalidArgumentError.

    Example:
        >>> check_bound(-3)
        -3
    """
    if isinstance(bound, bool) or not isinstance(bound, int) or bound >= MAX_STEP:
        raise InvalidArgumentError(f"{what} must be an int below 2**63, got {bound!r}")
    return bound
