"""Backends found by name (issue 26, item 2): entry points of ``paramstore.registries`` and
``paramstore.transports``, the built-ins declared as a third party's are, capability flags instead
of class tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import paramstore
from paramstore import InvalidArgumentError
from paramstore.backends.registries import LmdbRegistry, Registry, open_registry
from paramstore.backends.transports import open_transport, parse_transport
from paramstore.plugins import REGISTRIES, TRANSPORTS, _toml_entry_points, entry_points

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOY = '''
import os

from paramstore.backends.registries.lmdb import LmdbRegistry

OPENED = []


class ToyRegistry(LmdbRegistry):
    """An LMDB registry of its own, in meta/toy-<name>: a third party's, found by its URL scheme."""


def from_url(url, meta_dir, namespace, *, create=True, mode=0o600):
    OPENED.append((url, namespace))
    return ToyRegistry(os.path.join(meta_dir, "toy-" + url.partition("://")[2].strip("/")), create=True, mode=mode)
'''

# Run in a fresh interpreter with the toy distribution on PYTHONPATH: only what its metadata declares
# makes paramstore find it.
DRIVER = '''
import json, os, sys
import torch
import paramstore
from paramstore import InvalidArgumentError
import toyreg

root = sys.argv[1]
out = {}
with paramstore.ParamStore(root, registry="toy://run1", name="x") as store:
    store.commit(1, {"w": torch.arange(8.0)}).result()
    with store.checkout("latest") as snap:
        out["w"] = snap["w"].tolist()
    out["registry"] = type(store._root.registry).__module__ + "." + type(store._root.registry).__name__
    out["shared"] = store._root.registry.shared
    out["steps"] = [v.step for v in store._root.registry.versions()]
out["opened"] = toyreg.OPENED
out["files"] = sorted(os.listdir(os.path.join(root, "meta", "toy-run1")))
try:
    with paramstore.ParamStore(root + "-2", registry="fancy://h", name="x") as other:
        other.commit(1, {"w": torch.ones(2)}).result()
except InvalidArgumentError as e:
    out["fancy"] = str(e)
