"""ninfer-core depends on no plugin, converter or gateway: every import under ninfer-core/src, lazy ones
inside functions and ``importlib.import_module("...")`` calls included, stays out of those packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE_SRC = Path(__file__).resolve().parents[1] / "src"
FORBIDDEN = ("ninfer_qwen35", "ninfer_qwen4exp", "ninfer_convert", "ninfer_serve", "ninfer_example_arch")


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import statement and every literal ``import_module`` / ``__import__`` call."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def forbidden_imports(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        for line, module in imported_modules(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if module.split(".")[0] in FORBIDDEN:
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


def test_core_src_imports_no_plugin_converter_or_gateway():
    assert forbidden_imports(CORE_SRC) == []


@pytest.mark.parametrize("source", [
    "import ninfer_convert.convert",
    "from ninfer_qwen35.config import parse_config",
    "def f():\n    from ninfer_serve import testing\n",
    "import importlib\nimportlib.import_module('ninfer_qwen4exp.plugin')\n",
])
def test_the_check_sees_every_kind_of_import(tmp_path, source):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(source)
    assert len(forbidden_imports(tmp_path)) == 1


def test_the_check_reads_the_real_tree():
    assert len(list(CORE_SRC.rglob("*.py"))) > 50
    assert (CORE_SRC / "ninfer" / "engine" / "engine.py").is_file()
