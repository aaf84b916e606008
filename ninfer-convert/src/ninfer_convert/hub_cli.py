"""``ninfer pull ID`` (fetch and convert a Hugging Face model ahead of time) and ``ninfer list`` (what the
ninfer cache holds)."""

from __future__ import annotations

import argparse
import json
import sys


def add_hub_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pull", help="fetch a Hugging Face model and convert it into the ninfer cache, ahead of its first use",
        description="Fetch a Hugging Face model (org/name or org/name@revision) into the Hugging Face cache, "
                    "downloading only what conversion needs, and convert it once into the ninfer cache "
                    "(NINFER_CACHE_DIR). serve, generate, score, plan and inspect then take the same id. "
                    "Offline (HF_HUB_OFFLINE=1) it uses what the Hugging Face cache holds.")
    p.add_argument("models", nargs="+", metavar="ID", help="a Hugging Face model id, org/name[@revision]")
    p.set_defaults(func=run_pull)
    p = subparsers.add_parser("list", help="the Hugging Face models converted into the ninfer cache",
                              description="List the converted models in the ninfer cache (NINFER_CACHE_DIR): "
                                          "id, revision, commit, size and the artifact's path.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_list)


def run_pull(args: argparse.Namespace) -> int:
    from ninfer_convert.hub import ModelId
    from ninfer_convert.hub_cache import resolve

    try:
        models = [ModelId.parse(m) for m in args.models]
    except ValueError as exc:
        print(f"ninfer pull: {exc}", file=sys.stderr)
        return 2
    for model in models:
        try:
            entry = resolve(str(model))
        except ValueError as exc:
            print(f"ninfer pull: {exc}", file=sys.stderr)
            return 1
        print(f"{entry.id} (commit {entry.commit[:12]}): {entry.path}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from ninfer.core.sizes import format_bytes
    from ninfer_convert.hub_cache import cache_root, cached_models

    entries = cached_models()
    if args.json:
        print(json.dumps([e.to_json() for e in entries], indent=2))
        return 0
    if not entries:
        print(f"no converted models in {cache_root()} (ninfer pull ORG/NAME converts one)")
        return 0
    rows = [("ID", "REVISION", "COMMIT", "SIZE", "PATH")]
    rows += [(e.id, e.revision, e.commit[:12], format_bytes(e.bytes), e.path) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
    return 0
