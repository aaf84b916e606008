"""Every ```python block in README.md and docs/*.md runs as written, on its own (imports included).

Each block runs in a fresh namespace on the embedded model (CPU here). A block that cannot run on its own
(it needs a server, a GPU or a real checkpoint) is marked by the line ``<!-- docs-test: skip (why) -->``
right before its fence.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.S)
SKIP = "<!-- docs-test: skip"


def _blocks() -> list:
    found = []
    for doc in DOCS:
        text = "\n" + doc.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            marks = [pytest.mark.skip(reason=m["before"].strip())] if m["before"].strip().startswith(SKIP) else []
            found.append(pytest.param(doc, m["code"], id=f"{doc.relative_to(ROOT)}:{line}", marks=marks))
    return found


def test_engine_md_has_examples():
    assert any(doc.name == "engine.md" for doc, *_ in (p.values for p in _blocks()))


@pytest.mark.parametrize("doc,code", _blocks())
def test_python_block_runs(doc, code, one_cpu_thread):
    exec(compile(code, str(doc), "exec"), {"__name__": "__docs_example__"})  # noqa: S102 - our own docs