out["made"] = os.path.exists(root + "-2")
print(json.dumps(out))
'''


def _toy_distribution(where) -> None:
    """``toyreg`` and its metadata, as pip would install it: a registry under ``toy://``, and one under
    ``fancy://`` whose module needs a package that is not installed (provided by its extra)."""
    (where / "toyreg").mkdir()
    (where / "toyreg" / "__init__.py").write_text(TOY)
    (where / "toyreg" / "fancy.py").write_text("import toyreg_not_installed_dependency\n")
    info = where / "toyreg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyreg\nVersion: 0.1\n"
                                   "Provides-Extra: fancy\n")
    (info / "entry_points.txt").write_text("[paramstore.registries]\ntoy = toyreg:from_url\n"
                                           "fancy = toyreg.fancy:from_url [fancy]\n")
    (info / "RECORD").write_text("")


def test_a_third_partys_registry_is_found_by_its_url_scheme(tmp_path, shm_dir):
    _toy_distribution(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    root = os.path.join(shm_dir, "store")
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(root)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["registry"] == "toyreg.ToyRegistry" and out["opened"] == [["toy://run1", "x"]]
    assert out["w"] == list(map(float, range(8))) and out["steps"] == [1] and out["shared"] is False
    assert "data.mdb" in out["files"]  # the version went into the toy registry's own environment
    # the entry point's module cannot be imported: the extra that provides it is named
    assert "registry URL scheme 'fancy'" in out["fancy"] and "pip install 'toyreg[fancy]'" in out["fancy"]
    assert out["made"] is False  # refused before any directory was made


def test_an_unknown_scheme_lists_the_installed_ones(tmp_path, store_root):
    with paramstore.ParamStore(store_root, registry="etcd://10.0.0.5:2379", name="x") as store:
        with pytest.raises(InvalidArgumentError, match=r"unknown registry URL scheme 'etcd': installed: lmdb, "
                                                       r"redis, rediss.*paramstore\.registries"):
            store.commit(1, {"w": torch.ones(2)}).result()
    assert not os.path.exists(store_root)  # nothing created
    with pytest.raises(InvalidArgumentError, match=r"SCHEME://.*installed schemes: lmdb, redis, rediss"):
        open_registry("localhost:6379", str(tmp_path / "meta"), "x")
    with pytest.raises(InvalidArgumentError, match="has no URL"):  # the root's own: never by URL
        open_registry("lmdb://", str(tmp_path / "meta"), "x")


def test_an_unknown_transport_lists_the_installed_ones(monkeypatch):
    with pytest.raises(InvalidArgumentError, match=r"unknown transport 'nixl': installed: mooncake"):
        open_transport("nixl", "127.0.0.1")
    monkeypatch.setenv("PARAMSTORE_TRANSPORT", "nixl")  # what a store's transport is made by
    with pytest.raises(InvalidArgumentError, match=r"unknown transport 'nixl'"):
        open_transport(None, "127.0.0.1")


def test_a_transport_spec_carries_the_factorys_options(monkeypatch):
    assert parse_transport("mooncake?protocol=rdma&device=mlx5_0&timeout=2.5&window=8") == (
        "mooncake", {"protocol": "rdma", "device": "mlx5_0", "timeout": 2.5, "window": 8})
    for bad in ("mooncake?protocol", "mooncake?a=1&a=2", "mooncake?1x=2"):
        with pytest.raises(InvalidArgumentError, match="transport"):
            parse_transport(bad)
    # An option the factory does not take is refused before anything starts, with the ones it takes.
    with pytest.raises(InvalidArgumentError, match=r"'protocl'.*takes protocol, device, timeout, slice_bytes, window"):
        open_transport("mooncake?protocl=rdma", "127.0.0.1")
    pytest.importorskip("mooncake")
    # The real engine, its options through the environment as a store gets them (TCP: no RDMA NIC here).
    monkeypatch.setenv("PARAMSTORE_TRANSPORT", "mooncake?protocol=tcp&timeout=30&window=4")
    t = open_transport(None, "127.0.0.1")
    try:
        assert (t.protocol, t.timeout, t.window) == ("tcp", 30.0, 4)
    finally:
        t.close()


def test_rdma_on_a_host_without_the_device_is_refused_not_tcp_in_disguise(monkeypatch, tmp_path):
    pytest.importorskip("mooncake")
    from paramstore.backends.transports import mooncake
    from paramstore.errors import TransferError

    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.setattr(mooncake, "RDMA_SYSFS", str(tmp_path / "infiniband"))  # a host with no RDMA device
    with pytest.raises(TransferError, match=r"RDMA device\(s\) \['mlx5_0'\] but this host has none"):
        open_transport("mooncake?protocol=rdma&device=mlx5_0", "127.0.0.1")
    (tmp_path / "infiniband" / "mlx5_1").mkdir(parents=True)
    with pytest.raises(TransferError, match=r"\['mlx5_0'\] but this host has \['mlx5_1'\]"):
        open_transport("mooncake?protocol=rdma&device=mlx5_0", "127.0.0.1")
    monkeypatch.setenv("MC_FORCE_TCP", "1")  # forced to TCP: nothing to check
    t = open_transport("mooncake?protocol=rdma&device=mlx5_0", "127.0.0.1")
    try:
        assert t.protocol == "tcp"
    finally:
        t.close()


def test_the_builtins_are_declared_as_entry_points():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        declared = _toml_entry_points(f.read().decode())
    for group in (REGISTRIES, TRANSPORTS):
        found = {name: ep.value for name, ep in entry_points(group).items()}
        assert declared[group].items() <= found.items()  # installed metadata says what pyproject says
    assert entry_points(TRANSPORTS)["mooncake"].load().__name__ == "MooncakeTransport"


def test_capability_flags_not_classes(tmp_path):
    reg = open_registry(None, str(tmp_path / "meta"), "x")
    try:
        assert isinstance(reg, LmdbRegistry) and reg.shared is False
    finally:
        reg.close()
    assert Registry.shared is True  # a registry that does not say is treated as shared (the cautious answer)
    redis = pytest.importorskip("redis")
    del redis
    from paramstore.backends.registries import RedisRegistry

    assert RedisRegistry.shared is True
    core = os.path.join(REPO, "paramstore")
    for dirpath, _, files in os.walk(core):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name)) as f:
                    text = f.read()
                for concrete in ("LmdbRegistry", "RedisRegistry", "registries.lmdb", "registries.redis",
                                 "transports.mooncake", "import lmdb", "lmdb.Error"):
                    assert concrete not in text, f"{name} names {concrete}: find backends through entry points"


def test_a_plain_checkout_finds_the_builtins_in_its_pyproject(tmp_path, shm_dir):
    # No paramstore metadata anywhere on the path (as on the GPU machine): the checkout and the other
    # installed packages only. The built-ins are read from pyproject.toml, as declared.
    site = tmp_path / "site"
    site.mkdir()
    packages = os.path.dirname(os.path.dirname(pytest.__file__))
    for entry in os.listdir(packages):
        if "paramstore" not in entry.lower():
            os.symlink(os.path.join(packages, entry), site / entry)
    code = textwrap.dedent('''
        import importlib.metadata as m, json, sys
        import torch, paramstore
        from paramstore.plugins import entry_points
        try:
            m.distribution("paramstore")
            installed = True
        except m.PackageNotFoundError:
            installed = False
        with paramstore.ParamStore(sys.argv[1]) as store:
            store.commit(1, {"w": torch.ones(3)}).result()
            with store.checkout(1) as snap:
                w = snap["w"].tolist()
        print(json.dumps({"installed": installed, "file": paramstore.__file__, "w": w,
                          "registries": sorted(entry_points("paramstore.registries")),
                          "transports": sorted(entry_points("paramstore.transports"))}))
    ''')
    checkout = tmp_path / "checkout"  # the tracked parts only (no paramstore.egg-info a build left)
    checkout.mkdir()
    for part in ("paramstore", "backends", "pyproject.toml"):
        os.symlink(os.path.join(REPO, part), checkout / part)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), str(site)])
    proc = subprocess.run([sys.executable, "-S", "-c", code, os.path.join(shm_dir, "store")], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["installed"] is False and out["file"] == str(checkout / "paramstore" / "__init__.py")
    assert out["registries"] == ["lmdb", "redis", "rediss"] and out["transports"] == ["mooncake"]
    assert out["w"] == [1.0, 1.0, 1.0]
