"""Tiny real Qwen4Exp checkpoints for tests, written by Hugging Face ``transformers`` (test-only dependency).

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", variant="full")   # fp32, per-expert tensors, MTP added
    art = convert_tiny(ckpt, tmp_path / "tiny.ninfer")               # the real converter

``transformers``' own ``Qwen4ExpForCausalLM`` (``vl=True``: ``Qwen4ExpForConditionalGeneration`` with a tiny
vision tower) builds the model and ``save_pretrained`` writes it, so the tensors carry the published names: the
n-gram tables as ``...ngram_embedding.shard_{k}.weight`` row chunks (``split_ngram_parts``), the routed experts
one by one (``experts="fused"`` rewrites them as the fused banks ``experts.gate_up_proj`` / ``down_proj``). Every
parameter is then perturbed by seeded noise: transformers initialises norms to zero and the PLE conv to zeros,
which would hide a wrong norm or conv. MTP tensors (``mtp.*``, which transformers does not build) are random in
the shapes of ``ninfer_qwen4exp.source_mapping``. The tokenizer, chat template and generation config are the
Qwen3.5 tiny ones (``ninfer_qwen35.testing.checkpoints``).

``VARIANTS`` names the tiny configs (see each entry); ``TINY_TEXT`` is what they share.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ninfer_qwen35.testing.checkpoints import TINY_VISION, make_tokenizer_json

# Shared by every variant: the tokenizer's 400 BPE tokens and the Qwen3.5 added tokens fit in 512 ids. The rotary
# half of a 16-wide head (8 dims) fits the 16-wide QSA index head; the MRoPE sections cover its 4 frequencies.
# Four index heads, as published: with fewer, block scores tie at exactly zero often, and at the budget's edge
# transformers keeps torch.topk's order where ninfer keeps the earlier block (ninfer.ops.qsa).
TINY_TEXT = dict(
    vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_conv_kernel_dim=4, max_position_embeddings=4096, rms_norm_eps=1e-6, hc_lowrank=16,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_compress_ratio=4,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                         mrope_section=[2, 1, 1], mrope_interleaved=True))
_PLE = dict(ple_layer_ids=[2, 3], ngram_vocab_size_base=211, heads_per_ngram=2, ngram_size=3,
            ple_conv_kernel_size=4, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4)
VARIANTS: dict[str, dict[str, Any]] = {
    # QSA whose budget (512 tokens) keeps every complete block within 300 tokens: attention is dense; no PLE.
    "plain": dict(hc_count=2, output_gate_type="silu", indexer_budget=512),
    # QSA that selects: 2 blocks of 4 tokens plus the open tail, so selection matters from the 12th token on.
    "qsa": dict(hc_count=2, output_gate_type="silu", indexer_budget=8),
    # PLE on layers 1 and 2 (0-indexed; ple_layer_ids are 1-indexed) with small prime tables; dense QSA.
    "ple": dict(hc_count=2, output_gate_type="silu", indexer_budget=512, **_PLE),
    # Everything: 4 streams, sigmoid GDN gate, selecting QSA, PLE with a narrower embedding (8-wide table rows).
    "full": dict(hc_count=4, output_gate_type="sigmoid", indexer_budget=8, num_experts=8, num_experts_per_tok=2,
                 ple_embed_dim=32, **_PLE),
}
NOISE = 0.05  # the std of the perturbation added to every parameter


def tiny_text_config(variant: str = "full", *, layers: int = 4, **overrides: Any) -> dict[str, Any]:
    """The text config (``Qwen4ExpTextConfig`` keyword arguments) of a named tiny variant."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny Qwen4Exp variant {variant!r}; known: {', '.join(VARIANTS)}")
    return {**TINY_TEXT, **VARIANTS[variant], "num_hidden_layers": layers, **overrides}


def _perturb(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * NOISE)


def _to_dtype(model, dtype) -> None:
    import torch

    model.to(dtype)
    if dtype != torch.float32:
        for name, p in model.named_parameters():  # published checkpoints keep these fp32
            if name.endswith("linear_attn.A_log") or name.endswith("linear_attn.norm.weight"):
                p.data = p.data.float()


