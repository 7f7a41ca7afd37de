"""The package's import structure: no cycles, no module importing a higher layer, and imports
inside functions only where they keep an optional or heavy dependency from loading.

Every module of ``paramstore/`` and ``backends/`` (installed as ``paramstore.backends``) is parsed
with :mod:`ast`, never imported. A module-level import is one outside every function (a
``try: ... except ImportError`` around it included); imports under ``if TYPE_CHECKING:`` are for
annotations only and are not counted.

* **Cycles** among module-level imports fail, naming the modules in the cycle.
* **Layers** (:data:`LAYERS`, lowest first): a module may import its own layer and those below it,
  never one above, at module level or inside a function. Every module belongs to one layer: a new
  module is placed in the table.
* **Function-level imports** of a paramstore module fail unless that module loads, when imported,
  one of :data:`LAZY_DEPENDENCIES` that the importing module does not already load (directly or
  through its own module-level imports): then deferring it is the point, e.g. the CLI's metadata
  commands never load torch. Also allowed: the imports in a module-level ``__getattr__`` (PEP 562:
  a package's lazy public names, as ``paramstore.__init__``'s ``_LAZY``), and the modules listed in
  :data:`LAZY_IMPORTERS`.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
#: package name -> its directory in the repository (backends/ is installed as paramstore.backends)
PACKAGES = {"paramstore": os.path.join(REPO, "paramstore"), "paramstore.backends": os.path.join(REPO, "backends")}

#: The layers, lowest first: (name, what belongs there, module patterns (fnmatch; the first layer
#: whose pattern matches a module is its layer)).
LAYERS: list[tuple[str, str, tuple[str, ...]]] = [
    ("data", "plain data, formats, input checks, reports and small utilities", (
        "paramstore.errors", "paramstore.text", "paramstore.format", "paramstore.validate", "paramstore.reports",
        "paramstore.manifest", "paramstore.patch", "paramstore.liveness", "paramstore.progress", "paramstore.safefs",
        "paramstore.accel", "paramstore.pinning", "paramstore.plugins", "paramstore.metrics", "paramstore.recipes",
        "paramstore.adapters", "paramstore.kernels",
    )),
    ("contracts", "the backend contracts and their conformance suites", (
        "paramstore.backends", "paramstore.backends.*.base", "paramstore.backends.*.testing",
        # the Collective contract, beside its torch.distributed implementation (torch loaded only when one is made)
        "paramstore.backends.transports.collective",
    )),
    ("backends", "the backend implementations (and the packages that find them by name)", (
        "paramstore.backends.*",
    )),
    ("mechanisms", "one job each: the store root, staging, commit, snapshot, patches, peers, remote, device", (
        "paramstore.root", "paramstore.staging", "paramstore.writer", "paramstore.assets", "paramstore.retention",
        "paramstore.sharded", "paramstore.tensors", "paramstore.objects", "paramstore.snapshot", "paramstore.delta",
        "paramstore.peer", "paramstore.remote", "paramstore.commit", "paramstore.device", "paramstore.lazy",
        "paramstore.derived", "paramstore.following", "paramstore.hashing", "paramstore.relay", "paramstore.retire",
    )),
    ("orchestration", "paths and services built on the mechanisms: checkout, broadcast, maintenance, commands", (
        "paramstore.checkout", "paramstore.collective", "paramstore.ops", "paramstore.maintenance",
        "paramstore.persist", "paramstore.scrub", "paramstore.export",
    )),
    ("facade", "what users call: the package, ParamStore and its parts, the CLI, the integrations", (
        "paramstore", "paramstore.store", "paramstore.options", "paramstore.opening", "paramstore.read_side",
        "paramstore.write_side", "paramstore.cli", "paramstore.__main__", "paramstore.integrations",
        "paramstore.integrations.*",
    )),
]

#: Third-party packages a paramstore module may be imported lazily (inside a function) for, and why.
LAZY_DEPENDENCIES = {
    "torch": "seconds to import: `import paramstore` and the CLI's metadata commands (ls, du, gc, tags...) "
             "must not load it",
    "redis": "the paramstore[redis] extra",
    "fsspec": "the paramstore[s3] extra",
    "s3fs": "the paramstore[s3] extra",
    "mooncake": "the paramstore[mooncake] extra",
    "verl": "a framework (paramstore[verl])",
    "vllm": "a framework (paramstore[vllm])",
    "sglang": "a framework",
    "transformers": "a framework",
    "prometheus_client": "the paramstore[metrics] extra",
}

#: Modules whose function-level imports of paramstore modules are all allowed, and why.
LAZY_IMPORTERS = {
    # vLLM imports it in each of its processes through the `vllm.general_plugins` entry point, for
    # `register()`: nothing more of paramstore may load until an engine is built.
    "paramstore.integrations.vllm": "loaded by vLLM's plugin hook in every process",
}


@dataclass
class Module:
    name: str
    path: str
    is_package: bool
    imports: set[str] = field(default_factory=set)  # internal, module level
    lazy: list[tuple[str, int, bool]] = field(default_factory=list)  # internal, in functions: (target, line, in __getattr__)
    external: set[str] = field(default_factory=set)  # third-party top-level names, module level


def _modules() -> dict[str, Module]:
    out: dict[str, Module] = {}
    for package, directory in PACKAGES.items():
        for dirpath, dirnames, filenames in os.walk(directory):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for f in sorted(filenames):
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                parts = os.path.relpath(path, directory)[:-3].split(os.sep)
                is_package = parts[-1] == "__init__"
                if is_package:
                    parts = parts[:-1]
                name = ".".join([package, *parts])
                out.setdefault(name, Module(name, path, is_package))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, in_function: bool = False, getattr_: bool = False):
    """Yield (import node, in a function, in a module-level __getattr__), skipping TYPE_CHECKING blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function, getattr_
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            top_getattr = not in_function and isinstance(node, ast.Module) and getattr(child, "name", "") == "__getattr__"
            yield from _imports(child, True, getattr_ or top_getattr)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield from _imports(ast.Module(body=[sub], type_ignores=[]), in_function, getattr_)
        else:
            yield from _imports(child, in_function, getattr_)


