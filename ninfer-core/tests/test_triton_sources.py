"""The op and kernel sources say why, not when or how fast: measurements live in docs/kernels.md."""

from __future__ import annotations

import re
from pathlib import Path

OPS = Path(__file__).resolve().parents[1] / "src" / "ninfer" / "ops"
LAB_NOTES = {
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a session or run label": re.compile(r"\bsession \d|\bgpu-pending\b", re.I),
    "a measured time or rate": re.compile(r"\d\s*(us|ms|µs)\b|\btok/s\b|\bTB/s\b|\bTFLOP/s\b"),
}


def test_op_sources_hold_no_lab_notes():
    found = [f"{path.relative_to(OPS)}:{n}: {what}: {line.strip()}"
             for path in sorted(OPS.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             for what, pattern in LAB_NOTES.items() if pattern.search(line)]
    assert not found, "move these to docs/kernels.md:\n" + "\n".join(found)


def test_kernels_share_one_pdl_prologue():
    """griddepcontrol is spelled once, in _pdl_jit; every kernel calls its helpers (compile_check checks where
    the instructions land in each kernel's PTX)."""
    spelled = sorted(str(path.relative_to(OPS)) for path in OPS.rglob("*.py")
                     if re.search(r"gdc_wait|gdc_launch_dependents", path.read_text()))
    assert spelled == ["triton/_pdl_jit.py"]
