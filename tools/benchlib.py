"""Small helpers shared by the benchmarks: timestamped logging and summary statistics."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

__all__ = ["log", "stats"]


def log(msg: str) -> None:
    """Print ``msg`` to stderr with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stats(xs: list[float]) -> dict[str, Any]:
    """Median, best (smallest), count and every value of the measurements that are not None."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "best": None, "n": 0, "all": []}
    return {"median": statistics.median(xs), "best": min(xs), "n": len(xs), "all": xs}