def _targets(module: Module, node: ast.Import | ast.ImportFrom, known: dict[str, Module]) -> tuple[list[str], list[str]]:
    """(internal modules, third-party top-level names) an import statement loads."""
    internal: list[str] = []
    external: list[str] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            (internal if alias.name == "paramstore" or alias.name.startswith("paramstore.") else external).append(alias.name)
    else:
        if node.level:
            base = module.name.split(".")
            if not module.is_package:
                base = base[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source == "paramstore" or source.startswith("paramstore."):
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                internal.append(sub if sub in known else source)
        elif source != "__future__":
            external.append(source)
    for name in internal:
        assert name in known, f"{module.path}:{node.lineno}: imports {name}, which is not a module here"
    return internal, [e.split(".")[0] for e in external]


def _graph() -> dict[str, Module]:
    mods = _modules()
    for m in mods.values():
        with open(m.path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), m.path)
        for node, in_function, in_getattr in _imports(tree):
            internal, external = _targets(m, node, mods)
            if in_function:
                m.lazy.extend((t, node.lineno, in_getattr) for t in dict.fromkeys(internal))
            else:
                m.imports.update(t for t in internal if t != m.name)
                m.external.update(external)
    return mods


GRAPH = _graph()


def _layer(name: str) -> int | None:
    for i, (_, _, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return i
    return None


def _parents(name: str) -> list[str]:
    """The packages Python imports before ``name``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _loads(name: str, memo: dict[str, set[str]] | None = None) -> set[str]:
    """The third-party top-level packages importing ``name`` loads (its module-level imports, those
    of the paramstore modules it imports, and their packages' ``__init__``)."""
    memo = {} if memo is None else memo
    if name in memo:
        return memo[name]
    memo[name] = set()  # (a cycle is reported by its own test)
    out = set(GRAPH[name].external)
    for t in {*GRAPH[name].imports, *_parents(name)}:
        out |= _loads(t, memo)
        for p in _parents(t):
            out |= _loads(p, memo)
    memo[name] = out
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the component, as a path that ends where it starts."""
    members = set(component)
    start = component[0]
    seen = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return seen[v] + [start]
            if w not in seen:
                seen[w] = seen[v] + [w]
                todo.append(w)
    return component


def test_the_modules_are_found():
    # the parse itself: both trees, the facade and the contracts among them
    for name in ("paramstore", "paramstore.store", "paramstore.cli", "paramstore.manifest",
                 "paramstore.backends.tiers.base", "paramstore.backends.registries.base"):
        assert name in GRAPH, name


def test_no_import_cycles():
    graph = {name: m.imports for name, m in GRAPH.items()}
    cycles = [" -> ".join(_path(graph, c)) for c in _cycles(graph)]
    assert not cycles, "import cycles at module level (move the shared part into a lower module):\n  " + \
        "\n  ".join(cycles)


def test_every_module_has_a_layer():
    missing = sorted(name for name in GRAPH if _layer(name) is None)
    assert not missing, f"modules in no layer: {missing}: add each to LAYERS in {__file__}"


def test_no_module_imports_a_higher_layer():
    bad = []
    for name, m in sorted(GRAPH.items()):
        mine = _layer(name)
        if mine is None:
            continue
        for target, line in [*((t, None) for t in sorted(m.imports)), *((t, n) for t, n, _ in m.lazy)]:
            theirs = _layer(target)
            if theirs is not None and theirs > mine:
                where = f"{name}" + (f" (line {line}, in a function)" if line else "")
                bad.append(f"{where} [{LAYERS[mine][0]}] imports {target} [{LAYERS[theirs][0]}]")
    assert not bad, "imports of a higher layer:\n  " + "\n  ".join(bad)


def test_function_level_imports_only_defer_heavy_dependencies():
    memo: dict[str, set[str]] = {}
    bad = []
    for name, m in sorted(GRAPH.items()):
        if name in LAZY_IMPORTERS:
            continue
        mine = _loads(name, memo)
        for target, line, in_getattr in m.lazy:
            if in_getattr or target == name:
                continue
            deferred = (_loads(target, memo) - mine) & set(LAZY_DEPENDENCIES)
            if not deferred:
                bad.append(f"{os.path.relpath(m.path, REPO)}:{line}: {name} imports {target} in a function, but "
                           f"{target} loads nothing of {sorted(LAZY_DEPENDENCIES)} that {name} does not already: "
                           "import it at the top of the module")
    assert not bad, "function-level imports with no dependency to defer:\n  " + "\n  ".join(bad)


def test_allow_lists_are_current():
    stale = [name for name in LAZY_IMPORTERS if name not in GRAPH or not GRAPH[name].lazy]
    assert not stale, f"LAZY_IMPORTERS entries with no function-level import left: {stale}"
    # every listed dependency is still deferred by some function-level import
    memo: dict[str, set[str]] = {}
    used = {d for name, m in GRAPH.items() for target, _, _ in m.lazy
            for d in _loads(target, memo) - _loads(name, memo)}
    assert "torch" in used, "no lazy import defers torch any more: is LAZY_DEPENDENCIES still needed?"


@pytest.mark.parametrize("module", ["paramstore", "paramstore.cli"])
def test_importing_does_not_load_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"`import {module}` loads torch: {out.stdout.strip()[:300]}"


def test_metadata_commands_never_load_torch(tmp_path):
    """``paramstore ls`` (opening a store, listing, closing) stays a metadata command: a close that
    imported the snapshot module to wait for mappings loaded torch every time (1.3 s of 1.5 s of
    ``ls`` on 10,000 versions)."""
    import paramstore
    import torch

    root = str(tmp_path / "store")
    with paramstore.ParamStore(root, create=True) as store:
        store.commit(1, {"w": torch.ones(2)}).result()
    code = ("import sys, paramstore\n"
            f"s = paramstore.ParamStore({root!r}); assert [v.step for v in s.versions()] == [1]; s.close()\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"listing a store loads torch: {out.stdout.strip()[:300]}"
    cli = subprocess.run([sys.executable, "-m", "paramstore", "--root", root, "ls"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert cli.returncode == 0 and "1" in cli.stdout, cli.stderr


def test_the_checks_see_what_they_should():
    # a cycle, and one path through it
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _path(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    # relative imports and `from . import x` resolve to modules
    m = Module("paramstore.backends.tiers.local", "local.py", False)
    known = {n: Module(n, "", False) for n in ("paramstore", "paramstore.backends.tiers.base", "paramstore.errors",
                                                 "paramstore.liveness")}
    tree = ast.parse("from .base import Tier\nfrom paramstore import liveness\nfrom paramstore.errors import X\n"
                     "import numpy.linalg\n")
    got = [_targets(m, node, known) for node in tree.body]
    assert got == [(["paramstore.backends.tiers.base"], []), (["paramstore.liveness"], []),
                   (["paramstore.errors"], []), ([], ["numpy"])]
    # TYPE_CHECKING blocks are skipped; functions and __getattr__ are told apart
    tree = ast.parse("if TYPE_CHECKING:\n    import a\nimport b\ndef f():\n    import c\n"
                     "def __getattr__(n):\n    import d\n")
    assert [(n.names[0].name, f, g) for n, f, g in _imports(tree)] == [("b", False, False), ("c", True, False),
                                                                       ("d", True, True)]
    # the layers are as documented: the data layer at the bottom, the facade on top
    assert _layer("paramstore.reports") == 0 and _layer("paramstore.backends.tiers.base") == 1
    assert _layer("paramstore.backends.registries.lmdb") == 2 and _layer("paramstore.store") == len(LAYERS) - 1
