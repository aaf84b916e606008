"""Images and videos into a model without the vision feature, end to end on the embedded (text-only) model:
the Engine refuses them with ``VisionNotEnabled`` before the Frontend sees them, the gateway answers 400
``vision_not_enabled`` before fetching anything, ``ninfer generate --image`` says so; ``--vision`` reaches the
startup, and the Engine checks that the startup kept it. Also how ``ninfer generate`` reads ``--image`` and
``--video`` into the chat message."""

from __future__ import annotations

import argparse
import types

import pytest
from starlette.testclient import TestClient

import ninfer
import ninfer.engine.engine
import ninfer.engine.startup
from ninfer.cli import main
from ninfer.cli.vision_args import add_media_arguments, media_from_args, user_content
from ninfer.contract import ChatInput, GenerationRequest, SamplingParams
from ninfer.contract.config import StartupFeatures
from ninfer.contract.model import ModelInstance
from ninfer.contract.prompt import MediaItem
from ninfer.engine.errors import VisionNotEnabled

pytest.importorskip("ninfer_qwen35")
pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PNG = b"\x89PNG\r\n\x1a\n" + bytes(64)
IMAGE_CHAT = ChatInput(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                       media=[MediaItem(kind="image", data=PNG)])


@pytest.fixture(scope="module")
def engine(embedded_model):
    with ninfer.Engine(embedded_model, ninfer.EngineConfig(device="cpu", max_concurrency=1,
                                                           max_model_len=128)) as e:
        yield e


def test_the_engine_refuses_media_without_vision(engine):
    assert engine.vision_enabled is False
    parts_only = ChatInput(messages=[{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "x"}]}])
    for chat in (IMAGE_CHAT, parts_only):
        with pytest.raises(VisionNotEnabled, match="vision feature.*the model does not provide it"):
            engine.submit(GenerationRequest(input=chat))
    metrics = engine.metrics()
    assert metrics.requests_rejected.get("vision_not_enabled") == 2 and metrics.outstanding == 0
    text = ChatInput(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    result = engine.generate(GenerationRequest(input=text, sampling=SamplingParams(max_tokens=2)), timeout=120)
    assert result.error is None


def test_vision_off_says_it_was_turned_off(embedded_model):
    with ninfer.Engine(embedded_model, ninfer.EngineConfig(device="cpu", max_concurrency=1, max_model_len=64,
                                                           features=StartupFeatures(vision=False))) as e:
        assert e.vision_enabled is False
        with pytest.raises(VisionNotEnabled, match="it was turned off"):
            e.submit(GenerationRequest(input=IMAGE_CHAT))


def test_vision_required_on_a_model_without_it_does_not_start(embedded_model):
    with pytest.raises(ValueError, match="(?i)vision"):
        ninfer.Engine(embedded_model, ninfer.EngineConfig(device="cpu", max_concurrency=1, max_model_len=64,
                                                          features=StartupFeatures(vision=True)))


@pytest.mark.parametrize("asked,bound,words", [
    (True, ("text",), "vision was required"),
    (False, ("text", "vision"), "vision was turned off"),
])
def test_the_engine_checks_that_the_startup_kept_the_vision_setting(monkeypatch, asked, bound, words):
    closed = []
    artifact = types.SimpleNamespace(close=lambda: closed.append(True))
    program = types.SimpleNamespace(max_concurrency=8, max_model_len=64)
    instance = ModelInstance(architecture="fake", config=None, model=None, parameters=None, frontend=None,
                             program=program, features=bound)
    monkeypatch.setattr(ninfer.engine.startup, "build_instance", lambda model, options, verify: (
        instance, "fake", artifact))
    with pytest.raises(ValueError, match=words):
        ninfer.Engine("unused", ninfer.EngineConfig(device="cpu", features=StartupFeatures(vision=asked)))
    assert closed == [True]  # the opened artifact is not left behind


def test_the_gateway_answers_vision_not_enabled(engine):
    from ninfer_serve.app import create_app

    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}], "max_tokens": 2}
    with TestClient(create_app(engine)) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "messages[0].content[1]: image and video input needs a model started with the vision "
                       "feature; this one was started without it",
            "type": "invalid_request_error", "param": "messages[0].content[1]", "code": "vision_not_enabled"}
        text = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert c.post("/v1/chat/completions", json=text).status_code == 200


# ---------------------------------------------------------------- ninfer generate


