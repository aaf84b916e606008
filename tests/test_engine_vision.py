"""Images and videos end to end on a real tiny Qwen3.5 VL artifact (a random transformers checkpoint through the
converter): ``ninfer.Engine`` prepares the chat (Frontend: decoding, placeholders, timestamps), the Program encodes
and places the media (MRoPE), and the greedy tokens equal transformers' ``Qwen3_5ForConditionalGeneration`` (fp32)
on the same token ids and pixels; the OpenAI gateway gives the same answer for data URLs and refuses bad media with
a 400; forced preemption (Snapshot and Replay) of concurrent image requests changes no token; everything is freed.
"""

from __future__ import annotations

import base64
import io

import pytest
import torch

from ninfer.contract import ChatInput, GenerationRequest, SamplingParams
from ninfer.contract.prompt import MediaItem
from ninfer.testing.scheduling import submit_together

pytest.importorskip("transformers")
pytest.importorskip("ninfer_qwen35")
from PIL import Image  # noqa: E402

from ninfer import Engine  # noqa: E402
from ninfer.contract import EngineConfig
from ninfer_qwen35.testing.checkpoints import convert_tiny, make_tiny_checkpoint  # noqa: E402
from ninfer_qwen35.testing.vision_prompts import hf_media_inputs, randomise  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)  # the tiny model may sample an end token


def png(seed: int, width: int, height: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def solid(value: int, width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (value, value, value)).save(buf, format="PNG")
    return buf.getvalue()


def chat(text: str, *images: bytes, video: tuple[bytes, ...] = ()) -> ChatInput:
    parts = [{"type": "image"} for _ in images] + ([{"type": "video"}] if video else [])
    media = [MediaItem(kind="image", data=d) for d in images]
    if video:
        media.append(MediaItem(kind="video", frames=video, fps=2.0))
    return ChatInput(messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], media=media)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny VL checkpoint with O(1) weights (transformers' init is near zero: the images would barely count)."""
    import transformers

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("vl") / "ckpt", layout="vl", sharded=False)
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    randomise(model, seed=5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    return convert_tiny(checkpoint, tmp_path_factory.mktemp("vl-art") / "tiny.ninfer")


def make_engine(artifact, **kw) -> Engine:
    opts = dict(device="cpu", dtype="float32", max_concurrency=2, max_model_len=512, page_size=8, num_pages=128,
                context_cache=False)
    return Engine(artifact, EngineConfig(**{**opts, **kw}))


@pytest.fixture(scope="module")
def engine(artifact):
    with make_engine(artifact) as e:
        yield e


@pytest.fixture(scope="module")
def hf(checkpoint):
    import transformers

    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


def hf_greedy(hf, engine, request_chat: ChatInput, steps: int) -> list[int]:
    """transformers' greedy tokens on the token ids and pixels our Frontend prepared."""
    prompt = engine.frontend.prepare(request_chat)
    ids, out = list(prompt.token_ids), []
    for _ in range(steps):
        extra = hf_media_inputs(prompt, hf.config.image_token_id, hf.config.video_token_id, extra=len(out))
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids]), **extra).logits
        out.append(int(logits[0, -1].argmax()))
        ids.append(out[-1])
    return out


def settled(engine) -> None:
    assert engine.usage().all_free
    assert engine.metrics().outstanding == 0
    assert engine.instance.program.vision.items_held == 0


CASES = {
    "one image": lambda: chat("What is this?", png(1, 64, 48)),
    "two images": lambda: chat("Compare them.", png(2, 32, 96), png(3, 80, 40)),
    "a video": lambda: chat("What happens?", video=(png(4, 48, 48), png(5, 48, 48), png(6, 48, 48),
                                                    png(7, 48, 48))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_match_transformers(engine, hf, case):
    assert engine.vision_enabled
    request_chat = CASES[case]()
    result = engine.generate(GenerationRequest(input=request_chat, sampling=SamplingParams(**GREEDY)), timeout=300)
    assert result.error is None
    assert list(result.token_ids) == hf_greedy(hf, engine, request_chat, GREEDY["max_tokens"])
    settled(engine)


def test_the_image_changes_the_answer(engine):
    def tokens(image: bytes) -> list[int]:
        req = GenerationRequest(input=chat("Describe.", image), sampling=SamplingParams(temperature=0.0, max_tokens=12,
                                                                                      ignore_eos=True))
        return list(engine.generate(req, timeout=300).token_ids)

    assert tokens(solid(0, 64, 64)) != tokens(solid(255, 64, 64))


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_the_gateway_answers_with_the_engines_tokens(engine):
    from starlette.testclient import TestClient

    from ninfer_serve.app import create_app

    image = png(1, 64, 48)
    want = engine.generate(GenerationRequest(input=chat("What is this?", image), sampling=SamplingParams(**GREEDY)),
                           timeout=300)
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": "What is this?"}]}],
        "max_tokens": GREEDY["max_tokens"], "temperature": 0.0, "logprobs": True, "ignore_eos": True}
    with TestClient(create_app(engine)) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == want.content
        # logprobs.content covers the content tokens, each with the text it added
        assert "".join(e["token"] for e in choice["logprobs"]["content"]) == want.content
        bad = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"nope").decode()}},
            {"type": "text", "text": "?"}]}], "max_tokens": 2}
        r = c.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_media", r.text
    settled(engine)