def make_tiny_checkpoint(out_dir: str | Path, *, seed: int = 0, layers: int = 4, variant: str = "full",
                         vl: bool = False, mtp: bool = True, dtype: str = "float32", experts: str = "per_expert",
                         sharded: bool | None = None, **config_overrides: Any) -> Path:
    """Write a tiny random Qwen4Exp checkpoint into ``out_dir`` and return it (see the module docstring).

    ``variant``: a key of ``VARIANTS``; ``config_overrides`` update its text config (``vision_config=`` updates
    the vision config). ``dtype``: ``float32`` (oracle tests) or ``bfloat16`` (``A_log`` and the GDN gated-norm
    weight stay fp32, as published). ``experts``: ``per_expert`` (what ``save_pretrained`` writes) or ``fused``.
    ``sharded`` defaults to ``vl``: several safetensors files and an index.
    """
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from ninfer_qwen35.testing.checkpoints import add_tensors, fuse_experts, write_frontend_files

    if experts not in ("per_expert", "fused"):
        raise ValueError(f"experts must be 'per_expert' or 'fused', got {experts!r}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sharded = vl if sharded is None else sharded
    tokenizer_json, added = make_tokenizer_json()
    vision = {**TINY_VISION, **config_overrides.pop("vision_config", {})}
    text = tiny_text_config(variant, layers=layers, **config_overrides)
    text["tie_word_embeddings"] = False
    text["eos_token_id"] = added["<|endoftext|>"]
    torch.manual_seed(seed)
    if vl:
        vision["out_hidden_size"] = text["hidden_size"]
        cfg = transformers.Qwen4ExpConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=False,
            image_token_id=added["<|image_pad|>"], video_token_id=added["<|video_pad|>"],
            vision_start_token_id=added["<|vision_start|>"], vision_end_token_id=added["<|vision_end|>"])
        model = transformers.Qwen4ExpForConditionalGeneration(cfg)
    else:
        model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**text))
    _perturb(model, seed)
    _to_dtype(model, torch_dtype)
    model.config.dtype = torch_dtype
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=total // 2 + 1 if sharded else "50GB")

    if experts == "fused":
        fuse_experts(out, load_file, save_file)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    target = config.get("text_config", config)
    target["mtp_num_hidden_layers"] = 1 if mtp else 0
    config_path.write_text(json.dumps(config, indent=2))
    if mtp:
        add_tensors(out, _mtp_tensors(config, seed, torch_dtype, experts), sharded=sharded)
    write_frontend_files(out, tokenizer_json, added, vision=vision if vl else None)
    return out


def _mtp_tensors(config: dict, seed: int, dtype, experts: str) -> dict:
    """Random ``mtp.*`` tensors in the source mapping's shapes, the experts laid out as the main layers' are."""
    import re

    import torch

    from ninfer_qwen4exp.config import parse_config
    from ninfer_qwen4exp.source_mapping import expected_parameters

    gen = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, (_, shape) in expected_parameters(parse_config(config), ("mtp",)).items():
        t = (torch.randn(shape, generator=gen) * NOISE).to(dtype)
        bank = re.match(r"^(.+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if bank is None or experts == "fused":
            out[name] = t
        elif bank.group(2) == "down_proj":
            out.update({f"{bank.group(1)}.{e}.down_proj.weight": t[e].clone() for e in range(shape[0])})
        else:
            for e in range(shape[0]):
                gate, up = t[e].chunk(2)
                out[f"{bank.group(1)}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{bank.group(1)}.{e}.up_proj.weight"] = up.clone()
    return out


def tiny_checkpoint(out_dir: Path, *, seed: int, layers: int, vl: bool, mtp: bool, variant: str | None) -> None:
    """The ``qwen4exp`` maker of ``ninfer tiny-checkpoint`` (``ArchitectureSpec.tiny_checkpoint``): a ``VARIANTS``
    entry (default ``full``), bf16 as published."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # its "Writing model shards" bar is noise on a command line
    make_tiny_checkpoint(out_dir, seed=seed, layers=layers, variant=variant or "full", vl=vl, mtp=mtp,
                         dtype="bfloat16")


def convert_tiny(directory_or_checkpoint: str | Path, out_path: str | Path, *, variant: str = "full",
                 **convert_kwargs: Any) -> Path:
    """Convert a checkpoint directory with the real converter (making a tiny ``variant`` there if it is empty)."""
    from ninfer_convert.convert import convert_checkpoint

    src = Path(directory_or_checkpoint)
    if not (src / "config.json").exists():
        make_tiny_checkpoint(src, variant=variant)
    convert_checkpoint(src, out_path, **convert_kwargs)
    return Path(out_path)
