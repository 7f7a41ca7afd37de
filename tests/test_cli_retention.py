"""The retention commands of the CLI (prune, gc, leases), run as real subprocesses.

``prune`` takes restic-style keep flags that compose as "keep a version if any flag keeps it"; the
latest and leased versions are always kept, and so are tagged ones unless ``--prune-tagged``; a
prune with no keep flag is refused (it would delete everything but the latest); ``--keep-best``
needs ``--mode`` unless the metric's name says which way is better. Errors exit 2 with a message on stderr and change nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import random_tensor, tree

from paramstore import ParamStore

LOSS = {1: 3.0, 2: 2.5, 3: 0.7, 4: 1.9, 5: 1.1, 6: 1.5}


def cli(root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paramstore.cli", "--root", root, *args],
                          capture_output=True, text=True, timeout=120)


def ok_json(root: str, *args: str):
    proc = cli(root, *args, "--json")
    assert proc.returncode == 0, f"paramstore {' '.join(args)} exited {proc.returncode}: {proc.stderr}"
    return json.loads(proc.stdout)


def steps(root: str) -> list[int]:
    return [v["step"] for v in ok_json(root, "ls")]


def state_for(step: int) -> dict[str, torch.Tensor]:
    return {"w": random_tensor(torch.float32, (64, 16), seed=step),
            "b": random_tensor(torch.bfloat16, (64,), seed=100 + step)}


@pytest.fixture
def six(store_root):
    """A store with versions 1..6, loss and entropy metrics on each, and a tag on 2."""
    with ParamStore(store_root) as store:
        for s in range(1, 7):
            store.commit(s, state_for(s), metrics={"loss": LOSS[s], "entropy": LOSS[s]}, tags=["warmup"] if s == 2 else ()).result()
    return store_root


def files(root: str) -> dict:
    """Every file of the store with its bytes, except LMDB's lock file (its reader table changes on open)."""
    return {k: v for k, v in tree(root).items() if k != os.path.join("meta", "lock.mdb")}


def assert_unchanged(root: str, before: dict) -> None:
    assert files(root) == before, "the store changed"


def test_prune_without_a_keep_flag_is_refused(six):
    before = files(six)
    proc = cli(six, "prune")
    assert proc.returncode == 2
    assert "no keep flag" in proc.stderr and "--keep-last" in proc.stderr
    assert proc.stdout == ""
    # --dry-run alone, and --json alone, are no keep flags either
    for extra in (["--dry-run"], ["--json"]):
        p = cli(six, "prune", *extra)
        assert p.returncode == 2 and "no keep flag" in p.stderr
    assert json.loads(cli(six, "prune", "--json").stdout)["error"] == "InvalidArgumentError"
    assert_unchanged(six, before)
    assert steps(six) == [1, 2, 3, 4, 5, 6]


def test_prune_dry_run_lists_reasons_and_removes_nothing(six):
    before = files(six)
    r = ok_json(six, "prune", "--keep-last", "2", "--dry-run")
    assert r["dry_run"] is True
    assert r["removed"] == [1, 3, 4]
    assert r["kept"] == {"2": ["tagged warmup"], "5": ["one of the last 2"], "6": ["one of the last 2", "latest"]}
    assert r["policy"] == "keep the last 2; keep tagged versions"
    assert_unchanged(six, before)
    text = cli(six, "prune", "--keep-last", "2", "--dry-run")
    assert text.returncode == 0
    assert "would remove 3 versions, kept 3" in text.stdout
    assert "latest" in text.stdout
    assert_unchanged(six, before)


def test_keep_flags_compose_as_any(six):
    r = ok_json(six, "prune", "--keep-last", "1", "--keep-every", "3", "--prune-tagged")
    assert r["dry_run"] is False
    assert r["removed"] == [1, 2, 4, 5]
    assert r["kept"] == {"3": ["step divisible by 3"],
                         "6": ["one of the last 1", "step divisible by 3", "latest"]}
    assert steps(six) == [3, 6]
    assert ok_json(six, "verify")["ok"]


