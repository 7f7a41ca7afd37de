"""Bad input: each raises the right ``ParamStoreError`` subclass (and its builtin) and writes nothing.

"Nothing written" is checked on the whole store state: versions, tags, registered objects, the
object files (names, sizes, bytes), the files in ``tmp/`` and the root's entries. The populated
store uses ``prepare_buffers=False`` so that no background thread creates slabs in ``tmp/`` while
the test compares (with the default, the pool refills ``tmp/`` asynchronously after each commit).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from torch import nn

import paramstore
from helpers import store_state, tree
from paramstore import (
    InvalidArgumentError,
    NotAStoreError,
    ParamStore,
    ParamStoreError,
    StepOrderError,
    VersionNotFoundError,
)
from paramstore.errors import (
    CorruptStoreError,
    InvalidNameError,
    InvalidTensorError,
    StoreClosedError,
    TagNotFoundError,
)

GOOD = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4, dtype=torch.int64)}


@pytest.fixture
def pstore(store_root):
    """A store holding version 1 (tagged 'best'), with no background slab preparation."""
    s = ParamStore(store_root, prepare_buffers=False)
    s.commit(1, GOOD, tags=["best"], metrics={"loss": 1.0}).result()
    try:
        yield s
    finally:
        s.close()


def expect_error(store, exc, builtin, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` raises ``exc`` (a ParamStoreError and ``builtin``); the store is unchanged."""
    assert issubclass(exc, ParamStoreError) and issubclass(exc, builtin)
    before = store_state(store)
    with pytest.raises(exc) as ei:
        fn(*args, **kwargs)
    assert isinstance(ei.value, ParamStoreError) and isinstance(ei.value, builtin)
    assert type(ei.value) is exc or issubclass(type(ei.value), exc)
    time.sleep(0.02)  # anything queued to a background thread would show up now
    assert store_state(store) == before
    return ei.value


def _qtensor():
    return torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)


