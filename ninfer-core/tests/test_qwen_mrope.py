"""MRopePlan against transformers' Qwen3.5 ``get_rope_index`` (images, videos split per frame group, text around
them), chunk by chunk, and the positions after the prompt (``rope_deltas``)."""

from __future__ import annotations

import random

import pytest
import torch

from ninfer.contract.prompt import MediaSpan
from ninfer.models.common.qwen.mrope import MRopePlan

IMAGE, VIDEO, TEXT = 7, 8, 1


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, linear_key_head_dim=4, linear_value_head_dim=4,
                linear_num_key_heads=1, linear_num_value_heads=1, layer_types=["full_attention"])
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=2, out_hidden_size=16,
                  num_position_embeddings=16)
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                     video_token_id=VIDEO)
    return transformers.Qwen3_5Model(cfg).eval()


def _prompt(rng: random.Random, items: list[tuple[str, tuple[int, int, int]]], tail: int):
    """Token ids, the HF inputs (token types, image and video grids) and our spans of a prompt of text runs
    around ``items``; a video's frame groups are separated by a few timestamp tokens, as the processor writes."""
    ids, spans, images, videos = [], [], [], []

    def text(n):
        ids.extend([TEXT] * n)

    for index, (kind, (t, h, w)) in enumerate(items):
        text(rng.randint(2, 5) if index else rng.randint(1, 5))  # at least <|vision_end|><|vision_start|>
        per_group = h * w // 4
        if kind == "image":
            images.append((t, h, w))
            spans.append(MediaSpan(item_index=index, start=len(ids), length=t * per_group, grid_thw=(t, h, w)))
            ids.extend([IMAGE] * (t * per_group))
            continue
        videos.append((t, h, w))
        for group in range(t):
            text(rng.randint(1, 3))  # "<t seconds><|vision_start|>"
            spans.append(MediaSpan(item_index=index, start=len(ids), length=per_group, grid_thw=(1, h, w),
                                   offset=group * per_group))
            ids.extend([VIDEO] * per_group)
            text(1)  # <|vision_end|>
    text(tail)
    types = [1 if t == IMAGE else 2 if t == VIDEO else 0 for t in ids]
    return ids, types, images, videos, spans


def _hf(model, ids, types, images, videos):
    with torch.no_grad():
        pos, delta = model.get_rope_index(torch.tensor([ids]), torch.tensor([types]),
                                          image_grid_thw=torch.tensor(images) if images else None,
                                          video_grid_thw=torch.tensor(videos) if videos else None)
    return pos[:, 0], int(delta[0, 0])


CASES = {
    "one_image": [("image", (1, 4, 6))],
    "two_images": [("image", (1, 6, 4)), ("image", (1, 2, 2))],
    "video": [("video", (3, 4, 4))],
    "tall_image_then_video": [("image", (1, 10, 2)), ("video", (2, 2, 6)), ("image", (1, 4, 4))],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_get_rope_index(hf_model, case, seed):
    rng = random.Random(seed)
    ids, types, images, videos, spans = _prompt(rng, CASES[case], tail=rng.randint(1, 4))
    want, delta = _hf(hf_model, ids, types, images, videos)
    plan = MRopePlan(len(ids), spans, merge_size=2)
    assert torch.equal(plan.positions(0, len(ids)), want)
    assert plan.delta == delta
    for chunk in (1, 3, 7):  # any chunk, the same positions
        got = torch.cat([plan.positions(a, min(a + chunk, len(ids))) for a in range(0, len(ids), chunk)], dim=1)
        assert torch.equal(got, want)
    # text positions are ledger position + the run's shift; generated tokens continue at + delta on every axis
    text = [p for p, t in enumerate(types) if t == 0]
    assert [p + plan.shift(p) for p in text] == want[0, text].tolist() == want[2, text].tolist()
    after = plan.positions(len(ids) - 1, len(ids) + 5)
    assert after[:, 1:].tolist() == [list(range(len(ids) + delta, len(ids) + delta + 5))] * 3
    assert plan.shift(len(ids) + 3) == delta
    assert plan.text_positions(len(ids), len(ids) + 2).tolist() == [len(ids) + delta, len(ids) + 1 + delta]


def test_text_only_plan_is_the_identity():
    plan = MRopePlan(9, [], merge_size=2)
    assert plan.delta == 0 and plan.shift(4) == 0 and not plan.touches_media(0, 20)
    assert torch.equal(plan.positions(2, 12), torch.arange(2, 12).expand(3, -1))


def test_chunk_queries():
    spans = [MediaSpan(item_index=0, start=3, length=4, grid_thw=(1, 4, 4))]
    plan = MRopePlan(10, spans, merge_size=2)
    assert plan.spans == ((3, 7),)
    assert plan.touches_media(0, 4) and plan.touches_media(6, 9) and not plan.touches_media(0, 3)
    assert not plan.touches_media(7, 12)
    assert plan.text_positions(7, 10).tolist() == [5, 6, 7]  # 3 text + the 2x2 grid advances by 2
    with pytest.raises(ValueError, match="media placeholders"):
        plan.text_positions(2, 5)
    with pytest.raises(ValueError, match="placeholder"):
        plan.shift(4)


@pytest.mark.parametrize("spans, message", [
    ([MediaSpan(item_index=0, start=1, length=5, grid_thw=(1, 4, 4))], "merges to 4"),
    ([MediaSpan(item_index=0, start=1, length=4, grid_thw=(1, 3, 4))], "multiples of the merge size"),
    ([MediaSpan(item_index=0, start=8, length=4, grid_thw=(1, 4, 4))], "outside the prompt"),
    ([MediaSpan(item_index=0, start=1, length=4, grid_thw=(1, 4, 4)),
      MediaSpan(item_index=1, start=3, length=4, grid_thw=(1, 4, 4))], "overlaps"),
])
def test_bad_spans_are_refused(spans, message):
    with pytest.raises(ValueError, match=message):
        MRopePlan(10, spans, merge_size=2)
