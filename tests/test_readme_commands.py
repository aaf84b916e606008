"""Every command line in README.md's ```bash blocks runs as printed, on the CPU, one test per line.

A line runs in a working directory shared by its block, after the lines above it in the block (each once per
module, so a line run alone still finds the files they make). ``scripts/ninfer ARGS`` runs as
``python -m ninfer ARGS`` with this interpreter (the wrapper only adds the .venv set-up, which ``scripts/test`` has
done), ``generate`` with a small ``--max-tokens`` appended; ``serve`` starts on a free port, answers /health and
stops on SIGTERM; a line with a pipe or a redirection, or any other line, runs in bash (``scripts/ninfer``
meaning ``python -m ninfer``), with ``.venv/bin/`` meaning this interpreter's bin folder. A line
whose comment says it ``needs the network`` is skipped with that comment as the reason, and ``scripts/test`` (the
suite itself) is skipped. The Python blocks are run by tests/test_docs_examples.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NETWORK = "needs the network"
TIMEOUT_S = 240  # generous: each line takes seconds on a quiet 2-core machine
GENERATE_TOKENS = "16"
SHELL_OPERATORS = {"|", "&&", "||", ";", ">", "<"}  # such a line runs in bash as a whole  # enough to show a line works; the README's own counts are for people


@attrs.frozen
class Line:
    block: int
    number: int  # in README.md
    text: str

    @property
    def comment(self) -> str:
        """The text after an unquoted ``#`` that starts a word (as bash reads it)."""
        quote = None
        for i, ch in enumerate(self.text):
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (i == 0 or self.text[i - 1].isspace()):
                return self.text[i + 1:].strip()
        return ""

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text, comments=True)


def readme_lines() -> list[Line]:
    text = README.read_text(encoding="utf-8")
    found = []
    for block, m in enumerate(re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M)):
        first = text.count("\n", 0, m.start(1)) + 1
        for offset, line in enumerate(m.group(1).splitlines()):
            if line.strip() and not line.lstrip().startswith("#"):
                found.append(Line(block, first + offset, line))
    return found


LINES = readme_lines()


def skip_reason(line: Line) -> str | None:
    if NETWORK in line.comment:
        return line.comment
    if line.words[0] == "scripts/test":
        return "scripts/test is the suite this test is part of"
    return None


def env() -> dict[str, str]:
    # One thread: tiny models run fastest on it, and the suite runs a worker per core.
    return {**os.environ, "NINFER_COMMAND": "scripts/ninfer", "OMP_NUM_THREADS": "1"}


def run(line: Line, cwd: Path) -> None:
    words = line.words
    if words[0] != "scripts/ninfer" or SHELL_OPERATORS.intersection(words):
        bin_dir = shlex.quote(str(Path(sys.executable).parent)) + "/"
        text = line.text.replace(".venv/bin/", bin_dir).replace("scripts/ninfer ", f"{bin_dir}python -m ninfer ")
        proc = subprocess.run(["bash", "-c", text], cwd=cwd, env=env(), capture_output=True, text=True,
                              timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    elif words[1] == "serve":
        return serve(words[2:], cwd)
    else:
        extra = ["--max-tokens", GENERATE_TOKENS] if words[1] == "generate" else []
        proc = subprocess.run([sys.executable, "-m", "ninfer", *words[1:], *extra], cwd=cwd, env=env(),
                              capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"README.md:{line.number}: {line.text}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"


def serve(args: list[str], cwd: Path) -> None:
    """The server starts, is healthy, and stops cleanly on SIGTERM (on a free port: 8000 may be taken)."""
    pytest.importorskip("ninfer_serve")
    from ninfer_serve.testing import ServerProcess

    kept = [a for i, a in enumerate(args) if a != "--port" and (i == 0 or args[i - 1] != "--port")]
    model = kept.pop(0) if kept and not kept[0].startswith("-") else None
    before = Path.cwd()
    os.chdir(cwd)  # the server process starts here, as it would in the reader's shell
    try:
        server = ServerProcess(model, *kept, env=env(), startup_timeout_s=TIMEOUT_S)
        with server:
            pass
    finally:
        os.chdir(before)
    assert server.proc.returncode == 0, server.log()


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    """Per block: its working directory and the line numbers already run there."""
    made: dict[int, tuple[Path, set[int]]] = {}

    def workdir(block: int) -> tuple[Path, set[int]]:
        if block not in made:
            made[block] = (tmp_path_factory.mktemp(f"readme-block{block}"), set())
        return made[block]
    return workdir


def test_the_readme_has_runnable_command_blocks():
    runnable = [line for line in LINES if skip_reason(line) is None]
    assert len(runnable) >= 10 and any(line.words[1:2] == ["tiny-checkpoint"] for line in runnable)
    assert all(line.words[0] != "ninfer" for line in LINES), "a checkout runs scripts/ninfer"


def case_id(line: Line) -> str:
    words = line.words
    return f"README.md:{line.number}:{words[1] if words[0] == 'scripts/ninfer' else Path(words[0]).name}"


@pytest.mark.parametrize("line", [pytest.param(line, id=case_id(line)) for line in LINES])
def test_readme_line_runs(line, blocks):
    reason = skip_reason(line)
    if reason is not None:
        pytest.skip(reason)
    cwd, done = blocks(line.block)
    for earlier in LINES:  # what the lines above made (each runs once per module)
        if earlier.block == line.block and earlier.number < line.number and earlier.number not in done \
                and skip_reason(earlier) is None:
            run(earlier, cwd)
            done.add(earlier.number)
    run(line, cwd)
    done.add(line.number)
