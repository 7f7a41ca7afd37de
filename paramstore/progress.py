"""Progress bars for long work: shown on a terminal (stderr), silent otherwise."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress"]


def progress(total: int, desc: str, *, unit: str = "B", enabled: bool | None = None) -> Any:
    """A tqdm bar over ``total`` units, shown only when stderr is a terminal (or ``enabled``).

    Use as a context manager and call ``.update(n)``.
    """
    from tqdm import tqdm

    show = sys.stderr.isatty() if enabled is None else enabled
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                disable=not show, leave=False, file=sys.stderr)
