"""``ninfer serve`` argument handling: every failure before serving is one clear line and exit code 2,
the address is bound before any model work, and the embedded model needs no path."""

import socket

import pytest

import ninfer
from ninfer.cli import main


class EngineStub:
    """Stands in for ``ninfer.Engine``: records the model it was asked for, then fails like a bad artifact."""

    built: list[str] = []

    def __init__(self, model, **options):
        EngineStub.built.append(str(model))
        raise RuntimeError("stub engine: not loading anything")


@pytest.fixture
def stub_engine(monkeypatch):
    EngineStub.built = []
    monkeypatch.setattr(ninfer, "Engine", EngineStub, raising=False)
    return EngineStub


@pytest.mark.parametrize("argv,words", [
    (["serve", "/no/such/model.ninfer"], "model file not found"),
    (["serve", "{bad}", "--max-queue", "0"], "--max-queue must be >= 1"),
    (["serve", "{bad}", "--queue-timeout", "0"], "--queue-timeout must be > 0"),
    (["serve", "{bad}", "--http-queue", "-1"], "--http-queue must be >= 0"),
    (["serve", "{bad}", "--chat-template", "/no/such/template.jinja"], "cannot read --chat-template"),
    (["serve", "{bad}", "--port", "0"], "cannot start the engine"),
])
def test_serve_fails_clearly(tmp_path, capsys, argv, words):
    bad = tmp_path / "bad.ninfer"
    bad.write_bytes(b"not an artifact")
    # Port 0 always: the default port may be busy (another suite, a server running here), which is refused first.
    argv = [*argv, "--port", "0"] if "--port" not in argv else argv
    assert main([a.replace("{bad}", str(bad)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ninfer serve: ") and words in err and err.count("\n") == 1, err


def test_serve_without_model_names_the_missing_default(capsys, monkeypatch):
    monkeypatch.setattr(ninfer, "default_model_path", lambda *, host=None: None)
    assert main(["serve"]) == 2
    assert "no embedded default model" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve"], ["serve", "default"]])
def test_serve_takes_the_embedded_model_without_a_path(stub_engine, capsys, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file named "default" here
    assert main([*argv, "--port", "0"]) == 2
    assert stub_engine.built == [ninfer.default_model_path()]
    assert "stub engine" in capsys.readouterr().err


def test_busy_port_is_one_line_before_any_model_work(stub_engine, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"ninfer serve: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert stub_engine.built == []  # the model was never touched


def test_help_describes_the_command_and_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "OpenAI-compatible HTTP API" in out and "embedded model" in out
    for shown in ("--port PORT port to listen on (0: any free port) (default: 8000)",
                  "(default: 127.0.0.1)", "--max-queue MAX_QUEUE", "(default: 64)",
                  "--body-timeout SECONDS", "(default: 30.0)", "--max-connections N",
                  "log every HTTP request to stderr", "NINFER_API_KEY", "--allowed-hosts", "--allowed-origins"):
        assert shown in out, shown
    assert "(default: None)" not in out and "(default: False)" not in out


def test_concurrency_bounds():
    with pytest.raises(SystemExit):
        main(["serve", "x.ninfer", "--max-concurrency", "9"])
