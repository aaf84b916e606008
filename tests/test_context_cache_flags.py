"""The context cache's flags on ``ninfer serve`` and ``ninfer generate`` reach ``Engine``'s config (MiB become
bytes), bad values are refused by the parser naming the flag, and ``generate``'s stats line reports the prompt
tokens restored from the cache."""

from __future__ import annotations

import pytest

import ninfer
import ninfer.engine.engine
from ninfer.cli import main
from ninfer.cli.generate import _report
from ninfer.contract.events import FinishReason, GenerationResult, Timings, Usage

pytest.importorskip("ninfer_serve")

COMMANDS = [["serve", "--port", "0"], ["generate", "--chat", "hi"]]


class _Stop(RuntimeError):
    pass


@pytest.fixture
def engine_configs(monkeypatch):
    """Replaces Engine with one that records its config and stops the command."""
    seen = []

    def fake_engine(model, **options):
        seen.append(options["config"])
        raise _Stop("recorded")

    monkeypatch.setattr(ninfer, "Engine", fake_engine)
    monkeypatch.setattr(ninfer.engine.engine, "Engine", fake_engine)
    return seen


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_reach_the_engine_config(engine_configs, command, capsys):
    model = ninfer.default_model_path()
    main([command[0], model, *command[1:]])
    main([command[0], model, *command[1:], "--no-context-cache", "--checkpoint-grid", "256",
          "--checkpoint-slots", "0", "--cache-host-budget-mib", "64"])
    capsys.readouterr()
    default, given = engine_configs
    assert (default.context_cache, default.checkpoint_grid, default.checkpoint_slots,
            default.cache_host_budget_bytes) == (True, None, None, None)
    assert (given.context_cache, given.checkpoint_grid, given.checkpoint_slots,
            given.cache_host_budget_bytes) == (False, 256, 0, 64 << 20)
    assert given.max_concurrency == default.max_concurrency  # the other options are kept


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag,value,words", [("--checkpoint-grid", "0", "must be >= 1, got 0"),
                                              ("--checkpoint-slots", "-1", "must be >= 0, got -1"),
                                              ("--cache-host-budget-mib", "lots", "expected a whole number")])
def test_bad_values_are_refused_naming_the_flag(engine_configs, command, flag, value, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command[0], ninfer.default_model_path(), *command[1:], flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {words}" in err
    assert engine_configs == []


def _result(cached: int) -> GenerationResult:
    return GenerationResult(request_id="r", finish_reason=FinishReason.LENGTH,
                            usage=Usage(prompt_tokens=40, completion_tokens=8, cached_tokens=cached),
                            timings=Timings(time_to_first_token_s=0.01, end_to_end_s=0.1))


def test_generate_stats_show_cached_prompt_tokens_only_when_some_were_restored(capsys):
    assert _report(_result(32)) == 0
    line = capsys.readouterr().err
    assert "40 prompt + 8 generated tokens | 32 prompt tokens from the context cache" in line
    assert _report(_result(0)) == 0
    assert "context cache" not in capsys.readouterr().err


def test_help_lists_the_cache_flags(capsys):
    for command in ("serve", "generate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        for flag in ("--no-context-cache", "--checkpoint-grid N", "--checkpoint-slots N", "--cache-host-budget-mib N",
                     "NINFER_CACHE_HOST_BUDGET_MIB"):
            assert flag in out, (command, flag)
