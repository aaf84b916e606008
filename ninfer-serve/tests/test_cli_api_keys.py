"""``ninfer serve`` API keys: ``--api-key`` repeatable, ``--api-key-file`` (one key a line, blank lines and
'#' comment lines skipped, a repeated key once), ``NINFER_API_KEY`` when neither is given; bad input is one
clear line before the address is bound, and never shows a key."""

import pytest

import ninfer
import ninfer_serve.app
import ninfer_serve.server
from ninfer.cli import main


class StubEngine:
    model_name = "stub"
    memory = None

    def __init__(self, model, *, config):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def apps(monkeypatch):
    """Nothing loads or serves: the create_app keywords of each run are recorded."""
    monkeypatch.delenv("NINFER_API_KEY", raising=False)
    monkeypatch.setattr(ninfer, "Engine", StubEngine, raising=False)
    made: list[dict] = []
    monkeypatch.setattr(ninfer_serve.app, "create_app", lambda engine, **kw: made.append(kw) or object())
    monkeypatch.setattr(ninfer_serve.server, "serve", lambda app, listener, options, drain=None: None)
    return made


@pytest.fixture
def served(apps):
    """Runs ``ninfer serve`` through to the app: returns create_app's api_key."""
    def run(*options: str):
        assert main(["serve", "--port", "0", "--no-warmup", *options]) == 0
        return apps[-1]["api_key"]
    return run


def test_keys_from_flags_a_file_and_the_environment(served, tmp_path, monkeypatch):
    keys = tmp_path / "keys.txt"
    keys.write_text("# tenants\nsk-a\n\n   sk-b  \n#sk-commented\nsk-a\nsk c with spaces\n", encoding="utf-8")
    assert served() is None  # no key: the API is open
    assert served("--api-key", "one") == ("one",)
    assert served("--api-key", "one", "--api-key", "two", "--api-key", "one") == ("one", "two")
    assert served("--api-key-file", str(keys)) == ("sk-a", "sk-b", "sk c with spaces")
    assert served("--api-key", "sk-b", "--api-key-file", str(keys)) == ("sk-b", "sk-a", "sk c with spaces")
    monkeypatch.setenv("NINFER_API_KEY", "from-env")
    assert served() == ("from-env",)
    assert served("--api-key", "flag") == ("flag",)  # the flags win over the environment
    monkeypatch.setenv("NINFER_API_KEY", "")
    assert served() is None


@pytest.mark.parametrize("content,words", [
    (None, "cannot read --api-key-file"), ("", "holds no key"), ("\n  \n# only a comment\n", "holds no key"),
    (b"\xff\xfe-not-utf8", "is not UTF-8 text"),
])
def test_a_bad_key_file_is_one_line_before_binding(apps, tmp_path, capsys, content, words):
    path = tmp_path / "keys.txt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    assert main(["serve", "--port", "0", "--no-warmup", "--api-key-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ninfer serve: ") and words in err and err.count("\n") == 1
    assert apps == []


def test_an_empty_api_key_is_refused_not_an_open_api(apps, capsys):
    assert main(["serve", "--port", "0", "--no-warmup", "--api-key", "sk-secret", "--api-key", ""]) == 2
    err = capsys.readouterr().err
    assert "a key must not be empty" in err and "sk-secret" not in err and apps == []
