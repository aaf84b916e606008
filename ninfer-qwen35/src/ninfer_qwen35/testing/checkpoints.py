"""Tiny real Qwen3.5 checkpoints for tests, written by Hugging Face ``transformers`` (test-only dependency).

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", layout="vl")   # VL naming, sharded + index, MTP added
    art = convert_tiny(ckpt, tmp_path / "tiny.ninfer")            # the real converter

From the command line (docs/models.md): ``ninfer tiny-checkpoint OUT_DIR`` (``tiny_checkpoint`` is its maker).

``layout="text"`` writes ``Qwen3_5ForCausalLM`` (flat ``model.layers.*`` names), ``layout="vl"`` writes
``Qwen3_5ForConditionalGeneration`` (``model.language_model.*``, ``model.visual.*``). Both get random
``mtp.*`` tensors (``mtp_num_hidden_layers: 1``), a tiny byte-level BPE tokenizer.json in the Qwen3.5 format
(its pre-tokenizer, then the Qwen3.5 added tokens in their published order: ``<think>``, ``<tool_call>`` and
friends are added but not special, as in the real tokenizer), the project's Qwen3.5 chat template (thinking
switch, tools, tool turns), generation_config.json and (VL) preprocessor_config.json.
Weights are bf16 except ``A_log`` and the GDN gated-norm weight, which stay fp32 as in published checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ninfer.models.common.qwen.chat_template import builtin_template
from ninfer_qwen35.testing.qwen_vocab import (
    QWEN35_ADDED_TOKENS,
    add_qwen35_added_tokens,
    set_qwen35_text_pipeline,
)

ADDED_TOKENS = tuple(content for content, _ in QWEN35_ADDED_TOKENS)
# The ones decoding may skip; <think>, <tool_call>, <tool_response> and the FIM tokens are not among them.
SPECIAL_TOKENS = tuple(content for content, special in QWEN35_ADDED_TOKENS if special)

CHAT_TEMPLATE = builtin_template("qwen3_5")

TINY_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
                 max_position_embeddings=4096, rms_norm_eps=1e-6)
# The MoE block of a tiny Qwen3_5MoeForCausalLM (it replaces intermediate_size).
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=64,
                   patch_size=16, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?",
    "ninfer runs Qwen3.5 on one GPU with gated delta networks and attention.",
    "def main():\n    print('hello')\n    return 0\n", "Numbers like 12345 and 3.14159 are split into digits.",
    "A user asks a question; the assistant thinks, then answers.", "Ünïcödé and 中文 text also appear here.",
]


def make_tokenizer_json(vocab_size: int = 400) -> tuple[str, dict[str, int]]:
    """A byte-level BPE trained on a few sentences, then the Qwen3.5 added tokens; (json, {added token: id})."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    set_qwen35_text_pipeline(tok)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_SENTENCES * 4, trainer)
    ids = add_qwen35_added_tokens(tok)
    return tok.to_str(), ids


def _randomize(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.05)


def _to_checkpoint_dtypes(model) -> None:
    import torch

    model.to(torch.bfloat16)
    for name, p in model.named_parameters():  # published checkpoints keep these fp32
        if name.endswith("linear_attn.A_log") or name.endswith("linear_attn.norm.weight"):
            p.data = p.data.float()


