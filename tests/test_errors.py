"""The error tree: the table in ``paramstore.errors``' docstring is the truth, and the classes follow it.

Every class in ``paramstore.errors`` is listed in the table under exactly one root, descends from
that root and from no other, and from the builtins the table names; the classes marked ``*`` (and
the roots) are what ``paramstore`` exports. A new error class therefore cannot be added without
placing it in the table.
"""

from __future__ import annotations

import builtins
import inspect
import re

import pytest

import paramstore
from paramstore import errors

ROOTS = ("NotFoundError", "ConflictError", "CorruptionError", "UnavailableError", "InvalidArgumentError", "StorageError")


def _table() -> dict[str, tuple[str, bool, tuple[str, ...]]]:
    """``{class: (root, exported, builtins)}`` read from the module docstring's table."""
    doc = errors.__doc__ or ""
    rules = [i for i, line in enumerate(doc.splitlines()) if re.fullmatch(r"=+( +=+)+", line.strip())]
    assert len(rules) == 3, "the docstring's table: a header between two rules, then rows, then a rule"
    lines = doc.splitlines()
    cols = [m.start() for m in re.finditer(r"=+", lines[rules[0]])]
    rows: dict[str, tuple[str, bool, tuple[str, ...]]] = {}
    root = None
    for line in lines[rules[1] + 1:rules[2]]:
        first, name, also = line[:cols[1]].strip(), line[cols[1]:cols[2]].strip(), line[cols[2]:].strip()
        if first and re.fullmatch(r"\w+Error", first):
            root = first
        if not name:
            continue
        assert root is not None, line
        exported = name.endswith("*")
        name = name.rstrip(" *")
        also = re.sub(r"\(.*\)", "", also)
        rows[name] = (root, exported, tuple(b.strip() for b in also.split(",") if b.strip()))
    return rows


def _classes() -> dict[str, type]:
    return {name: cls for name, cls in vars(errors).items()
            if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == errors.__name__}


def test_the_roots_sit_under_paramstore_error():
    for name in ROOTS:
        root = getattr(errors, name)
        assert root.__bases__[0] is errors.ParamStoreError, name
        assert not any(issubclass(root, getattr(errors, other)) for other in ROOTS if other != name), name
    assert errors.InvalidArgumentError.__bases__ == (errors.ParamStoreError, ValueError)
    assert errors.StorageError.__bases__ == (errors.ParamStoreError, OSError)


def test_the_table_lists_every_class_and_each_descends_from_exactly_its_root():
    table = _table()
    placed = set(table) | set(ROOTS) | {"ParamStoreError", "ParamStoreWarning"}
    unlisted = sorted(set(_classes()) - placed)
    assert not unlisted, f"add {unlisted} to the table in paramstore/errors.py's docstring, under its root"
    assert not sorted(set(table) - set(_classes())), "the table lists a class paramstore.errors lacks"
    assert set(errors.__all__) == set(_classes()), "paramstore.errors.__all__ lists every class, and only them"
    for name, (root, _, also) in table.items():
        cls = getattr(errors, name)
        assert root in ROOTS, f"{name}: {root} is not a root"
        roots = [r for r in ROOTS if issubclass(cls, getattr(errors, r))]
        assert roots == [root], f"{name} descends from {roots}, the table says {root}"
        for b in also:
            parent = getattr(errors, b, None) or getattr(builtins, b)
            assert issubclass(cls, parent), f"{name} is not a {b}, as the table says"


def test_the_warning_is_outside_the_tree():
    assert issubclass(errors.ParamStoreWarning, UserWarning)
    assert not issubclass(errors.ParamStoreWarning, errors.ParamStoreError)


def test_paramstore_exports_the_roots_and_the_marked_classes():
    table = _table()
    marked = {name for name, (_, exported, _) in table.items() if exported}
    exported_errors = {n for n in paramstore.__all__ if n in _classes()}
    assert exported_errors == marked | set(ROOTS) | {"ParamStoreError", "ParamStoreWarning"}
    for name in exported_errors:
        assert getattr(paramstore, name) is getattr(errors, name)


@pytest.mark.parametrize("name", sorted(set(_classes()) - {"ParamStoreWarning"}))
def test_every_error_is_a_paramstore_error(name):
    assert issubclass(getattr(errors, name), errors.ParamStoreError)
