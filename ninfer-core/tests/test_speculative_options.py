"""Selecting speculative decoding: ``ninfer.EngineConfig(features=StartupFeatures(speculative="mtp"))`` hands
the feature to the model's Startup; ``ninfer generate --speculative mtp [--num-draft-tokens K]`` maps onto it,
a bad combination is a usage error before any model work, and the stats line reports the drafts' acceptance
when drafts were verified. No model runs here: the Startup and the CLI's engine are stand-ins."""

from __future__ import annotations

import pytest

import ninfer
import ninfer.engine.engine
import ninfer.engine.startup
from ninfer.cli import main
from ninfer.contract.config import EngineConfig, StartupFeatures
from ninfer.contract.events import FinishReason, GenerationResult, OutputDelta, Timings, Usage
from ninfer.engine.metrics import MetricsRecorder


class StubEngine:
    """Records its config; answers one request with two tokens; its metrics hold the drafts in ``verified``."""

    configs: list = []
    verified: tuple[tuple[int, int], ...] = ()
    memory = None  # no start took memory: generate prints no memory block

    def __init__(self, model, *, config) -> None:
        StubEngine.configs.append(config)
        self.max_model_len = 64
        self.recorder = MetricsRecorder()
        for drafted, accepted in self.verified:
            self.recorder.drafts_verified(drafted, accepted)

    def __enter__(self) -> StubEngine:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def submit(self, request):
        return iter([OutputDelta(content="to be", token_ids=(1, 2)),
                     GenerationResult(request_id="r", finish_reason=FinishReason.LENGTH,
                                      usage=Usage(prompt_tokens=3, completion_tokens=2),
                                      timings=Timings(time_to_first_token_s=0.5, end_to_end_s=1.0))])

    def metrics(self):
        return self.recorder.snapshot(queue_depth=0, running=0, paused=0, outstanding=0, kv_pages_used=0,
                                      kv_pages_total=1, failed=False)


@pytest.fixture
def stub(monkeypatch):
    monkeypatch.setattr(StubEngine, "configs", [])
    monkeypatch.setattr(StubEngine, "verified", ())
    monkeypatch.setattr(ninfer.engine.engine, "Engine", StubEngine)
    return StubEngine


GENERATE = ["generate", "--prompt", "ROMEO:", "--max-tokens", "2", "--device", "cpu"]


@pytest.mark.parametrize("options,features", [
    ([], StartupFeatures()),
    (["--speculative", "mtp"], StartupFeatures(speculative="mtp", num_draft_tokens=2)),
    (["--speculative", "mtp", "--num-draft-tokens", "3"], StartupFeatures(speculative="mtp", num_draft_tokens=3)),
    (["--num-draft-tokens", "1", "--speculative", "mtp"], StartupFeatures(speculative="mtp", num_draft_tokens=1)),
])
def test_the_options_become_the_engines_startup_features(stub, capsys, options, features):
    assert main([*GENERATE, *options]) == 0, capsys.readouterr().err
    (config,) = stub.configs
    assert config.features == features


def test_draft_tokens_without_speculative_is_a_usage_error_before_loading(stub, capsys):
    assert main([*GENERATE, "--num-draft-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert err == "ninfer generate: --num-draft-tokens needs --speculative (e.g. --speculative mtp)\n"
    assert out == "" and stub.configs == []


@pytest.mark.parametrize("options,words", [
    (["--speculative", "mtp", "--num-draft-tokens", "4"], "must be in 1..3, got 4"),
    (["--speculative", "mtp", "--num-draft-tokens", "0"], "must be in 1..3, got 0"),
    (["--speculative", "mtp", "--num-draft-tokens", "two"], "expected a whole number, got 'two'"),
    (["--speculative", "dflash"], "invalid choice: 'dflash'"),
])
def test_bad_values_are_refused_by_the_parser(stub, capsys, options, words):
    with pytest.raises(SystemExit) as exc:
        main([*GENERATE, *options])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err and stub.configs == []


def test_the_stats_line_reports_acceptance_when_drafts_were_verified(stub, capsys):
    stub.verified = ((2, 2), (2, 1))  # 2 verify steps: 3 of 4 drafts accepted, 5 tokens in 2 steps
    assert main([*GENERATE, "--speculative", "mtp"]) == 0
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("finish: length | 3 prompt + 2 generated tokens")
    assert line.endswith(" | mean acceptance length 2.50 | draft acceptance rate 75.0%")


def test_the_stats_line_has_no_acceptance_without_drafts(stub, capsys):
    assert main(GENERATE) == 0
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("finish: length") and "acceptance" not in line


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--speculative {mtp}" in out and "--num-draft-tokens 1..3" in out and "(default 2)" in out


class _Built(Exception):
    """Raised by the recording Startup: the options were seen, nothing is built."""


@pytest.mark.parametrize("how", ["keyword", "config"])
def test_the_engine_hands_the_speculative_feature_to_the_startup(monkeypatch, how):
    seen = []

    def recording(model, options, **kw):
        seen.append(options)
        raise _Built
    monkeypatch.setattr(ninfer.engine.startup, "build_instance", recording)
    features = StartupFeatures(speculative="mtp", num_draft_tokens=3)
    with pytest.raises(_Built):
        if how == "keyword":
            ninfer.Engine(ninfer.default_model_path(), ninfer.EngineConfig(device="cpu", features=features))
        else:
            ninfer.Engine(ninfer.default_model_path(), config=EngineConfig(device="cpu", features=features))
    (options,) = seen
    assert options.features == features and options.features.draft_tokens == 3
