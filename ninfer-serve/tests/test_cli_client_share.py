"""``ninfer serve``'s per-client and heavy-preparation options reach the listener and the app, with their
documented defaults, and the server gets the same Drain as the app; bad values are refused by argparse."""

import pytest

import ninfer
import ninfer_serve.app
import ninfer_serve.listener
import ninfer_serve.server
from ninfer.cli import main


class StubEngine:
    """Stands in for ``ninfer.Engine``: starts nothing."""

    model_name = "stub"
    memory = None

    def __init__(self, model, *, config):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def served(monkeypatch):
    """Runs ``ninfer serve`` through to serving without loading or serving: returns (listener keywords,
    create_app keywords, serve's drain)."""
    monkeypatch.setattr(ninfer, "Engine", StubEngine, raising=False)
    seen: dict = {}
    real_bind = ninfer_serve.listener.bind_listener

    def bind(host, port, **kw):
        seen["listener"] = kw
        return real_bind(host, port, **kw)
    monkeypatch.setattr(ninfer_serve.listener, "bind_listener", bind)
    monkeypatch.setattr(ninfer_serve.app, "create_app", lambda engine, **kw: seen.update(app=kw) or object())
    monkeypatch.setattr(ninfer_serve.server, "serve",
                        lambda app, listener, options, drain=None: seen.update(drain=drain))

    def run(*options: str) -> dict:
        assert main(["serve", "--port", "0", "--no-warmup", *options]) == 0
        return seen
    return run


def test_defaults(served):
    seen = served()
    assert seen["listener"]["max_per_client"] == 128 and seen["listener"]["max_connections"] == 512
    app = seen["app"]
    assert (app["heavy_threads"], app["heavy_queue"], app["heavy_per_client"], app["heavy_running_per_client"],
            app["media_per_client"]) == (4, 64, 16, 1, 16)
    assert seen["drain"] is not None and app["drain"] is seen["drain"]


def test_options_reach_the_listener_and_the_app(served):
    seen = served("--max-connections-per-client", "7", "--heavy-threads", "3", "--heavy-queue", "0",
                  "--heavy-per-client", "2", "--heavy-running-per-client", "2", "--media-per-client", "5")
    assert seen["listener"]["max_per_client"] == 7
    app = seen["app"]
    assert (app["heavy_threads"], app["heavy_queue"], app["heavy_per_client"], app["heavy_running_per_client"],
            app["media_per_client"]) == (3, 0, 2, 2, 5)


@pytest.mark.parametrize("option", ["--max-connections-per-client", "--heavy-threads", "--heavy-per-client",
                                    "--heavy-running-per-client", "--media-per-client"])
def test_zero_is_refused(served, option, capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--port", "0", option, "0"])
    assert option in capsys.readouterr().err
