"""Phrases messages share: counts (``1 version`` / ``2 versions``), and what to do with a store whose
metadata is lost.

Example:
    >>> plural(1, "version"), plural(3, "tensor"), plural(2, "alias", "aliases")
    ('1 version', '3 tensors', '2 aliases')
"""

from __future__ import annotations

__all__ = ["plural", "restore_advice"]


def plural(count: int, noun: str, plural_form: str | None = None) -> str:
    """``count`` and its noun, plural-correct (``plural_form``: an irregular plural)."""
    return f"{count} {noun if count == 1 else plural_form or noun + 's'}"


def restore_advice(root: str) -> str:
    """What to do with a store whose metadata (at ``root``) is lost or damaged, as commands that work
    as written: ``pull`` needs the remote's URL, and creates the new store."""
    return (f"move {root} aside (or remove it), then restore the versions from the store's remote into a new "
            f"store there: `paramstore --root {root} --remote URL pull VERSION` (`paramstore --root {root} "
            "--remote URL ls --tier remote` lists them); or start a new store")
