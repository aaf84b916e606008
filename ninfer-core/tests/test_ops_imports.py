"""The shape of ``ninfer.ops`` as an import graph, read from the source (AST, nothing imported): no import cycle among
its modules (function-level imports count: they are cycles deferred, not removed), and no module outside it
imports one of its private modules (``ninfer.ops._*``, ``ninfer.ops.triton._*``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ninfer-core" / "src" / "ninfer" / "ops"


def _module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports (module or function level, outside ``if TYPE_CHECKING``); ``from p import n``
    counts as ``p.n`` (the caller keeps the names that are modules) and as ``p``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join([*package.split(".")[:len(package.split(".")) - child.level + 1], base]).strip(".")
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def import_graph(src: Path, prefix: str) -> dict[str, set[str]]:
    """module -> the modules under ``prefix`` it imports, for every module file under ``src/<prefix path>``."""
    files = {_module_name(p, src): p for p in (src / prefix.replace(".", "/")).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {m for m in imported_modules(path, package) if m in files and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
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

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def _private_ops(module: str) -> bool:
    parts = module.split(".")
    return parts[:2] == ["ninfer", "ops"] and any(p.startswith("_") and p != "__init__" for p in parts[2:])


def test_no_import_cycle_among_the_ops_modules():
    graph = import_graph(OPS.parents[1], "ninfer.ops")
    assert "ninfer.ops.triton.moe" in graph and "ninfer.ops.triton.moe_one_token" in graph["ninfer.ops.triton.moe"]
    assert cycles(graph) == []


def test_the_cycle_finder_sees_deferred_imports(tmp_path):
    pkg = tmp_path / "ninfer" / "ops"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from ninfer.ops import b\n")
    (pkg / "b.py").write_text("def f():\n    from ninfer.ops.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ninfer.ops import a\n")
    assert cycles(import_graph(tmp_path, "ninfer.ops")) == [["ninfer.ops.a", "ninfer.ops.b"]]


def test_no_private_ops_module_is_imported_outside_ops():
    users = [*ROOT.glob("ninfer-*/src/**/*.py"), *ROOT.glob("examples/*/src/**/*.py")]
    reached = []
    for path in users:
        if OPS in path.parents:
            continue
        reached += [f"{path.relative_to(ROOT)}: {m}" for m in sorted(imported_modules(path, "")) if _private_ops(m)]
    assert reached == []
