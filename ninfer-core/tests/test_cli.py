"""The ninfer CLI with core commands and plugin-contributed subcommands."""

import argparse
import json

from ninfer import hookimpl
from ninfer.cli import main
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
