"""Test helpers for Qwen3.5 with media: a tiny random transformers VL model with ours over its tensors, and
prompts built as the Frontend builds them (``vision_preprocess`` for pixels and grids, each placeholder expanded
to its token run; a video as one run per temporal patch group with a timestamp before each).

    tiny = tiny_vl(seed=3)                             # HF Qwen3_5ForConditionalGeneration + our model + encoder
    built = build_prompt([[5, 6], ("image", image(1, 24, 16)), [8, 9]])
    built.prompt                                       # PreparedPrompt with vision / media_spans
    hf_logits(tiny.hf, built)                          # transformers' logits of the prompt
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from PIL import Image

from ninfer.artifact.weights import WeightSet
from ninfer.contract.batch import RowDecision
from ninfer.contract.prompt import MediaSpan, PreparedPrompt, VisionItem
from ninfer.contract.request import SamplingParams
from ninfer.models.common.qwen.vision_preprocess import PreprocessConfig, preprocess_image, preprocess_video
from ninfer_qwen35.config import parse_config
from ninfer_qwen35.execution.model import Qwen35Model
from ninfer_qwen35.execution.parameters import Qwen35Parameters
from ninfer_qwen35.execution.vision import Qwen35Vision, VisionParams
from ninfer_qwen35.source_mapping import canonical_name, fused_parents
from ninfer_qwen35.testing.hf_model import randomise

VOCAB, START, END, IMAGE, VIDEO = 160, 150, 151, 152, 153
# head_dim 32 x 0.5: 16 rotary dims, 8 frequency slots interleaved t, h, w, t, h, w, t, h: every axis matters
TEXT = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=1024,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True})
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, in_channels=3, num_position_embeddings=64, out_hidden_size=48)
PIXELS = PreprocessConfig(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=64, max_pixels=64 * 64,
                          video_min_pixels=64, video_max_pixels=4 * 32 * 32)


@attrs.frozen(eq=False)
class TinyVL:
    hf: Any  # transformers' Qwen3_5ForConditionalGeneration
    model: Qwen35Model
    vision: Qwen35Vision


def tensors_by_feature(hf: torch.nn.Module, canonical_name: Callable[[str], tuple[str, str] | None]
                       ) -> dict[str, dict[str, torch.Tensor]]:
    """A transformers VL model's tensors under our names, split by feature ("text", "vision") as the source
    mapping's ``canonical_name`` places them (tensors it maps to nothing are left out)."""
    by_feature: dict[str, dict[str, torch.Tensor]] = {"text": {}, "vision": {}}
    for name, t in hf.state_dict().items():
        mapped = canonical_name(name)
        if mapped is not None:
            by_feature[mapped[0]][mapped[1]] = t.detach().clone()
    return by_feature


def tiny_vl(seed: int = 3) -> TinyVL:
    """A tiny random VL model (fp32, CPU; GDN and attention layers as ``TEXT`` says) and ours on its tensors."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE,
                                     video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    cfg.text_config._attn_implementation = "eager"
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    randomise(hf, seed)
    config = parse_config(cfg.to_dict())
    by_feature = tensors_by_feature(hf, canonical_name)
    params = Qwen35Parameters.from_weights(config, WeightSet.from_tensors(by_feature["text"], fused_parents(config)),
                                           torch.float32)
    vision = Qwen35Vision(VisionParams.from_weights(config, WeightSet.from_tensors(by_feature["vision"]),
                                                    torch.float32))
    return TinyVL(hf=hf, model=Qwen35Model(params), vision=vision)


def image(seed: int, width: int, height: int) -> Image.Image:
    """A random RGB picture."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@attrs.frozen(eq=False)
class BuiltPrompt:
    prompt: PreparedPrompt
    hf_inputs: dict[str, torch.Tensor]  # what transformers' forward takes besides input_ids


