"""The package's import graph: no cycles (imports inside functions included), and imports run downward only.

Every module under `kvjax/` and `pallas_kernels/` is parsed (not imported); each `import` / `from ... import` that
names a project module — at top level or inside a function — is an edge. Implicit edges to parent packages (Python
runs `kvjax/__init__.py` before any `kvjax.x`) are left out: they are how packages work, not a dependency.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
PACKAGES = ("kvjax", "pallas_kernels")

# Layers, lowest first: a module may import only modules of its own layer or lower ones (DESIGN.md: cache -> models
# -> decode -> scheduling/remote -> cli). A top-level module of `kvjax/` (api, model, errors, ...) is placed explicitly.
LAYERS = [
    ("pallas_kernels", "kvjax.errors", "kvjax.arrays", "kvjax.data", "kvjax.tokenizer", "kvjax.checkpoint",
     "kvjax.generation"),
    ("kvjax.cache",),
    ("kvjax.models", "kvjax.model"),
    ("kvjax.compress", "kvjax.sharding"),
    ("kvjax.decode",),
    ("kvjax.prefix",),
    ("kvjax.families",),
    ("kvjax.scheduling", "kvjax.remote", "kvjax.plots", "kvjax.formats"),
    ("kvjax.api",),
    ("kvjax.training",),  # trains and evaluates the bundled models through the public API
    ("kvjax",),  # the package's public face re-exports everything
    ("kvjax.server",),  # the HTTP layer over the schedulers and the public API
    ("kvjax.cli",),
]


def _modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


def _edges(modules: dict[str, str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_pkg = path.endswith("__init__.py")
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    parts = mod.split(".")
                    parts = parts if is_pkg else parts[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            for t in targets:
                while t and t not in modules:  # `import kvjax.models.llama.model` names the module itself
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _layer(mod: str) -> int:
    best, rank = -1, None
    for i, names in enumerate(LAYERS):
        for n in names:
            if (mod == n or mod.startswith(n + ".")) and len(n) > best:
                best, rank = len(n), i
    if rank is None:
        raise AssertionError(f"module {mod} is in no layer of tests/test_imports.py: place it")
    return rank


def test_no_import_cycles():
    cycles = _cycles(_edges(_modules()))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_imports_run_downward():
    graph = _edges(_modules())
    upward = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if _layer(b) > _layer(a))
    assert not upward, "imports that run upward: " + ", ".join(upward)


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


@pytest.mark.parametrize("name", ["llama", "deepseek_v4"])
def test_a_family_is_one_folder_and_one_file(name):
    assert os.path.isdir(os.path.join(ROOT, "kvjax", "models", name))
    assert os.path.isfile(os.path.join(ROOT, "kvjax", "families", f"{name}.py"))
