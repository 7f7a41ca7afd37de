"""Files outside the store's own root, written or read by another local user (issue 25, items 4 and 5).

An export directory may hold links another user planted under the names an export writes; a model
directory given as ``assets=`` may hold links to the trainer's secrets. Neither is ever followed.
Real files, links, FIFOs and ownership (the tests run as root and chown to ``nobody``).
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import paramstore.assets
from paramstore import ParamStore
from paramstore.errors import InvalidArgumentError, InvalidNameError, ParamStoreWarning

CONFIG = json.dumps({"model_type": "gpt2"}).encode()


@pytest.fixture
def committed(store):
    store.commit(1, {"w": torch.arange(16.0)}, assets={"config.json": CONFIG}).result(timeout=60)
    return store


def secret(tmp_path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(b"root-only")
    os.chmod(path, 0o600)
    return str(path)


def test_an_export_never_writes_through_a_planted_link(committed, tmp_path):
    victim = secret(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("model-00001-of-00001.safetensors.partial", "config.json.partial",
                 "model.safetensors.index.json.partial"):  # the names an export writes first
        os.symlink(victim, out / name)
    r = committed.export(1, out)
    assert open(victim, "rb").read() == b"root-only"  # untouched
    assert sorted(os.listdir(out)) == sorted(r["files"])  # the links are gone, the export is whole
    assert not any(os.path.islink(out / f) for f in os.listdir(out))


def test_an_export_into_another_users_directory_is_refused(committed, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    out = tmp_path / "theirs"
    out.mkdir()
    os.chown(out, 65534, 65534)  # nobody's
    with pytest.raises(InvalidArgumentError, match="belongs to uid 65534"):
        committed.export(1, out)
    assert os.listdir(out) == []


def test_assets_follow_no_link_out_of_their_directory(store, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_bytes(CONFIG)
    (model_dir / "real_vocab.txt").write_bytes(b"a b c")
    os.symlink("real_vocab.txt", model_dir / "vocab.txt")  # inside: followed
    os.symlink(secret(tmp_path), model_dir / "tokenizer.json")  # outside: skipped
    os.symlink("/proc/self/environ", model_dir / "special_tokens_map.json")
    os.mkfifo(model_dir / "merges.txt")  # not a regular file: skipped (never blocks)
    (model_dir / "modeling_evil.py").write_bytes(b"import os")  # code: never kept
    with pytest.warns(ParamStoreWarning) as caught:
        store.commit(1, {"w": torch.ones(2)}, assets=str(model_dir)).result(timeout=60)
    said = " ".join(str(w.message) for w in caught)
    assert "tokenizer.json links outside" in said and "modeling_evil.py" in said
    assert sorted(store.manifest(1).assets) == ["config.json", "real_vocab.txt", "vocab.txt"]
    with store.checkout(1) as snap:
        assert snap.assets["vocab.txt"] == b"a b c"


def test_a_hugging_face_cache_snapshot_is_read_through_its_blob_links(store, tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap_dir = repo / "snapshots" / "0123abc"
    snap_dir.mkdir(parents=True)
    (repo / "blobs" / "f00d").write_bytes(CONFIG)
    os.symlink("../../blobs/f00d", snap_dir / "config.json")  # as huggingface_hub lays a snapshot out
    store.commit(1, {"w": torch.ones(2)}, assets=str(snap_dir)).result(timeout=60)
    with store.checkout(1) as snap:
        assert snap.assets == {"config.json": CONFIG}


def test_an_asset_file_is_bounded_and_code_names_are_refused(store, tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_bytes(CONFIG)
    (model_dir / "tokenizer.json").write_bytes(b"x" * 2048)
    monkeypatch.setattr(paramstore.assets, "MAX_ASSET_BYTES", 1024)
    with pytest.raises(InvalidArgumentError, match="more than the 1024 an asset may be"):
        store.commit(1, {"w": torch.ones(2)}, assets=str(model_dir))
    for name in ("modeling_x.py", "training_args.bin", "model.pkl", "ext.so"):
        with pytest.raises(InvalidNameError, match="code or a pickle"):
            store.commit(1, {"w": torch.ones(2)}, assets={name: b""})
    assert store.versions() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit path may be a link (the caller chose it)
        os.symlink(model_dir / "config.json", tmp_path / "cfg")
        store.commit(1, {"w": torch.ones(2)}, assets={"config.json": str(tmp_path / "cfg")}).result(timeout=60)
