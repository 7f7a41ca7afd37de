"""Tied weights (one storage under several names, stored once as one digest) in ``diff`` and ``export``.

``diff`` lists every tied name but counts the bytes of each distinct digest once; ``export`` writes
a tied tensor once, under the stored name, and maps the other names to it in the index metadata.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import paramstore
from paramstore.export import INDEX_NAME


def tied_model(seed: int) -> dict[str, torch.Tensor]:
    """An embedding tied to an output projection (as GPT-2's), and a bias."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(64, 32, generator=g)
    return {"transformer.wte.weight": emb, "lm_head.weight": emb, "b": torch.randn(32, generator=g)}


@pytest.fixture
def tied(store_root):
    with paramstore.ParamStore(store_root) as store:
        store.commit(1, tied_model(1)).result()
        two = dict(tied_model(2), b=tied_model(1)["b"])  # the tied pair changed, the bias did not
        extra = torch.ones(16, 8)
        two.update({"extra.a": extra, "extra.b": extra})  # a tied pair added
        store.commit(2, two).result()
        yield store


def test_diff_counts_a_tied_tensor_once(tied):
    r = tied.diff(1, 2)
    assert [c["name"] for c in r["changed"]] == ["lm_head.weight", "transformer.wte.weight"]  # both names listed
    assert r["changed_bytes"] == 64 * 32 * 4  # one tensor: was counted twice
    assert r["added"] == ["extra.a", "extra.b"]
    assert r["added_bytes"] == 16 * 8 * 4
    assert r["unchanged"] == 1


def test_export_writes_a_tied_tensor_once(tied, tmp_path):
    out = tmp_path / "export"
    r = tied.export(2, str(out), show_progress=False, weights_only=True)
    index = json.loads((out / INDEX_NAME).read_text())
    man = tied.manifest(2)
    assert dict(man.aliases) == {"transformer.wte.weight": "lm_head.weight", "extra.b": "extra.a"}
    assert sorted(index["weight_map"]) == ["b", "extra.a", "lm_head.weight"]  # stored names only
    assert index["metadata"]["paramstore_aliases"] == {"extra.b": "extra.a", "transformer.wte.weight": "lm_head.weight"}
    assert index["metadata"]["total_size"] == r["total_size"] == (64 * 32 + 32 + 16 * 8) * 4
    loaded = {}
    for f in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(os.path.join(out, f)))
    assert sorted(loaded) == sorted(index["weight_map"])
    want = tied_model(2)
    assert torch.equal(loaded["lm_head.weight"], want["lm_head.weight"])
    assert torch.equal(loaded["b"], tied_model(1)["b"])
    data = sum(os.path.getsize(os.path.join(out, f)) for f in set(index["weight_map"].values()))
    assert data < index["metadata"]["total_size"] + 1024  # bytes of each tensor once, plus headers


def test_export_of_tied_gpt2_loads_with_from_pretrained(store_root, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with paramstore.ParamStore(store_root) as store:
        store.commit(1, model).result()
        store.export(1, str(tmp_path / "gpt2"), show_progress=False)  # its config.json is the version's
    index = json.loads((tmp_path / "gpt2" / INDEX_NAME).read_text())
    tied_names = {"lm_head.weight", "transformer.wte.weight"}
    assert len(tied_names & set(index["weight_map"])) == 1  # written once (save_pretrained writes one too)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    tokens = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
