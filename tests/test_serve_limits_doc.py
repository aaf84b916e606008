"""docs/serving.md's "Every limit" table against ``ninfer serve``'s options: every flag it names exists, and the
default it states is the option's (so the table cannot drift from the code)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

pytest.importorskip("ninfer_serve")

from ninfer_serve.cli import add_serve_command  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


def _options() -> dict[str, object]:
    root = argparse.ArgumentParser()
    add_serve_command(root.add_subparsers())
    serve = root._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001 - argparse keeps it there
    return {a.option_strings[0]: a.default for a in serve._actions if a.option_strings}


def _rows() -> list[tuple[list[str], list[str]]]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Every limit", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`--"):
            flags = re.findall(r"`(--[a-z0-9-]+)`", cells[1])
            rows.append((flags, [d.strip() for d in cells[2].split(" / ")]))
    return rows


def _shown(default: object) -> str | None:
    """How the table writes an option's default (None: the option computes it; the table says in words)."""
    if default is None:
        return None
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    if default == ():
        return "none"
    return str(default)


def test_every_flag_in_the_table_exists_with_the_default_it_states():
    options, rows = _options(), _rows()
    assert len(rows) >= 20, "the table was not found"
    for flags, defaults in rows:
        assert len(flags) == len(defaults), (flags, defaults)
        for flag, stated in zip(flags, defaults, strict=True):
            assert flag in options, f"{flag} is not an option of ninfer serve"
            shown = _shown(options[flag])
            if shown is not None:
                assert stated == shown, f"{flag}: the table says {stated}, the option's default is {shown}"


def test_every_limit_flag_is_in_the_table():
    """Options that bound what a request or a client may take are all listed."""
    listed = {flag for flags, _ in _rows() for flag in flags}
    limits = [f for f in _options() if f.startswith(("--constraint-", "--media-max", "--heavy-", "--max-connections"))
              or f in ("--media-timeout", "--body-timeout", "--keep-alive-timeout", "--http-threads", "--http-queue",
                       "--media-threads", "--media-queue", "--media-per-client", "--queue-timeout", "--max-queue")]
    assert sorted(set(limits) - listed) == []
