"""Random weights for the Qwen3.5 vision encoder (``benchmarks/vision.py``, the vision GPU tests) and a random
Qwen3_5ForConditionalGeneration checkpoint (a text shape with the published vision tower) for the TTFT run.

Vision weights have an O(1) effect per block, as a trained tower's have (HF's init is near zero, which would make
every block an identity and hide numerical errors): LayerNorm scales 1 + 0.3 N(0, 1), biases 0.3 N(0, 1), the
position grid N(0, 1), matrices N(0, 1) * 1.5 / sqrt(fan_in). The text model's weights are N(0, 0.02), as the
other benchmarks write them (the RMSNorm scales are 1 + w).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from benchmarks.harness import FP32, GIB
from benchmarks.shapes import SHAPES

# Qwen3_5VisionConfig as the 9B / 27B / MoE checkpoints publish it (qwen35_arch.md 1.3, 5.2); out_hidden_size is
# the LM hidden size.
PUBLISHED_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
                    "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                    "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh",
                    "deepstack_visual_indexes": []}
# For CPU smoke runs: a tower small enough to run 448 x 448 images on the CPU in seconds.
TINY_VISION = {**PUBLISHED_VISION, "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
               "num_position_embeddings": 256}
VISION_SHAPES = {"published": PUBLISHED_VISION, "tiny": TINY_VISION}
# preprocessor_config.json of the published checkpoints (qwen35_arch.md 5.2).
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "do_convert_rgb": True, "resample": 3}


def vl_config(text_shape: str, vision: dict, token_ids: dict[str, int]) -> dict:
    """config.json of a Qwen3_5ForConditionalGeneration: the text shape (no MTP head), the vision tower with
    out_hidden_size = the LM hidden size, and the vision token ids of the tokenizer written beside it."""
    text = {k: v for k, v in SHAPES[text_shape].items() if k != "architectures"}
    text.update(model_type="qwen3_5_text", dtype="bfloat16", mtp_num_hidden_layers=0,
                eos_token_id=token_ids["<|im_end|>"], max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "dtype": "bfloat16",
            "text_config": text,
            "vision_config": {**vision, "out_hidden_size": text["hidden_size"], "model_type": "qwen3_5_vision"},
            "image_token_id": token_ids["<|image_pad|>"], "video_token_id": token_ids["<|video_pad|>"],
            "vision_start_token_id": token_ids["<|vision_start|>"],
            "vision_end_token_id": token_ids["<|vision_end|>"],
            "tie_word_embeddings": text.get("tie_word_embeddings", False)}


def vision_model_config(vision: dict, out_hidden_size: int):
    """A Qwen35Config carrying only what the vision tower reads (the text part is the tiny shape)."""
    from ninfer_qwen35.config import parse_config

    return parse_config({"text_config": dict(SHAPES["tiny"]),
                         "vision_config": {**vision, "out_hidden_size": out_hidden_size}})


def vision_init(name: str, shape: tuple[int, ...], gen, device: str):
    """One vision tensor in fp32 by the module docstring's scheme."""
    import torch

    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if "norm" in name and name.endswith(".weight"):
        return x.mul_(0.3).add_(1.0)
    if len(shape) == 1:
        return x.mul_(0.3)
    if name.endswith("pos_embed.weight"):
        return x
    return x.mul_(1.5 / math.sqrt(math.prod(shape[1:])))


def random_vision_weights(config, *, seed: int, device: str, dtype=None):
    """A WeightSet of every ``visual.*`` tensor of ``config`` (logical names, the converter's), random as above."""
    import torch

    from ninfer.models.common.weights import WeightSet
    from ninfer_qwen35.source_mapping import vision_parameters

    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = dtype or torch.float32
    return WeightSet.from_tensors({name: vision_init(name, shape, gen, device).to(dtype)
                                   for name, (_, shape) in vision_parameters(config).items()})


def checkpoint_parameters(cfg: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every tensor of the VL checkpoint under its published name -> (shape, is vision)."""
    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.source_mapping import expected_parameters, vision_parameters

    config = parse_config(cfg)
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    for name, (_, shape) in expected_parameters(config, ("text",)).items():
        published = name if name == "lm_head.weight" else "model.language_model." + name[len("model."):]
        out[published] = (tuple(shape), False)
    for name, (_, shape) in vision_parameters(config).items():
        out["model." + name] = (tuple(shape), True)
    return out


def checkpoint_bytes(cfg: dict) -> int:
    return sum(math.prod(shape) * (4 if name.endswith(FP32) else 2)
               for name, (shape, _) in checkpoint_parameters(cfg).items())


def write_vl_checkpoint(directory: Path, text_shape: str, vision: dict, device: str, *, seed: int = 0,
                        shard_bytes: int = 2 * GIB) -> dict:
    """A random Qwen3_5ForConditionalGeneration checkpoint (config.json, the small test tokenizer with the
    Qwen3.5 added tokens, chat template, generation config, the published preprocessor_config.json, safetensors
    shards + index), written shard by shard. Returns its config.json."""
    import torch

    from benchmarks.harness import write_shards
    from ninfer_qwen35.testing.checkpoints import CHAT_TEMPLATE, make_tokenizer_json

    tok, ids = make_tokenizer_json()
    cfg = vl_config(text_shape, vision, ids)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    (directory / "tokenizer.json").write_text(tok)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|im_end|>"]],
                                                                  "pad_token_id": ids["<|endoftext|>"]}))
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    gen_device = "cuda" if device.startswith("cuda") else "cpu"
    gen = torch.Generator(device=gen_device).manual_seed(seed)

    def tensors():
        for name, (shape, is_vision) in checkpoint_parameters(cfg).items():
            if is_vision:
                t = vision_init(name, shape, gen, gen_device)
            else:
                t = torch.randn(shape, generator=gen, device=gen_device, dtype=torch.float32).mul_(0.02)
            yield name, t.to(torch.float32 if name.endswith(FP32) else torch.bfloat16).cpu()

    write_shards(directory, tensors(), shard_bytes=shard_bytes)
    return cfg


def test_image(side: int, seed: int = 0, fmt: str = "JPEG") -> bytes:
    """An encoded side x side RGB picture (smooth gradients plus noise, so it compresses like a photo)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side] / side
    base = np.stack([x, y, (x + y) / 2], axis=-1) * 200 + rng.normal(0, 20, (side, side, 3))
    buf = io.BytesIO()
    Image.fromarray(base.clip(0, 255).astype(np.uint8)).save(buf, format=fmt, quality=90)
    return buf.getvalue()