def test_keep_tag_and_keep_within(six):
    r = ok_json(six, "prune", "--keep-tag", "warmup", "--keep-within", "1h", "--dry-run")
    assert r["removed"] == []  # every version was created within the hour
    r = ok_json(six, "prune", "--keep-tag", "warmup", "--keep-last", "1")
    assert r["removed"] == [1, 3, 4, 5] and r["kept"]["2"] == ["tagged warmup"]
    assert steps(six) == [2, 6]


def test_keep_best_by_metric_min(six):
    r = ok_json(six, "prune", "--keep-best", "1", "--metric", "loss", "--mode", "min", "--prune-tagged")
    assert r["kept"] == {"3": ["best 1 by loss (min)"], "6": ["latest"]}
    assert r["removed"] == [1, 2, 4, 5]
    assert steps(six) == [3, 6]


def test_keep_best_by_metric_max(six):
    r = ok_json(six, "prune", "--keep-best", "2", "--metric", "loss", "--mode", "max", "--dry-run")
    assert sorted(r["kept"]) == ["1", "2", "6"]
    assert r["kept"]["1"] == ["best 1 by loss (max)"]


def test_keep_best_by_loss_keeps_the_lowest_without_mode(six):
    # before 0.2 --mode defaulted to max: this kept step 1, the highest loss
    r = ok_json(six, "prune", "--keep-best", "1", "--metric", "loss", "--dry-run")
    assert r["kept"]["3"] == ["best 1 by loss (min)"]
    assert r["removed"] == [1, 4, 5]  # 2 is tagged, 6 the latest
    assert r["policy"] == "keep the best 1 by loss (min); keep tagged versions"


def test_keep_best_by_an_ambiguous_metric_needs_mode(six):
    before = files(six)
    proc = cli(six, "prune", "--keep-best", "1", "--metric", "entropy")  # before 0.2: kept the highest
    assert proc.returncode == 2 and "add --mode max (higher is better) or --mode min" in proc.stderr
    assert_unchanged(six, before)
    r = ok_json(six, "prune", "--keep-best", "1", "--metric", "entropy", "--mode", "min", "--dry-run")
    assert r["kept"]["3"] == ["best 1 by entropy (min)"]


def test_prune_keeps_tagged_versions_unless_prune_tagged(six):
    before = files(six)
    r = ok_json(six, "prune", "--keep-last", "1", "--dry-run")  # before 0.2: step 2 (tagged) was removed
    assert r["kept"] == {"2": ["tagged warmup"], "6": ["one of the last 1", "latest"]}
    assert r["removed"] == [1, 3, 4, 5]
    r = ok_json(six, "prune", "--keep-last", "1", "--keep-tag", "other", "--dry-run")
    assert r["kept"]["2"] == ["tagged warmup"]  # --keep-tag does not narrow the default
    r = ok_json(six, "prune", "--keep-last", "1", "--prune-tagged", "--keep-tag", "other", "--dry-run")
    assert r["removed"] == [1, 2, 3, 4, 5]
    assert r["policy"] == "keep the last 1; keep versions tagged other"
    r = ok_json(six, "prune", "--keep-last", "1", "--prune-tagged", "--keep-tag", "warmup", "--dry-run")
    assert r["kept"]["2"] == ["tagged warmup"]
    assert_unchanged(six, before)
    assert ok_json(six, "prune", "--keep-last", "1")["removed"] == [1, 3, 4, 5]
    assert steps(six) == [2, 6]
    assert ok_json(six, "prune", "--keep-last", "1", "--prune-tagged")["removed"] == [2]
    assert steps(six) == [6]


