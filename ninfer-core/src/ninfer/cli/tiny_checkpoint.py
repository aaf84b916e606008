"""``ninfer tiny-checkpoint OUT_DIR [--arch NAME]``: a tiny random checkpoint in Hugging Face format, offline.

For trying ``convert``, ``generate`` and ``serve`` without downloading a model, and for tests: random weights
(the output is noise), a small tokenizer, the chat template and a generation config. Each architecture that
offers one names its maker in ``ArchitectureSpec.tiny_checkpoint``; this command picks it by ``--arch`` and
owns what is common: the options, an all-or-nothing output folder and the summary. The makers build the model
with transformers' own classes, so transformers must be installed. Nothing heavy is imported before a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

from ninfer import env
from ninfer.plugins import ArchitectureSpec, load_target

DEFAULT_ARCH = "qwen35"


def add_tiny_checkpoint_command(subparsers: argparse._SubParsersAction, makers: dict[str, ArchitectureSpec]) -> None:
    """Add the command for the architectures in ``makers`` (name -> spec with a ``tiny_checkpoint`` maker)."""
    default = DEFAULT_ARCH if DEFAULT_ARCH in makers else sorted(makers)[0]
    p = subparsers.add_parser(
        "tiny-checkpoint", help="write a tiny random checkpoint (Hugging Face format), no download",
        description="Write a tiny checkpoint with random weights into a new directory: config.json, "
                    "model.safetensors (or shards), tokenizer.json, tokenizer_config.json (with the chat "
                    "template) and generation_config.json, as published checkpoints hold them. Its output is "
                    "noise; it is for trying the tools offline (ninfer convert OUT_DIR OUT_DIR.ninfer) and "
                    "for tests. Needs transformers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", metavar="OUT_DIR", help="directory to create (absent or empty)")
    p.add_argument("--arch", choices=sorted(makers), default=default, help="the architecture to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (same seed, same checkpoint)")
    p.add_argument("--layers", type=_at_least_one_attention_layer, default=4,
                   help="decoder layers, at least 4: every 4th is attention, the others Gated DeltaNet")
    p.add_argument("--vl", action="store_true",
                   help="the vision-language layout (...ForConditionalGeneration with a tiny vision tower and "
                        "sharded weights)")
    p.add_argument("--layout", choices=("text", "vl"), default="text", help="--layout vl is --vl")
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=True,
                   help="include a multi-token-prediction layer (mtp.*), as published checkpoints do")
    p.add_argument("--variant", metavar="NAME",
                   help="a named tiny configuration of the architecture (its maker lists them; default its own)")
    p.add_argument("--moe", action="store_true",
                   help="the architecture's mixture-of-experts variant where it offers one (--variant moe)")
    p.set_defaults(func=run_tiny_checkpoint, tiny_makers=makers)


def _at_least_one_attention_layer(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 4:  # layer 4 is the first attention layer of every tiny maker, and the Program needs its KV pool
        raise argparse.ArgumentTypeError(f"must be >= 4 (the 4th layer is the first attention layer), got {value}")
    return value


def _fail(message: str) -> int:
    print(f"ninfer tiny-checkpoint: {message}", file=sys.stderr)
    return 2


def _readable_as_umask_allows(directory: Path) -> None:
    """Give the files the mode a plain ``open`` would (safetensors writes its files owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~umask)


def run_tiny_checkpoint(args: argparse.Namespace) -> int:
    out = Path(args.out)
    spec: ArchitectureSpec = args.tiny_makers[args.arch]
    if args.moe and args.variant not in (None, "moe"):
        return _fail(f"--moe is --variant moe, not --variant {args.variant}")
    variant = "moe" if args.moe else args.variant
    vl = args.vl or args.layout == "vl"
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        return _fail(f"{out} exists and is not an empty directory; nothing was written")
    if not out.parent.is_dir():
        return _fail(f"folder does not exist: {out.parent}")
    try:
        maker = load_target(spec.tiny_checkpoint)
    except ImportError as exc:
        return _fail(f"the {args.arch} maker does not load ({exc})")
    # Written beside OUT_DIR and renamed into place: an interrupted or refused run leaves no half checkpoint.
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        maker(partial, seed=args.seed, layers=args.layers, vl=vl, mtp=args.mtp, variant=variant)
        _readable_as_umask_allows(partial)
        if out.exists():
            out.rmdir()
        partial.rename(out)
    except ImportError as exc:
        return _fail(f"needs transformers to build the model ({exc}); install it with pip install 'transformers>=5'")
    except ValueError as exc:
        return _fail(f"{args.arch}: {exc}; nothing was written")
    except OSError as exc:
        return _fail(f"{exc}; nothing was written")
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir())
    arch = ", ".join(json.loads((out / "config.json").read_text(encoding="utf-8"))["architectures"])
    kind = f"{args.arch}{f' {variant}' if variant else ''}"
    print(f"wrote a tiny random {kind} checkpoint to {out} ({arch}, {args.layers} layers"
          f"{', MTP' if args.mtp else ''}, seed {args.seed}, {size / 1e6:.1f} MB)")
    # The hint names the CLI as the user runs it (scripts/ninfer in a checkout sets NINFER_COMMAND).
    print(f"next: {shlex.quote(env.get('NINFER_COMMAND'))} convert {shlex.quote(str(out))} "
          f"{shlex.quote(str(out.with_name(out.name + '.ninfer')))}")
    return 0
