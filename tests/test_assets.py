"""Assets: a version's config and tokenizer files, kept, moved and exported like its tensors, so that
an export loads with ``from_pretrained`` as it is (no hand-written file)."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import pytest
import torch

import paramstore
from paramstore import ParamStore
from paramstore.errors import CorruptObjectError, InvalidArgumentError, InvalidNameError
from paramstore.manifest import Manifest

from helpers import assert_bits_equal
from ranks import run_ranks

transformers = pytest.importorskip("transformers")

VOCAB = ["[UNK]", "[PAD]", "hello", "world", "the", "weights", "moved"]


def gpt2(seed: int = 0) -> "transformers.GPT2LMHeadModel":
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=len(VOCAB) + 9, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).eval()


def tokenizer_dir(path) -> str:
    """A word-level tokenizer built here (no download), saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(path)
    return str(path)


def stored_dtype(config: dict) -> str:
    return config["dtype"] if "dtype" in config else config["torch_dtype"]  # transformers 5.x; 4.x


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def test_an_export_loads_with_from_pretrained_as_it_is(store, tmp_path):
    model = gpt2()
    tok_dir = tokenizer_dir(tmp_path / "tok")
    v = store.commit(1, model, assets=tok_dir).result()
    man = store.manifest(1)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(man.assets)
    assert v.num_tensors == len(model.state_dict())  # assets are not tensors
    assert man.to_json()["format"] == 3
    out = tmp_path / "hf"
    r = store.export(1, out, shard_size_bytes=20_000)  # several shards
    shards = [f for f in r["files"] if f.endswith(".safetensors")]
    assert len(shards) > 2 and r["files"][-1] == "model.safetensors.index.json"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert config["n_embd"] == 32 and stored_dtype(config) == "float32"
    assert model.config.architectures is None  # the model's own config is left alone
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded) is transformers.GPT2LMHeadModel
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again
    tokens = torch.randint(0, len(VOCAB), (2, 9))
    assert torch.equal(logits(loaded, tokens), logits(model, tokens))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("hello the world")["input_ids"] == [2, 4, 3]


