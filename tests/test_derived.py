"""Derived versions (issue 29, item 2): a checkout, prefetch or export in a recipe's form, derived
once per source object, shared by content, kept and swept with its source (paramstore.derived)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

import paramstore
from paramstore import derived, recipes
from paramstore.errors import CorruptObjectError, InvalidArgumentError
from paramstore.recipes import ERROR_BOUND
from paramstore.retention import KeepLast

FP8 = torch.float8_e4m3fn
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def model_state(seed: int = 0, rows: int = 300) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 200, generator=g).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(rows, 200, generator=g).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(200, rows, generator=g).bfloat16(),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(200, 200, generator=g).bfloat16(),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(200, generator=g).bfloat16(),
        "model.norm.weight": torch.full((200,), 1.0 + seed).bfloat16(),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (FP8 has no torch.equal on CPU in every build)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class Counting:
    """A registered recipe that counts its conversions (by tensor name)."""

    def __init__(self, name: str) -> None:
        base = recipes.get("fp8-block128")
        self.calls: list[str] = []

        def convert(n: str, t: torch.Tensor):
            self.calls.append(n)
            return base.convert(n, t)

        self.recipe = recipes.register(recipes.Recipe(name, 1, base.eligible, convert, base.config()),
                                       replace=True)


def derived_objects(root: str) -> set[str]:
    with paramstore.ParamStore(root) as store:
        return {o for _, r in derived.records(store._root) if r is not None for o in r.objects}


@pytest.mark.parametrize("recipe", ["fp8-block128", "fp8-tensor"])
def test_checkout_is_the_recipe_of_the_version(store, recipe):
    state = model_state()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: an alias in the manifest
    store.commit(1, state).result()
    with store.checkout(1) as plain:
        expected = recipes.derive(recipe, dict(plain.items()))
        committed = plain.manifest
    with store.checkout(1, recipe=recipe) as snap:
        assert snap.recipe == recipe and snap.step == 1 and snap.digest == store.get(1).digest
        assert sorted(snap) == sorted(expected)
        for name in expected:
            assert same(snap[name], expected[name]), name
        # what the recipe leaves alone is the committed bytes, mapped in place (no copy)
        for name in ("model.norm.weight", "model.layers.0.self_attn.o_proj.bias"):
            assert snap.manifest.entry(name) == committed.entry(name)
        assert snap["model.layers.0.mlp.up_proj.weight"].dtype == FP8
        assert snap.verify() == {}
    assert store.leases() == []


def test_made_once_shared_by_content(store_root):
    counting = Counting("test-count-fp8")
    state = model_state()
    with paramstore.ParamStore(store_root, shard_size_bytes=100_000) as store:  # one object per weight, about
        store.commit(1, state).result()
        n_objects = len(store.manifest(1).objects())
        assert n_objects >= 3
        with store.checkout(1, recipe=counting.recipe) as snap:
            first = snap.derived
        assert sorted(counting.calls) == sorted(n for n, t in state.items() if recipes.default_eligible(n, t))
        assert first.derived >= 1 and first.tensors == len(counting.calls)
        with store.checkout(1, recipe=counting.recipe) as snap:
            assert snap.derived.derived == 0 and snap.derived.tensors == 0
    assert len(counting.calls) == 3
    # another store object on the same root (what another process sees): nothing derived again
    with paramstore.ParamStore(store_root) as store:
        with store.checkout(1, recipe=counting.recipe) as snap:
            assert snap.derived.derived == 0
        assert len(counting.calls) == 3
        # the next version changes one weight: only the object holding it is derived again
        changed = dict(state)
        changed["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"] + 1
        store.commit(2, changed).result()
        with store.checkout(2, recipe=counting.recipe) as snap:
            assert same(snap["model.layers.0.mlp.down_proj.weight"],
                        recipes.derive("fp8-block128", changed)["model.layers.0.mlp.down_proj.weight"])
        assert counting.calls[3:] == ["model.layers.0.mlp.down_proj.weight"]


def test_another_process_derives_nothing_again(store):
    store.commit(1, model_state()).result()
    with store.checkout(1, recipe="fp8-block128") as snap:
        assert snap.derived.derived >= 1
        mine = {n: snap[n].clone() for n in snap}
    code = ("import paramstore, sys, json\n"
            "with paramstore.ParamStore(sys.argv[1]) as s, s.checkout(1, recipe='fp8-block128') as snap:\n"
            "    print(json.dumps(snap.derived.as_dict()))\n")
    out = subprocess.run([sys.executable, "-c", code, store.root], capture_output=True, text=True, check=True,
                         cwd=REPO)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["derived"] == 0 and report["units"] >= 1
    with store.checkout(1, recipe="fp8-block128") as snap:
        assert all(same(snap[n], mine[n]) for n in mine)


def test_concurrent_derivers_end_with_one_result(store_root):
    with paramstore.ParamStore(store_root) as store:
        store.commit(1, model_state(rows=1000)).result()
    code = ("import paramstore, sys, hashlib\n"
            "with paramstore.ParamStore(sys.argv[1]) as s, s.checkout(1, recipe='fp8-block128') as snap:\n"
            "    h = hashlib.sha256()\n"
            "    for n in sorted(snap): h.update(n.encode()); h.update(snap[n].contiguous().view(-1).view(__import__('torch').uint8).numpy().tobytes())\n"
            "    print(h.hexdigest(), snap.verify() == {})\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, store_root], stdout=subprocess.PIPE, text=True, cwd=REPO)
             for _ in range(3)]
    results = []
    errors: list[BaseException] = []

    def in_thread() -> None:
        try:
            with paramstore.ParamStore(store_root) as s, s.checkout(1, recipe="fp8-block128") as snap:
                results.append(snap.verify() == {})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=in_thread) for _ in range(2)]
    for t in threads:
        t.start()
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    for t in threads:
        t.join()
    assert not errors and results == [True, True]
    assert all(p.returncode == 0 for p in procs)
    assert len({o[0] for o in outs}) == 1 and all(o[1] == "True" for o in outs)
    with paramstore.ParamStore(store_root) as store:
        recs = [r for _, r in derived.records(store._root)]
        assert len(recs) == 1 and recs[0] is not None and len(recs[0].objects) == 1
        assert [k.split("/")[0] for k in store._root.registry.derived_keys()] == ["fp8-block128@1"]
        # every derived object made is the recorded one (the losers' copies were dropped by the rename)
        present = set(store._root.tier.list()) - store.manifest(1).objects()
        assert present == set(recs[0].objects)


def test_same_bytes_whatever_the_thread_count(shm_dir):
    state = {"model.layers.0.mlp.up_proj.weight": torch.randn(1100, 2100, generator=torch.Generator().manual_seed(3)).bfloat16(),
             "model.layers.0.mlp.down_proj.weight": torch.randn(700, 300, generator=torch.Generator().manual_seed(4))}
    threads = torch.get_num_threads()
    digests = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            with paramstore.ParamStore(os.path.join(shm_dir, f"t{n}")) as store:
                store.commit(1, state).result()
                with store.checkout(1, recipe="fp8-block128") as snap:
                    assert snap.derived.derived >= 1
                digests.append(derived_objects(store.root))
    finally:
        torch.set_num_threads(threads)
    assert digests[0] and digests[0] == digests[1]


def test_gc_keeps_derived_objects_of_kept_and_leased_versions(store):
    a, b = model_state(0), model_state(1)
    store.commit(1, a).result()
    snap = store.checkout(1, recipe="fp8-block128")  # leased
    made = derived_objects(store.root)
    assert made and made <= set(store._root.tier.list())
    store.commit(2, b).result()  # shares nothing with step 1
    with store.checkout(2, recipe="fp8-block128"):
        pass
    assert store.prune(KeepLast(1)).removed == []  # step 1 is leased
    assert not set(store.gc().objects) & made
    assert made <= set(store._root.tier.list())
    assert same(snap["model.layers.0.mlp.up_proj.weight"],
                recipes.derive("fp8-block128", a)["model.layers.0.mlp.up_proj.weight"])
    snap.close()
    assert store.prune(KeepLast(1)).removed == [1]
    assert store.gc(dry_run=True).objects and made <= set(store._root.tier.list())  # a dry run deletes nothing
    swept = set(store.gc().objects)
    assert made <= swept and not made & set(store._root.tier.list())
    kept = derived_objects(store.root)  # step 2's are kept, with their record
    assert kept and kept <= set(store._root.tier.list())
    with store.checkout(2, recipe="fp8-block128") as snap:
        assert snap.derived.derived == 0
    report = store.verify()
    assert report["orphans"] == [] and report["derived_objects"] == len(kept) and report["ok"]


def test_derived_object_lives_as_long_as_its_source(store):
    """Step 2 keeps the object of step 1 it did not change: its derived object outlives step 1."""
    a = model_state(0)
    store.commit(1, {"model.layers.0.mlp.up_proj.weight": a["model.layers.0.mlp.up_proj.weight"]}).result()
    b = {"model.layers.0.mlp.up_proj.weight": a["model.layers.0.mlp.up_proj.weight"],
         "model.layers.0.mlp.down_proj.weight": a["model.layers.0.mlp.down_proj.weight"]}
    store.commit(2, b).result()
    with store.checkout(1, recipe="fp8-block128"):
        pass
    shared = derived_objects(store.root)
    assert store.prune(KeepLast(1)).removed == [1]
    assert not set(store.gc().objects) & shared
    with store.checkout(2, recipe="fp8-block128") as snap:
        assert snap.derived.tensors == 1  # only the new weight: the unchanged one was derived with step 1
        assert set(snap.manifest.objects()) >= shared


def test_prefetch_with_recipe_derives_ahead(store):
    store.commit(1, model_state()).result()
    assert store.prefetch(1, recipe="fp8-block128").result(timeout=60).step == 1
    with store.checkout(1, recipe="fp8-block128") as snap:
        assert snap.derived.derived == 0 and snap.derived.units >= 1
    with pytest.raises(InvalidArgumentError, match="unknown recipe 'int3'.*'fp8-block128'"):
        store.prefetch(1, recipe="int3")


def test_bad_input_is_refused_clearly(store):
    store.commit(1, model_state()).result()
    with pytest.raises(InvalidArgumentError, match="unknown recipe 'fp4'.*known recipes are.*'fp8-block128'.*'fp8-tensor'"):
        store.checkout(1, recipe="fp4")
    with pytest.raises(InvalidArgumentError, match="recipe must be a recipe's name or a Recipe"):
        store.checkout(1, recipe=3)
    with pytest.raises(InvalidArgumentError, match="unknown recipe"):
        store.export(1, os.path.join(store.root, "..", "x"), recipe="nope", weights_only=True)
    clash = recipes.register(recipes.Recipe("test-clash", 1, lambda n, t: n.endswith("up_proj.weight"),
                                            lambda n, t: {n: t, "model.norm.weight": t}), replace=True)
    with pytest.raises(InvalidArgumentError, match="is in the version already"):
        store.checkout(1, recipe=clash)
    assert store.leases() == []


def test_damaged_derived_object_is_caught_and_derived_again(store):
    store.commit(1, model_state()).result()
    with store.checkout(1, recipe="fp8-block128"):
        pass
    (obj,) = derived_objects(store.root)
    path = store._root.tier.object_path(obj)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(CorruptObjectError, match="recipe 'fp8-block128'.*quarantined"):
        store.checkout(1, recipe="fp8-block128", verify=True)
    assert store.leases() == []
    with store.checkout(1, recipe="fp8-block128", verify=True) as snap:
        assert snap.derived.derived == 1 and snap.verify() == {}


def test_damaged_record_is_derived_again(store):
    store.commit(1, model_state()).result()
    with store.checkout(1, recipe="fp8-block128"):
        pass
    reg = store._root.registry
    (key,) = reg.derived_keys()
    assert reg.swap_derived(key, reg.derived([key])[key], b'{"format": 1, "tensors": [') == b'{"format": 1, "tensors": ['
    with store.checkout(1, recipe="fp8-block128") as snap:
        assert snap.derived.derived == 1
        assert snap["model.layers.0.mlp.up_proj.weight"].dtype == FP8
    assert derived._parse(reg.derived([key])[key], recipes.get("fp8-block128")) is not None  # replaced


def test_export_with_recipe_loads_and_dequantizes_within_the_bound(store, tmp_path):
    state = model_state()
    config = {"model_type": "llama", "hidden_size": 200}
    store.commit(1, state, assets={"config.json": json.dumps(config).encode()}).result()
    out = store.export(1, tmp_path / "fp8", recipe="fp8-block128", shard_size_bytes=100_000)
    written = {}
    for f in out["files"]:
        if f.endswith(".safetensors"):
            written.update(load_file(str(tmp_path / "fp8" / f)))
    expected = recipes.derive("fp8-block128", state)
    assert sorted(written) == sorted(expected)
    for name, t in expected.items():
        assert same(written[name], t), name
    rel, absolute, slack = ERROR_BOUND
    for name, w in state.items():
        if not recipes.default_eligible(name, w):
            continue
        scale = written[recipes.scale_name(name, "weight_scale_inv")]
        back = recipes.dequantize_block(written[name], scale).double()
        full = scale.double().repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
        bound = torch.maximum(rel * w.double().abs(), absolute * full) * (1 + slack)
        assert bool(((back - w.double()).abs() <= bound).all()), name
    saved = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["hidden_size"] == 200
    assert saved["quantization_config"] == recipes.get("fp8-block128").config()
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["paramstore_recipe"] == "fp8-block128@1"
    assert set(index["weight_map"]) == set(expected)


def test_cli_export_with_recipe(store, tmp_path):
    store.commit(1, model_state(), assets={"config.json": b'{"model_type": "llama"}'}).result()
    env = {**os.environ, "PYTHONPATH": REPO}
    run = subprocess.run([sys.executable, "-m", "paramstore", "--root", store.root, "export", "1",
                          str(tmp_path / "out"), "--recipe", "fp8-tensor"], capture_output=True, text=True, env=env,
                         cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert "in the form of recipe fp8-tensor" in run.stdout
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic"}
    tensors = load_file(str(tmp_path / "out" / "model-00001-of-00001.safetensors"))
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == FP8
    assert tensors["model.layers.0.mlp.up_proj.weight_scale"].shape == ()
    bad = subprocess.run([sys.executable, "-m", "paramstore", "--root", store.root, "export", "1",
                          str(tmp_path / "bad"), "--recipe", "int4"], capture_output=True, text=True, env=env, cwd=REPO)
    assert bad.returncode != 0 and "unknown recipe 'int4'" in bad.stderr and "'fp8-block128'" in bad.stderr


def test_a_trainer_with_derive_makes_each_version_in_the_background(shm_dir):
    """``ParamStore(derive=[...])``: the committing process derives each version it commits once
    it is visible; a reader then derives nothing. An unknown recipe fails the store's creation."""
    with pytest.raises(paramstore.InvalidArgumentError, match="recipe"):
        paramstore.ParamStore(os.path.join(shm_dir, "bad"), derive=["no-such-recipe"])
    with pytest.raises(paramstore.InvalidArgumentError, match="derive"):
        paramstore.ParamStore(os.path.join(shm_dir, "bad"), derive="fp8-block128")
    root = os.path.join(shm_dir, "trainer")
    with paramstore.ParamStore(root, derive=["fp8-block128", "fp8-tensor"]) as trainer:
        for step in (1, 2, 3):
            trainer.commit(step, model_state(seed=step)).result()
        assert trainer.flush(timeout=60).step == 3  # ... and its derivations done
        keys = trainer._root.registry.derived_keys()
        assert {k.split("/")[0] for k in keys} == {"fp8-block128@1", "fp8-tensor@1"}
        latest = trainer.manifest(3).objects()
        assert {k.split("/")[1] for k in keys} >= latest  # the newest version, in both recipes
        with paramstore.ParamStore(root) as reader:
            for recipe in ("fp8-block128", "fp8-tensor"):
                with reader.checkout(3, recipe=recipe) as snap:
                    assert snap.derived.derived == 0, recipe
                    assert snap["model.layers.0.mlp.up_proj.weight"].dtype == FP8


