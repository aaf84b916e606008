"""docs/architecture.md names only paths that exist (issue 16): every backticked path in it, outside the design
document's own paths (the table's second column) and the ownership-chain sketch, resolves in this checkout. A bare
file name, or a path without a package prefix, is looked up in the folder (a path ending in ``/``) named last
before it in the same table cell or line."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
FILE_EXT = re.compile(r"\.(py|md|jinja|ninfer|toml|txt|json)$")
PATHLIKE = re.compile(r"^[\w./\-{},]+$")


def _expand(token: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m.group(1).split(",") for x in _expand(token[:m.start()] + alt + token[m.end():])]


def _is_path(token: str) -> bool:
    return bool(PATHLIKE.match(token)) and ("/" in token or bool(FILE_EXT.search(token))) \
        and not token.startswith("shared/")  # the design document lives beside the repository, not in it


def _units(text: str):
    """(place, text) pieces whose paths share a folder context: table cells (the design document's column
    left out) and the other lines; fenced code is skipped."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("|"):
            cells = [c for c in line.strip().strip("|").split("|")]
            if len(cells) >= 3 and not set(line) <= set("|- "):
                yield n, cells[0]
                yield n, "|".join(cells[2:])
            continue
        yield n, line


def missing_paths(text: str) -> list[str]:
    missing = []
    for n, unit in _units(text):
        base: Path | None = None
        for token in re.findall(r"`([^`]+)`", unit):
            if not _is_path(token):
                continue
            for name in _expand(token):
                found = next((p for p in (ROOT / name, base / name if base else None) if p and p.exists()), None)
                if found is None:
                    missing.append(f"line {n}: {name}")
                    continue
                if name.endswith("/"):  # a folder sets the context of the bare names after it
                    base = found
    return missing


def test_architecture_doc_names_only_existing_paths():
    assert not missing_paths(DOC.read_text(encoding="utf-8"))


def test_the_check_sees_a_missing_path():
    assert missing_paths("| a | `src/x` | `ninfer-core/src/ninfer/engine/`: `core.py`, `nope.py` |") == \
        ["line 1: nope.py"]
    assert missing_paths("see `ninfer-core/src/ninfer/gone.py` and `docs/engine.md`") == \
        ["line 1: ninfer-core/src/ninfer/gone.py"]
