"""Prometheus metrics (``ParamStore(metrics=True)``, ``paramstore serve --metrics-port N``): what each
operation records, under its store's label, read back from the registry and from the HTTP exporter."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
import torch

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import REGISTRY, generate_latest  # noqa: E402

from paramstore import InvalidArgumentError, ParamStore  # noqa: E402
from paramstore.metrics import SOURCES, split  # noqa: E402
from paramstore.options import StoreOptions  # noqa: E402
from paramstore.retention import KeepLast  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def weights(seed: int, nudge: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {f"layer{i}.weight": torch.randn(256, 256, generator=g) for i in range(4)}
    if nudge:  # a few elements changed: the next version moves as patches
        for t in w.values():
            t.view(-1)[:nudge] += 1.0
    return w


def value(name: str, store: ParamStore, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"store": store.root, **labels}) or 0.0


def fetch_bytes(store: ParamStore) -> dict[str, float]:
    return {s: value("paramstore_fetch_bytes_total", store, source=s) for s in SOURCES}


def test_commits_and_checkouts_are_counted_with_the_bytes_of_each_source(shm_dir, tmp_path):
    url = f"file://{tmp_path}/bucket"
    opts = {"remote": url, "storage_options": {"auto_mkdir": True}, "metrics": True}
    with ParamStore(os.path.join(shm_dir, "trainer"), **opts) as trainer, \
            ParamStore(os.path.join(shm_dir, "rollout"), **opts) as rollout:
        v1 = trainer.commit(1, weights(1)).persisted.result(60)
        v2 = trainer.commit(2, weights(1, nudge=3)).persisted.result(60)
        assert value("paramstore_operations_total", trainer, operation="commit", status="ok") == 2
        assert value("paramstore_operation_duration_seconds_count", trainer, operation="commit") == 2
        assert value("paramstore_commit_stage_duration_seconds_count", trainer) == 2
        assert value("paramstore_commit_bytes_total", trainer) == v1.nbytes + v2.nbytes
        assert value("paramstore_operations_in_flight", trainer, operation="commit") == 0
        # two stores, one process: each has its own series
        assert value("paramstore_operations_total", rollout, operation="commit", status="ok") == 0

        for step in (1, 2):  # 1: whole objects from the remote; 2: rebuilt from its patches
            before = fetch_bytes(rollout)
            with rollout.checkout(step) as snap:
                report = snap.fetch
                sizes = rollout._root.registry.object_sizes(snap.manifest.objects())
            got = {s: fetch_bytes(rollout)[s] - before[s] for s in SOURCES}
            want, _ = split(report, list(snap.manifest.objects()), sizes, url)
            assert got == {s: float(want[s]) for s in SOURCES}
            assert got["peer"] + got["remote"] + got["patch"] + got["group"] == report.bytes > 0
            assert got["remote"] + got["patch"] == report.bytes_from[url]
            assert got["patch"] == report.patch_bytes
        assert report.from_patches and got["patch"] > 0  # step 2 came as patches
        assert value("paramstore_fetch_objects_total", rollout, source="patch") == len(report.from_patches)
        assert value("paramstore_operations_total", rollout, operation="checkout", status="ok") == 2
        assert value("paramstore_fetch_duration_seconds_count", rollout, source="remote") >= 1
        text = generate_latest(REGISTRY).decode()
        line = f'paramstore_fetch_bytes_total{{source="patch",store="{rollout.root}"}} {float(report.patch_bytes)}'
        assert line in text.splitlines()
        assert "# TYPE paramstore_operation_duration_seconds histogram" in text

        # a prefetch moves the bytes (counted then); the checkout that follows finds them local
        trainer.commit(3, weights(1, nudge=6)).persisted.result(60)
        before = fetch_bytes(rollout)
        assert rollout.prefetch(3).result(60).step == 3
        moved = {s: fetch_bytes(rollout)[s] - before[s] for s in SOURCES}
        assert moved["remote"] + moved["patch"] > 0 and moved["peer"] == moved["group"] == 0
        with rollout.checkout(3) as snap:
            assert not snap.fetch.moved
        assert fetch_bytes(rollout)["remote"] + fetch_bytes(rollout)["patch"] == \
            before["remote"] + before["patch"] + moved["remote"] + moved["patch"]


def test_prefetch_then_checkout_count_the_bytes_once_moved_then_local(shm_dir):
    with ParamStore(os.path.join(shm_dir, "s"), metrics=True) as store:
        store.commit(1, weights(1)).result()
        stored = sum(store._root.registry.object_sizes(store.manifest(1).objects()).values())  # objects' bytes
        assert store.prefetch(1).result(60).step == 1
        assert value("paramstore_operations_total", store, operation="prefetch", status="ok") == 1
        assert value("paramstore_fetch_bytes_total", store, source="local") == stored
        with store.checkout(1) as snap:
            assert not snap.fetch.moved
        assert value("paramstore_fetch_bytes_total", store, source="local") == 2 * stored
        assert value("paramstore_fetch_duration_seconds_count", store, source="local") == 2


def test_failures_prune_gc_leases_and_staleness(shm_dir):
    with ParamStore(os.path.join(shm_dir, "s"), metrics=True) as store:
        store.commit(1, weights(1)).result()
        with pytest.raises(Exception):
            store.commit(1, weights(1))  # step order: refused at once
        with pytest.raises(Exception):
            store.checkout(7)
        assert value("paramstore_operations_total", store, operation="commit", status="error") == 1
        assert value("paramstore_operations_total", store, operation="checkout", status="error") == 1
        snap = store.checkout(1)
        for step in (2, 3, 4):
            store.commit(step, weights(step)).result()
        assert value("paramstore_latest_step", store) == 4
        assert value("paramstore_leases", store) == 1
        assert value("paramstore_oldest_leased_step", store) == 1
        assert value("paramstore_staleness_steps", store) == 3
        snap.close()
        assert value("paramstore_leases", store) == 0 and value("paramstore_staleness_steps", store) == 0
        assert REGISTRY.get_sample_value("paramstore_oldest_leased_step", {"store": store.root}) is None
        pruned = store.prune(KeepLast(1))
        collected = store.gc()
        assert value("paramstore_pruned_versions_total", store, tier="local") == len(pruned.removed) == 3
        assert value("paramstore_gc_deleted_objects_total", store, tier="local") == len(collected.objects) > 0
        assert value("paramstore_gc_freed_bytes_total", store, tier="local") == collected.bytes_freed > 0
        assert value("paramstore_operations_total", store, operation="gc", status="ok") == 1


def test_without_metrics_nothing_is_recorded_nor_imported(shm_dir):
    with ParamStore(os.path.join(shm_dir, "off"), retention=KeepLast(1)) as store:
        store.commit(1, weights(1)).result()
        store.commit(2, weights(2)).result()
        with store.checkout("latest"):
            pass
        store.gc()
    text = generate_latest(REGISTRY).decode()
    assert f'"{store.root}"' not in text
    code = textwrap.dedent(f"""
        import sys, torch
        from paramstore import ParamStore
        with ParamStore({os.path.join(shm_dir, 'off2')!r}) as s:
            s.commit(1, {{"w": torch.ones(4)}}).result()
            s.checkout(1).close()
        assert "prometheus_client" not in sys.modules, "imported without metrics=True"
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=REPO)