def test_a_bf16_commit_records_its_dtype_and_the_stream_keeps_given_assets(store, tmp_path):
    model = gpt2()
    store.commit(1, model, dtype=torch.bfloat16).result()
    with store.checkout(1) as snap:
        assert stored_dtype(json.loads(snap.assets["config.json"])) == "bfloat16"
        assert snap["lm_head.weight"].dtype == torch.bfloat16
    # A stream has no model to take a config from: assets= gives it (here, the files of a checkout).
    with store.checkout(1) as snap:
        files = snap.assets
    pairs = ((n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters())  # as verl streams them
    store.commit(2, pairs, assets=files).result()
    assert store.manifest(2).assets["config.json"].digest == store.manifest(1).assets["config.json"].digest
    auto = {"dtype" if transformers.__version__ >= "5" else "torch_dtype": "auto"}  # the recorded dtype
    loaded = transformers.AutoModelForCausalLM.from_pretrained(store.export(2, tmp_path / "hf")["directory"], **auto)
    assert loaded.dtype == torch.bfloat16
    for n, p in model.named_parameters():
        assert_bits_equal(loaded.get_parameter(n), p.detach().to(torch.bfloat16), n)


def test_assets_are_deduplicated_and_kept_from_gc(store):
    model = gpt2()
    store.commit(1, model).result()
    store.commit(2, gpt2(seed=1)).result()  # other weights, the same config
    a, b = store.manifest(1).assets, store.manifest(2).assets
    assert a["config.json"] == b["config.json"]  # one copy: same object, same place
    store.commit(3, {"w": torch.ones(2)}, assets={"config.json": b'{"model_type": "x"}', "new.txt": b""}).result()
    assert store.diff(2, 3)["assets"] == {"added": ["new.txt"], "removed": ["generation_config.json"],
                                          "changed": ["config.json"]}
    assert store.diff(1, 2)["assets"] == {"added": [], "removed": [], "changed": []}
    store.remove(1)
    store.gc()
    with store.checkout(2) as snap:
        assert json.loads(snap.assets["config.json"])["n_layer"] == 2
    assert store.verify()["ok"]


def test_unchanged_assets_are_one_small_object_that_pins_no_tensors(store):
    """Every version of a fine-tuned model shares its config; that must not keep any version's
    tensors alive once retention drops them (assets are stored in objects of their own)."""
    from paramstore.retention import KeepLast

    model = gpt2()
    sizes = []
    for step in range(1, 5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)  # every tensor changes
        store.commit(step, model, assets={"notes.txt": b"same"}).result()
        store.prune(KeepLast(1))
        store.gc()
        du = store.du()
        sizes.append((du["objects"], du["stored_bytes"]))
    assert all(n == 2 for n, _ in sizes), sizes  # one shard of tensors + one object of assets
    assert sizes[-1][1] < store.get(4).nbytes + (64 << 10), sizes  # about one model, not two
    objects = {e.object for e in store.manifest(4).assets.values()}
    assert len(objects) == 1 and not objects & {c.object for e in store.manifest(4).tensors.values()
                                                 for c in e.pieces()}


def test_a_config_that_cannot_be_saved_warns_and_the_weights_are_committed(store):
    model = gpt2()
    model.config.run_info = {"started": {1, 2}}  # a set: not JSON
    with pytest.warns(paramstore.ParamStoreWarning, match="cannot be written as config.json"):
        store.commit(1, model).result()
    assert store.manifest(1).assets == {}
    compiled = torch.compile(gpt2())  # a wrapper: the class recorded is the model's
    store.commit(2, compiled, assets={"config.json": b"{}"}).result()  # the model's own config wins
    del model.config.run_info
    config = json.loads(_asset(store, 2, "config.json"))
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"


def _asset(store, step, name):
    with store.checkout(step) as snap:
        return snap.assets[name]


def test_a_version_without_config_is_refused_then_exported_with_assets_from(store, tmp_path):
    model = gpt2()
    store.commit(2, model.state_dict()).result()  # a state dict: nothing says which model it is
    assert store.manifest(2).assets == {} and store.manifest(2).to_json()["format"] == 1
    with pytest.raises(InvalidArgumentError, match="no config.json.*assets_from"):
        store.export(2, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer_dir(model_dir)
    r = store.export(2, tmp_path / "hf", assets_from=model_dir)
    assert "config.json" in r["files"] and not any(f.startswith("model.safetensors") and f.endswith("safetensors")
                                                   for f in r["files"])  # its weights are not copied
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, len(VOCAB), (1, 6))
    assert torch.equal(logits(loaded, tokens), logits(model, tokens))
    # A config without model_type would build the wrong model: refused too.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"n_embd": 32}))
    with pytest.raises(InvalidArgumentError, match="no model_type"):
        store.export(2, tmp_path / "refused", assets_from=bad)
    with pytest.raises(InvalidArgumentError, match="not both"):
        store.export(2, tmp_path / "refused", assets_from=bad, weights_only=True)
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("assets, error, match", [
    ({"a/b.json": b"{}"}, InvalidNameError, "plain file name"),
    ({"..": b"{}"}, InvalidNameError, "plain file name"),
    ({"model-00001-of-00001.safetensors": b""}, InvalidNameError, "weights or temporary file"),
    ({"model.safetensors.index.json": b"{}"}, InvalidNameError, "weights or temporary file"),
    ({"model.safetensors.index.json.partial": b"{}"}, InvalidNameError, "weights or temporary file"),
    ({"t" * 236 + ".json": b"{}"}, InvalidNameError, "at most 240 bytes"),
    ({"config.json": {"model_type": "gpt2"}}, InvalidArgumentError, "bytes .the content. or a path"),
    ({"config.json": "/nonexistent/config.json"}, InvalidArgumentError, "cannot read '/nonexistent/config.json'"),
    ({"modeling_evil.py": b"import os"}, InvalidNameError, "code or a pickle"),
    ({"training_args.bin": b"\x80\x04"}, InvalidNameError, "code or a pickle"),
    ("/nonexistent/model", InvalidArgumentError, "not a directory"),
    (42, InvalidArgumentError, "directory or a mapping"),
])
def test_bad_assets_are_refused_before_anything_is_written(store, assets, error, match):
    with pytest.raises(error, match=match):
        store.commit(2, {"w": torch.ones(3)}, assets=assets)
    assert store.versions() == []


def test_a_directory_of_weights_only_is_refused(store, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    with pytest.raises(InvalidArgumentError, match="no asset files"):
        store.commit(2, {"w": torch.ones(3)}, assets=tmp_path)


def test_a_damaged_asset_is_found_by_verify(store):
    store.commit(2, {"w": torch.ones(3)}, assets={"notes.txt": b"x" * 100}).result()
    e = store.manifest(2).assets["notes.txt"]
    path = store._root.tier.object_path(e.object)
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(e.offset + 10)
        f.write(b"y")
    report = store.verify()
    assert not report["ok"] and e.object in report["corrupt"]
    assert report["damaged_versions"] == [2]
    with store.checkout(2) as snap:  # a checkout maps it; its own verify finds the damage
        assert e.object in snap.verify()


def test_manifest_format_3_round_trips_and_is_checked(store):
    store.commit(1, {"w": torch.ones(3)}).result()
    store.commit(2, {"w": torch.ones(3)}, assets={"notes.txt": b"abc"}).result()
    man = store.manifest(2)
    d = json.loads(json.dumps(man.to_json()))
    assert Manifest.from_json(d) == man
    assert man.digest() == store.get(2).digest
    other = json.loads(json.dumps(d))
    other["assets"]["notes.txt"]["digest"] = "0" * 64
    assert Manifest.from_json(other).digest() != man.digest()  # the digest covers the assets
    for broken, match in [({"format": 3, "tensors": d["tensors"], "aliases": {}, "assets": {}}, "no assets"),
                          ({**d, "assets": {"a/b": d["assets"]["notes.txt"]}}, "plain file name"),
                          ({**d, "assets": {"x": {**d["assets"]["notes.txt"], "dtype": "F32", "shape": [0]}}},
                           "1-D U8"),
                          ({**d, "assets": []}, "must be a JSON object")]:
        with pytest.raises(CorruptObjectError, match=match):
            Manifest.from_json(broken)
    plain = store.manifest(1)  # a version without assets keeps format 1 and its digest
    assert plain.to_json()["format"] == 1 and "assets" not in plain.to_json()


def test_assets_are_pushed_and_pulled(shm_dir, s3_remote):
    url, options = s3_remote
    with ParamStore(os.path.join(shm_dir, "a"), remote=url, storage_options=options) as store:
        h = store.commit(1, gpt2(), assets={"notes.txt": b"pushed"})
        h.persisted.result(timeout=60)
    with ParamStore(os.path.join(shm_dir, "b"), remote=url, storage_options=options) as store:
        store.pull(1)
        with store.checkout(1) as snap:
            assert snap.assets["notes.txt"] == b"pushed"
            assert json.loads(snap.assets["config.json"])["model_type"] == "gpt2"
        assert store.verify()["ok"]


def _commit_sharded_with_assets(rank: int, world: int, hosts: list[str], registry: str, name: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = torch.randn(8, 4)
    sd = {"w": distribute_tensor(full, mesh, [Shard(0)])}
    with ParamStore(hosts[rank], registry=registry, name=name) as store:
        store.serve("127.0.0.1")
        v = store.commit(1, sd, assets={"config.json": b'{"model_type": "x"}', "rank.txt": b"same on every rank"}
                         ).result(timeout=60)
        while not os.path.exists(os.path.join(hosts[rank], "..", "done")):
            time.sleep(0.1)
        return {"digest": v.digest}


def test_a_sharded_commit_stores_assets_once_and_another_host_fetches_them(shm_dir, redis_url):
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda and libibverbs1")
    name = f"assets-{uuid.uuid4().hex[:8]}"
    hosts = [os.path.join(shm_dir, f"host{i}", "store") for i in range(3)]
    for h in hosts:
        os.makedirs(os.path.dirname(h))
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(run_ranks(2, _commit_sharded_with_assets, hosts, redis_url, name,
                                                                timeout=120)))
    t.start()
    try:
        with ParamStore(hosts[2], registry=redis_url, name=name) as store:
            assert store.wait_for(1, timeout=90) is not None
            with store.checkout(1) as snap:
                assert snap.assets == {"config.json": b'{"model_type": "x"}', "rank.txt": b"same on every rank"}
                assert sorted(snap) == ["w"]
                torch.manual_seed(0)
                assert_bits_equal(snap["w"], torch.randn(8, 4), "w")
                assert snap.fetch.from_peers
            man = store.manifest(1)
    finally:
        for h in hosts[:2]:
            open(os.path.join(os.path.dirname(h), "done"), "w").close()
        t.join(60)
    assert len({r["digest"] for r in result.values()}) == 1
    asset_objects = {e.object for e in man.assets.values()}
    on = [{f.split(".")[0] for _, _, fs in os.walk(os.path.join(h, "objects")) for f in fs} for h in hosts[:2]]
    assert asset_objects <= on[0] and not asset_objects & on[1]  # the lead stored them, once


def test_the_config_files_follow_a_change_of_config_or_dtype(store):
    """The files are made once per model and config (serialising costs ~1 ms a commit): a changed
    config, or another stored dtype, gives new files."""
    model = gpt2()
    store.commit(1, model).result()
    model.config.n_inner = 99  # changed between commits
    store.commit(2, model, dtype=torch.bfloat16).result()
    first, second = (json.loads(_asset(store, s, "config.json")) for s in (1, 2))
    assert first.get("n_inner") is None and second["n_inner"] == 99
    assert stored_dtype(first) == "float32" and stored_dtype(second) == "bfloat16"
    store.commit(3, model, dtype=torch.bfloat16).result()  # unchanged: the same files, one object
    assert store.manifest(3).assets == store.manifest(2).assets
