"""What the doctests need: the examples in ``paramstore/``, ``backends/`` and ``README.md`` run in ``make test``.

Every doctest gets, in its namespace (nothing is downloaded):

* ``paramstore``, ``torch``;
* ``model``: a small MLP (``Linear(4, 8)``, ``ReLU``, ``Linear(8, 2)``; seed 0, so the same weights
  every run), ``policy`` (a module of the same shape, other weights), ``optimizer`` (SGD over ``model``);
* ``root``: a fresh, empty directory on ``/dev/shm``, removed after the example;
* ``store``: ``ParamStore(root)`` with step 1 of ``model`` committed, closed after the example. It is
  only made for an example that uses the name ``store`` without opening a ``ParamStore(...)`` itself;
* ``bucket_url`` (``s3://<fresh bucket>/runs/42``) and ``storage_options`` (s3fs options): a real S3
  API, moto's server on 127.0.0.1, started on first use and shared by the session;
* ``redis_url``: ``redis://127.0.0.1:<port>/0`` of a redis-server on a free loopback port, started on
  first use (the example is skipped, with the reason, where ``redis-server`` is not installed),
  emptied after each example.

The servers are the test suite's own (``tests/s3_server.py``, ``tests/redis_server.py``), started only
for examples whose code (``# doctest: +SKIP`` lines aside) names them.
"""

from __future__ import annotations

import doctest
import importlib.util
import os
import re
import shutil
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "tests")
if TESTS not in sys.path:
    sys.path.append(TESTS)  # s3_server, redis_server (appended; test modules import their helpers as `helpers`, never `conftest`)

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

# Modules whose optional dependency is missing are not imported for doctest collection.
collect_ignore: list[str] = []
if importlib.util.find_spec("redis") is None:
    collect_ignore += ["backends/registries/redis.py", "tests/redis_server.py"]
# Each integration imports its framework; they are tested in that framework's own environment
# (`make test-integrations`), where the framework is importable.
for _module, _framework in (("verl", "verl"), ("vllm", "vllm")):
    if importlib.util.find_spec(_framework) is None:
        collect_ignore.append(f"paramstore/integrations/{_module}.py")


@pytest.fixture(scope="session")
def _doctest_s3():
    pytest.importorskip("moto", reason="moto is not installed (pip install -e '.[dev]')")
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'paramstore[s3]')")
    from s3_server import S3Server

    server = S3Server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _doctest_redis():
    pytest.importorskip("redis", reason="redis-py is not installed (pip install 'paramstore[redis]')")
    import redis_server

    if not os.path.exists(redis_server.BINARY):
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    with redis_server.running() as url:
        yield url


def _uses(source: str, name: str) -> bool:
    return re.search(rf"\b{name}\b", source) is not None


@pytest.fixture(autouse=True)
def _doctest_globals(request):
    from _pytest.doctest import DoctestItem

    if not isinstance(request.node, DoctestItem):
        yield
        return
    source = "".join(ex.source for ex in request.node.dtest.examples if not ex.options.get(doctest.SKIP))
    namespace = request.getfixturevalue("doctest_namespace")
    import torch

    import paramstore

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    policy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    root = tempfile.mkdtemp(prefix="paramstore-doctest-", dir=SHM)
    added = {"paramstore": paramstore, "torch": torch, "model": model, "policy": policy,
             "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "root": root}
    store = None
    redis_url = None
    try:
        if _uses(source, "store") and "ParamStore(" not in source:
            store = paramstore.ParamStore(root)
            store.commit(1, model).result()
            added["store"] = store
        if _uses(source, "bucket_url") or _uses(source, "storage_options"):
            s3 = request.getfixturevalue("_doctest_s3")
            added["bucket_url"] = f"s3://{s3.new_bucket()}/runs/42"
            added["storage_options"] = s3.options()
        if _uses(source, "Policy") and "class Policy" not in source:  # the engine model of the SGLang examples
            class Policy(torch.nn.Sequential):
                def load_weights(self, weights):
                    for name, tensor in weights:
                        self.get_parameter(name).data.copy_(tensor)

            added["Policy"] = Policy
        if _uses(source, "redis_url"):
            redis_url = added["redis_url"] = request.getfixturevalue("_doctest_redis")
        namespace.update(added)
        yield
    finally:
        for name in added:
            namespace.pop(name, None)
        if store is not None:
            store.close()
        if redis_url is not None:
            import redis

            with redis.Redis.from_url(redis_url) as client:
                client.flushdb()
        shutil.rmtree(root, ignore_errors=True)