def build_prompt(parts: Sequence[Any]) -> BuiltPrompt:
    """``parts``: lists of text token ids, ("image", picture) or ("video", [frames])."""
    ids: list[int] = []
    items, spans = [], []
    for part in parts:
        if isinstance(part, list):
            ids += part
            continue
        kind, media = part
        prepared = preprocess_image(media, PIXELS) if kind == "image" else preprocess_video(media, PIXELS)
        index = len(items)
        digest = hashlib.sha256(repr(prepared.grid_thw).encode() + prepared.pixel_values.numpy().tobytes())
        items.append(VisionItem(kind=kind, pixel_values=prepared.pixel_values, grid_thw=prepared.grid_thw,
                                digest=digest.hexdigest()))
        t, h, w = prepared.grid_thw
        per_group = h * w // 4
        groups = [(t, 0)] if kind == "image" else [(1, g) for g in range(t)]
        for group_t, g in groups:
            if kind == "video":
                ids += [90 + g, 91]  # "<g.0 seconds>"
            ids.append(START)
            spans.append(MediaSpan(item_index=index, start=len(ids), length=group_t * per_group,
                                   grid_thw=(group_t, h, w), offset=g * per_group))
            ids += [IMAGE if kind == "image" else VIDEO] * (group_t * per_group)
            ids.append(END)
    prompt = PreparedPrompt(token_ids=ids, vision=items, media_spans=spans)
    return BuiltPrompt(prompt=prompt, hf_inputs=hf_media_inputs(prompt, IMAGE, VIDEO))


def hf_media_inputs(prompt: PreparedPrompt, image_id: int, video_id: int, extra: int = 0) -> dict[str, Any]:
    """transformers' media inputs for ``prompt`` followed by ``extra`` text tokens: the token types (1 image,
    2 video placeholder) and the pixel rows and grids of its images and videos."""
    kinds = {image_id: 1, video_id: 2}
    inputs: dict[str, Any] = {"mm_token_type_ids": torch.tensor([[kinds.get(t, 0) for t in prompt.token_ids]
                                                                 + [0] * extra])}
    images = [i for i in prompt.vision if i.kind == "image"]
    videos = [i for i in prompt.vision if i.kind == "video"]
    if images:
        inputs.update(pixel_values=torch.cat([i.pixel_values for i in images]),
                      image_grid_thw=torch.tensor([i.grid_thw for i in images]))
    if videos:
        inputs.update(pixel_values_videos=torch.cat([i.pixel_values for i in videos]),
                      video_grid_thw=torch.tensor([i.grid_thw for i in videos]))
    return inputs


def hf_logits(hf: Any, built: BuiltPrompt, extra: Sequence[int] = ()) -> torch.Tensor:
    """transformers' logits [len, V] of the prompt followed by the text tokens ``extra``."""
    ids = [*built.prompt.token_ids, *extra]
    inputs = dict(built.hf_inputs)
    inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(extra), dtype=torch.long)],
                                            dim=1)
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), **inputs).logits[0]


def hf_greedy(hf: Any, built: BuiltPrompt, steps: int) -> list[int]:
    """transformers' greedy tokens, each from a full forward over the prompt and the tokens so far
    (``get_rope_index`` then places the generated tokens itself)."""
    out: list[int] = []
    for _ in range(steps):
        out.append(int(hf_logits(hf, built, out)[-1].argmax()))
    return out


# -- greedy generation through a Program ---------------------------------------------------------------------

def program_greedy(prog, prompt: PreparedPrompt, steps: int, chunk: int) -> list[int]:
    """``steps`` greedy tokens of ``prompt`` through a Program, prefilled in chunks of ``chunk`` tokens."""
    sid = prog.open_sequence(prompt, SamplingParams(temperature=0.0))
    tokens = prefill_greedy(prog, sid, chunk)
    tokens += decode_greedy(prog, sid, steps - len(tokens))
    prog.release(sid)
    return tokens


def prefill_greedy(prog, sid: int, chunk: int) -> list[int]:
    """Prefill sequence ``sid``'s remaining input in chunks; its first token (none if nothing was left)."""
    batch = None
    while prog.input_remaining(sid):
        _reserve(prog, sid, min(chunk, prog.input_remaining(sid)))
        batch = prog.prefill(sid, chunk)
    if batch is None:
        return []
    prog.commit(batch, [RowDecision(accepted=1)])
    return [batch.rows[0].tokens[0]]


def decode_greedy(prog, sid: int, steps: int) -> list[int]:
    """``steps`` decode steps of sequence ``sid`` alone, each committed."""
    out = []
    for _ in range(steps):
        _reserve(prog, sid, 1)
        batch = prog.decode([sid])
        prog.commit(batch, [RowDecision(accepted=1)])
        out.append(batch.rows[0].tokens[0])
    return out


def _reserve(prog, sid: int, tokens: int) -> None:
    if not prog.reserve_units(sid, tokens):
        raise RuntimeError(f"the Program could not reserve {tokens} tokens for sequence {sid}")
