"""``ninfer serve --constraint-*``: the constrained-decoding limits become the engine's ConstraintLimits (issue 42);
every ConstraintLimits field has its flag, shown with its default; a bad value is one clear line."""

import attrs
import pytest

import ninfer
import ninfer_serve.app
import ninfer_serve.server
from ninfer.cli import main
from ninfer.contract.constraint import LIMIT_FLAGS, ConstraintLimits


class StubEngine:
    """Stands in for ``ninfer.Engine``: records its config and starts nothing."""

    configs: list = []
    model_name = "stub"
    memory = None

    def __init__(self, model, *, config):
        StubEngine.configs.append(config)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def served(monkeypatch):
    """Runs ``ninfer serve`` through to the app without loading or serving: returns the engine's config."""
    monkeypatch.setattr(StubEngine, "configs", [])
    monkeypatch.setattr(ninfer, "Engine", StubEngine, raising=False)
    monkeypatch.setattr(ninfer_serve.app, "create_app", lambda engine, **kw: object())
    monkeypatch.setattr(ninfer_serve.server, "serve", lambda app, listener, options, drain=None: None)

    def run(*options: str):
        assert main(["serve", "--port", "0", "--no-warmup", *options]) == 0
        return StubEngine.configs[-1]
    return run


def test_every_limit_has_a_flag():
    assert set(LIMIT_FLAGS) == {f.name for f in attrs.fields(ConstraintLimits)}


def test_the_flags_become_the_engines_limits(served):
    assert served().constraint_limits == ConstraintLimits()
    limits = served("--constraint-schema-bytes", "1M", "--constraint-grammar-bytes", "2K", "--constraint-regex-bytes",
                    "300", "--constraint-choices", "10", "--constraint-choice-bytes", "4K", "--constraint-rules", "99",
                    "--constraint-compiled-bytes", "8M", "--constraint-compile-timeout", "2.5",
                    "--constraint-compile-memory", "2G", "--constraint-matcher-memory", "16M",
                    "--constraint-token-time", "0.2", "--constraint-workers", "1", "--constraint-queue", "0",
                    "--constraint-total-memory", "256M").constraint_limits
    assert limits == ConstraintLimits(
        max_schema_bytes=1 << 20, max_grammar_bytes=2048, max_regex_bytes=300, max_choices=10,
        max_choice_bytes=4096, max_grammar_rules=99, max_compiled_bytes=8 << 20, compile_timeout_s=2.5,
        compile_memory_bytes=2 << 30, matcher_memory_bytes=16 << 20, token_time_s=0.2, compile_workers=1,
        compile_queue=0, total_matcher_bytes=256 << 20)


def test_json_compact_sets_the_engines_default_json_whitespace(served):
    assert served().json_whitespace == "bounded"
    assert served("--json-compact").json_whitespace == "compact"


@pytest.mark.parametrize("options,words", [
    (["--constraint-regex-bytes", "0"], "expected a positive byte count"),
    (["--constraint-workers", "0"], "must be >= 1, got 0"),
    (["--constraint-queue", "-1"], "must be >= 0, got -1"),
    (["--constraint-compile-timeout", "0"], "must be > 0"),
])
def test_bad_values_are_refused_by_the_parser(served, capsys, options, words):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *options])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err and StubEngine.configs == []


def test_a_limit_the_config_refuses_is_one_line(served, capsys):
    assert main(["serve", "--port", "0", "--constraint-compile-memory", "1M"]) == 2
    assert "compile_memory_bytes must be an integer >= 67108864" in capsys.readouterr().err
    assert StubEngine.configs == []


def test_help_lists_the_limits_with_their_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in LIMIT_FLAGS.values():
        assert flag in out, flag
    for shown in ("--constraint-schema-bytes BYTES bytes of a JSON schema", "(default: 512K)", "(default: 30.0)",
                  "(default: 1G)"):
        assert shown in out, shown
