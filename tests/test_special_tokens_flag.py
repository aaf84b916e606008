"""``--special-tokens-in-content`` on ``ninfer serve`` and ``ninfer generate`` reaches ``Engine``'s config;
without it the option keeps its default (plain text)."""

from __future__ import annotations

import pytest

import ninfer
import ninfer.engine.engine
from ninfer.cli import main

pytest.importorskip("ninfer_serve")


class _Stop(RuntimeError):
    pass


@pytest.fixture
def engine_options(monkeypatch):
    """Replaces Engine with one that records its options and stops the command."""
    seen = []

    def fake_engine(model, **options):
        seen.append(options)
        raise _Stop("recorded")

    monkeypatch.setattr(ninfer, "Engine", fake_engine)
    monkeypatch.setattr(ninfer.engine.engine, "Engine", fake_engine)
    return seen


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["generate", "--chat", "hi"]])
def test_flag_reaches_the_engine(engine_options, command, capsys):
    model = ninfer.default_model_path()
    if model is None:
        pytest.fail("the embedded model is missing")
    main([command[0], model, *command[1:]])
    main([command[0], model, *command[1:], "--special-tokens-in-content"])
    capsys.readouterr()
    assert [o["config"].special_tokens_in_content for o in engine_options] == [False, True]
