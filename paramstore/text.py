"""Phrases messages share: counts (``1 version`` / ``2 versions``), and what to do with a store whose
metadata is lost; and :func:`warn`, which points a warning at the caller's own line.

Example:
    >>> plural(1, "version"), plural(3, "tensor"), plural(2, "alias", "aliases")
    ('1 version', '3 tensors', '2 aliases')
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["plural", "restore_advice", "warn"]

_HERE = os.path.dirname(os.path.abspath(__file__))
#: The package's files: paramstore/ (backends/ beneath it when installed), and the checkout's backends/.
_OURS = (_HERE + os.sep, os.path.join(os.path.dirname(_HERE), "backends") + os.sep)


def plural(count: int, noun: str, plural_form: str | None = None) -> str:
    """``count`` and its noun, plural-correct (``plural_form``: an irregular plural)."""
    return f"{count} {noun if count == 1 else plural_form or noun + 's'}"


def restore_advice(root: str) -> str:
    """What to do with a store whose metadata (at ``root``) is lost or damaged, as commands that work
    as written: ``pull`` needs the remote's URL, and creates the new store."""
    return (f"move {root} aside (or remove it), then restore the versions from the store's remote into a new "
            f"store there: `paramstore --root {root} --remote URL pull VERSION` (`paramstore --root {root} "
            "--remote URL ls --tier remote` lists them); or start a new store")


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` naming the first frame outside paramstore: the user's line that led here,
    however deep in the package the warning is raised (on a thread of the package's own, the
    thread's entry point)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OURS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
