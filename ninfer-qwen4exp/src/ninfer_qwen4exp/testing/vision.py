"""Test helpers for Qwen4Exp with media: a tiny random transformers ``Qwen4ExpForConditionalGeneration`` (fp32,
CPU) with our model and Qwen3.5's vision encoder over its tensors. Prompts are built with Qwen3.5's helpers
(``ninfer_qwen35.testing.vision_prompts.build_prompt``: its token ids and pixel preprocessing are this config's).

    tiny = tiny_vl(seed=3)                           # .hf, .model (Qwen4ExpModel), .vision (Qwen35Vision)
    built = build_prompt([[5, 6], ("image", image(1, 48, 32)), [8, 9]])
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ninfer.artifact.weights import WeightSet
from ninfer_qwen4exp.config import parse_config
from ninfer_qwen4exp.execution.model import Qwen4ExpModel
from ninfer_qwen4exp.execution.parameters import Qwen4ExpParameters
from ninfer_qwen4exp.source_mapping import canonical_name, fused_parents
from ninfer_qwen35.execution.vision import Qwen35Vision, VisionParams
from ninfer_qwen35.testing.hf_model import randomise
from ninfer_qwen35.testing.vision_prompts import END, IMAGE, START, VIDEO, VISION, VOCAB, tensors_by_feature

EOS = 7
# QSA that selects (2 blocks of 4 and the open tail from the 12th token on), PLE on two GDN layers (1-indexed ids),
# 8 experts, 4 streams. head_dim 16 x 0.5: 8 rotary dims, 4 frequency slots t, h, w, t: every axis matters.
# Eight index heads: with fewer, block scores over the media tokens tie at the budget's edge, where transformers
# keeps torch.topk's order and ninfer the earlier block (ninfer.ops.qsa).
TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    layer_types=["linear_attention", "indexed_attention", "linear_attention", "linear_attention", "indexed_attention"],
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    hc_count=4, hc_lowrank=12, ple_layer_ids=[1, 3], ple_embed_dim=32, ple_conv_kernel_size=3, ngram_size=3,
    heads_per_ngram=2, ngram_vocab_size_base=600, make_ngram_vocab_size_divisible_by=16, eos_token_id=EOS,
    indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=24, indexer_budget=8, indexer_compress_ratio=4,
    output_gate_type="silu", tie_word_embeddings=False, max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})


@attrs.frozen(eq=False)
class TinyVL:
    hf: Any  # transformers' Qwen4ExpForConditionalGeneration
    model: Qwen4ExpModel
    vision: Qwen35Vision


def tiny_vl(seed: int = 3, **text: Any) -> TinyVL:
    """The tiny VL model (``TEXT`` updated by ``text``) and ours on its tensors, through the source mapping."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen4ExpConfig(
        text_config={**TEXT, **text}, vision_config={**VISION, "out_hidden_size": TEXT["hidden_size"]},
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=False)
    cfg.text_config._attn_implementation = "eager"
    hf = transformers.Qwen4ExpForConditionalGeneration(cfg).eval()
    hf.generation_config.eos_token_id = None  # greedy runs its full length; a generated EOS only resets n-grams
    randomise(hf, seed)
    config = parse_config(cfg.to_dict())
    by_feature = tensors_by_feature(hf, canonical_name)
    params = Qwen4ExpParameters.from_weights(config, WeightSet.from_tensors(by_feature["text"], fused_parents(config)),
                                             torch.float32)
    vision = Qwen35Vision(VisionParams.from_weights(config.base, WeightSet.from_tensors(by_feature["vision"]),
                                                    torch.float32))
    return TinyVL(hf=hf, model=Qwen4ExpModel(params), vision=vision)