def test_the_choices_of_one_request_decode_its_image_once(engine, monkeypatch):
    from starlette.testclient import TestClient

    from ninfer_serve.app import create_app

    decoded = []
    preparer = engine.frontend._media
    original = preparer.prepare
    monkeypatch.setattr(preparer, "prepare", lambda media, *a, **k: decoded.append(len(media)) or original(media, *a, **k))
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(png(1, 64, 48))}}, {"type": "text", "text": "Hi."}]}],
        "max_tokens": 3, "temperature": 0.0, "n": 3, "ignore_eos": True}
    with TestClient(create_app(engine)) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    texts = [choice["message"]["content"] for choice in r.json()["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 1  # greedy choices are the same answer
    assert decoded == [1]
    settled(engine)


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_forced_preemption_of_image_requests_changes_no_token(artifact, engine, mode):
    """Three image requests (31-35 prompt tokens, 10 new) one at a time, then together on 10 pages of 8 positions
    with chunks of 8 tokens: the scheduler must pause residents (the images span several chunks), and each
    request still gives its solo tokens."""
    work = [chat("Tell me more.", png(10 + i, 64 + 32 * i, 64)) for i in range(3)]
    reqs = [GenerationRequest(input=c, sampling=SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
            for c in work]
    alone = [list(engine.generate(r, timeout=300).token_ids) for r in reqs]
    with make_engine(artifact, max_concurrency=3, num_pages=10, max_model_len=80, prefill_chunk=8, pause_mode=mode,
                     host_budget_bytes=(1 << 26) if mode == "snapshot" else 0) as tight:
        handles = submit_together(tight, reqs)
        results = [h.result(timeout=300) for h in handles]
        m = tight.metrics()
        assert m.preemptions > 0
        assert (m.preemptions_snapshot if mode == "snapshot" else m.preemptions_replay) == m.preemptions
        assert [list(r.token_ids) for r in results] == alone
        settled(tight)


def test_media_with_mtp_is_refused_as_a_combination_not_supported(tmp_path):
    """The startup leaves the encoder out when MTP is on: the refusal names the combination, not a missing tower.
    (The module's artifact was re-saved by transformers, which drops the MTP head: this one keeps it.)"""
    from ninfer.contract.config import StartupFeatures
    from ninfer.engine.errors import VisionNotEnabled

    with_mtp = convert_tiny(make_tiny_checkpoint(tmp_path / "ckpt", layout="vl"), tmp_path / "mtp.ninfer")
    with make_engine(with_mtp, features=StartupFeatures(speculative="mtp")) as mtp:
        with pytest.raises(VisionNotEnabled, match="together with speculative decoding .* not supported") as err:
            mtp.submit(GenerationRequest(input=chat("What is this?", png(1, 64, 48))))
    assert "vision tower" not in str(err.value)


def test_plan_says_what_the_encoder_costs(artifact, capsys):
    """``ninfer plan --vision off`` plans without the encoder: fewer weight bytes and a smaller workspace."""
    import json

    from ninfer.cli import main

    reports = {}
    for setting in ("auto", "off"):
        assert main(["plan", str(artifact), "--device", "cpu", "--num-pages", "64", "--vision", setting,
                     "--json"]) == 0
        reports[setting] = json.loads(capsys.readouterr().out)
    on, off = reports["auto"], reports["off"]
    assert on["features"] == ["text", "vision"] and off["features"] == ["text"]
    assert on["categories"]["workspace"] > off["categories"]["workspace"]
    assert on["categories"]["weights"] > off["categories"]["weights"]


def test_serve_warmup_runs_an_image_through_the_encoder(engine, monkeypatch):
    from ninfer_serve.warmup import warmup

    vision = engine.instance.program.vision
    before = vision.encoded
    warmup(engine, concurrency=2)
    assert vision.encoded == before + 1  # the picture went through the encoder once
    settled(engine)
