"""``ninfer serve --vision {auto,on,off}`` and the media options: ``--vision`` becomes
``StartupFeatures.vision``, the ``--media-*`` options one ``MediaPolicy`` for the app, and bad values are one
clear line before the address is bound or the model touched."""

import socket

import pytest

import ninfer
import ninfer_serve.app
import ninfer_serve.server
from ninfer.cli import main
from ninfer_serve.media import MediaPolicy


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
    """Runs ``ninfer serve`` through to the app without loading or serving: returns the create_app keywords."""
    monkeypatch.setattr(StubEngine, "configs", [])
    monkeypatch.setattr(ninfer, "Engine", StubEngine, raising=False)
    apps: list[dict] = []
    monkeypatch.setattr(ninfer_serve.app, "create_app", lambda engine, **kw: apps.append(kw) or object())
    monkeypatch.setattr(ninfer_serve.server, "serve", lambda app, listener, options, drain=None: None)

    def run(*options: str) -> dict:
        assert main(["serve", "--port", "0", "--no-warmup", *options]) == 0
        return apps[-1]
    return run


@pytest.mark.parametrize("option,vision", [([], None), (["--vision", "auto"], None), (["--vision", "on"], True),
                                           (["--vision", "off"], False)])
def test_vision_becomes_the_startup_feature(served, option, vision):
    served(*option)
    (config,) = StubEngine.configs
    assert config.features.vision is vision


def test_media_options_become_the_apps_policy(served, tmp_path):
    assert served()["media"] == MediaPolicy()  # data: URLs only
    policy = served("--media-root", str(tmp_path), "--allow-remote-media", "--media-max-bytes", "3M",
                    "--media-timeout", "2.5", "--media-max-items", "5", "--media-max-frames", "7",
                    "--media-threads", "16", "--media-queue", "0",
                    "--media-allowed-hosts", "Pics.Example, *.cdn.example,[::1]")["media"]
    assert policy == MediaPolicy(root=str(tmp_path), allow_remote=True, max_bytes=3 << 20, timeout_s=2.5,
                                 max_items=5, max_frames=7, threads=16, queue=0,
                                 allowed_hosts=("pics.example", "*.cdn.example", "::1"))
    assert served("--media-max-bytes", "1000")["media"].max_bytes == 1000
    assert served("--media-max-bytes", "2k")["media"].max_bytes == 2048


def test_a_missing_media_root_is_one_line_before_binding(served, capsys, tmp_path):
    with socket.socket() as busy:  # a busy port: the usage error comes first
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--media-root", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err == f"ninfer serve: --media-root: {tmp_path / 'none'} is not a directory\n"
    assert StubEngine.configs == []


def test_the_pixel_bound_reaches_the_engine(served):
    served()
    served("--media-max-pixels", "1000000")
    default, given = StubEngine.configs
    assert default.media_max_pixels is None and given.media_max_pixels == 1_000_000


def test_the_request_media_token_bound_reaches_the_engine(served):
    served()
    served("--media-max-tokens", "4096")
    default, given = StubEngine.configs
    assert default.media_max_tokens is None and given.media_max_tokens == 4096


@pytest.mark.parametrize("options,words", [
    (["--vision", "maybe"], "invalid choice: 'maybe'"),
    (["--media-threads", "17"], "must be in 1..16, got 17"),
    (["--media-queue", "-1"], "must be >= 0, got -1"),
    (["--media-max-bytes", "20X"], "expected a positive byte count"),
    (["--media-max-bytes", "0"], "expected a positive byte count"),
    (["--media-timeout", "0"], "must be > 0"),
    (["--media-max-items", "0"], "must be >= 1"),
    (["--media-max-pixels", "0"], "must be >= 1"),
    (["--media-allowed-hosts", "a.*.example"], "argument --media-allowed-hosts: 'a.*.example' is not a host name"),
    (["--media-allowed-hosts", "*"], "'*' is not a host name"),
])
def test_bad_values_are_refused_by_the_parser(served, capsys, options, words):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *options])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err and StubEngine.configs == []


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in ("--vision {auto,on,off}", "--media-root DIR", "--allow-remote-media", "--media-max-bytes BYTES",
                  "(default: 20M)", "--media-timeout SECONDS", "--media-max-items N", "--media-max-frames N",
                  "--media-threads N", "--media-queue N", "--media-max-pixels N", "--media-allowed-hosts NAMES",
                  "public addresses only"):
        assert shown in out, shown