@pytest.fixture
def frames(tmp_path):
    paths = {}
    for name, data in (("a.png", PNG), ("b.jpg", b"\xff\xd8jpeg"), ("f1.png", b"f1"), ("f2.png", b"f2"),
                       ("g1.png", b"g1"), ("empty.png", b"")):
        (tmp_path / name).write_bytes(data)
        paths[name] = str(tmp_path / name)
    return paths


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_media_arguments(parser)
    return parser.parse_args(argv)


def test_images_then_videos_then_the_text(frames):
    args = parse("--image", frames["a.png"], "--video", frames["f1.png"], frames["f2.png"], "--image",
                 frames["b.jpg"], "--video", frames["g1.png"], "--video-fps", "2")
    media = media_from_args(args)
    assert media == (MediaItem(kind="image", data=PNG, mime_type="image/png"),
                     MediaItem(kind="image", data=b"\xff\xd8jpeg", mime_type="image/jpeg"),
                     MediaItem(kind="video", frames=(b"f1", b"f2"), fps=2.0),
                     MediaItem(kind="video", frames=(b"g1",), fps=2.0))
    assert user_content("what?", media) == [{"type": "image"}, {"type": "image"}, {"type": "video"},
                                            {"type": "video"}, {"type": "text", "text": "what?"}]
    assert user_content("what?", ()) == "what?"


def test_bad_media_arguments_name_the_option(frames, tmp_path):
    for argv, words in ((["--image", str(tmp_path / "none.png")], "--image: file not found"),
                        (["--image", frames["empty.png"]], "--image: " + frames["empty.png"] + " is empty"),
                        (["--video", frames["f1.png"], frames["empty.png"]], "--video: "),
                        (["--video-fps", "2"], "--video-fps needs --video")):
        with pytest.raises(ValueError, match=words):
            media_from_args(parse(*argv))
    for bad in ("0", "-1", "inf", "x"):
        with pytest.raises(SystemExit):
            parse("--video", frames["f1.png"], "--video-fps", bad)


@pytest.mark.parametrize("argv,words", [
    (["--prompt", "hi", "--image", "{a}"], "--image and --video go into a chat message: use --chat or --chat-file"),
    (["--chat", "hi", "--image", "{a}", "--vision", "off"], "which --vision off turns off"),
    (["--chat", "hi", "--image", "/no/such.png"], "--image: file not found"),
])
def test_generate_refuses_bad_media_use_before_loading(frames, capsys, monkeypatch, argv, words):
    monkeypatch.setattr(ninfer.engine.engine, "Engine", None)  # loading would fail loudly
    assert main(["generate", *(a.replace("{a}", frames["a.png"]) for a in argv)]) == 2
    assert words in capsys.readouterr().err


@pytest.fixture(scope="module")
def vision_artifact(tmp_path_factory) -> str:
    """A tiny artifact with a vision tower: generate reads its header before sending media."""
    from ninfer_qwen35.testing.checkpoints import convert_tiny, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("vl-cli")
    return str(convert_tiny(make_tiny_checkpoint(root / "ckpt", layout="vl", sharded=False, mtp=False),
                            root / "vl.ninfer"))


def test_generate_sends_the_media_in_the_user_message(vision_artifact, frames, capsys, monkeypatch):
    sent = []

    class StubEngine:
        memory = None
        max_model_len = 4096

        def __init__(self, model, *, config):
            sent.append(config.features)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def submit(self, request, cancel=None):
            sent.append(request.input)
            raise VisionNotEnabled("stub: no vision here")

    monkeypatch.setattr(ninfer.engine.engine, "Engine", StubEngine)
    assert main(["generate", vision_artifact, "--chat", "compare", "--system", "brief", "--image", frames["a.png"],
                 "--video", frames["f1.png"], frames["f2.png"], "--vision", "on"]) == 1
    assert "ninfer generate: stub: no vision here" in capsys.readouterr().err
    features, chat = sent
    assert features.vision is True
    assert chat.messages == ({"role": "system", "content": "brief"},
                             {"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                                          {"type": "text", "text": "compare"}]})
    assert [m.kind for m in chat.media] == ["image", "video"] and chat.media[1].frames == (b"f1", b"f2")


def test_generate_with_an_image_on_a_text_only_model(embedded_model, frames, capsys):
    assert main(["generate", embedded_model, "--chat", "what is this?", "--image", frames["a.png"], "--device", "cpu",
                 "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err  # found in the artifact's header, before the weights load
    assert "is a text-only model (its artifact has no vision tower)" in err and "memory:" not in err
    assert main(["generate", embedded_model, "--chat", "hi", "--vision", "on", "--device", "cpu", "--max-tokens", "2"]) == 2
    assert "vision" in capsys.readouterr().err.lower()
