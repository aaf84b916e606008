"""The commands that describe this installation: ``ninfer plugins``, ``ninfer archs`` and ``ninfer env`` (the
``NINFER_*`` variables and the fast paths a CUDA start uses)."""

from __future__ import annotations

import argparse
import json
import sys

from ninfer.plugins import PluginConflict, PluginHost


def add_installation_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plugins", help="list loaded plugins and load failures")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_plugins)
    p = subparsers.add_parser("archs", help="list architectures and the plugin providing each")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all", action="store_true", help="also the example and test plugins' architectures")
    p.set_defaults(func=_cmd_archs)
    p = subparsers.add_parser("env", help="the NINFER_* environment variables and their values now, and the "
                                          "fast paths a CUDA start has (fla-core, Triton)")
    p.add_argument("--markdown", action="store_true", help="the documentation table (docs/configuration.md)")
    p.set_defaults(func=_cmd_env)


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
    from ninfer import env, fast_paths

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
    print("\nfast paths of a CUDA start (ninfer.fast_paths):")
    for path in fast_paths.FAST_PATHS:
        print(f"{path.name:<32} {fast_paths.status(path).text()}")
    return status