def test_derived_forms_go_to_the_remote_with_their_version(shm_dir, s3_remote):
    """A trainer with ``derive=`` and a remote pushes each version's derived forms with it (objects,
    then records); a host that reaches the version only through the remote (its own registry)
    reads the record there and downloads the derived object, verified, instead of deriving; the
    remote's GC keeps derived objects while their sources are in a version, and sweeps them after."""
    from paramstore import maintenance
    from paramstore.remote import Remote

    url, opts = s3_remote
    with paramstore.ParamStore(os.path.join(shm_dir, "trainer"), remote=url, storage_options=opts,
                               derive=["fp8-block128"]) as trainer:
        trainer.commit(1, model_state(seed=1)).result()
        trainer.wait_persisted(timeout=120)
        keys = trainer._root.registry.derived_keys()
        assert len(keys) == 1
        made = set(derived._decode(trainer._root.registry.derived(keys)[keys[0]]).objects)
        remote = trainer._open.remote
        assert made <= remote.referenced() and all(remote.tier.exists(o) for o in made)
    with paramstore.ParamStore(os.path.join(shm_dir, "reader"), remote=url, storage_options=opts) as reader:
        with reader.checkout(1, recipe="fp8-block128") as snap:
            assert snap.derived.derived == 0  # found in the remote, not derived
            assert snap.fetch.bytes_from[remote.url] >= sum(remote.tier.size(o) for o in made)
            want = recipes.derive("fp8-block128", model_state(seed=1))
            assert all(same(snap[k], t) for k, t in want.items()) and set(snap) == set(want)
        assert reader._root.registry.derived_keys() == keys  # shared with this host's registry now
    remote = Remote(url, opts)
    assert maintenance.gc_remote(remote, grace=0).objects == []  # the version's sources keep them
    remote.remove([1])  # the version goes: its derived objects are garbage too
    assert not made & remote.referenced()
    assert made <= set(maintenance.gc_remote(remote, grace=0).objects)


