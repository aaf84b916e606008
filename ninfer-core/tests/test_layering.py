"""Layering of ninfer-core, read from the source: every import under ninfer-core/src, lazy ones inside functions
and ``importlib.import_module("...")`` calls included, is checked.

- Core depends on no plugin, converter or gateway (any package beside ``ninfer`` in this repository).
- Lower layers do not reach up: the contract imports no other ninfer package at run time (annotations under
  ``if TYPE_CHECKING:`` may name the engine's snapshot types); shared model parts, ops, core stores and the
  artifact reader do not import the engine or the CLI; the artifact reader imports no model part.

What plugins may import of core is checked by tests/test_plugin_layering.py against docs/public-api.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE_SRC = REPO / "ninfer-core" / "src"
# Every package of the repository that is not ninfer itself, and the names tests give their plugins.
PLUGIN_PACKAGES = frozenset(
    {p.name for p in (*REPO.glob("ninfer-*/src/*"), *REPO.glob("examples/*/src/*")) if p.is_dir()} - {"ninfer"}
) | {"ninfer_qwen4exp", "ninfer_example_arch"}
# (package under ninfer, packages under ninfer it must not import); "runtime" rules skip TYPE_CHECKING blocks.
UPWARD = (
    ("ninfer.contract", ("ninfer.engine", "ninfer.cli", "ninfer.models", "ninfer.core", "ninfer.ops",
                         "ninfer.artifact", "ninfer.plugins"), "runtime"),
    ("ninfer.models", ("ninfer.engine", "ninfer.cli"), "always"),
    ("ninfer.ops", ("ninfer.engine", "ninfer.cli", "ninfer.models"), "always"),
    ("ninfer.core", ("ninfer.engine", "ninfer.cli", "ninfer.models"), "always"),
    ("ninfer.artifact", ("ninfer.engine", "ninfer.models"), "always"),
)


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imported_modules(tree: ast.AST, *, runtime_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every import statement and every literal ``import_module`` / ``__import__`` call;
    ``runtime_only``: leave out what ``if TYPE_CHECKING:`` blocks import."""
    found = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if runtime_only and _type_checking_block(node):
            stack += node.orelse
            continue
        stack += ast.iter_child_nodes(node)
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return sorted(found)


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def forbidden_imports(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        for line, module in imported_modules(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if module.split(".")[0] in PLUGIN_PACKAGES:
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


def upward_imports(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        here = _module_name(root, path)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for package, above, when in UPWARD:
            if not _under(here, package):
                continue
            for line, module in imported_modules(tree, runtime_only=when == "runtime"):
                if any(_under(module, a) for a in above):
                    bad.append(f"{path.relative_to(root)}:{line} imports {module} ({package} is below it)")
    return bad


def test_core_src_imports_no_plugin_converter_or_gateway():
    assert forbidden_imports(CORE_SRC) == []


def test_lower_layers_do_not_import_upper_ones():
    assert upward_imports(CORE_SRC) == []


@pytest.mark.parametrize("source", [
    "import ninfer_convert.convert",
    "from ninfer_qwen35.config import parse_config",
    "def f():\n    from ninfer_serve import testing\n",
    "import importlib\nimportlib.import_module('ninfer_qwen4exp.plugin')\n",
    "from ninfer_qwen3.startup import Qwen3Startup",
])
def test_the_check_sees_every_kind_of_import(tmp_path, source):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(source)
    assert len(forbidden_imports(tmp_path)) == 1


@pytest.mark.parametrize(("module", "source", "found"), [
    ("ninfer/models/common/qwen/errors.py", "from ninfer.engine.errors import Unrepresentable", 1),
    ("ninfer/artifact/mapping.py", "def f():\n    from ninfer.models.common.weights import FusedParent\n", 1),
    ("ninfer/contract/model.py", "from ninfer.core.device import Device", 1),
    ("ninfer/contract/model.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ninfer.engine import x\n", 0),
    ("ninfer/models/common/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ninfer.engine import x\n", 1),
    ("ninfer/engine/core.py", "from ninfer.models.common.paged_program import PagedProgram", 0),
])
def test_the_upward_check_reads_the_layers(tmp_path, module, source, found):
    path = tmp_path / module
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert len(upward_imports(tmp_path)) == found


def test_the_check_reads_the_real_tree():
    assert len(list(CORE_SRC.rglob("*.py"))) > 50
    assert (CORE_SRC / "ninfer" / "engine" / "engine.py").is_file()
    assert {"ninfer_qwen35", "ninfer_serve", "ninfer_convert", "ninfer_qwen3"} <= PLUGIN_PACKAGES
