"""Hostile input on every parser of untrusted bytes (issue 25): one bounded hypothesis run per
target of ``tests/fuzz_targets.py`` (``PARAMSTORE_FUZZ_EXAMPLES`` inputs each, 25 by default;
``make fuzz`` runs them for longer with ``tools/fuzz.py``). A target fails on any exception that is
not the package's (or the documented ValueError of the low-level parsers), and on an input whose
parsing allocated more than its bound (twice the object it names plus one 2 MiB chunk, or 4 MiB)."""

from __future__ import annotations

import os
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_targets import BY_NAME, describe, run_one

EXAMPLES = int(os.environ.get("PARAMSTORE_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module", autouse=True)
def _tracemalloc_stopped_afterwards():
    """``run_one`` measures under tracemalloc and leaves it tracing (starting it per input would
    cost more than the inputs): stop it after this module, or every later test in the process
    runs traced, and a later ``os.fork`` can deadlock the child (CPython 3.11: the child re-creates
    the runtime's locks through tracemalloc's allocator, whose lock another thread may have held;
    seen once in ``test_store_identity``, the child stuck in ``_PyThread_at_fork_reinit``)."""
    was = tracemalloc.is_tracing()
    yield
    if not was:
        tracemalloc.stop()


@pytest.mark.parametrize("name", sorted(BY_NAME))
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(data=st.data())
def test_fuzz(name: str, data: st.DataObject) -> None:
    target = BY_NAME[name]
    inp = data.draw(target.strategy, label="input")
    got = run_one(target, inp)
    assert got.kind != "other", f"{name}: {describe(got.error)}"
    assert got.peak <= got.bound, f"{name}: {got.peak} bytes allocated, the bound is {got.bound}"
