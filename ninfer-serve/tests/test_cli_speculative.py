"""``ninfer serve --speculative mtp [--num-draft-tokens K]``: the options reach the engine's
``StartupFeatures`` (the same definition ``ninfer generate`` uses), and ``--num-draft-tokens`` alone is one
clear line before the address is bound or the model touched."""

import socket

import pytest

import ninfer
from ninfer.cli import main
from ninfer.contract.config import StartupFeatures


class RecordingEngine:
    """Stands in for ``ninfer.Engine``: records the config it was given, then fails like a bad artifact."""

    configs: list = []

    def __init__(self, model, *, config):
        RecordingEngine.configs.append(config)
        raise RuntimeError("stub engine: not loading anything")


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setattr(RecordingEngine, "configs", [])
    monkeypatch.setattr(ninfer, "Engine", RecordingEngine, raising=False)
    return RecordingEngine


@pytest.mark.parametrize("options,features", [
    ([], StartupFeatures()),
    (["--speculative", "mtp"], StartupFeatures(speculative="mtp", num_draft_tokens=2)),
    (["--speculative", "mtp", "--num-draft-tokens", "1"], StartupFeatures(speculative="mtp", num_draft_tokens=1)),
])
def test_the_options_become_the_engines_startup_features(recording, capsys, options, features):
    assert main(["serve", "--port", "0", *options]) == 2
    assert "stub engine" in capsys.readouterr().err
    (config,) = recording.configs
    assert config.features == features


def test_draft_tokens_without_speculative_is_one_line_before_binding(recording, capsys):
    with socket.socket() as busy:  # a busy port: the usage error comes first
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--num-draft-tokens", "3"]) == 2
    assert capsys.readouterr().err == "ninfer serve: --num-draft-tokens needs --speculative (e.g. --speculative mtp)\n"
    assert recording.configs == []


@pytest.mark.parametrize("options,words", [
    (["--speculative", "mtp", "--num-draft-tokens", "9"], "must be in 1..3, got 9"),
    (["--speculative", "eagle"], "invalid choice: 'eagle'"),
])
def test_bad_values_are_refused_by_the_parser(recording, capsys, options, words):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *options])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err and recording.configs == []


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--speculative {mtp}" in out and "--num-draft-tokens 1..3" in out and "(default 2)" in out
    assert "(default: None)" not in out
