"""Images end to end on a real tiny Qwen4Exp VL artifact (``make_tiny_checkpoint(vl=True)``, the ``full`` variant:
QSA selecting, PLE, 4 streams; through the converter): ``ninfer.Engine`` prepares the chat (PNG decoding, the chat
template, placeholders), the Program encodes and places the image (MRoPE, the QSA block keys at their first
token's (t, h, w)), and the greedy tokens equal transformers' ``Qwen4ExpForConditionalGeneration.generate`` on
the token ids and pixels our Frontend prepared; forced preemption of concurrent image requests (Snapshot and
Replay) and the context cache change no token; everything is freed."""

from __future__ import annotations

import io

import pytest
import torch

from ninfer.contract import ChatInput, GenerationRequest, SamplingParams
from ninfer.contract.config import EngineConfig
from ninfer.contract.prompt import MediaItem
from ninfer.testing.scheduling import submit_together

pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from ninfer import Engine  # noqa: E402
from ninfer_qwen4exp.testing.checkpoints import convert_tiny, make_tiny_checkpoint  # noqa: E402
from ninfer_qwen35.testing.vision_prompts import hf_media_inputs  # noqa: E402

GREEDY = dict(temperature=0.0, max_tokens=10, ignore_eos=True)



def png(seed: int, width: int, height: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def chat(text: str, image: bytes) -> ChatInput:
    return ChatInput(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
                     media=[MediaItem(kind="image", data=image)])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q4vl") / "ckpt", vl=True, variant="full", mtp=False)


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    return convert_tiny(checkpoint, tmp_path_factory.mktemp("q4vl-art") / "tiny.ninfer")


def make_engine(artifact, **kw) -> Engine:
    opts = dict(device="cpu", dtype="float32", max_concurrency=2, max_model_len=512, page_size=8, num_pages=128,
                context_cache=False)
    return Engine(artifact, EngineConfig(**{**opts, **kw}))


def settled(engine) -> None:
    assert engine.usage().all_free
    assert engine.metrics().outstanding == 0
    assert engine.instance.program.vision.items_held == 0


def test_greedy_tokens_match_transformers_generate(artifact, checkpoint):
    import transformers

    request_chat = chat("What is this?", png(1, 256, 192))
    with make_engine(artifact) as engine:
        assert engine.vision_enabled
        result = engine.generate(GenerationRequest(input=request_chat, sampling=SamplingParams(**GREEDY)),
                                 timeout=300)
        assert result.error is None
        prompt = engine.frontend.prepare(request_chat)
        settled(engine)
    qsa = engine.instance.config.qsa
    assert len(prompt.token_ids) // qsa.compress_ratio > qsa.block_topk  # selection is active in the prompt
    hf = transformers.Qwen4ExpForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt.token_ids]), do_sample=False,
                          max_new_tokens=GREEDY["max_tokens"],
                          **hf_media_inputs(prompt, hf.config.image_token_id, hf.config.video_token_id))
    assert list(result.token_ids) == out[0, len(prompt.token_ids):].tolist()


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_forced_preemption_of_image_requests_changes_no_token(artifact, mode):
    """Three image requests one at a time, then together on 12 pages of 8 positions with chunks of 8 tokens: the
    scheduler must pause residents (the images span several chunks), and each request still gives its solo
    tokens."""
    work = [chat("Tell me more.", png(10 + i, 96 + 32 * i, 64)) for i in range(3)]
    reqs = [GenerationRequest(input=c, sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            for c in work]
    with make_engine(artifact) as engine:
        alone = [list(engine.generate(r, timeout=300).token_ids) for r in reqs]
    with make_engine(artifact, max_concurrency=3, num_pages=12, max_model_len=88, prefill_chunk=8, pause_mode=mode,
                     host_budget_bytes=(1 << 26) if mode == "snapshot" else 0) as tight:
        handles = submit_together(tight, reqs)
        results = [h.result(timeout=300) for h in handles]
        m = tight.metrics()
        assert m.preemptions > 0
        assert (m.preemptions_snapshot if mode == "snapshot" else m.preemptions_replay) == m.preemptions
        assert [list(r.token_ids) for r in results] == alone
        settled(tight)


def test_context_cache_on_equals_off(artifact):
    """An image chat, the same chat, and another question on the same image: restored from checkpoints (the
    state and the pages of the cached prefix, their keys and rotary positions) they give the uncached tokens."""
    image = png(5, 192, 128)
    requests = [GenerationRequest(input=chat(q, image), sampling=SamplingParams(**GREEDY))
                for q in ("What is this?", "What is this?", "Which colours are in it?")]
    with make_engine(artifact) as off:
        ref = [off.generate(r, timeout=300).token_ids for r in requests]
        settled(off)
    with make_engine(artifact, context_cache=True, checkpoint_grid=8) as on:
        got = [on.generate(r, timeout=300) for r in requests]
        assert [r.token_ids for r in got] == ref
        # the same chat restores all but its last token; the other question a checkpoint inside the image
        assert got[1].usage.cached_tokens == got[1].usage.prompt_tokens - 1 and got[2].usage.cached_tokens > 0
        on.clear_context_cache()
        settled(on)
