"""The ``ninfer`` command line. Plugins add subcommands through ``ninfer_add_commands``."""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import sys
from collections.abc import Sequence

from ninfer import __version__
from ninfer._markers import hookimpl
from ninfer.engine.score_cli import add_score_command
from ninfer.plugins import PluginConflict, PluginHost, default_host


def _cmd_plugins(args: argparse.Namespace) -> int:
    host: PluginHost = args.host
    rows = [{"name": p.name, "module": p.module, "distribution": p.distribution, "version": p.version,
             "hooks": sorted(h.name for h in host.pm.get_hookcallers(host.pm.get_plugin(p.name)) or [])}
            for p in host.loaded]
    failures = [{"name": f.name, "target": f.target, "error": f.error} for f in host.failures]
    if args.json:
        print(json.dumps({"plugins": rows, "failures": failures}, indent=2))
    else:
        for r in rows:
            print(f"{r['name']:<12} {r['distribution'] or '-'} {r['version'] or ''}  ({r['module']})  "
                  f"hooks: {', '.join(r['hooks']) or '-'}")
        for f in failures:
            print(f"{f['name']:<12} FAILED to load {f['target']}: {f['error']}")
    return 1 if host.failures else 0


# The test and example plugins this repository ships: real architectures, but not what a user runs, so
# ``ninfer archs`` lists them only with --all.
EXAMPLE_DISTRIBUTIONS = frozenset({"ninfer-example-arch", "ninfer-qwen3"})


def _cmd_archs(args: argparse.Namespace) -> int:
    host: PluginHost = args.host
    try:
        archs = host.architectures()
    except PluginConflict as exc:
        print(f"ninfer: {exc}", file=sys.stderr)
        return 1
    examples = {p.name for p in host.loaded if p.distribution in EXAMPLE_DISTRIBUTIONS}
    rows = [{"name": n, "plugin": e.plugin, "handles": list(e.spec.handles), "provides": list(e.spec.provided()),
             "description": e.spec.description, "example": e.plugin in examples} for n, e in archs.items()]
    hidden = [] if args.all else [r["name"] for r in rows if r["example"]]
    rows = [r for r in rows if r["name"] not in hidden]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no architectures registered (install an architecture plugin such as ninfer-qwen35)")
    for r in rows:
        print(f"{r['name']:<12} from plugin {r['plugin']:<10} handles {', '.join(r['handles'])}"
              + ("  (example)" if r["example"] else ""))
        print(f"{'':<12} provides: {', '.join(r['provides']) or 'nothing yet'}")
    if hidden:
        print(f"({len(hidden)} example and test architecture(s) not shown: {', '.join(hidden)}; --all lists them)")
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    from ninfer import env

    if args.markdown:
        print(env.markdown_table(), end="")
        return 0
    status = 0
    for v in env.REGISTRY:
        try:
            value = v.shown()
        except env.EnvError as exc:
            value, status = f"error: {exc}", 1
        print(f"{v.name:<32} {value:<12} {v.meaning}")
    return status


class _CoreCommands:
    """Subcommands that belong to ninfer-core itself."""

    @hookimpl
    def ninfer_add_commands(self, subparsers: argparse._SubParsersAction) -> None:
        p = subparsers.add_parser("plugins", help="list loaded plugins and load failures")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=_cmd_plugins)
        p = subparsers.add_parser("archs", help="list architectures and the plugin providing each")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--all", action="store_true", help="also the example and test plugins' architectures")
        p.set_defaults(func=_cmd_archs)
        p = subparsers.add_parser("env", help="the NINFER_* environment variables and their values now")
        p.add_argument("--markdown", action="store_true", help="the documentation table (docs/configuration.md)")
        p.set_defaults(func=_cmd_env)
        add_score_command(subparsers)
        from ninfer.artifact.cli import add_inspect_command  # light: no torch until a command runs

        add_inspect_command(subparsers)
        from ninfer.engine.generate_cli import add_generate_command  # light: no torch until it runs

        add_generate_command(subparsers)
        from ninfer.engine.chat_cli import add_chat_command  # light: no torch until it runs

        add_chat_command(subparsers)
        from ninfer.engine.plan_cli import add_plan_command  # light: no torch until it runs

        add_plan_command(subparsers)


def build_parser(host: PluginHost) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description="Fast single-GPU inference for the Qwen3.5 family.")
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    core = _CoreCommands()
    core.ninfer_add_commands(subparsers)
    host.pm.hook.ninfer_add_commands(subparsers=subparsers)
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
