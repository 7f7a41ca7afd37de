"""StoreOptions: one validated object for every option of a store, buildable from a plain mapping."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from paramstore import ParamStore
from paramstore.errors import InvalidArgumentError
from paramstore.options import StoreOptions, policy_from_spec
from paramstore.retention import AnyOf, KeepBest, KeepLast, KeepTagged

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "options.md")


def test_the_docs_table_lists_exactly_the_fields():
    with open(DOCS) as f:
        documented = re.findall(r"^\| `(\w+)` \|", f.read(), flags=re.M)
    assert documented == [f.name for f in dataclasses.fields(StoreOptions)]


def test_from_dict_refuses_an_unknown_option_naming_the_closest():
    with pytest.raises(InvalidArgumentError, match="'retension'.*did you mean 'retention'"):
        StoreOptions.from_dict({"retension": {"keep_last": 2}})


@pytest.mark.parametrize("bad", [{"shard_size_bytes": 0}, {"shard_size_bytes": True}, {"create": "yes"},
                                 {"registry": "redis://x"}, {"storage_options": {"key": "k"}},
                                 {"persist_backlog": 0}, {"scrub_rate": -1}, {"group_timeout": -1},
                                 {"retention": {"remote": KeepLast(1)}}, {"retention": {"keep_lats": 2}},
                                 {"takeover": 1}, {"run_id": "a b"}])
def test_each_bad_option_is_refused_before_anything_opens(bad, tmp_path):
    with pytest.raises(InvalidArgumentError):
        StoreOptions.from_dict(bad)
    with pytest.raises(InvalidArgumentError):
        ParamStore(str(tmp_path / "s"), **bad)
    assert not (tmp_path / "s").exists()


def test_retention_as_plain_data():
    assert policy_from_spec({"keep_last": 2}) == KeepLast(2)
    rule = policy_from_spec({"keep_last": 2, "keep_best": {"n": 1, "metric": "loss"}, "keep_tagged": []})
    assert rule == AnyOf(KeepLast(2), KeepBest(1, "loss", mode="min"), KeepTagged())
    with pytest.raises(InvalidArgumentError, match="higher or a lower"):
        policy_from_spec({"keep_best": {"n": 1, "metric": "foo"}})
    opts = StoreOptions.from_dict({"remote": "file:///tmp/x", "retention": {"local": {"keep_last": 1},
                                                                            "remote": {"keep_every": 10}}})
    assert set(opts.policies) == {"local", "remote"}


def test_keywords_override_an_options_object_and_a_mapping(shm_dir):
    base = StoreOptions(shard_size_bytes=1 << 20, patches=False)
    with ParamStore(os.path.join(shm_dir, "a"), base, patches=True) as store:
        assert store.options.shard_size_bytes == 1 << 20 and store.options.patches is True
    with ParamStore(os.path.join(shm_dir, "b"), {"shard_size_bytes": 4096}, prepare_buffers=False) as store:
        assert store.options == StoreOptions(shard_size_bytes=4096, prepare_buffers=False)
    with pytest.raises(InvalidArgumentError, match="did you mean 'patches'"):
        ParamStore(os.path.join(shm_dir, "c"), base, patchs=True)
