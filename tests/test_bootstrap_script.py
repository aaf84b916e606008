"""scripts/bootstrap says what it sets up, and keeps pip's noise down without hiding real messages.

It runs here on a copy of the script in a scratch checkout whose interpreter is a stand-in: ``python -m
venv`` makes a ``.venv/bin/python`` that logs its pip calls and prints what this machine's pip prints
(one "Location ... is ignored" warning per package, from a pip.conf naming local index folders), plus a
real warning; so no package is installed and the test takes well under a second."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = r"""#!/usr/bin/env bash
# Stand-in interpreter: "-m venv DIR" makes DIR/bin/python (this script); "-m pip ..." logs and talks.
here="$(cd "$(dirname "$0")" && pwd)"
if [ "$1 $2" = "-m venv" ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0
fi
echo "$*" >> "$here/pip-calls.log"
echo "Looking in indexes: https://pypi.org/simple, file:///opt/pypi/simple"
echo "Collecting attrs"
echo "  Downloading attrs-26.1.0-py3-none-any.whl (67 kB)"
echo "Processing /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
echo "Requirement already satisfied: pluggy in ./.venv/lib/python3.11/site-packages (1.7.0)"
echo "Installing collected packages: attrs, torch"
echo "Successfully installed attrs-26.1.0 torch-2.13.0+cpu"
echo "WARNING: Location 'file:///opt/pypi/simple/attrs/' is ignored: it is neither a file nor a directory." >&2
echo "WARNING: Location 'file:///opt/pypi/simple/torch/' is ignored: it is neither a file nor a directory." >&2
echo "WARNING: a real warning from pip" >&2
[ -z "${FAKE_PIP_FAIL:-}" ] || { echo "ERROR: No matching distribution found for torch" >&2; exit 1; }
"""


@pytest.fixture
def checkout(tmp_path):
    """A scratch checkout with the real script and the files its stamp hashes."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap", tmp_path / "scripts" / "bootstrap")
    for rel in ("requirements/dev.txt", "ninfer-core/pyproject.toml", "tests/example_plugin/pyproject.toml",
                "examples/ninfer-qwen3/pyproject.toml"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return tmp_path


def bootstrap(checkout: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(checkout / "scripts" / "bootstrap")], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHON": str(checkout / "fake-python"), **env})


def test_first_run_says_what_it_sets_up_and_hides_only_the_location_warnings(checkout):
    run = bootstrap(checkout)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert lines[0] == "ninfer: setting up .venv (first run: a few minutes) ..."
    assert lines[-1].startswith("ninfer: .venv ready (") and lines[-1].endswith(" s)")
    assert "Location" not in run.stderr
    assert lines.count("WARNING: a real warning from pip") == 2  # one per pip call: real messages stay
    assert run.stdout == ""
    calls = (checkout / ".venv" / "bin" / "pip-calls.log").read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith("-m pip install --progress-bar off ") for c in calls)


def test_each_step_shows_pips_progress_a_line_per_package(checkout):
    lines = bootstrap(checkout).stderr.splitlines()
    step1 = lines.index("ninfer: [1/2] pip, setuptools and wheel")
    step2 = next(i for i, line in enumerate(lines) if line.startswith("ninfer: [2/2] the ninfer packages"))
    progress = ["  fetching attrs", "  fetching torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
                "  installing 2 package(s) ...", "  installed 2 package(s)"]
    for start in (step1, step2):
        assert lines[start + 1:start + 5] == progress  # pip's own lines ("Looking in", "already satisfied") left out

    again = bootstrap(checkout)  # current: silent, no pip
    assert again.returncode == 0 and again.stderr == "" and again.stdout == ""
    assert len((checkout / ".venv" / "bin" / "pip-calls.log").read_text().splitlines()) == 2


def test_a_refresh_and_an_unfinished_setup_say_so(checkout):
    assert bootstrap(checkout).returncode == 0
    (checkout / "requirements" / "dev.txt").write_text("attrs\n")  # requirements changed
    run = bootstrap(checkout)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines()[0] == "ninfer: refreshing .venv (requirements or package metadata changed) ..."
    assert run.stderr.splitlines()[-1].startswith("ninfer: .venv refreshed (")
    (checkout / ".venv" / ".ninfer-bootstrap").unlink()  # an earlier run was interrupted
    run = bootstrap(checkout)
    assert run.stderr.splitlines()[0] == "ninfer: finishing .venv (an earlier setup did not complete) ..."


def test_a_pip_failure_is_shown_in_full_and_leaves_no_stamp(checkout):
    run = bootstrap(checkout, FAKE_PIP_FAIL="1")
    assert run.returncode != 0
    assert "ERROR: No matching distribution found for torch" in run.stderr
    assert "WARNING: a real warning from pip" in run.stderr and "Location" not in run.stderr
    assert "failed (exit 1); .venv is not ready" in run.stderr
    assert not (checkout / ".venv" / ".ninfer-bootstrap").exists()  # the next run tries again
