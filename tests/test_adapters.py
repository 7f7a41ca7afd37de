"""LoRA adapter versions (issue 29 item 4): committed on a base, the base kept while they need it,
written out as a directory PEFT loads. Real PEFT models, a real store."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from torch import nn

from paramstore import ParamStore, adapters
from paramstore.errors import InvalidArgumentError, StepOrderError, VersionNotFoundError
from paramstore.retention import KeepLast

peft = pytest.importorskip("peft")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.v = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v(self.q(x))


def _peft_model(seed: int = 0) -> "peft.PeftModel":
    torch.manual_seed(seed)
    model = peft.get_peft_model(Tiny(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q", "v"]))
    with torch.no_grad():  # lora_B starts at zero: make the adapter do something
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p))
    return model


def _no_leases(store: ParamStore) -> bool:
    """The adapter commit's lease on its base goes once the version is visible: a moment after
    ``result()`` returns (released by the commit future's callback)."""
    deadline = time.monotonic() + 10
    while store.leases() and time.monotonic() < deadline:
        time.sleep(0.01)
    return store.leases() == []


CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q"]}


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"base_model.model.q.lora_A.weight": torch.randn(2, 8, generator=g),
            "base_model.model.q.lora_B.weight": torch.randn(8, 2, generator=g)}


def test_a_peft_models_adapter_is_committed_on_its_base_and_loads_back_into_peft(store_root, tmp_path):
    model = _peft_model()
    with ParamStore(store_root, create=True) as store:
        store.commit(1, Tiny()).result()
        version = store.commit(2, model, base=1).result()
        base = store.get(1)
        assert version.metadata[adapters.BASE_KEY] == {"step": 1, "digest": base.digest}
        want = peft.utils.get_peft_model_state_dict(model)
        with store.checkout(2) as snap:
            assert sorted(snap) == sorted(want)
            for name, t in want.items():
                assert torch.equal(snap[name], t), name
            config = json.loads(snap.assets[adapters.ADAPTER_CONFIG])
            assert config["peft_type"] == "LORA" and config["r"] == 2 and sorted(config["target_modules"]) == ["q", "v"]
            files = adapters.write_peft(str(tmp_path / "adapter"), dict(snap), snap.assets[adapters.ADAPTER_CONFIG])
        assert sorted(files) == sorted(os.listdir(tmp_path / "adapter"))
        assert _no_leases(store)  # the commit's lease on the base is gone
    loaded = peft.PeftModel.from_pretrained(Tiny(), str(tmp_path / "adapter"))
    got = peft.utils.get_peft_model_state_dict(loaded)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_a_state_dict_adapter_takes_its_config_from_a_mapping_or_a_file(store_root, tmp_path):
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps(CONFIG))
    with ParamStore(store_root, create=True) as store:
        store.commit(1, {"q.weight": torch.ones(8, 8)}).result()
        store.commit(2, _state(0), base=1, adapter_config=CONFIG).result()
        store.commit(3, _state(1), base=1, adapter_config=str(path)).result()
        for step, seed in ((2, 0), (3, 1)):
            with store.checkout(step) as snap:
                assert {k: v.clone() for k, v in snap.items()}.keys() == _state(seed).keys()
                assert all(torch.equal(snap[k], v) for k, v in _state(seed).items())
                assert json.loads(snap.assets[adapters.ADAPTER_CONFIG])["target_modules"] == ["q"]


def test_an_unchanged_adapter_is_stored_once(store_root):
    with ParamStore(store_root, create=True) as store:
        store.commit(1, {"q.weight": torch.ones(8, 8)}).result()
        store.commit(2, _state(0), base=1, adapter_config=CONFIG).result()
        store.commit(3, _state(0), base=1, adapter_config=CONFIG).result()
        assert store.manifest(3).objects() == store.manifest(2).objects()
        changed = _state(0)
        changed["base_model.model.q.lora_B.weight"] = changed["base_model.model.q.lora_B.weight"] + 1
        store.commit(4, changed, base=1, adapter_config=CONFIG).result()
        assert store.manifest(4).objects() != store.manifest(3).objects()


def test_retention_keeps_the_base_of_every_kept_adapter_version_and_no_other(store_root):
    with ParamStore(store_root, create=True) as store:
        store.commit(1, {"q.weight": torch.ones(8, 8)}).result()
        store.commit(2, _state(0), base=1, adapter_config=CONFIG).result()
        store.commit(3, {"q.weight": torch.zeros(8, 8)}).result()
        store.commit(4, _state(1), base=1, adapter_config=CONFIG).result()
        assert _no_leases(store)
        report = store.prune(KeepLast(1))
        assert report.kept == {1: ["base of adapter version 4"], 4: ["one of the last 1", "latest"]}
        assert sorted(report.removed) == [2, 3]
        store.commit(5, _state(2), base=1, adapter_config=CONFIG).result()
        store.commit(6, {"q.weight": torch.full((8, 8), 2.0)}).result()
        assert _no_leases(store)
        report = store.prune(KeepLast(1))  # no kept version names base 1 any more
        assert report.kept == {6: ["one of the last 1", "latest"]}
        assert [v.step for v in store.versions()] == [6]


