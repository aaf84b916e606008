"""Test helpers: our Qwen3.5 model over a ``transformers`` model's own tensors, and a float32 Program on it.

    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(...)).eval()
    model = model_from_hf(hf)                          # same numbers, our layout (fused parents)
    prog = float32_program(model, page_size=4, num_pages=64)

``randomise`` gives a transformers model of this family (Qwen3.5, Qwen4Exp, their vision towers) O(1) weights.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ninfer.contract.memory import ProgramCapacity
from ninfer.models.common.weights import WeightSet
from ninfer_qwen35.config import Qwen35Config, parse_config
from ninfer_qwen35.execution.model import Qwen35Model
from ninfer_qwen35.execution.parameters import Qwen35Parameters
from ninfer_qwen35.program import Qwen35Program
from ninfer_qwen35.source_mapping import fused_parents
from ninfer_qwen35.state import kv_pools, state_layout


def model_from_hf(hf_model: Any, *, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None) -> Qwen35Model:
    """Our model bound to ``hf_model``'s state dict (a ``Qwen3_5ForCausalLM``), fused as the converter lays it out."""
    config = parse_config(hf_model.config.to_dict())
    weights = WeightSet.from_tensors(hf_model.state_dict(), fused_parents(config))
    return Qwen35Model(Qwen35Parameters.from_weights(config, weights, dtype, device))


def float32_program(model: Any, *, page_size: int, num_pages: int, device: str = "cpu", max_concurrency: int = 1,
                    config: Qwen35Config | None = None, max_model_len: int | None = None, host_budget_bytes: int = 0,
                    checkpoint_slots: int = 0, cache_host_budget_bytes: int = 0, **options: Any) -> Qwen35Program:
    """A Qwen35Program over ``model`` with float32 state and KV pages, granted ``num_pages`` and the capacity
    keywords (``ProgramCapacity``). ``config`` defaults to ``model.config`` (give it when ``model`` wraps ours);
    ``options`` go to the Program as they are."""
    config = config if config is not None else model.config
    capacity = ProgramCapacity(kv_pages=num_pages, max_model_len=max_model_len, host_budget_bytes=host_budget_bytes,
                               checkpoint_slots=checkpoint_slots, cache_host_budget_bytes=cache_host_budget_bytes)
    return Qwen35Program(model, state_layout=state_layout(config, "float32"),
                         kv_pool=kv_pools(config, page_size=page_size, dtype="float32")[0], device=device,
                         max_concurrency=max_concurrency, capacity=capacity, vocab_size=config.vocab_size,
                         **options)


def decisive_tiny_hf(seed: int, *, vocab_size: int = 448, max_position_embeddings: int = 512,
                     moe: bool = False) -> Any:
    """A tiny ``Qwen3_5ForCausalLM`` (4 layers: 3 GDN, 1 attention; ``moe``: ``Qwen3_5MoeForCausalLM``, 8 experts,
    top-2, a shared expert) whose weights are O(1) Gaussian draws of ``seed``, so greedy choices are decisive
    rather than near-ties (engine tests compare tokens exactly)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                  linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=max_position_embeddings,
                  tie_word_embeddings=True)
    if moe:
        cfg = transformers.Qwen3_5MoeTextConfig(**common, num_experts=8, num_experts_per_tok=2,
                                                moe_intermediate_size=16, shared_expert_intermediate_size=24)
        model_class = transformers.Qwen3_5MoeForCausalLM
    else:
        cfg, model_class = transformers.Qwen3_5TextConfig(**common, intermediate_size=64), transformers.Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    hf = model_class(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:  # fan-in is the last dim (an expert bank [E, out, in] too)
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(p.shape[-1])))
    return hf


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every weight an O(1) effect, drawn from ``seed``: transformers' near-zero init, zero-centred norms, zero
    convs and unit gates would flatten the logits and hide parts. Norm scales of the GDN output and the vision
    tower around 1; other vectors 0.3 x N(0, 1); embedding tables N(0, 1); matrices 1.5 / sqrt(fan-in) x N(0, 1),
    the fan-in being the last dim (an expert bank [E, out, in], a conv [C, 1, K]) or, in the vision tower, every
    dim but the first (its 3-D patch conv)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            visual = "visual" in name
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.5, generator=gen))
            elif name.endswith("linear_attn.norm.weight") or (visual and "norm" in name and name.endswith(".weight")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("embed_tokens.weight", "ngram_embedding.weight", "pos_embed.weight")):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = math.prod(p.shape[1:]) if visual else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(fan_in)))


def agree_where_decisive(hf: Any, prompt: list[int], ours: list[int], margin: float = 1e-3) -> int:
    """Teacher-forced over our tokens: each must be ``hf``'s argmax while its top-2 logits are apart by more than
    ``margin`` (fp32 kernels may order a near-tie either way; a tiny checkpoint's logits are flat). At the first
    near-tie our token must be one of the tied and the comparison ends. Returns the tokens compared."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].float()
    for i, (row, token) in enumerate(zip(logits, ours, strict=True)):
        top = torch.topk(row, 2)
        if float(top.values[0] - top.values[1]) <= margin:
            assert float(top.values[0] - row[token]) <= margin, (i, token, top)
            return i
        assert token == int(top.indices[0]), (i, token, top)
    return len(ours)
