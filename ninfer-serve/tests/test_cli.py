"""``ninfer serve`` argument handling: every failure before serving is one clear line and exit code 2."""

import pytest

from ninfer.cli import main


@pytest.mark.parametrize("argv,words", [
    (["serve", "/no/such/model.ninfer"], "model file not found"),
    (["serve", "{bad}", "--max-queue", "0"], "--max-queue must be >= 1"),
    (["serve", "{bad}", "--queue-timeout", "0"], "--queue-timeout must be > 0"),
    (["serve", "{bad}", "--chat-template", "/no/such/template.jinja"], "cannot read --chat-template"),
    (["serve", "{bad}"], "cannot start the engine"),
])
def test_serve_fails_clearly(tmp_path, capsys, argv, words):
    bad = tmp_path / "bad.ninfer"
    bad.write_bytes(b"not an artifact")
    assert main([a.replace("{bad}", str(bad)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ninfer serve: ") and words in err


def test_serve_without_model_names_the_missing_default(capsys, monkeypatch):
    import ninfer_serve.cli as cli

    monkeypatch.setattr(cli, "default_model_path", lambda: None)
    assert main(["serve"]) == 2
    assert "no embedded default model" in capsys.readouterr().err


def test_concurrency_bounds():
    with pytest.raises(SystemExit):
        main(["serve", "x.ninfer", "--max-concurrency", "9"])
