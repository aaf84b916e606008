"""The command-line flags that set an engine option agree with the one declaration (``EngineConfig``): every such
flag of ``ninfer generate / chat / serve / score / plan`` names a declared field, every declared field is set by a
flag or is listed as an API-only option, and every other flag is listed as not an engine option. A new flag or
field fails here until it is placed."""

from __future__ import annotations

import argparse

import attrs
import pytest

from ninfer.contract import EngineConfig
from ninfer.contract.constraint import ConstraintLimits

COMMANDS = ("generate", "chat", "serve", "score", "plan")

# flag dest -> the EngineConfig field it sets ("features.x" / "constraint_limits.x": a field of that part)
ENGINE_FLAGS = {
    "device": "device", "dtype": "dtype", "max_model_len": "max_model_len", "context": "max_model_len",
    "max_concurrency": "max_concurrency", "max_queue": "max_queue", "prefill_chunk": "prefill_chunk",
    "no_verify": "verify", "chat_template": "chat_template", "special_tokens_in_content": "special_tokens_in_content",
    "no_context_cache": "context_cache", "checkpoint_grid": "checkpoint_grid", "checkpoint_slots": "checkpoint_slots",
    "cache_host_budget_mib": "cache_host_budget_bytes", "vram_budget": "device_budget_bytes",
    "placement": "placement", "expert_cache": "expert_cache_bytes", "page_size": "page_size",
    "num_pages": "num_pages", "vision": "features.vision", "speculative": "features.speculative",
    "num_draft_tokens": "features.num_draft_tokens", "media_max_pixels": "media_max_pixels",
    "media_max_tokens": "media_max_tokens", "json_compact": "json_whitespace",
    **{f"constraint_{f.name}": f"constraint_limits.{f.name}" for f in attrs.fields(ConstraintLimits)},
}

# Fields no flag sets: the Python API's (tests and embedders choose them; the CLI keeps their defaults).
API_ONLY = {"bypass_limit", "pause_mode", "host_budget_bytes", "cuda_graphs", "pdl"}

# Flags that are not engine options: the request (prompt, sampling, constraint), the output, the HTTP server.
OTHER_FLAGS = {
    # one request and its sampling
    "prompt", "prompt_file", "chat", "chat_file", "system", "image", "video", "video_fps", "no_think", "max_tokens",
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_id", "ignore_eos", "min_tokens",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "json_schema", "regex", "grammar",
    "choice", "show_thinking", "verbose", "json",
    # scoring
    "file", "tokens", "window", "stride",
    # planning for another machine (ninfer plan): the host memory to plan with instead of this one's
    "host_memory",
    # the HTTP server and its gateway
    "host", "port", "backlog", "api_key", "api_key_file", "allowed_hosts", "allowed_origins", "access_log",
    "body_timeout", "graceful_timeout", "keep_alive_timeout", "queue_timeout", "http_queue", "http_threads",
    "heavy_per_client", "heavy_queue", "heavy_running_per_client", "heavy_threads", "max_connections",
    "max_connections_per_client", "model_id", "no_warmup", "responses_max", "responses_max_bytes",
    "allow_remote_media", "media_allowed_hosts", "media_max_bytes", "media_max_frames", "media_max_items",
    "media_per_client", "media_queue", "media_root", "media_threads", "media_timeout",
}


def _declared() -> set[str]:
    """Every EngineConfig field, with the fields of its typed parts (features, constraint limits) as "part.x"."""
    names: set[str] = set()
    for f in attrs.fields(EngineConfig):
        part = f.default if attrs.has(type(f.default)) else None
        names |= {f"{f.name}.{g.name}" for g in attrs.fields(type(part))} if part is not None else {f.name}
    return names


def _command_flags() -> dict[str, set[str]]:
    from ninfer.cli import build_parser
    from ninfer.plugins import default_host

    parser = build_parser(default_host())
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {cmd: {a.dest for a in sub.choices[cmd]._actions if a.option_strings and a.dest != "help"}
            for cmd in COMMANDS if cmd in sub.choices}


@pytest.fixture(scope="module")
def flags() -> dict[str, set[str]]:
    found = _command_flags()
    assert {"generate", "chat", "score", "plan"} <= set(found)
    return found


def test_every_flag_is_placed(flags):
    for cmd, dests in flags.items():
        unplaced = dests - set(ENGINE_FLAGS) - OTHER_FLAGS
        assert not unplaced, f"ninfer {cmd}: map {sorted(unplaced)} to an EngineConfig field or list it as not one"
    assert not set(ENGINE_FLAGS) & OTHER_FLAGS


def test_every_engine_flag_names_a_declared_field():
    assert set(ENGINE_FLAGS.values()) <= _declared()


def test_every_declared_field_is_a_flag_or_api_only(flags):
    used = {ENGINE_FLAGS[d] for dests in flags.values() for d in dests if d in ENGINE_FLAGS}
    assert _declared() - used == API_ONLY
    assert set(ENGINE_FLAGS) <= set().union(*flags.values()), "a mapped flag no command has any more"


@pytest.mark.parametrize("argv,field,value", [
    (["--device", "cpu"], "device", "cpu"), (["--dtype", "float32"], "dtype", "float32"),
    (["--max-model-len", "99"], "max_model_len", 99), (["--prefill-chunk", "7"], "prefill_chunk", 7),
    (["--no-verify"], "verify", False), (["--special-tokens-in-content"], "special_tokens_in_content", True),
    (["--no-context-cache"], "context_cache", False), (["--checkpoint-grid", "32"], "checkpoint_grid", 32),
    (["--checkpoint-slots", "3"], "checkpoint_slots", 3),
    (["--cache-host-budget-mib", "2"], "cache_host_budget_bytes", 2 << 20),
    (["--vram-budget", "5"], "device_budget_bytes", 5 << 20), (["--placement", "host-experts"], "placement",
                                                                 "host-experts"),
    (["--expert-cache", "3"], "expert_cache_bytes", 3 << 20), (["--vision", "off"], "features.vision", False),
    (["--speculative", "mtp"], "features.speculative", "mtp"),
])
def test_generate_flags_set_the_field_the_table_names(argv, field, value):
    """What ``ninfer generate`` builds from each flag is the field ENGINE_FLAGS maps it to (and only that one)."""
    from ninfer.cli import build_parser
    from ninfer.cli.generate import engine_config_from_args
    from ninfer.plugins import default_host

    parser = build_parser(default_host())
    base = engine_config_from_args(parser.parse_args(["generate", "model.ninfer", "--prompt", "x"]))
    config = engine_config_from_args(parser.parse_args(["generate", "model.ninfer", "--prompt", "x", *argv]))
    dest = argv[0].lstrip("-").replace("-", "_")
    assert ENGINE_FLAGS[dest] == field

    def read(c: EngineConfig, name: str):
        part, _, sub = name.partition(".")
        return getattr(getattr(c, part), sub) if sub else getattr(c, part)

    assert read(config, field) == value
    changed = {n for n in _declared() if read(config, n) != read(base, n)}
    assert changed <= {field, "features.speculative", "features.vision"}, changed
