"""The CLI, run as a real subprocess, and the Hugging Face export."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import paramstore
from paramstore.format import parse_header


def cli(root: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "paramstore.cli", "--root", root, *args],
                          capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"paramstore {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
    return proc


@pytest.fixture
def populated(store_root):
    torch.manual_seed(0)
    sd = {"w": torch.randn(32, 16), "b": torch.zeros(16, dtype=torch.bfloat16), "n": torch.arange(7)}
    with paramstore.ParamStore(store_root) as store:
        store.commit(1, sd, tags=["first"], metrics={"loss": 2.0}).result()
        sd2 = dict(sd, w=sd["w"] + 0.25, extra=torch.ones(3))
        del sd2["n"]
        store.commit(2, sd2, metadata={"note": "second"}).result()
    return store_root, sd, sd2


def test_ls_show_json(populated):
    root, sd, _ = populated
    rows = json.loads(cli(root, "ls", "--json").stdout)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["tags"] == ["first"] and rows[0]["metrics"] == {"loss": 2.0}
    assert rows[1]["metadata"] == {"note": "second"}
    # --json accepted before the command too
    assert json.loads(cli(root, "--json", "ls").stdout) == rows
    shown = json.loads(cli(root, "show", "first", "--json").stdout)
    assert shown["step"] == 1 and set(shown["manifest"]["tensors"]) == set(sd)
    text = cli(root, "ls").stdout
    assert "first" in text and len(text.strip().splitlines()) == 3  # header + 2 rows


def test_diff(populated):
    root, _, _ = populated
    r = json.loads(cli(root, "diff", "1", "2", "--json").stdout)
    assert r["added"] == ["extra"] and r["removed"] == ["n"]
    assert [c["name"] for c in r["changed"]] == ["w"]
    assert r["changed"][0]["max_abs_diff"] == pytest.approx(0.25, abs=1e-6)
    assert r["unchanged"] == 1 and r["changed_bytes"] == 32 * 16 * 4


def test_du_counts_dedup(populated):
    root, _, _ = populated
    r = json.loads(cli(root, "du", "--json").stdout)
    assert r["versions"] == 2
    # b is shared by both versions: stored bytes are below the logical total
    assert r["logical_bytes"] == (32 * 16 * 4 + 16 * 2 + 7 * 8) + (32 * 16 * 4 + 16 * 2 + 3 * 4)
    assert r["stored_bytes"] < r["logical_bytes"] + 2 * 1024


def test_verify_detects_corruption(populated):
    root, _, _ = populated
    ok = json.loads(cli(root, "verify", "--json").stdout)
    assert ok["ok"] and ok["objects_checked"] >= 2 and ok["orphans"] == [] and ok["leftovers"] == []
    with paramstore.ParamStore(root) as store:
        obj = store._root.registry.get_manifest(2).tensors["w"].object
        path = store._root.tier.object_path(obj)
    with open(path, "r+b") as f:  # flip one byte inside tensor data
        start, _ = parse_header(f.read(4096))
        f.seek(start + 5)
        byte = f.read(1)
        f.seek(start + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad = cli(root, "verify", "--json", check=False)
    assert bad.returncode == 1
    r = json.loads(bad.stdout)
    assert not r["ok"] and obj in r["corrupt"] and 2 in r["damaged_versions"]
    # verifying only version 1 still passes if it does not use that object
    with paramstore.ParamStore(root) as store:
        v1_objects = store._root.registry.get_manifest(1).objects()
    assert cli(root, "verify", "1", check=False).returncode == (1 if obj in v1_objects else 0)


def test_verify_reports_orphans_and_leftovers(populated):
    root, _, _ = populated
    open(os.path.join(root, "tmp", "slab-999-0"), "wb").close()
    r = json.loads(cli(root, "verify", "--json").stdout)
    assert r["ok"] and r["leftovers"] == ["slab-999-0"]


def test_tag_and_errors(populated):
    root, _, _ = populated
    cli(root, "tag", "2", "best")
    assert json.loads(cli(root, "show", "best", "--json").stdout)["step"] == 2
    cli(root, "tag", "--delete", "best")
    missing = cli(root, "show", "best", check=False)
    assert missing.returncode == 2 and "no tag named 'best'" in missing.stderr
    assert cli(root, "tag", "--delete", "best", check=False).returncode == 2
    assert cli(root, "show", "99", check=False).returncode == 2
    assert cli(root, "tag", "1", "latest", check=False).returncode == 2


def test_not_a_store(tmp_path):
    proc = cli(str(tmp_path), "ls", check=False)
    assert proc.returncode == 2 and "not a paramstore root" in proc.stderr
    assert not os.path.exists(tmp_path / "paramstore.json")


def test_export_loads_with_safetensors(populated, tmp_path):
    root, _, sd2 = populated
    out = tmp_path / "export"
    cli(root, "export", "2", str(out), "--shard-size-bytes", "1000")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1  # sharded at 1000 bytes
    loaded = {}
    for f in files:
        loaded.update(load_file(out / f))
    assert set(loaded) == set(sd2)
    for k, v in sd2.items():
        assert torch.equal(loaded[k], v), k
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in sd2.values())
    again = cli(root, "export", "2", str(out), check=False)
    assert again.returncode == 2  # refuses to overwrite an export


def test_export_from_pretrained_gpt2(store_root, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    with paramstore.ParamStore(store_root) as store:
        store.commit(5, model).result()
        with store.checkout(5) as snap:
            assert snap["lm_head.weight"] is snap["transformer.wte.weight"]
    out = tmp_path / "gpt2"
    cli(store_root, "export", "5", str(out))
    cfg.save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    tokens = torch.randint(0, 100, (2, 10))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
