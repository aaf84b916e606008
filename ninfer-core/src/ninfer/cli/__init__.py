"""The ``ninfer`` command line. Plugins add subcommands through ``ninfer_add_commands``.

Each command is a module of this package (``generate``, ``chat``, ``score``, ``plan``, ``installation`` for
``plugins`` / ``archs`` / ``env``); the flags several commands share are the ``*_args`` modules, which
``ninfer serve`` uses too. Every module is light at import: torch loads only when a command runs.
"""

from __future__ import annotations

import argparse
import io
import os
import shlex
import sys
from collections.abc import Sequence

from ninfer import __version__
from ninfer._markers import hookimpl
from ninfer.cli.chat import add_chat_command
from ninfer.cli.generate import add_generate_command
from ninfer.cli.installation import add_installation_commands
from ninfer.cli.plan import add_plan_command
from ninfer.cli.score import add_score_command
from ninfer.cli.tiny_checkpoint import add_tiny_checkpoint_command
from ninfer.plugins import PluginError, PluginHost, default_host


class _CoreCommands:
    """Subcommands that belong to ninfer-core itself."""

    @hookimpl
    def ninfer_add_commands(self, subparsers: argparse._SubParsersAction) -> None:
        from ninfer.artifact.cli import add_inspect_command  # light: no torch until a command runs

        add_installation_commands(subparsers)
        add_score_command(subparsers)
        add_inspect_command(subparsers)
        add_generate_command(subparsers)
        add_chat_command(subparsers)
        add_plan_command(subparsers)


def build_parser(host: PluginHost) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description="Fast single-GPU inference for the Qwen3.5 family.")
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    core = _CoreCommands()
    core.ninfer_add_commands(subparsers)
    host.pm.hook.ninfer_add_commands(subparsers=subparsers)
    try:
        makers = {n: e.spec for n, e in host.architectures().items() if e.spec.tiny_checkpoint is not None}
    except PluginError:  # conflicting plugins: the commands that need the registry report it themselves
        makers = {}
    if makers:  # a core-only install has none: PLUGIN_COMMANDS then names the package that brings one
        add_tiny_checkpoint_command(subparsers, makers)
    parser.set_defaults(host=host, commands=tuple(subparsers.choices))
    return parser


# Commands the project's own plugins add, with the plugin (entry-point name) and the package that brings each:
# a core-only install answers them with what to install, not argparse's "invalid choice".
PLUGIN_COMMANDS = {"serve": ("serve", "ninfer-serve"), "convert": ("convert", "ninfer-convert"),
                   "pull": ("convert", "ninfer-convert"), "list": ("convert", "ninfer-convert"),
                   "tiny-checkpoint": ("qwen35", "ninfer-qwen35[test]")}


def _missing_plugin_command(argv: Sequence[str], parser: argparse.ArgumentParser, host: PluginHost) -> str | None:
    """Why the command ``argv`` names is absent, when it is one of PLUGIN_COMMANDS that no plugin added."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in PLUGIN_COMMANDS or command in parser.get_default("commands"):
        return None
    plugin, package = PLUGIN_COMMANDS[command]
    failure = next((f for f in host.failures if f.name == plugin), None)
    if failure is not None:
        return f"'{command}' comes with the {plugin} plugin, which failed to load: {failure.error}"
    return (f"'{command}' comes with {package.partition('[')[0]}, which is not installed: "
            f"pip install {shlex.quote(package)} (in a checkout: scripts/bootstrap installs every package)")


# What a shell reports for a tool stopped by SIGPIPE (128 + 13); Python ignores the signal, so we say it.
EXIT_BROKEN_PIPE = 141


def _discard_stdout() -> None:
    """Point stdout at the null device, so the interpreter's last flush of what is still buffered cannot
    fail a second time (with an "Exception ignored" message) after the reader has gone."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass  # stdout is not a file descriptor (replaced in-process): nothing will flush to the pipe
    finally:
        os.close(devnull)


def main(argv: Sequence[str] | None = None, host: PluginHost | None = None) -> int:
    try:
        host = host or default_host()
        parser = build_parser(host)
        missing = _missing_plugin_command(sys.argv[1:] if argv is None else argv, parser, host)
        if missing is not None:
            print(f"ninfer: {missing}", file=sys.stderr)
            return 2
        args = parser.parse_args(argv)
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's exit
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ninfer inspect x | head`: the reader has what it wanted; stop quietly
        _discard_stdout()
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
