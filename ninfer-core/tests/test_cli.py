"""The ninfer CLI with core commands and plugin-contributed subcommands."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from ninfer import hookimpl
from ninfer.cli import EXIT_BROKEN_PIPE, main
from ninfer.plugins import make_plugin_host


class _HelloCommand:
    @hookimpl
    def ninfer_add_commands(self, subparsers):
        p = subparsers.add_parser("hello", help="say hello")
        p.add_argument("--name", default="world")
        p.set_defaults(func=lambda args: print(f"hello {args.name}") or 0)


def test_plugin_contributes_a_subcommand(capsys):
    host = make_plugin_host(autoload=False)
    host.register_module(_HelloCommand(), "hello-plugin")
    assert main(["hello", "--name", "ninfer"], host=host) == 0
    assert capsys.readouterr().out.strip() == "hello ninfer"


def test_archs_and_plugins_json(capsys):
    host = make_plugin_host(autoload=False)
    assert main(["archs", "--json"], host=host) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["plugins", "--json"], host=host) == 0
    assert json.loads(capsys.readouterr().out) == {"plugins": [], "failures": []}


def test_unknown_command_exits_2(capsys):
    host = make_plugin_host(autoload=False)
    try:
        main(["no-such-command"], host=host)
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("argparse should exit")
    assert isinstance(argparse.ArgumentParser, type)


# -- a reader that leaves early (`ninfer inspect x | head`) ends the command quietly, as Unix tools do -------

def _closed_pipe() -> int:
    """The write end of a pipe whose reader is already gone: every write fails with EPIPE, deterministically."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


@pytest.mark.parametrize("command", [["archs"], ["inspect", "{model}", "--objects"]])
def test_closed_stdout_exits_quietly_in_a_real_process(command):
    from ninfer import default_model_path

    write_end = _closed_pipe()
    try:
        argv = [a.format(model=default_model_path()) for a in command]
        proc = subprocess.run([sys.executable, "-m", "ninfer", *argv], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.stderr == ""  # no traceback, no "Exception ignored" from the interpreter's last flush
    assert proc.returncode == EXIT_BROKEN_PIPE


@pytest.mark.parametrize("command", [
    ["generate", "--prompt", "ROMEO:", "--max-tokens", "3", "--device", "cpu"],
    ["score", "{model}", "To be, or not to be.", "--tokens", "--device", "cpu"]])
def test_commands_that_catch_os_errors_let_a_closed_stdout_through(command, monkeypatch, capsys):
    from ninfer import default_model_path

    write_end = _closed_pipe()
    with open(write_end, "w", encoding="utf-8", buffering=1) as out:  # line-buffered: the first line fails
        monkeypatch.setattr(sys, "stdout", out)
        assert main([a.format(model=default_model_path()) for a in command]) == EXIT_BROKEN_PIPE
        monkeypatch.undo()
    assert "Broken pipe" not in capsys.readouterr().err  # not reported as a failed command


def test_model_argument_names_the_embedded_model(tmp_path, monkeypatch):
    import ninfer

    assert "Engine" in dir(ninfer)
    embedded = ninfer.default_model_path()
    assert ninfer.resolve_model_path(None) == embedded
    assert ninfer.resolve_model_path("default") == embedded
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").write_bytes(b"x")  # a file of that name is taken as given
    assert ninfer.resolve_model_path("default") == "default"
    with pytest.raises(ValueError, match="model file not found: missing.ninfer"):
        ninfer.resolve_model_path("missing.ninfer")


def test_the_cli_lives_in_its_package_and_the_engine_does_not_import_it():
    """Commands and their flags are ``ninfer.cli``'s; the engine under them knows nothing of argparse."""
    import ast
    from pathlib import Path

    import ninfer.engine

    engine = Path(ninfer.engine.__file__).parent
    assert not [p.name for p in engine.rglob("*.py") if "cli" in p.name or p.name == "stream_printer.py"]
    for path in engine.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n == "ninfer.cli" or n.startswith("ninfer.cli.")], path


def test_the_parser_of_every_command_loads_no_torch():
    """``ninfer --help`` stays quick: the command modules import torch only when a command runs."""
    code = ("import sys; from ninfer.cli import build_parser; from ninfer.plugins import default_host; "
            "build_parser(default_host()); print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
