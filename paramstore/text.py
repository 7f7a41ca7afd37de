"""How counts are written in messages: one place for ``1 version`` / ``2 versions``.

Example:
    >>> plural(1, "version"), plural(3, "tensor"), plural(2, "alias", "aliases")
    ('1 version', '3 tensors', '2 aliases')
"""

from __future__ import annotations

__all__ = ["plural"]


def plural(count: int, noun: str, plural_form: str | None = None) -> str:
    """``count`` and its noun, plural-correct (``plural_form``: an irregular plural)."""
    return f"{count} {noun if count == 1 else plural_form or noun + 's'}"
