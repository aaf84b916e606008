"""Qwen3.5 with images and videos vs transformers' Qwen3_5ForConditionalGeneration (fp32, CPU, a tiny random VL
model): prompt logits, greedy tokens through the Program in chunk sizes that split images, pause (Snapshot and
Replay) with an image, decode through the graphs' static buffers, and every page, slot and handoff freed after.

Prompts are built as the Frontend builds them (``ninfer_qwen35.testing.vision_prompts``): ``vision_preprocess``
for pixels and grids, each placeholder expanded to its token run (a video: one run per temporal patch group, a
timestamp before each).
"""

from __future__ import annotations

import attrs
import pytest
import torch

from ninfer.contract.batch import RowDecision
from ninfer.contract.memory import ProgramCapacity
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.core.batch_assembly import RowInput, build_forward_batch
from ninfer_qwen35.testing import float32_program

transformers = pytest.importorskip("transformers")
from ninfer_qwen35.testing.vision_prompts import (  # noqa: E402
    IMAGE,
    VOCAB,
    TinyVL,
    build_prompt,
    decode_greedy,
    hf_greedy,
    hf_logits,
    image,
    prefill_greedy,
    program_greedy,
    tiny_vl,
)

RTOL = 1e-4  # logits: max |ours - HF| <= RTOL * max |HF| (fp32)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny() -> TinyVL:
    return tiny_vl(seed=3)


FRAMES = [image(20 + i, 24, 16) for i in range(4)]
PROMPTS = {
    "one_image": lambda: build_prompt([[5, 6, 7], ("image", image(1, 24, 16)), [8, 9, 10, 11]]),
    "two_images": lambda: build_prompt([[5, 6], ("image", image(1, 16, 24)), [12, 13], ("image", image(2, 8, 16)),
                                        [14, 15, 16]]),
    "video": lambda: build_prompt([[5], ("video", FRAMES), [17, 18, 19]]),
}


def _program(tiny: TinyVL, **options):
    options = {"page_size": 4, "num_pages": 96, "max_concurrency": 2, "host_budget_bytes": 1 << 26, **options}
    return float32_program(tiny.model, vision=tiny.vision, **options)


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    assert err <= RTOL * ref.abs().max().item(), f"max |ours - HF| = {err:.3g}, max |HF| = {ref.abs().max():.3g}"


def _prompt_logits(prog, prompt: PreparedPrompt, chunk: int) -> torch.Tensor:
    """Every prompt position's logits, through the Program's stores in chunks (the handoff fills each)."""
    sid = prog.open_sequence(prompt, GREEDY)
    seq = prog.sequences.get(sid)
    out = []
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            n = min(chunk, len(prompt) - start)
            assert prog.reserve_units(sid, n)
            batch = build_forward_batch([RowInput(tokens=prompt.token_ids[start:start + n], start=start,
                                                  slot=seq.slot, pages=seq.pages, want_logits=False)], 4,
                                        torch.device("cpu"))
            prog.vision.fill(batch, seq, start, n)
            out.append(prog.logits(prog.forward(batch)))
            seq.computed += n
            prog.vision.passed(seq)
    prog.release(sid)
    return torch.cat(out)


@pytest.mark.parametrize("case", sorted(PROMPTS))
def test_prompt_logits_match_transformers(tiny, case):
    built = PROMPTS[case]()
    assert len(built.prompt.media_spans) >= 1 and all(s.length > 1 for s in built.prompt.media_spans)
    want = hf_logits(tiny.hf, built)
    prog = _program(tiny)
    for chunk in (len(built.prompt), 5):  # whole, and chunks that split every span
        _close(_prompt_logits(prog, built.prompt, chunk), want)
    assert prog.usage().all_free and prog.vision.items_held == 0


def test_the_image_matters(tiny):
    """A different image of the same size changes the logits after it (and not before)."""
    a = build_prompt([[5, 6, 7], ("image", image(1, 24, 16)), [8, 9]])
    b = build_prompt([[5, 6, 7], ("image", image(9, 24, 16)), [8, 9]])
    assert a.prompt.token_ids == b.prompt.token_ids and a.prompt.vision[0].digest != b.prompt.vision[0].digest
    prog = _program(tiny)
    la, lb = (_prompt_logits(prog, x.prompt, 64) for x in (a, b))
    first = a.prompt.media_spans[0].start
    assert torch.equal(la[:first], lb[:first])
    assert (la[-1] - lb[-1]).abs().max() > 1e-2 * la[-1].abs().max()


@pytest.fixture(scope="module")
def greedy(tiny):
    """(prompt, HF's greedy tokens) of each case."""
    out = {}
    for case, make in PROMPTS.items():
        built = make()
        out[case] = (built.prompt, hf_greedy(tiny.hf, built, 8))
    return out


@pytest.mark.parametrize("case", sorted(PROMPTS))
@pytest.mark.parametrize("chunk", [64, 7, 3])
def test_greedy_tokens_match_transformers(tiny, greedy, case, chunk):
    prompt, want = greedy[case]
    prog = _program(tiny)
    assert program_greedy(prog, prompt, len(want), chunk) == want
    assert prog.vision.encoded == len(prompt.vision)  # each item once, however the chunks split it
    assert prog.usage().all_free and prog.vision.items_held == 0