def test_metrics_option_is_validated_and_names_the_extra_when_missing(monkeypatch, shm_dir):
    with pytest.raises(InvalidArgumentError, match="metrics must be True or False"):
        StoreOptions(metrics="yes")
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(InvalidArgumentError, match=r"pip install 'paramstore\[metrics\]'"):
        ParamStore(os.path.join(shm_dir, "s"), metrics=True)
    assert not os.path.exists(os.path.join(shm_dir, "s"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_metrics_port_serves_them_over_http(shm_dir):
    root = os.path.join(shm_dir, "s")
    with ParamStore(root) as store:
        store.commit(1, weights(1)).result()
        store.commit(2, weights(2)).result()
        snap = store.checkout(1)  # a reader one step behind
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "paramstore", "--root", root, "serve", "--metrics-port", str(port)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline, body = time.monotonic() + 60, None
            while body is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                        body = r.read().decode()
                except OSError:
                    assert proc.poll() is None, proc.communicate()
                    assert time.monotonic() < deadline, "the exporter never answered"
                    time.sleep(0.2)
            assert f'paramstore_latest_step{{store="{root}"}} 2.0' in body
            assert f'paramstore_leases{{store="{root}"}} 1.0' in body
            assert f'paramstore_staleness_steps{{store="{root}"}} 1.0' in body
            assert "# TYPE paramstore_operations_total counter" in body
        finally:
            snap.close()
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert f"http://127.0.0.1:{port}/metrics" in err


def test_cli_serve_needs_a_registry_or_a_metrics_port(shm_dir, capsys):
    from paramstore.cli import main

    assert main(["--root", os.path.join(shm_dir, "s"), "serve"]) == 2
    assert "--metrics-port" in capsys.readouterr().err
