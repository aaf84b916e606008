"""``ninfer convert``: Hugging Face checkpoint directory to a .ninfer v3 artifact."""

from __future__ import annotations

import argparse
import sys


def add_convert_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("convert", help="convert a Hugging Face checkpoint directory into a .ninfer file")
    p.add_argument("src", help="checkpoint directory (config.json, *.safetensors, tokenizer files)")
    p.add_argument("out", help="output .ninfer path (written atomically)")
    p.add_argument("--name", help="public model name (metadata.name; what ninfer serve calls the model); default: the "
                                         "checkpoint folder's name (a Hugging Face cache snapshot's: its org/name id)")
    p.add_argument("--quantize", choices=("fp8", "nvfp4"),
                   help="quantize a bf16 / fp32 checkpoint's linear weights: fp8 (e4m3, 128x128 block scales) or "
                        "nvfp4 (e2m1, e4m3 scales per 16 inputs, a global scale per shard); embeddings, lm_head, "
                        "routers, the GDN a/b and output projections, the vision tower and MTP fc stay as stored")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress line on stderr (default: when stderr is a terminal)")
    p.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    from ninfer.artifact.format import ArtifactError
    from ninfer_convert.convert import convert_checkpoint
    from ninfer_convert.source import ConversionError

    progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        summary = convert_checkpoint(args.src, args.out, name=args.name, host=getattr(args, "host", None),
                                     progress=progress, quantize=args.quantize)
    except (ConversionError, ArtifactError, OSError) as exc:
        print(f"ninfer convert: {exc}; nothing was written", file=sys.stderr)
        return 2
    print(summary.format())
    return 0