def test_decode_through_static_graph_buffers(tiny, greedy):
    """The decode graphs' input path (``DecodeGraphs.load`` with the prompt's rotary shift) on the CPU, two rows
    at once: one with an image, one text-only."""
    prompt, want = greedy["two_images"]
    text = PreparedPrompt(token_ids=[5, 6, 7, 8])
    prog = _program(tiny, static_decode=True)
    assert prog.graphs is not None
    a, b = prog.open_sequence(prompt, GREEDY), prog.open_sequence(text, GREEDY)
    got = {a: prefill_greedy(prog, a, 64), b: prefill_greedy(prog, b, 64)}
    for _ in range(len(want) - 1):
        for sid in (a, b):
            assert prog.reserve_units(sid, 1)
        batch = prog.decode([a, b])
        prog.commit(batch, [RowDecision(accepted=1)] * 2)
        for sid, row in zip((a, b), batch.rows, strict=True):
            got[sid].append(row.tokens[0])
    assert got[a] == want
    assert got[b] == program_greedy(_program(tiny), text, len(want), 64)
    for sid in (a, b):
        prog.release(sid)
    assert prog.usage().all_free


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
@pytest.mark.parametrize("at", ["inside_the_image", "after_the_prompt"])
def test_pause_and_resume(tiny, greedy, mode, at):
    """Paused inside the image (the handoff is dropped; resuming encodes the image again) or after two tokens:
    the same tokens as an unpaused run; nothing is left held."""
    prompt, want = greedy["one_image"]
    prog = _program(tiny)
    sid = prog.open_sequence(prompt, GREEDY)
    span = prompt.media_spans[0]
    got: list[int] = []
    if at == "inside_the_image":
        n = span.start + span.length // 2
        assert prog.reserve_units(sid, n)
        assert prog.prefill(sid, n) is None
        assert prog.vision.items_held == 1  # the image is half done: its rows stay for the next chunk
    else:
        got = prefill_greedy(prog, sid, 64) + decode_greedy(prog, sid, 1)
    state = prog.pause(sid, mode)
    assert prog.vision.items_held == 0 and prog.usage().kv_pages_used == 0
    encoded = prog.vision.encoded
    sid = prog.resume(state)
    got += prefill_greedy(prog, sid, 5)
    got += decode_greedy(prog, sid, len(want) - len(got))
    assert got == want
    reencoded = prog.vision.encoded - encoded
    assert reencoded == (1 if at == "inside_the_image" or mode == "replay" else 0)
    prog.release(sid)
    assert prog.usage().all_free and prog.vision.items_held == 0


def test_fork_and_rollback_keep_the_media(tiny, greedy):
    """A fork after the prompt decodes like its source; an aborted first token rolls back to a Replay of the
    prompt, which encodes the image again and gives the same tokens."""
    prompt, want = greedy["one_image"]
    prog = _program(tiny)
    sid = prog.open_sequence(prompt, GREEDY)
    batch = None
    while prog.input_remaining(sid):
        assert prog.reserve_units(sid, 64)
        batch = prog.prefill(sid, 64)
    prog.abort_pending(batch)  # rollback: the whole prompt runs again
    first = prefill_greedy(prog, sid, 6)
    assert first == want[:1] and prog.vision.encoded == 2
    child = prog.fork(sid)
    assert decode_greedy(prog, child, 3) == decode_greedy(prog, sid, 3) == want[1:4]
    prog.release(child)
    prog.release(sid)
    assert prog.usage().all_free and prog.vision.items_held == 0


# -- refusals ------------------------------------------------------------------------------------------
def test_text_program_refuses_media(tiny, greedy):
    prompt, _ = greedy["one_image"]
    prog = float32_program(tiny.model, page_size=4, num_pages=16)
    with pytest.raises(ValueError, match="without the vision feature"):
        prog.open_sequence(prompt, GREEDY)
    assert prog.usage().all_free


def _evolve_span(prompt: PreparedPrompt, **changes) -> PreparedPrompt:
    span = attrs.evolve(prompt.media_spans[0], **changes)
    return attrs.evolve(prompt, media_spans=(span, *prompt.media_spans[1:]))


@pytest.mark.parametrize("bad, message", [
    (lambda p: _evolve_span(p, item_index=3), "names item 3"),
    (lambda p: _evolve_span(p, offset=4), "takes rows 4"),
    (lambda p: _evolve_span(p, start=p.media_spans[0].start - 1), "not media placeholders"),
    (lambda p: _evolve_span(p, grid_thw=(1, 4, 4)), "merges to"),
    (lambda p: attrs.evolve(p, media_spans=()), "both vision items and media spans"),
    (lambda p: attrs.evolve(p, token_ids=(*p.token_ids[:-4], IMAGE, IMAGE, IMAGE, IMAGE)),
     "placeholder tokens but its spans cover"),
])
def test_bad_media_prompts_are_refused(tiny, greedy, bad, message):
    prompt, _ = greedy["one_image"]
    prog = _program(tiny)
    with pytest.raises(ValueError, match=message):
        prog.open_sequence(bad(prompt), GREEDY)
    assert prog.usage().all_free


def test_mtp_program_refuses_media(tiny):
    from ninfer_qwen35.program.mtp_program import Qwen35MTPProgram

    with pytest.raises(ValueError, match="MTP"):
        Qwen35MTPProgram(tiny.model, mtp=None, steps=None, draft_tokens=1, vision=tiny.vision, state_layout=None,
                         kv_pool=None, device="cpu", max_concurrency=1, capacity=ProgramCapacity(kv_pages=8),
                         vocab_size=VOCAB)