def test_automatic_retention_never_prunes_a_base_an_adapter_needs(store_root):
    with ParamStore(store_root, create=True, retention=KeepLast(1)) as store:
        store.commit(1, {"q.weight": torch.ones(8, 8)}).result()
        for step in range(2, 6):
            store.commit(step, _state(step), base=1, adapter_config=CONFIG).result()
        assert store.flush() is not None
        store._write.maintainer.wait_idle(30)
        steps = [v.step for v in store.versions()]
        assert 1 in steps and steps[-1] == 5
        with store.checkout(5) as snap:
            assert torch.equal(snap["base_model.model.q.lora_A.weight"], _state(5)["base_model.model.q.lora_A.weight"])
        with store.checkout(1) as base:
            assert torch.equal(base["q.weight"], torch.ones(8, 8))


def test_bad_adapter_commits_are_refused_and_leave_no_lease(store_root):
    with ParamStore(store_root, create=True) as store:
        store.commit(1, {"q.weight": torch.ones(8, 8)}).result()
        store.commit(2, _state(0), base=1, adapter_config=CONFIG).result()
        with pytest.raises(InvalidArgumentError, match="needs adapter_config"):
            store.commit(3, _state(0), base=1)
        with pytest.raises(InvalidArgumentError, match="pass base="):
            store.commit(3, _state(0), adapter_config=CONFIG)
        with pytest.raises(InvalidArgumentError, match="itself an adapter version"):
            store.commit(3, _state(0), base=2, adapter_config=CONFIG)
        with pytest.raises(VersionNotFoundError):
            store.commit(3, _state(0), base=7, adapter_config=CONFIG)
        with pytest.raises(InvalidArgumentError, match="positive int r"):
            store.commit(3, _state(0), base=1, adapter_config={**CONFIG, "r": 0})
        with pytest.raises(InvalidArgumentError, match="peft_type"):
            store.commit(3, _state(0), base=1, adapter_config={"r": 2})
        with pytest.raises(InvalidArgumentError, match="is the store's"):
            store.commit(3, _state(0), base=1, adapter_config=CONFIG, metadata={adapters.BASE_KEY: 1})
        with pytest.raises(InvalidArgumentError, match="carries its own config"):
            store.commit(3, _peft_model(), base=1, adapter_config=CONFIG)
        with pytest.raises(StepOrderError):  # refused after the base was leased
            store.commit(2, _state(0), base=1, adapter_config=CONFIG)
        assert _no_leases(store)
        assert [v.step for v in store.versions()] == [1, 2]


def test_a_base_cannot_be_removed_while_an_adapter_version_needs_it(store_root):
    with ParamStore(store_root, create=True) as store:
        store.commit(1, {"q.weight": torch.ones(8, 8)}).result()
        store.commit(2, _state(0), base=1, adapter_config=CONFIG).result()
        store.commit(3, {"q.weight": torch.zeros(8, 8)}).result()
        assert _no_leases(store)
        with pytest.raises(InvalidArgumentError, match=r"base of adapter version\(s\) \[2\]"):
            store.remove(1)
        store.remove(2)
        store.remove(1)
        assert [v.step for v in store.versions()] == [3]


def test_an_adapter_version_exports_as_a_directory_peft_loads(store_root, tmp_path):
    model = _peft_model(seed=3)
    with ParamStore(store_root, create=True) as store:
        store.commit(1, Tiny()).result()
        store.commit(2, model, base=1).result()
        out = store.export(2, str(tmp_path / "export"))
        assert sorted(out["files"]) == sorted(os.listdir(tmp_path / "export")) == [adapters.ADAPTER_CONFIG,
                                                                                   adapters.ADAPTER_WEIGHTS]
        with pytest.raises(InvalidArgumentError, match="adapter version"):
            store.export(2, str(tmp_path / "other"), recipe="fp8-block128")
    torch.manual_seed(3)  # the base weights _peft_model(seed=3) started from
    loaded = peft.PeftModel.from_pretrained(Tiny(), str(tmp_path / "export"))
    want = peft.utils.get_peft_model_state_dict(model)
    got = peft.utils.get_peft_model_state_dict(loaded)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.allclose(loaded(x), model(x))
