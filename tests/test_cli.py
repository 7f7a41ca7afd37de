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
    assert proc.returncode == 2 and f"no store exists at {tmp_path}" in proc.stderr
    assert not os.path.exists(tmp_path / "paramstore.json")


def test_export_loads_with_safetensors(populated, tmp_path):
    root, _, sd2 = populated
    out = tmp_path / "export"
    refused = cli(root, "export", "2", str(out), check=False)  # a plain state dict: no config.json
    assert refused.returncode == 2 and "no config.json" in refused.stderr and "--assets-from" in refused.stderr
    assert not out.exists()  # nothing written
    cli(root, "export", "2", str(out), "--shard-size-bytes", "1000", "--weights-only")
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
    from safetensors import safe_open

    for f in files:  # transformers 4.x loads only shards that say their format
        with safe_open(out / f, "pt") as st:
            assert st.metadata() == {"format": "pt"}
    again = cli(root, "export", "2", str(out), "--weights-only", check=False)
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
    cli(store_root, "export", "5", str(out))  # config.json and generation_config.json come from the version
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded) is transformers.GPT2LMHeadModel
    tokens = torch.randint(0, 100, (2, 10))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


# -- the command line's shape: common options, --version, python -m, ls and prune output, errors ---
def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``paramstore ARGV`` in this process: (exit status, stdout, stderr)."""
    from paramstore.cli import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_env(monkeypatch):
    for var in ("PARAMSTORE_ROOT", "PARAMSTORE_REMOTE", "PARAMSTORE_REGISTRY", "PARAMSTORE_NAME"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_common_options_go_before_or_after_the_command(populated, capsys, no_env):
    from paramstore.cli import _parser, _serve

    root, _, _ = populated
    code, out, _ = run(capsys, "ls", "--root", root, "--json")
    assert code == 0 and [r["step"] for r in json.loads(out)] == [1, 2]
    code, out, _ = run(capsys, "--root", root, "ls")
    assert code == 0 and "first" in out
    # given before and after: the one after the command wins
    code, out, _ = run(capsys, "--root", os.path.join(root, "nowhere"), "ls", "--root", root, "--json")
    assert code == 0 and len(json.loads(out)) == 2
    args = _parser().parse_args(["serve", "--root", "R", "--registry", "redis://h:6379/0", "--name", "N"])
    assert (args.root, args.registry, args.name, args.fn) == ("R", "redis://h:6379/0", "N", _serve)
    # a command does not reset what was given before it
    args = _parser().parse_args(["--registry", "redis://h/0", "--name", "N", "--remote", "s3://b/p", "push", "--json"])
    assert (args.registry, args.name, args.remote, args.json) == ("redis://h/0", "N", "s3://b/p", True)
    assert _parser().parse_args(["--remote", "s3://a", "push", "--remote", "s3://b"]).remote == "s3://b"
    # the environment still gives the defaults, and an option overrides them
    no_env.setenv("PARAMSTORE_REMOTE", "s3://env/p")
    no_env.setenv("PARAMSTORE_NAME", "env-name")
    assert _parser().parse_args(["push"]).remote == "s3://env/p"
    assert _parser().parse_args(["gc", "--remote", "s3://x"]).remote == "s3://x"
    assert _parser().parse_args(["--name", "n", "gc"]).name == "n"
    no_env.setenv("PARAMSTORE_ROOT", root)
    code, out, _ = run(capsys, "ls", "--json")
    assert code == 0 and len(json.loads(out)) == 2
    # registry after the command is seen: serve without --name is refused by paramstore, not by argparse
    no_env.delenv("PARAMSTORE_NAME")
    code, _, err = run(capsys, "serve", "--root", root, "--registry", "redis://127.0.0.1:1/0")
    assert code == 2 and "needs --name" in err


def test_tag_name_is_not_the_store_name(populated, capsys, no_env):
    from paramstore.cli import _parser

    root, _, _ = populated
    args = _parser().parse_args(["--name", "store", "tag", "2", "best"])
    assert (args.name, args.tag) == ("store", "best")
    code, _, err = run(capsys, "--root", root, "tag", "2", "best", "--name", "store")
    assert code == 0, err
    code, out, _ = run(capsys, "--root", root, "show", "best", "--json")
    assert json.loads(out)["step"] == 2
    assert run(capsys, "--root", root, "tag", "--delete", "best")[0] == 0


def test_ls_help_lists_the_common_options(capsys):
    from paramstore.cli import main

    with pytest.raises(SystemExit) as e:
        main(["ls", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--root", "--remote", "--registry", "--name", "--json", "--tier"):
        assert option in out, option


def test_version(capsys):
    from paramstore.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"paramstore {paramstore.__version__}"


def test_python_dash_m_paramstore(populated):
    root, _, _ = populated
    proc = subprocess.run([sys.executable, "-m", "paramstore", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"paramstore {paramstore.__version__}"
    proc = subprocess.run([sys.executable, "-m", "paramstore", "ls", "--root", root, "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in json.loads(proc.stdout)] == [1, 2]
    proc = subprocess.run([sys.executable, "-m", "paramstore", "--root", root, "show", "99"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "paramstore: error:" in proc.stderr  # the exit status comes through


def test_ls_tier_remote_and_remote_url(populated, tmp_path, capsys, no_env):
    root, _, _ = populated
    url = (tmp_path / "remote").as_uri()
    code, _, err = run(capsys, "--root", root, "push", "1", "--remote", url)
    assert code == 0, err
    code, out, _ = run(capsys, "--root", root, "ls", "--tier", "remote", "--remote", url, "--json")
    assert code == 0 and [r["step"] for r in json.loads(out)] == [1]
    # --remote after ls is the URL, as for every command (the local listing, persisted to that remote or not)
    code, out, _ = run(capsys, "--root", root, "ls", "--remote", url, "--json")
    assert code == 0 and [(r["step"], r["persisted"]) for r in json.loads(out)] == [(1, url), (2, None)]
    # a URL given before the command is kept; --tier remote lists the remote
    code, out, err = run(capsys, "--root", root, "--remote", url, "ls", "--tier", "remote", "--json")
    assert code == 0 and [r["step"] for r in json.loads(out)] == [1], err
    no_env.setenv("PARAMSTORE_REMOTE", url)
    code, out, err = run(capsys, "--root", root, "ls", "--tier", "remote")
    assert code == 0 and len(out.strip().splitlines()) == 2, err  # header + step 1
    with pytest.raises(SystemExit) as exit_:  # --remote takes a URL, as for every command
        run(capsys, "--root", root, "ls", "--remote")
    assert exit_.value.code == 2 and "--remote: expected one argument" in capsys.readouterr().err
    no_env.delenv("PARAMSTORE_REMOTE")
    code, _, err = run(capsys, "--root", root, "ls", "--tier", "remote")
    assert code == 2 and "needs a remote" in err


def test_ls_shows_metrics(store_root, capsys, no_env):
    with paramstore.ParamStore(store_root) as store:
        store.commit(1, {"w": torch.ones(3)}, metrics={"loss": 0.123456, "reward": 3}, tags=["a"]).result()
        store.commit(2, {"w": torch.zeros(3)}).result()
    code, out, _ = run(capsys, "--root", store_root, "ls")
    header, one, two = out.strip().splitlines()
    assert "METRICS" in header and "loss=0.1235 reward=3" in one and one.rstrip().endswith("a")
    assert "=" not in two
    code, out, _ = run(capsys, "--root", store_root, "ls", "--json")
    rows = json.loads(out)
    assert all(set(r) == {"step", "created_at", "nbytes", "digest", "num_tensors", "metrics", "metadata",
                          "tags", "persisted", "writer"} for r in rows)
    assert len({r["writer"] for r in rows}) == 1 and rows[0]["writer"] in header + one
    assert rows[0]["metrics"] == {"loss": 0.123456, "reward": 3} and rows[0]["tags"] == ["a"]


def test_prune_text_columns_line_up(store_root, capsys, no_env):
    import re

    with paramstore.ParamStore(store_root) as store:
        for step in (15, 20, 25, 30, 100):
            store.commit(step, {"w": torch.full((3,), float(step))}).result()
    for dry in (["--dry-run"], []):
        code, out, err = run(capsys, "--root", store_root, "prune", "--keep-every", "10", *dry)
        assert code == 0, err
        lines = out.strip().splitlines()[1:-1]  # between the policy and the summary
        verbs = [line.split()[0] for line in lines]
        assert verbs == ["keep"] * 3 + (["remove"] * 2 if dry else ["removed"] * 2)
        steps = [re.match(r"\S+ +(\d+)", line) for line in lines]
        assert [int(m.group(1)) for m in steps] == [20, 30, 100, 15, 25]
        assert len({m.end(1) for m in steps}) == 1, out  # right-aligned in one column, whatever the verb
        assert len({m.start(1) for m in steps if len(m.group(1)) == 2}) == 1, out  # same width: same start


@pytest.mark.parametrize("kind", ["file", "foreign directory"])
def test_root_that_cannot_be_a_store(tmp_path, capsys, no_env, kind):
    path = tmp_path / "thing"
    if kind == "file":
        path.write_text("hello")
    else:
        path.mkdir()
        (path / "notes.txt").write_text("hello")
    for command in ("ls", "serve"):  # serve would create a store in an empty or new directory
        code, _, err = run(capsys, "--root", str(path), command)
        assert code == 2 and str(path) in err
        assert "ParamStore(" not in err  # which would refuse too
        assert ("is a file" if kind == "file" else "not empty") in err
        assert "empty or new directory" in err and "--root" in err
    assert not os.path.exists(tmp_path / "thing" / "paramstore.json")


def test_warnings_are_one_line_and_tag_delete_takes_one_name(populated, capsys, no_env):
    disk = os.path.join(os.path.dirname(os.path.abspath(__file__)), f".tmp-cli-{os.getpid()}")
    from paramstore.opening import _fstype

    try:
        if _fstype(os.path.dirname(disk)) not in ("tmpfs", "ramfs", None):
            with pytest.warns(paramstore.ParamStoreWarning):
                paramstore.ParamStore(disk, create=True).close()  # a store on disk
            import paramstore.opening as store_mod

            store_mod._warned_roots.discard(disk)
            code, out, err = run(capsys, "--root", disk, "ls")
            assert code == 0
            assert err.startswith("paramstore: warning: store root") and err.count("\n") == 1, err
    finally:
        import shutil

        shutil.rmtree(disk, ignore_errors=True)
    code, _, err = run(capsys, "--root", populated, "tag", "--delete", "a", "b")
    assert code == 2 and "one name" in err
