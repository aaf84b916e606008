"""``ninfer serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import sys
from importlib import resources


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a .ninfer model over an OpenAI-compatible HTTP API")
    p.add_argument("model", nargs="?", help="path to a .ninfer artifact (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-id", help="public model name (default: the artifact's metadata.name)")
    p.add_argument("--max-concurrency", type=int, default=4, choices=range(1, 9), metavar="1..8",
                   help="requests resident on the device at once")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for admission before new ones get 429 (default 64)")
    p.add_argument("--queue-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a request not admitted within this time gets 503 (default 60)")
    p.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--prefill-chunk", type=int, metavar="TOKENS",
                   help="prompt tokens per prefill unit (default: 2048 on a GPU, 512 on the CPU)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template replacing the artifact's")
    p.add_argument("--special-tokens-in-content", action="store_true",
                   help="read special-token strings in chat messages (e.g. <|im_end|>) as control tokens; by "
                        "default they are plain text, so a message cannot end its turn or open another")
    p.add_argument("--graceful-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long in-flight requests may run on after SIGTERM (default 30)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warmup requests before serving")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request to stderr")
    p.add_argument("--no-verify", action="store_true", help="load without checking the artifact's checksums")
    p.set_defaults(func=run_serve)


def default_model_path() -> str | None:
    """The embedded default model, when this installation carries one."""
    import ninfer

    helper = getattr(ninfer, "default_model_path", None)
    if helper is not None:
        path = helper()
        return None if path is None else os.fspath(path)
    candidate = resources.files("ninfer").joinpath("data/default.ninfer")
    return os.fspath(candidate) if candidate.is_file() else None


def _fail(message: str) -> int:
    print(f"ninfer serve: {message}", file=sys.stderr)
    return 2


def run_serve(args: argparse.Namespace) -> int:
    model = args.model or default_model_path()
    if model is None:
        return _fail("no model given and no embedded default model is available in this installation; "
                     "pass the path of a .ninfer artifact")
    if not os.path.exists(model):
        return _fail(f"model file not found: {model}")
    if args.max_queue < 1:
        return _fail(f"--max-queue must be >= 1, got {args.max_queue}")
    if not args.queue_timeout > 0:
        return _fail(f"--queue-timeout must be > 0, got {args.queue_timeout}")
    chat_template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        except OSError as exc:
            return _fail(f"cannot read --chat-template: {exc}")

    try:
        from ninfer import Engine
    except ImportError as exc:
        return _fail(f"the generation engine is not available: {exc}")
    from ninfer_serve.app import create_app
    from ninfer_serve.server import serve
    from ninfer_serve.warmup import WarmupFailed, warmup

    options = {"max_concurrency": args.max_concurrency, "max_queue": args.max_queue, "verify": not args.no_verify}
    if args.max_model_len is not None:
        options["max_model_len"] = args.max_model_len
    if args.device is not None:
        options["device"] = args.device
    if args.prefill_chunk is not None:
        options["prefill_chunk"] = args.prefill_chunk
    if chat_template is not None:
        options["chat_template"] = chat_template
    if args.special_tokens_in_content:
        options["special_tokens_in_content"] = True
    try:
        engine = Engine(model, **options)
    except Exception as exc:  # a bad artifact or device must read as a message, not a traceback
        return _fail(f"cannot start the engine for {model}: {type(exc).__name__}: {exc}")
    with engine:
        if not args.no_warmup:
            try:
                seconds = warmup(engine, concurrency=args.max_concurrency)
            except WarmupFailed as exc:
                return _fail(str(exc))
            print(f"ninfer serve: warmup done in {seconds:.2f} s", file=sys.stderr)
        app = create_app(engine, model_id=args.model_id, queue_timeout_s=args.queue_timeout)
        print(f"ninfer serve: serving {args.model_id or engine.model_name} on http://{args.host}:{args.port}",
              file=sys.stderr, flush=True)
        try:
            serve(app, args.host, args.port, graceful_timeout_s=args.graceful_timeout, access_log=args.access_log)
        except OSError as exc:  # address in use, permission denied
            return _fail(f"cannot listen on {args.host}:{args.port}: {exc}")
    return 0