def nudged(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` after a small training step: 1% of each tensor's elements halved."""
    g = torch.Generator().manual_seed(1)
    out = {}
    for k, v in sd.items():
        w = v.float().clone()
        w[torch.rand(w.shape, generator=g) < 0.01] *= 0.5
        out[k] = w.to(v.dtype)
    return out


def test_derived_objects_are_patched_kept_and_rebuilt(shm_dir):
    """A trainer with ``derive=`` and ``patches=`` patches each derived version against the one it
    derived before (named in the records, kept with them); a host lacking a derived object but
    holding the previous one rebuilds it from its patch, verified; a damaged patch is refused,
    counted, and the object made another way (here: derived again), bit for bit the same."""
    root = os.path.join(shm_dir, "trainer")
    a = model_state(0)
    b = nudged(a)
    with paramstore.ParamStore(root, derive=["fp8-block128"], patches=True) as store:
        store.commit(1, a).result()
        store.flush(timeout=60)
        store.commit(2, b).result()
        store.flush(timeout=60)
        tier = store._root.tier
        with store.checkout(1, recipe="fp8-block128") as snap:
            old = set(snap.manifest.objects()) - set(store.manifest(1).objects())
        with store.checkout(2, recipe="fp8-block128") as snap:
            new = set(snap.manifest.objects()) - set(store.manifest(2).objects())
        patched = {o: r.patches[o] for _, r in derived.records(store._root) if r is not None for o in r.patches}
        assert set(patched) == new and len(new) == 1, patched  # step 2's derived object, and only it
        (obj, (patch, size, reads)), = patched.items()
        assert set(reads) <= old and size < 0.25 * tier.size(obj)  # read from step 1's derived object: small
        want = recipes.derive("fp8-block128", b)

        os.unlink(tier.object_path(obj))  # this host now lacks step 2's derived object
        with store.checkout(2, recipe="fp8-block128") as snap:
            assert obj in snap.fetch.from_patches and snap.derived.derived == 0
            assert all(same(snap[k], v) for k, v in want.items())

        report = store.verify()  # the patch is kept by its record: no orphan, and GC keeps it
        assert report["orphans"] == [] and report["derived_objects"] == 3, report  # 2 derived objects + a patch
        store.gc()
        assert patch in set(tier.list())

        os.unlink(tier.object_path(obj))
        path = tier.object_path(patch)
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:  # one byte of the patch's changes flipped
            f.seek(os.path.getsize(path) - 5)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.warns(RuntimeWarning, match="fetched whole"):
            with store.checkout(2, recipe="fp8-block128") as snap:
                assert snap.fetch.rejected["patch"] == 1 and obj not in snap.fetch.from_patches
                assert snap.derived.derived == 1  # nobody else has it: derived again, the same bytes
                assert all(same(snap[k], v) for k, v in want.items())
        # the record made again names no patch: the damaged one is garbage now, and swept
        assert not any(r.patches for _, r in derived.records(store._root) if r is not None)
        assert patch in store.gc().objects
        store.commit(3, model_state(3)).result()  # shares nothing with step 2
        store.flush(timeout=60)
        assert store.prune(KeepLast(1)).removed == [1, 2]
        store.gc()
        assert obj not in set(tier.list())


def test_a_record_naming_a_bad_patch_is_not_a_record(store):
    """A record's ``patches`` are checked like the rest of it: each names one of its derived
    objects, a digest, a size and the digests it reads; anything else makes it a damaged record
    (derived again), never a path read."""
    store.commit(1, model_state(0)).result()
    with store.checkout(1, recipe="fp8-block128"):
        pass
    (key, record), = [(k, r) for k, r in derived.records(store._root) if r is not None]
    raw = json.loads(store._root.registry.derived([key])[key])
    obj = next(iter(record.objects))
    good = "ab" * 32
    assert derived._decode(json.dumps(raw | {"patches": {obj: [good, 10, [good]]}}).encode()).patches == {
        obj: (good, 10, (good,))}
    for bad in ({obj: ["../etc/passwd", 10, []]}, {obj: [good, -1, []]}, {obj: [good, 10, ["x"]]},
                {good: [good, 10, []]}, {obj: [good, True, []]}, {obj: [good, 10]}):
        with pytest.raises((ValueError, paramstore.ParamStoreError)):
            derived._decode(json.dumps(raw | {"patches": bad}).encode())


def test_a_recipe_with_shapes_converts_into_the_objects_memory(store):
    """A recipe that says its outputs' shapes (``Recipe.shapes``, as the built-in ones do) is given
    them to fill (``convert(..., out=...)``): the store writes the object from there. One that
    returns other tensors instead is refused, naming the contract; nothing is recorded."""
    base = recipes.get("fp8-block128")
    calls = []

    def convert(n, t, out=None):
        calls.append(out is not None)
        return base.convert(n, t, out=out)

    good = recipes.register(recipes.Recipe("fp8-block128-into", 1, base.eligible, convert, base.config(),
                                           shapes=base.shapes), replace=True)
    bad = recipes.register(recipes.Recipe("fp8-block128-ignores-out", 1, base.eligible,
                                          lambda n, t, out=None: base.convert(n, t), base.config(),
                                          shapes=base.shapes), replace=True)
    sd = model_state(0)
    store.commit(1, sd).result()
    with store.checkout(1, recipe=good) as snap:
        want = recipes.derive("fp8-block128", sd)
        assert all(same(snap[k], v) for k, v in want.items())
    assert calls and all(calls)  # every conversion given its outputs
    with pytest.raises(InvalidArgumentError, match="must fill and return the outputs it was given"):
        store.checkout(1, recipe=bad)
    assert not [k for k in store._root.registry.derived_keys() if k.startswith("fp8-block128-ignores-out@")]


@pytest.mark.parametrize("prepare", [True, False])
def test_derived_objects_written_into_slabs_or_files_are_the_same(shm_dir, prepare):
    """A store that prepares buffers writes derived objects into its pool's slabs (and prepares
    slabs of those sizes for the next version); one that does not writes new files. The same
    objects, bit for bit as ``recipes.derive``."""
    sd = model_state(0)
    want = recipes.derive("fp8-block128", sd)
    with paramstore.ParamStore(os.path.join(shm_dir, f"s{prepare}"), prepare_buffers=prepare) as store:
        store.commit(1, sd).result()
        with store.checkout(1, recipe="fp8-block128") as snap:
            assert snap.derived.derived == 1 and all(same(snap[k], v) for k, v in want.items())
            made = sorted(set(snap.manifest.objects()) - set(store.manifest(1).objects()))
        sizes = [store._root.tier.size(o) for o in made]
        assert bool(store._pool._want.get("derive")) is prepare  # slabs for the next version's derivation
        if prepare:
            assert sorted(store._pool._want["derive"]) == sorted(sizes)
        assert store.verify()["ok"]
    with paramstore.ParamStore(os.path.join(shm_dir, f"s{prepare}")) as again:
        with again.checkout(1, recipe="fp8-block128") as snap:
            assert snap.derived.derived == 0 and all(same(snap[k], v) for k, v in want.items())


def test_a_record_lists_piece_digests_so_hosts_relay_its_objects_and_an_older_record_does_not(store_root):
    """A derived output over a piece (a 4096 x 4096 weight in FP8: 16 MiB) is recorded with its
    piece digests, so hosts that want its object relay it block by block (``derived._pieced`` gives
    the record's outputs, which tile the object: ``Relay.plan`` plans it). A record written before
    (its outputs without piece digests) gives none: its objects are then fetched whole, checked
    against their names, instead of each block failing against a tensor digest taken for a piece's
    and every honest peer being blamed."""
    import dataclasses

    from paramstore.format import PIECE_SIZE
    from paramstore.manifest import object_piece_spans, object_spans
    from paramstore.relay import Relay

    with paramstore.ParamStore(store_root) as store:
        w = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(1)).bfloat16()
        store.commit(1, {"model.layers.0.mlp.up_proj.weight": w}).result()
        with store.checkout(1, recipe="fp8-block128") as snap:
            assert snap.derived.derived == 1
        [(_, record)] = list(derived.records(store._root))
    entries = derived._pieced(record)
    big = [e for e in entries if e.nbytes > PIECE_SIZE]
    assert big and all(len(e.piece_digests) == -(-e.nbytes // PIECE_SIZE) for e in big), entries
    [(obj, size)] = record.objects.items()
    assert Relay.plan(obj, size, object_spans(entries), object_piece_spans(entries)) is not None
    old = dataclasses.replace(record, outputs={k: {n: dataclasses.replace(e, piece_digests=()) for n, e in outs.items()}
                                               for k, outs in record.outputs.items()})
    assert derived._pieced(old) == []