def make_tiny_checkpoint(directory: str | Path, *, layout: str = "text", mtp: bool = True,
                         tie_word_embeddings: bool = False, seed: int = 0, sharded: bool | None = None,
                         moe: bool = False, **config_overrides: Any) -> Path:
    """Write a tiny random Qwen3.5 checkpoint into ``directory`` and return it (see the module docstring).

    ``config_overrides`` update the text config (``vision_config=`` replaces the vision config). ``sharded``
    defaults to True for ``vl`` (several shards + model.safetensors.index.json) and False for ``text``.
    ``moe``: a Qwen3.5 MoE checkpoint (``Qwen3_5MoeForCausalLM`` / ``...ForConditionalGeneration``, ``TINY_MOE``
    experts in the published fused layout; the MTP layer gets a MoE block too).
    """
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    if layout not in ("text", "vl"):
        raise ValueError(f"layout must be 'text' or 'vl', got {layout!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    sharded = layout == "vl" if sharded is None else sharded
    tokenizer_json, added = make_tokenizer_json()
    vision = dict(TINY_VISION, **config_overrides.pop("vision_config", {}))
    text = {**TINY_TEXT, **(TINY_MOE if moe else {}), **config_overrides}  # overrides may replace TINY_MOE keys
    if moe:
        text.pop("intermediate_size")
    kind = "Qwen3_5Moe" if moe else "Qwen3_5"
    text_config, config_class = getattr(transformers, f"{kind}TextConfig"), getattr(transformers, f"{kind}Config")
    text["tie_word_embeddings"] = tie_word_embeddings
    text["eos_token_id"] = added["<|endoftext|>"]
    torch.manual_seed(seed)
    if layout == "text":
        model = getattr(transformers, f"{kind}ForCausalLM")(text_config(**text))
    else:
        vision["out_hidden_size"] = text["hidden_size"]
        cfg = config_class(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings,
                            image_token_id=added["<|image_pad|>"], video_token_id=added["<|video_pad|>"],
                            vision_start_token_id=added["<|vision_start|>"],
                            vision_end_token_id=added["<|vision_end|>"])
        model = getattr(transformers, f"{kind}ForConditionalGeneration")(cfg)
    _randomize(model, seed)
    _to_checkpoint_dtypes(model)
    model.config.dtype = torch.bfloat16
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=total // 2 + 1 if sharded else "50GB")

    if moe:  # transformers saves the experts one by one; published Qwen3.5 MoE checkpoints hold fused banks
        fuse_experts(out, load_file, save_file)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    target = config.get("text_config", config)
    target["mtp_num_hidden_layers"] = 1 if mtp else 0
    target["mtp_use_dedicated_embeddings"] = False
    config_path.write_text(json.dumps(config, indent=2))
    if mtp:
        _add_mtp(out, config, seed, sharded)

    write_frontend_files(out, tokenizer_json, added, vision=vision if layout == "vl" else None)
    return out


def write_frontend_files(out: Path, tokenizer_json: str, added: dict[str, int], *,
                         vision: dict[str, Any] | None = None) -> None:
    """tokenizer.json, tokenizer_config.json (the chat template), generation_config.json and, given the vision
    config, preprocessor_config.json, as published Qwen3.5 checkpoints hold them."""
    (out / "tokenizer.json").write_text(tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "model_max_length": 4096}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [added["<|im_end|>"], added["<|endoftext|>"]], "pad_token_id": added["<|endoftext|>"],
        "do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 20}, indent=2))
    if vision is not None:
        (out / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
            "patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
            "merge_size": vision["spatial_merge_size"], "size": {"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "resample": 3}, indent=2))


def fuse_experts(out: Path, load_file, save_file) -> None:
    """Rewrite every shard's per-expert ``...mlp.experts.{e}.{gate,up,down}_proj.weight`` as the published fused
    banks ``...mlp.experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
    ``...mlp.experts.down_proj`` [E, H, I] (the index too)."""
    import re

    import torch

    part = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    renamed: dict[str, str] = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(shard))
        banks: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        kept = {}
        for name, t in tensors.items():
            m = part.match(name)
            if m is None:
                kept[name] = t
                continue
            banks.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            renamed[name] = shard.name
        for prefix, experts in banks.items():
            order = [experts[e] for e in sorted(experts)]
            kept[prefix + ".gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in order])
            kept[prefix + ".down_proj"] = torch.stack([x["down"] for x in order])
        save_file(kept, str(shard), metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        weight_map = {n: f for n, f in index["weight_map"].items() if n not in renamed}
        for name, shard in renamed.items():
            prefix = part.match(name).group(1)
            weight_map[prefix + ".gate_up_proj"] = weight_map[prefix + ".down_proj"] = shard
        index["weight_map"] = weight_map
        index_path.write_text(json.dumps(index, indent=2))


def _add_mtp(out: Path, config: dict, seed: int, sharded: bool) -> None:
    """Add random ``mtp.*`` tensors (shapes from the Qwen3.5 source mapping) the way published checkpoints hold them."""
    import torch

    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.source_mapping import expected_parameters

    gen = torch.Generator().manual_seed(seed + 1)
    shapes = expected_parameters(parse_config(config), ("mtp",))
    tensors = {name: (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16) for name, (_, shape) in shapes.items()}
    add_tensors(out, tensors, sharded=sharded)


def add_tensors(out: Path, tensors: dict, *, sharded: bool, shard: str = "model-mtp.safetensors") -> None:
    """Add ``tensors`` to a saved checkpoint: as a shard of their own in the index, or into model.safetensors."""
    from safetensors.torch import load_file, save_file

    if sharded:
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        index_path = out / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        index["weight_map"].update({name: shard for name in tensors})
        index.setdefault("metadata", {})["total_size"] = index.get("metadata", {}).get("total_size", 0) + sum(
            t.numel() * t.element_size() for t in tensors.values())
        index_path.write_text(json.dumps(index, indent=2))
    else:
        path = out / "model.safetensors"
        merged = dict(load_file(str(path)))
        merged.update(tensors)
        save_file(merged, str(path), metadata={"format": "pt"})


def tiny_checkpoint(out_dir: Path, *, seed: int, layers: int, vl: bool, mtp: bool, variant: str | None) -> None:
    """The ``qwen35`` maker of ``ninfer tiny-checkpoint`` (``ArchitectureSpec.tiny_checkpoint``): variant ``dense``
    (the default) or ``moe``, bf16 as published."""
    variants = ("dense", "moe")
    if variant not in (None, *variants):
        raise ValueError(f"unknown tiny Qwen3.5 variant {variant!r}; known: {', '.join(variants)}")
    _cli_checkpoint(out_dir, seed, layers, vl, mtp, moe=variant == "moe")


def tiny_moe_checkpoint(out_dir: Path, *, seed: int, layers: int, vl: bool, mtp: bool, variant: str | None) -> None:
    """The ``qwen35_moe`` maker of ``ninfer tiny-checkpoint``: a Qwen3.5 MoE (its one variant, ``moe``)."""
    if variant not in (None, "moe"):
        raise ValueError(f"unknown tiny Qwen3.5 MoE variant {variant!r}; known: moe")
    _cli_checkpoint(out_dir, seed, layers, vl, mtp, moe=True)


def _cli_checkpoint(out_dir: Path, seed: int, layers: int, vl: bool, mtp: bool, *, moe: bool) -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # its "Writing model shards" bar is noise on a command line
    make_tiny_checkpoint(out_dir, layout="vl" if vl else "text", mtp=mtp, seed=seed, moe=moe,
                         num_hidden_layers=layers)


def convert_tiny(directory_or_checkpoint: str | Path, out_path: str | Path, **convert_kwargs: Any) -> Path:
    """Convert a checkpoint directory with the real converter (making a default tiny one there if it is empty)."""
    from ninfer_convert.convert import convert_checkpoint

    src = Path(directory_or_checkpoint)
    if not (src / "config.json").exists():
        make_tiny_checkpoint(src)
    convert_checkpoint(src, out_path, **convert_kwargs)
    return Path(out_path)
