"""ktorch's modules form no import cycle, and each imports alone in a fresh interpreter.

The graph is read from the sources (ast): an edge m -> n for every ``import``/``from ... import`` of ktorch module
n in m, plus n's enclosing packages other than m's own (importing ``ktorch.compile.options`` runs
``ktorch/compile/__init__.py`` first). Two graphs are checked: the module-level imports alone, and those with the
imports inside functions too (a lazy import hides a cycle from the interpreter, not from a reader). Imports under
``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ktorch"


def ktorch_modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(module: str, is_package: bool, node: ast.AST) -> list[str]:
    """The dotted names ``node`` imports (for ``from a import b``: a, and a.b in case b is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: resolved against the importing module's package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    return [source] + [f"{source}.{alias.name}" for alias in node.names]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(body: list, lazy: bool):
    """The import statements of ``body``: module level (``if``/``try`` blocks included), or every one if lazy."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                yield from _import_nodes(node.body, lazy)
                yield from _import_nodes(node.orelse, lazy)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _import_nodes(block, lazy)
        elif lazy:
            children = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
            yield from _import_nodes(children, lazy)


def import_graph(modules: dict[str, pathlib.Path], lazy: bool) -> dict[str, set[str]]:
    graph = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}  # itself and its packages
        edges = set()
        for node in _import_nodes(ast.parse(path.read_text()).body, lazy):
            for name in _imported(module, is_package, node):
                parts = name.split(".")
                # the module and every package it is in, but the root (ktorch/__init__ runs before any of them)
                edges |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & modules.keys()
                if name == "ktorch":
                    edges.add(name)
        graph[module] = edges - own
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as [a, b, ..., a], or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_find_cycle_finds_one_and_only_real_ones():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_import_graph_reads_lazy_relative_and_package_imports(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from p.sub.x import f\n")
    (pkg / "sub" / "x.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import y\n"
                                      "def f():\n    from .. import y\n")
    (pkg / "y.py").write_text("import p.sub.x\n")
    modules = {"p": pkg / "__init__.py", "p.sub": pkg / "sub" / "__init__.py", "p.sub.x": pkg / "sub" / "x.py",
               "p.y": pkg / "y.py"}
    eager, lazy = import_graph(modules, lazy=False), import_graph(modules, lazy=True)
    assert eager["p.y"] == {"p.sub", "p.sub.x"} and eager["p.sub"] == {"p.sub.x"}
    assert eager["p.sub.x"] == set() and find_cycle(eager) == []  # the TYPE_CHECKING import is left out
    assert lazy["p.sub.x"] == {"p.y"} and find_cycle(lazy) in (["p.sub.x", "p.y", "p.sub.x"],
                                                               ["p.sub", "p.sub.x", "p.y", "p.sub"])


@pytest.mark.parametrize("lazy", [False, True], ids=["module-level", "with-function-level"])
def test_ktorch_has_no_import_cycle(lazy):
    modules = ktorch_modules()
    assert len(modules) > 20 and "ktorch.compile.experts_runtime" in modules
    cycle = find_cycle(import_graph(modules, lazy))
    assert not cycle, "import cycle: " + " -> ".join(cycle)


# Run by one interpreter that imports torch (the first thing any ktorch import does: ktorch/__init__.py imports it)
# and then forks a child per module, each importing that module alone, two at a time: a fresh interpreter per module
# took ~160 s of the CI's 2 cores (torch imported 58 times), the forks a few seconds.
_FORKED_IMPORTS = r"""
import importlib, os, sys
import torch  # noqa: F401  (before any fork: what a fresh interpreter's ktorch import does first)

failures, running, todo = [], {}, list(sys.argv[1:])
while todo or running:
    while todo and len(running) < 2:
        module = todo.pop(0)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                importlib.import_module(module)
                code, msg = 0, ""
            except BaseException as e:
                code, msg = 1, f"{type(e).__name__}: {e}"
            os.write(w, msg.encode()[:4000])
            os._exit(code)
        os.close(w)
        running[pid] = (module, r)
    pid, status = os.waitpid(-1, 0)
    module, r = running.pop(pid)
    msg = os.read(r, 4000).decode(errors="replace")
    os.close(r)
    if os.waitstatus_to_exitcode(status) != 0:
        failures.append(f"{module}: {msg or os.waitstatus_to_exitcode(status)}")
print("\n".join(failures))
sys.exit(1 if failures else 0)
"""


def test_each_module_imports_alone_in_a_fresh_interpreter():
    # a module imported after others could lean on what they loaded: each is imported in a child of its own
    modules = sorted(ktorch_modules())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KT_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _FORKED_IMPORTS, *modules], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout.strip() or proc.stderr[-2000:]


def test_the_forked_imports_catch_a_module_that_leans_on_another(tmp_path):
    """The check itself: a module that uses a name only another module's import provides fails alone; the one that
    provides it passes."""
    pkg = tmp_path / "leaning"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "base.py").write_text("import sys\nsys.modules['leaning'].shared = 1\n")
    (pkg / "user.py").write_text("import leaning\nvalue = leaning.shared + 1\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _FORKED_IMPORTS, "leaning.base", "leaning.user"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stdout.strip().splitlines() == [
        "leaning.user: AttributeError: module 'leaning' has no attribute 'shared'"]