BAD_VALUES = {  # factories: some of these warn when built
    "list": lambda: [1.0, 2.0],
    "none": lambda: None,
    "int": lambda: 3,
    "numpy": lambda: torch.ones(3).numpy(),
    "parameter_list": lambda: nn.ParameterList([nn.Parameter(torch.ones(2))]),
    "sparse_coo": lambda: torch.eye(3).to_sparse(),
    "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
    "quantized": _qtensor,
    "meta": lambda: torch.empty(3, device="meta"),
    "complex128": lambda: torch.zeros(2, dtype=torch.complex128),
    "complex32": lambda: torch.zeros(2, dtype=torch.complex32),
    "float8_e8m0fnu": lambda: torch.zeros(2, dtype=torch.float8_e8m0fnu),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
def test_value_that_cannot_be_stored(pstore, kind):
    bad = dict(GOOD)  # good tensors first: still nothing may be written
    bad["zz_bad"] = BAD_VALUES[kind]()
    err = expect_error(pstore, InvalidTensorError, TypeError, pstore.commit, 2, bad)
    assert "zz_bad" in str(err)
    # the failed commit did not consume step 2
    assert pstore.commit(2, GOOD).result().step == 2


def test_module_with_a_meta_parameter(pstore):
    with torch.device("meta"):
        model = nn.Linear(3, 3)
    expect_error(pstore, InvalidTensorError, TypeError, pstore.commit, 2, model)


@pytest.mark.parametrize("name", ["", 7, None, ("a", "b"), b"bytes", "a\0b", "\0", "__metadata__"],
                         ids=["empty", "int", "none", "tuple", "bytes", "nul", "only-nul", "metadata"])
def test_bad_tensor_name(pstore, name):
    bad = dict(GOOD)
    bad[name] = torch.ones(2)
    expect_error(pstore, InvalidNameError, ValueError, pstore.commit, 2, bad)


@pytest.mark.parametrize("model", [{}, nn.ReLU(), [torch.ones(2)], torch.ones(2), "weights", None],
                         ids=["empty-dict", "no-tensor-module", "list", "tensor", "str", "none"])
def test_model_that_is_not_a_state_dict(pstore, model):
    expect_error(pstore, InvalidArgumentError, ValueError, pstore.commit, 2, model)


@pytest.mark.parametrize("step", [1, 0], ids=["equal", "below"])
def test_step_not_above_latest(pstore, step):
    expect_error(pstore, StepOrderError, ValueError, pstore.commit, step, GOOD)


def test_step_not_above_an_in_flight_step(pstore):
    h = pstore.commit(5, GOOD)
    with pytest.raises(StepOrderError):
        pstore.commit(5, GOOD)
    with pytest.raises(StepOrderError):
        pstore.commit(3, GOOD)
    h.result()
    assert [v.step for v in pstore.versions()] == [1, 5]


@pytest.mark.parametrize("step", [-1, -100, True, False, 2.0, 2.5, "2", None, float("nan")],
                         ids=["-1", "-100", "True", "False", "2.0", "2.5", "str", "None", "nan"])
def test_step_of_the_wrong_kind(pstore, step):
    expect_error(pstore, InvalidArgumentError, ValueError, pstore.commit, step, GOOD)


def test_step_too_large_for_the_registry(pstore):
    expect_error(pstore, InvalidArgumentError, ValueError, pstore.commit, 2**64, GOOD)


@pytest.mark.parametrize(
    "metrics",
    [{"loss": float("nan")}, {"loss": float("inf")}, {"loss": "0.5"}, {"loss": None}, {"ok": True},
     {"loss": [1.0]}, {"loss": torch.tensor([1.0, 2.0])}, [("loss", 1.0)], "loss"],
    ids=["nan", "inf", "str", "none", "bool", "list", "tensor-of-two", "pairs", "str-metrics"],
)
def test_bad_metrics(pstore, metrics):
    expect_error(pstore, InvalidArgumentError, ValueError, pstore.commit, 2, GOOD, metrics=metrics)


@pytest.mark.parametrize("name", ["", 3, "a\0"], ids=["empty", "int", "nul"])
def test_bad_metric_name(pstore, name):
    expect_error(pstore, InvalidNameError, ValueError, pstore.commit, 2, GOOD, metrics={name: 1.0})


@pytest.mark.parametrize(
    "metadata",
    [{"x": object()}, {"x": float("nan")}, {"x": {1, 2}}, {(1, 2): "k"}, {"x": torch.ones(1)}, {"x": b"raw"},
     "not-a-mapping", [("a", 1)], {"x": "y" * (1 << 20)}],
    ids=["object", "nan", "set", "tuple-key", "tensor", "bytes", "str", "pairs", "too-large"],
)
def test_metadata_that_is_not_json(pstore, metadata):
    expect_error(pstore, InvalidArgumentError, ValueError, pstore.commit, 2, GOOD, metadata=metadata)


@pytest.mark.parametrize("tag", ["5", "0", "-3", "007", "latest"])
def test_tag_that_looks_like_a_step_or_latest(pstore, tag):
    expect_error(pstore, InvalidNameError, ValueError, pstore.commit, 2, GOOD, tags=[tag])
    expect_error(pstore, InvalidNameError, ValueError, pstore.commit, 2, GOOD, tags=["fine", tag])
    expect_error(pstore, InvalidNameError, ValueError, pstore.tag, 1, tag)


@pytest.mark.parametrize("tag", ["", 5, None, "a\0b"], ids=["empty", "int", "none", "nul"])
def test_tag_with_a_bad_name(pstore, tag):
    expect_error(pstore, InvalidNameError, ValueError, pstore.commit, 2, GOOD, tags=[tag])
    expect_error(pstore, InvalidNameError, ValueError, pstore.tag, 1, tag)


def test_tag_too_long_for_the_registry(pstore):
    expect_error(pstore, InvalidNameError, ValueError, pstore.tag, 1, "t" * 600)
    expect_error(pstore, InvalidNameError, ValueError, pstore.commit, 2, GOOD, tags=["t" * 600])


def test_tag_that_is_not_utf8_encodable(pstore):
    expect_error(pstore, InvalidNameError, ValueError, pstore.commit, 2, GOOD, tags=["bad\ud800"])


def test_tensor_name_that_is_not_utf8_encodable(pstore):
    expect_error(pstore, InvalidNameError, ValueError, pstore.commit, 2, {"bad\ud800": torch.ones(2)})


# -- reading bad versions ----------------------------------------------------------------------
@pytest.mark.parametrize("step", [2, 999, 10**12])
def test_unknown_step(pstore, step):
    expect_error(pstore, VersionNotFoundError, KeyError, pstore.checkout, step)
    expect_error(pstore, VersionNotFoundError, KeyError, pstore.get, step)
    expect_error(pstore, VersionNotFoundError, KeyError, pstore.tag, step, "newtag")


@pytest.mark.parametrize("step", [-1, 2**64], ids=["negative", "2**64"])
def test_step_outside_the_key_range(pstore, step):
    expect_error(pstore, VersionNotFoundError, KeyError, pstore.checkout, step)


def test_unknown_tag(pstore):
    for fn in (pstore.checkout, pstore.get):
        err = expect_error(pstore, TagNotFoundError, KeyError, fn, "nope")
        assert isinstance(err, VersionNotFoundError)
    expect_error(pstore, TagNotFoundError, KeyError, pstore.untag, "nope")
    expect_error(pstore, TagNotFoundError, KeyError, pstore.tag, "nope", "other")


def test_untag_empty_name(pstore):
    with pytest.raises(ParamStoreError):
        pstore.untag("")


@pytest.mark.parametrize("spec", [True, 1.0, None, b"best", ["best"]], ids=["bool", "float", "none", "bytes", "list"])
def test_version_spec_of_the_wrong_kind(pstore, spec):
    expect_error(pstore, InvalidArgumentError, ValueError, pstore.checkout, spec)
    expect_error(pstore, InvalidArgumentError, ValueError, pstore.get, spec)


def test_empty_store(store):
    assert store.latest() is None and store.versions() == []
    for spec in ("latest", 0, 1):
        expect_error(store, VersionNotFoundError, KeyError, store.checkout, spec)
    expect_error(store, VersionNotFoundError, KeyError, store.checkout)
    expect_error(store, VersionNotFoundError, KeyError, store.get, "latest")
    expect_error(store, TagNotFoundError, KeyError, store.checkout, "best")
    # bad commits on an empty store (default settings) leave tmp/ and objects/ empty too
    expect_error(store, InvalidTensorError, TypeError, store.commit, 0, {"a": torch.empty(1, device="meta")})
    expect_error(store, InvalidArgumentError, ValueError, store.commit, -1, GOOD)
    assert os.listdir(os.path.join(store.root, "tmp")) == [] and store._root.registry.objects() == {}
    assert store.commit(0, GOOD).result().step == 0  # step 0 is allowed


def test_snapshot_missing_name(pstore):
    with pstore.checkout(1) as snap:
        with pytest.raises(KeyError):
            snap["nope"]


# -- closed store --------------------------------------------------------------------------------
def test_closed_store(store_root):
    s = ParamStore(store_root)
    s.commit(1, GOOD).result()
    s.close()
    s.close()  # idempotent
    for call in (lambda: s.commit(2, GOOD), lambda: s.checkout(1), s.versions, s.latest,
                 lambda: s.get(1), lambda: s.tag(1, "x"), lambda: s.untag("x"),
                 lambda: s.wait_for(1, timeout=0)):
        with pytest.raises(StoreClosedError) as ei:
            call()
        assert isinstance(ei.value, RuntimeError)
    with pytest.raises(StoreClosedError):
        next(iter(s.subscribe(min_step=0, timeout=0)))
    with ParamStore(store_root, create=False) as again:
        assert [v.step for v in again.versions()] == [1]


# -- store roots -------------------------------------------------------------------------------
def test_root_that_is_a_directory_of_other_files(shm_dir):
    root = os.path.join(shm_dir, "other")
    os.makedirs(os.path.join(root, "sub"))
    with open(os.path.join(root, "notes.txt"), "w") as f:
        f.write("mine")
    before = tree(root), sorted(os.listdir(root))
    for create in (True, False, None):
        with pytest.raises(NotAStoreError) as ei:
            ParamStore(root, create=create)
        assert isinstance(ei.value, FileNotFoundError)
        assert (tree(root), sorted(os.listdir(root))) == before


def test_root_missing_and_create_false(shm_dir):
    root = os.path.join(shm_dir, "missing")
    with pytest.raises(NotAStoreError) as ei:
        ParamStore(root, create=False)
    assert isinstance(ei.value, FileNotFoundError)
    assert not os.path.exists(root)
    os.mkdir(root)  # an empty directory is not a store either
    with pytest.raises(NotAStoreError):
        ParamStore(root, create=False)
    assert os.listdir(root) == []


def test_root_that_is_a_file(shm_dir):
    root = os.path.join(shm_dir, "file")
    with open(root, "wb") as f:
        f.write(b"x")
    with pytest.raises(NotAStoreError):
        ParamStore(root)
    with open(root, "rb") as f:
        assert f.read() == b"x"


@pytest.mark.parametrize("marker", [b"not json", b"[1]", json.dumps({"format": 99}).encode(), b"{}"],
                         ids=["not-json", "list", "future-format", "no-format"])
def test_root_with_a_bad_marker(store_root, marker):
    ParamStore(store_root, create=True).close()
    with open(os.path.join(store_root, "paramstore.json"), "wb") as f:
        f.write(marker)
    before = tree(store_root)
    with pytest.raises((NotAStoreError, CorruptStoreError)):  # bad JSON: damaged, not foreign
        ParamStore(store_root)
    assert tree(store_root) == before


@pytest.mark.parametrize("size", [0, -1, 1.5, "1", None], ids=["0", "-1", "float", "str", "none"])
def test_bad_shard_size(store_root, size):
    with pytest.raises(InvalidArgumentError):
        ParamStore(store_root, shard_size_bytes=size)
    assert not os.path.exists(store_root)


def test_exception_hierarchy():
    pairs = {
        paramstore.NotAStoreError: FileNotFoundError,
        paramstore.VersionNotFoundError: KeyError,
        paramstore.errors.TagNotFoundError: KeyError,
        paramstore.StepOrderError: ValueError,
        paramstore.errors.InvalidTensorError: TypeError,
        paramstore.errors.InvalidNameError: ValueError,
        paramstore.InvalidArgumentError: ValueError,
        paramstore.CorruptObjectError: OSError,
        paramstore.errors.StoreClosedError: RuntimeError,
        paramstore.WaitTimeoutError: TimeoutError,
    }
    for exc, builtin in pairs.items():
        assert issubclass(exc, ParamStoreError) and issubclass(exc, builtin), exc
    assert issubclass(paramstore.errors.TagNotFoundError, paramstore.VersionNotFoundError)
    assert str(VersionNotFoundError("no version at step 3")) == "no version at step 3"  # not repr'd