@pytest.mark.parametrize("args,message", [
    (["--keep-best", "1", "--metric", "los", "--mode", "min"], "no version has the metric 'los'"),
    (["--keep-best", "1", "--metric", "entropy"],
     "whether a higher or a lower 'entropy' is better: add --mode max (higher is better) or --mode min"),
    (["--keep-best", "1", "--metric", "los"], "add --mode max"),
    (["--keep-last", "1", "--mode", "min"], "--mode goes with --keep-best"),
    (["--keep-best", "1"], "--keep-best needs --metric"),
    (["--keep-last", "1", "--metric", "loss"], "--metric goes with --keep-best"),
    (["--keep-within", "two hours"], "cannot parse duration"),
    (["--keep-within", "2h30"], "cannot parse duration"),
    (["--keep-within=-5m"], "cannot parse duration"),
    (["--keep-last", "-1"], "non-negative"),
    (["--keep-every", "0"], "must be positive"),
    (["--keep-tag", ""], "KeepTagged"),
])
def test_bad_prune_flags_exit_2_and_delete_nothing(six, args, message):
    before = files(six)
    proc = cli(six, "prune", *args)
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stderr
    assert proc.stderr.startswith("paramstore: error:")
    assert_unchanged(six, before)


def test_prune_keeps_the_latest_even_with_keep_last_0(six):
    r = ok_json(six, "prune", "--keep-last", "0", "--prune-tagged")
    assert r["removed"] == [1, 2, 3, 4, 5] and r["kept"] == {"6": ["latest"]}
    assert steps(six) == [6]


def test_gc_reports_bytes_freed(six):
    objects = os.path.join(six, "objects")
    assert ok_json(six, "gc")["bytes_freed"] == 0
    ok_json(six, "prune", "--keep-last", "2", "--prune-tagged")
    before = tree(objects)
    dry = ok_json(six, "gc", "--dry-run")
    assert dry["dry_run"] is True and dry["objects_deleted"] > 0
    assert tree(objects) == before
    r = ok_json(six, "gc")
    after = tree(objects)
    gone = set(before) - set(after)
    assert r["dry_run"] is False
    assert r["objects_deleted"] == len(gone) == len(r["objects"]) > 0
    assert r["bytes_freed"] == sum(before[f][0] for f in gone) == dry["bytes_freed"]
    assert {os.path.basename(f).split(".")[0] for f in gone} == set(r["objects"])
    assert ok_json(six, "gc")["bytes_freed"] == 0
    text = cli(six, "gc")
    assert text.returncode == 0 and text.stdout.startswith("deleted 0 objects (0 B)")
    v = ok_json(six, "verify")
    assert v["ok"] and v["orphans"] == [] and v["versions_checked"] == 2


_HOLDER = textwrap.dedent("""
    import sys, time
    from paramstore import ParamStore
    store = ParamStore(sys.argv[1], create=False)
    snap = store.checkout(int(sys.argv[2]), holder="rollout worker 7")
    print("holding", flush=True)
    time.sleep(120)
""")


def test_leases_shows_a_lease_held_by_another_process(six):
    assert ok_json(six, "leases") == []
    assert cli(six, "leases").stdout.strip() == "no live leases"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, six, "2"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        [lease] = ok_json(six, "leases")
        assert lease["step"] == 2 and lease["pid"] == holder.pid
        assert lease["holder"] == "rollout worker 7"
        assert 0 <= lease["age_s"] < 120
        text = cli(six, "leases").stdout
        assert "rollout worker 7" in text and str(holder.pid) in text
        # the leased version survives a prune from the CLI
        r = ok_json(six, "prune", "--keep-last", "1", "--prune-tagged")
        assert r["kept"]["2"] == ["leased"] and r["removed"] == [1, 3, 4, 5]
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        holder.stdout.close()
    assert ok_json(six, "leases") == []  # its process is dead
    assert ok_json(six, "prune", "--keep-last", "1", "--prune-tagged")["removed"] == [2]
    assert steps(six) == [6]
