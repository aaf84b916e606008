"""What plugins import of core, read from their source (lazy imports and ``"module:attr"`` slot targets included).

- No plugin, nor the gateway or the converter, imports a private core module: a ``ninfer`` module path with a
  component starting ``_``.
- The Qwen3.5 plugin imports only what docs/public-api.md lists (its tables are the one allow-list; a name a
  listed package exports may come from its defining submodule, as the doc says).
The other direction, core importing a plugin, is ninfer-core/tests/test_layering.py.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "public-api.md"
PLUGIN_SOURCES = sorted({*ROOT.glob("ninfer-*/src"), *ROOT.glob("examples/*/src")} - {ROOT / "ninfer-core" / "src"})
QWEN35_SRC = ROOT / "ninfer-qwen35" / "src"


def public_api() -> dict[str, set[str]]:
    """Module -> names, from every table of docs/public-api.md (``*``: the module's ``__all__``)."""
    api: dict[str, set[str]] = {}
    for module, cell in re.findall(r"^\| `([\w.]+)` \| (.+) \|$", DOC.read_text(), re.M):
        names = set(re.findall(r"`([\w*]+)`", cell))
        if "*" in names:
            names = (names - {"*"}) | set(importlib.import_module(module).__all__)
        api.setdefault(module, set()).update(names)
    return api


def ninfer_imports(source: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every import of a ``ninfer`` module and every ``"ninfer....:attr"`` target."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value, None))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.fullmatch(r"ninfer(\.\w+)*:[\w.]+", node.value):
            module, name = node.value.split(":")
            found.append((node.lineno, module, name.split(".")[0]))
    return [(line, m, n) for line, m, n in found if m.split(".")[0] == "ninfer"]


def private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split("."))


def allowed(api: dict[str, set[str]], module: str, name: str | None) -> bool:
    """Listed, or a name that a listed package (not ``ninfer`` itself) exports, from one of its submodules."""
    if private(module):
        return False
    if module in api:
        return name is None or name in api[module]
    return name is not None and any(package != "ninfer" and module.startswith(package + ".") and name in names
                                    for package, names in api.items())


def private_imports(root: Path) -> list[str]:
    return [f"{p.relative_to(root)}:{line} imports {m}{':' + n if n else ''}"
            for p in sorted(root.rglob("*.py")) for line, m, n in ninfer_imports(p.read_text(encoding="utf-8"))
            if private(m)]


def unlisted_imports(root: Path, api: dict[str, set[str]]) -> list[str]:
    return [f"{p.relative_to(root)}:{line} imports {m}{'.' + n if n else ''}"
            for p in sorted(root.rglob("*.py")) for line, m, n in ninfer_imports(p.read_text(encoding="utf-8"))
            if not allowed(api, m, n)]


@pytest.mark.parametrize("src", PLUGIN_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_plugin_imports_a_private_core_module(src):
    assert private_imports(src) == []


def test_the_qwen35_plugin_imports_only_the_public_api():
    assert unlisted_imports(QWEN35_SRC, public_api()) == []


def test_every_listed_module_and_name_exists():
    missing = []
    for module, names in public_api().items():
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module} ({exc})")
            continue
        missing += [f"{module}.{n}" for n in sorted(names) if not hasattr(mod, n)]
    assert missing == []


@pytest.mark.parametrize(("source", "private_found", "unlisted_found"), [
    ("from ninfer.ops._dispatch import triton_selected", 1, 1),
    ("def f():\n    from ninfer.ops.triton._pdl import launch\n", 1, 1),
    ("import importlib\nimportlib.import_module('ninfer._markers')\n", 1, 1),
    ("TARGET = 'ninfer.engine._private:thing'", 1, 1),
    ("from ninfer.engine.core import EngineCore", 0, 1),
    ("from ninfer.contract.model import ModelInstance", 0, 0),
    ("from ninfer.models.common.qwen.chat_template import builtin_template", 0, 0),
    ("from ninfer.core.device import Device", 0, 0),
    ("from ninfer.core.device import secret_helper", 0, 1),
    ("import ninfer.ops", 0, 0),
    ("from ninfer.engine.engine import Engine", 0, 1),
])
def test_the_checks_see_every_kind_of_import(tmp_path, source, private_found, unlisted_found):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(source)
    assert len(private_imports(tmp_path)) == private_found
    assert len(unlisted_imports(tmp_path, public_api())) == unlisted_found


def test_the_checks_read_the_real_tree():
    names = {str(p.relative_to(ROOT)) for p in PLUGIN_SOURCES}
    assert {"ninfer-qwen35/src", "ninfer-serve/src", "ninfer-convert/src", "examples/ninfer-qwen3/src"} <= names
    assert len(list(QWEN35_SRC.rglob("*.py"))) > 20
