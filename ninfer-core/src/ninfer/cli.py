"""The ``ninfer`` command line. Plugins add subcommands through ``ninfer_add_commands``."""

from __future__ import annotations

import argparse
import io
import json
import os
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


def _cmd_archs(args: argparse.Namespace) -> int:
    host: PluginHost = args.host
    try:
        archs = host.architectures()
    except PluginConflict as exc:
        print(f"ninfer: {exc}", file=sys.stderr)
        return 1
    rows = [{"name": n, "plugin": e.plugin, "handles": list(e.spec.handles), "provides": list(e.spec.provided()),
             "description": e.spec.description} for n, e in archs.items()]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no architectures registered (install an architecture plugin such as ninfer-qwen35)")
    else:
        for r in rows:
            print(f"{r['name']:<12} from plugin {r['plugin']:<10} handles {', '.join(r['handles'])}")
            print(f"{'':<12} provides: {', '.join(r['provides']) or 'nothing yet'}")
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
        p.set_defaults(func=_cmd_archs)
        p = subparsers.add_parser("env", help="the NINFER_* environment variables and their values now")
        p.add_argument("--markdown", action="store_true", help="the documentation table (docs/configuration.md)")
        p.set_defaults(func=_cmd_env)
        add_score_command(subparsers)
        from ninfer.artifact.cli import add_inspect_command  # light: no torch until a command runs

        add_inspect_command(subparsers)
        from ninfer.engine.generate_cli import add_generate_command  # light: no torch until it runs

        add_generate_command(subparsers)
        from ninfer.engine.plan_cli import add_plan_command  # light: no torch until it runs

        add_plan_command(subparsers)


def build_parser(host: PluginHost) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description="Fast single-GPU inference for the Qwen3.5 family.")
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    core = _CoreCommands()
    core.ninfer_add_commands(subparsers)
    host.pm.hook.ninfer_add_commands(subparsers=subparsers)
    parser.set_defaults(host=host)
    return parser


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
        args = build_parser(host).parse_args(argv)
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
