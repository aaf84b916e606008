"""``ninfer serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import gc
import os
import sys

import attrs

from ninfer import env
from ninfer.cli.cache_args import add_context_cache_arguments, with_context_cache
from ninfer.cli.memory_args import add_memory_arguments, with_memory_options
from ninfer.cli.model_args import add_dtype_argument
from ninfer.cli.number_args import positive_number, whole_number
from ninfer.cli.speculative_args import add_speculative_arguments, speculative_features
from ninfer.cli.vision_args import add_vision_argument, with_vision
from ninfer.contract.config import MAX_CONCURRENCY, StartupFeatures
from ninfer.contract.constraint import LIMIT_FLAGS, ConstraintLimits
from ninfer_serve.media_policy import MAX_MEDIA_THREADS, MIB, MediaPolicy, allowed_host_names
from ninfer_serve.preparation import HEAVY_THREADS
from ninfer_serve.responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES

API_KEY_ENV = "NINFER_API_KEY"
_MEDIA = attrs.fields(MediaPolicy)  # the defaults, written once

DESCRIPTION = """\
Serve one .ninfer model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
/v1/responses, /v1/models; /health, /metrics and /openapi.json). The address is bound first, then the model
loads and warms up, then requests are answered. Without MODEL (or with the name 'default') the embedded model is
served. See docs/serving.md."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _byte_size(text: str) -> int:
    """A byte count, with an optional binary suffix: 20M is 20 MiB (K, M, G)."""
    number, unit = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "")
    if unit not in _BYTE_UNITS or not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive byte count such as 20971520 or 20M, got {text!r}")
    return int(number) * _BYTE_UNITS[unit]


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a .ninfer model over an OpenAI-compatible HTTP API",
                              description=DESCRIPTION, formatter_class=_HelpFormatter)
    p.add_argument("model", nargs="?",
                   help="path to a .ninfer artifact, a Hugging Face id (org/name[@revision]: fetched and "
                        "converted once, see ninfer pull), or 'default' (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--model-id", help="public model name (default: the artifact's metadata.name, which is the "
                                      "Hugging Face id for a model named by one)")
    p.add_argument("--max-concurrency", type=int, default=4, choices=range(1, MAX_CONCURRENCY + 1),
                   metavar=f"1..{MAX_CONCURRENCY}",
                   help="requests resident on the device at once")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for admission before new ones get 429")
    p.add_argument("--queue-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a request not admitted within this time gets 503")
    p.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    add_dtype_argument(p)
    add_memory_arguments(p)
    p.add_argument("--prefill-chunk", type=int, metavar="TOKENS",
                   help="prompt tokens per prefill unit (default: 2048 on a GPU, 512 on the CPU)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template replacing the artifact's")
    p.add_argument("--special-tokens-in-content", action="store_true",
                   help="read special-token strings in chat messages (e.g. <|im_end|>) as control tokens; by "
                        "default they are plain text, so a message cannot end its turn or open another")
    p.add_argument("--graceful-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long in-flight requests may run on after SIGTERM")
    p.add_argument("--no-warmup", action="store_true", help="skip the warmup requests before serving")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request to stderr")
    p.add_argument("--no-verify", action="store_true", help="load without checking the artifact's checksums")
    add_context_cache_arguments(p)
    add_speculative_arguments(p)
    _add_media_arguments(p)
    _add_constraint_arguments(p)
    limits = p.add_argument_group("request preparation and slow or many clients")
    limits.add_argument("--http-threads", type=_positive_int, default=4, metavar="N",
                        help="threads that prepare plain requests for the engine (chat template, tokenization)")
    limits.add_argument("--http-queue", type=int, default=64, metavar="N",
                        help="requests waiting for a preparation thread before new ones get 429")
    limits.add_argument("--body-timeout", type=positive_number, default=30.0, metavar="SECONDS",
                        help="a request body not received within this time after its headers gets 408 and "
                             "the connection is closed")
    limits.add_argument("--keep-alive-timeout", type=positive_number, default=5.0, metavar="SECONDS",
                        help="a connection must send complete request headers within this time; also how "
                             "long an idle connection stays open between requests")
    limits.add_argument("--max-connections", type=_positive_int, default=512, metavar="N",
                        help="open connections; one more is answered 503 and closed")
    limits.add_argument("--backlog", type=_positive_int, default=128, metavar="N",
                        help="connections the kernel queues before the server accepts them")
    _add_client_share_arguments(p)
    _add_responses_arguments(p)
    access = p.add_argument_group("access")
    access.add_argument("--api-key", metavar="KEY", action="append",
                        help=f"require 'Authorization: Bearer KEY' on every /v1 route (/health, /metrics and "
                             f"/openapi.json stay open); repeat it for several keys, each then a tenant whose "
                             f"context-cache entries no other key's requests reach; without --api-key or "
                             f"--api-key-file, read from ${API_KEY_ENV}, which keeps the key out of the process "
                             "list")
    access.add_argument("--api-key-file", metavar="FILE",
                        help="accepted API keys, one per line (blank lines and '#' comment lines skipped; a key "
                             "listed twice counts once), read at startup; adds to --api-key")
    access.add_argument("--allowed-hosts", type=_names, metavar="NAMES",
                        help="comma-separated Host header names accepted ('*.example.com' and '*' allowed; "
                             "default: the loopback names when bound to loopback, otherwise any)")
    access.add_argument("--allowed-origins", type=_names, metavar="ORIGINS",
                        help="comma-separated browser origins allowed by CORS (default: none, CORS off)")
    p.set_defaults(func=run_serve)


