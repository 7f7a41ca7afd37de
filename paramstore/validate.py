"""Checks on user input that need no torch: names, tags, metrics, metadata.

Each returns the checked (normalized) value or raises a :class:`~paramstore.ParamStoreError` leaf.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from .errors import InvalidArgumentError, InvalidNameError

__all__ = ["check_name", "check_tag", "check_metrics", "check_metadata", "MAX_TAG_BYTES"]

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
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InvalidArgumentError(f"metric {k!r} must be a finite number, got {v!r}")
        out[k] = float(v)
    return out


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metadata is any JSON-serializable mapping (returned as a JSON round-tripped copy)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidArgumentError(f"metadata must be a mapping, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"metadata must be JSON-serializable: {e}") from e
