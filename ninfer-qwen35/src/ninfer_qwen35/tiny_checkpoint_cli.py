"""``ninfer tiny-checkpoint OUT_DIR``: a tiny random Qwen3.5 checkpoint in Hugging Face format, offline.

For trying ``convert``, ``generate`` and ``serve`` without downloading a model, and for tests: random
weights (the output is noise), a small byte-level BPE tokenizer with the Qwen3.5 added tokens, the Qwen3.5
chat template and a generation config. The maker is ``ninfer_qwen35.testing.checkpoints.make_tiny_checkpoint``,
which builds the model with transformers' own Qwen3.5 classes (so transformers must be installed).
Imports stay inside the handler so ``ninfer --help`` does not load torch.
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


def add_tiny_checkpoint_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tiny-checkpoint", help="write a tiny random Qwen3.5 checkpoint (Hugging Face format), no download",
        description="Write a tiny Qwen3.5 checkpoint with random weights into a new directory: config.json, "
                    "model.safetensors (or shards), tokenizer.json, tokenizer_config.json (with the chat "
                    "template) and generation_config.json, as published checkpoints hold them. Its output is "
                    "noise; it is for trying the tools offline (ninfer convert OUT_DIR OUT_DIR.ninfer) and "
                    "for tests. Needs transformers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", metavar="OUT_DIR", help="directory to create (absent or empty)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (same seed, same checkpoint)")
    p.add_argument("--layers", type=_at_least_one_attention_layer, default=4,
                   help="decoder layers, at least 4: every 4th is gated attention, the others Gated DeltaNet")
    p.add_argument("--layout", choices=("text", "vl"), default="text",
                   help="text: Qwen3_5ForCausalLM; vl: Qwen3_5ForConditionalGeneration with a tiny vision "
                        "tower and sharded weights")
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=True,
                   help="include a multi-token-prediction layer (mtp.*), as published checkpoints do")
    p.add_argument("--moe", action="store_true",
                   help="a Qwen3.5 MoE checkpoint (Qwen3_5MoeForCausalLM: every MLP 8 routed experts, top-2, and "
                        "a shared expert; the experts as the published fused banks)")
    p.set_defaults(func=run_tiny_checkpoint)


def _at_least_one_attention_layer(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 4:  # layer 4 is the first gated-attention layer, and the Program needs its KV pool
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
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        return _fail(f"{out} exists and is not an empty directory; nothing was written")
    if not out.parent.is_dir():
        return _fail(f"folder does not exist: {out.parent}")
    try:
        import transformers  # the maker builds the model with it: say so before any work

        from ninfer_qwen35.testing.checkpoints import make_tiny_checkpoint
    except ImportError as exc:
        return _fail(f"needs transformers to build the model ({exc}); install it with pip install 'transformers>=5'")
    transformers.utils.logging.disable_progress_bar()  # its "Writing model shards" bar is noise here
    # Written beside OUT_DIR and renamed into place: an interrupted run leaves no half checkpoint behind.
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        make_tiny_checkpoint(partial, layout=args.layout, mtp=args.mtp, seed=args.seed, moe=args.moe,
                             num_hidden_layers=args.layers)
        _readable_as_umask_allows(partial)
        if out.exists():
            out.rmdir()
        partial.rename(out)
    except OSError as exc:
        return _fail(f"{exc}; nothing was written")
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir())
    arch = ", ".join(json.loads((out / "config.json").read_text(encoding="utf-8"))["architectures"])
    print(f"wrote a tiny random Qwen3.5{' MoE' if args.moe else ''} checkpoint to {out} ({arch}, {args.layers} layers"
          f"{', MTP' if args.mtp else ''}, seed {args.seed}, {size / 1e6:.1f} MB)")
    # The hint names the CLI as the user runs it (scripts/ninfer in a checkout sets NINFER_COMMAND).
    print(f"next: {shlex.quote(env.get('NINFER_COMMAND'))} convert {shlex.quote(str(out))} "
          f"{shlex.quote(str(out.with_name(out.name + '.ninfer')))}")
    return 0