def _add_responses_arguments(p: argparse.ArgumentParser) -> None:
    stored = p.add_argument_group("stored responses (/v1/responses, for previous_response_id)")
    stored.add_argument("--responses-max", type=whole_number(0), default=DEFAULT_MAX_RESPONSES, metavar="N",
                        help="finished responses kept, least recently used evicted first (0: none)")
    stored.add_argument("--responses-max-bytes", type=_byte_size, default=f"{DEFAULT_MAX_BYTES // MIB}M",
                        metavar="BYTES", help="bytes the kept responses' conversations may hold in all")


def _add_client_share_arguments(p: argparse.ArgumentParser) -> None:
    """Heavy preparation apart from plain requests, and what one client address may hold (docs/serving.md,
    "Slow and many clients")."""
    share = p.add_argument_group("heavy requests and per-client shares (a client is its peer IP address; behind "
                                 "a reverse proxy every client is the proxy's address)")
    share.add_argument("--max-connections-per-client", type=_positive_int, default=128, metavar="N",
                       help="open connections one client address may hold (at most --max-connections); one more "
                            "is answered 503 and closed")
    share.add_argument("--heavy-threads", type=_positive_int, default=HEAVY_THREADS, metavar="N",
                       help="threads that prepare requests with a constraint or media (they wait for grammar compile "
                            "workers and media decoding), apart from plain requests")
    share.add_argument("--heavy-queue", type=whole_number(0), default=64, metavar="N",
                       help="requests waiting for a heavy-preparation thread before new ones get 429")
    share.add_argument("--heavy-per-client", type=_positive_int, default=16, metavar="N",
                       help="requests one client address may have waiting for or in heavy preparation; one more "
                            "gets 429")
    share.add_argument("--heavy-running-per-client", type=_positive_int, default=1, metavar="N",
                       help="of those, how many are prepared at once (the others wait while a thread is free, which "
                            "keeps it for another client)")
    share.add_argument("--media-per-client", type=_positive_int, default=16, metavar="N",
                       help="requests one client address may have waiting for or fetching media; one more gets 429")


def _add_media_arguments(p: argparse.ArgumentParser) -> None:
    media = p.add_argument_group("images and videos (need a model with vision; data: URLs are always accepted)")
    add_vision_argument(media)
    media.add_argument("--media-root", metavar="DIR",
                       help="read local media (file:// URLs and paths) under DIR only; paths that lead out of it, "
                            "symbolic links included, are refused (default: no local files)")
    media.add_argument("--allow-remote-media", action="store_true",
                       help="fetch http(s) media URLs (default: refused) from public addresses only: loopback, "
                            "private, link-local and other non-public addresses are refused after resolving, "
                            "redirects included; the *_proxy environment is not used")
    media.add_argument("--media-allowed-hosts", type=_media_hosts, default=(), metavar="NAMES",
                       help="comma-separated hosts fetched from without the public-address check (exact names "
                            "or IP addresses, '*.example.com' for any name under it; default: none)")
    media.add_argument("--media-max-bytes", type=_byte_size, default=f"{_MEDIA.max_bytes.default // MIB}M",
                       metavar="BYTES",
                       help="bytes of one image, or of one video's frames together (K, M, G suffixes: 20M)")
    media.add_argument("--media-timeout", type=positive_number, default=_MEDIA.timeout_s.default, metavar="SECONDS",
                       help="time to fetch one http(s) media item, all of it (connects, redirects, body)")
    media.add_argument("--media-max-pixels", type=_positive_int, metavar="N",
                       help="pixels (width x height) of one image or video frame as decoded, read from its header "
                            "before decoding (default: twice the model's max_pixels, 33554432 for Qwen3.5)")
    media.add_argument("--media-max-tokens", type=_positive_int, metavar="N",
                       help="placeholder tokens of one request's images and videos together, counted from their "
                            "headers before decoding (default: 32768, 768 MiB of pixel rows for Qwen3.5)")
    media.add_argument("--media-max-items", type=_positive_int, default=_MEDIA.max_items.default, metavar="N",
                       help="images and videos in one request")
    media.add_argument("--media-max-frames", type=_positive_int, default=_MEDIA.max_frames.default, metavar="N",
                       help="frames of one video")
    media.add_argument("--media-threads", type=whole_number(1, MAX_MEDIA_THREADS), default=_MEDIA.threads.default,
                       metavar="N", help=f"threads that fetch media (1..{MAX_MEDIA_THREADS})")
    media.add_argument("--media-queue", type=whole_number(0), default=_MEDIA.queue.default, metavar="N",
                       help="requests waiting for a media thread before new ones get 429")


def _media_hosts(text: str) -> tuple[str, ...]:
    try:
        return allowed_host_names(_names(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _media_policy(args: argparse.Namespace) -> MediaPolicy:
    if args.media_root is not None and not os.path.isdir(args.media_root):
        raise ValueError(f"--media-root: {args.media_root} is not a directory")
    return MediaPolicy(root=args.media_root, allow_remote=args.allow_remote_media,
                       allowed_hosts=args.media_allowed_hosts, max_bytes=args.media_max_bytes,
                       timeout_s=args.media_timeout, max_items=args.media_max_items, max_frames=args.media_max_frames,
                       threads=args.media_threads, queue=args.media_queue)


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Every --api-key and the keys of --api-key-file, once each; without either, ${NINFER_API_KEY} (unset or
    empty: no key, the API is open). An empty --api-key is refused rather than opening the API."""
    from ninfer_serve.access import api_keys, read_api_key_file

    given = list(args.api_key or [])
    if "" in given:
        raise ValueError("--api-key: a key must not be empty")
    if args.api_key_file is not None:
        given += read_api_key_file(args.api_key_file)
    return api_keys(given) if given else api_keys(env.get(API_KEY_ENV))


# -- constrained decoding limits (ConstraintLimits; docs/serving.md, "Constrained decoding limits") ---------
_CONSTRAINT_HELP = {
    "max_schema_bytes": "bytes of a JSON schema (of the tools, for tool calls)",
    "max_grammar_bytes": "bytes of a GBNF or Lark grammar",
    "max_regex_bytes": "bytes of a regex",
    "max_choices": "options of a choice",
    "max_choice_bytes": "bytes of a choice's options together",
    "max_grammar_rules": "rules of the grammar a constraint makes (checked before it compiles)",
    "max_compiled_bytes": "bytes of one compiled grammar",
    "compile_timeout_s": "seconds a compile worker may take for one grammar (then it is killed)",
    "compile_memory_bytes": "address space one compile may add to its worker",
    "matcher_memory_bytes": "memory one request's grammar matcher may grow by (probed at compile, then checked)",
    "token_time_s": "CPU seconds of one matcher step (a token's mask or acceptance; probed, then checked)",
    "compile_workers": "compile worker processes",
    "compile_queue": "constraints waiting for a compile worker before new ones get 429",
    "total_matcher_bytes": "memory all live grammar matchers may hold before new constrained requests get 429",
}


def _add_constraint_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("constrained decoding limits (past one: 400 naming it; full workers or memory: 429)")
    defaults = ConstraintLimits()
    for name, flag in LIMIT_FLAGS.items():
        default = getattr(defaults, name)
        if name.endswith("_bytes"):
            kind, shown, metavar = _byte_size, _byte_text(default), "BYTES"
        elif name.endswith("_s"):
            kind, shown, metavar = positive_number, default, "SECONDS"
        else:
            kind, shown, metavar = whole_number(0 if name == "compile_queue" else 1), default, "N"
        # argparse passes a string default through ``type``: byte sizes show as 512K
        group.add_argument(flag, dest=f"constraint_{name}", type=kind, default=shown, metavar=metavar,
                           help=_CONSTRAINT_HELP[name])
    p.add_argument("--json-compact", action="store_true",
                   help="JSON output (response_format, structured_outputs, json_schema) has no whitespace outside "
                        "strings unless a request sets structured_outputs.disable_any_whitespace to false; by "
                        "default whitespace runs are bounded (docs/constrained-decoding.md)")


def _byte_text(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _constraint_limits(args: argparse.Namespace) -> ConstraintLimits:
    return ConstraintLimits(**{name: getattr(args, f"constraint_{name}") for name in LIMIT_FLAGS})


def _fail(message: str) -> int:
    print(f"ninfer serve: {message}", file=sys.stderr)
    return 2


def run_serve(args: argparse.Namespace) -> int:
    import ninfer

    try:
        model = ninfer.resolve_model_path(args.model)
    except ValueError as exc:
        return _fail(str(exc))
    if args.max_queue < 1:
        return _fail(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.http_queue < 0:
        return _fail(f"--http-queue must be >= 0, got {args.http_queue}")
    if not args.queue_timeout > 0:
        return _fail(f"--queue-timeout must be > 0, got {args.queue_timeout}")
    try:
        features = with_vision(speculative_features(args), args)
        media = _media_policy(args)
        keys = _api_keys(args)
        constraint_limits = _constraint_limits(args)
    except ValueError as exc:
        return _fail(str(exc))
    chat_template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        except OSError as exc:
            return _fail(f"cannot read --chat-template: {exc}")

    from ninfer_serve.access import default_allowed_hosts
    from ninfer_serve.listener import bind_listener

    # The address first: a busy port is one line before any model work, and nothing can take it later.
    try:
        listener = bind_listener(args.host, args.port, max_connections=args.max_connections, backlog=args.backlog,
                                 max_per_client=args.max_connections_per_client)
    except OSError as exc:  # address in use, permission denied, unknown host
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    with listener:
        return _load_and_serve(args, model, chat_template, features, listener, media, api_keys=keys,
                               allowed_hosts=args.allowed_hosts or list(default_allowed_hosts(args.host)),
                               constraint_limits=constraint_limits)


def _load_and_serve(args: argparse.Namespace, model: str, chat_template: str | None, features: StartupFeatures,
                    listener: object, media: MediaPolicy, *, api_keys: tuple[str, ...], allowed_hosts: list[str],
                    constraint_limits: ConstraintLimits) -> int:
    try:
        from ninfer import Engine, EngineConfig
    except ImportError as exc:
        return _fail(f"the generation engine is not available: {exc}")
    from ninfer.engine.memory_report import summary_text
    from ninfer_serve.app import create_app
    from ninfer_serve.drain import Drain
    from ninfer_serve.server import ServerOptions, gateway_logger, serve
    from ninfer_serve.warmup import WarmupFailed, warmup

    try:
        config = EngineConfig(max_concurrency=args.max_concurrency, max_queue=args.max_queue, dtype=args.dtype,
                              verify=not args.no_verify, max_model_len=args.max_model_len, device=args.device,
                              prefill_chunk=args.prefill_chunk, chat_template=chat_template,
                              special_tokens_in_content=args.special_tokens_in_content, features=features,
                              media_max_pixels=args.media_max_pixels, media_max_tokens=args.media_max_tokens,
                              constraint_limits=constraint_limits,
                              json_whitespace="compact" if args.json_compact else "bounded")
        engine = Engine(model, config=with_memory_options(with_context_cache(config, args), args))
    except Exception as exc:  # a bad artifact or device must read as a message, not a traceback
        return _fail(f"cannot start the engine for {model}: {type(exc).__name__}: {exc}")
    with engine:
        if engine.memory is not None:
            print(summary_text(engine.memory, prefix="ninfer serve: "), file=sys.stderr, flush=True)
        if not args.no_warmup:
            try:
                seconds = warmup(engine, concurrency=args.max_concurrency)
            except WarmupFailed as exc:
                return _fail(str(exc))
            print(f"ninfer serve: warmup done in {seconds:.2f} s", file=sys.stderr)
        drain = Drain()  # shared by the app (its requests watch it) and the server (which sets it)
        app = create_app(engine, model_id=args.model_id, queue_timeout_s=args.queue_timeout,
                         body_timeout_s=args.body_timeout, http_threads=args.http_threads,
                         http_queue=args.http_queue, heavy_threads=args.heavy_threads, heavy_queue=args.heavy_queue,
                         heavy_per_client=args.heavy_per_client,
                         heavy_running_per_client=args.heavy_running_per_client, media_per_client=args.media_per_client,
                         drain=drain, api_key=api_keys or None,
                         allowed_hosts=None if "*" in allowed_hosts else allowed_hosts,
                         allowed_origins=args.allowed_origins, media=media, responses_max=args.responses_max,
                         responses_max_bytes=args.responses_max_bytes)
        # What startup made lives as long as the server: the garbage collector no longer walks it, so a full
        # collection (which a large request body's allocations trigger) stops pausing every request for it.
        gc.freeze()
        host, port = listener.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"ninfer serve: serving {args.model_id or engine.model_name} on http://{shown}:{port}",
              file=sys.stderr, flush=True)
        gateway_logger()
        serve(app, listener, ServerOptions(graceful_timeout_s=args.graceful_timeout,
                                           keep_alive_timeout_s=args.keep_alive_timeout, backlog=args.backlog,
                                           access_log=args.access_log), drain=drain)
    return 0
