"""MoE ops against an independent oracle: transformers' ``Qwen3_5MoeSparseMoeBlock`` with random weights (router,
fused expert bank, shared expert and its gate), fp32 on the CPU; routing ties and shape errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer.ops.moe import moe_experts, moe_route

transformers = pytest.importorskip("transformers")


def hf_block(seed: int, *, experts: int = 8, top_k: int = 3, hidden: int = 32, inter: int = 16, shared: int = 24):
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                                  num_experts_per_tok=top_k, shared_expert_intermediate_size=shared)
    block = Qwen3_5MoeSparseMoeBlock(config).float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def ours(block, x: torch.Tensor) -> torch.Tensor:
    """The block from the ops: router, routed experts, shared SwiGLU scaled by sigmoid(its gate)."""
    weights, ids = moe_route(F.linear(x, block.gate.weight), block.gate.top_k)
    routed = moe_experts(x, block.experts.gate_up_proj, block.experts.down_proj, ids, weights)
    s = block.shared_expert
    shared = s.down_proj(F.silu(s.gate_proj(x)) * s.up_proj(x))
    return routed + torch.sigmoid(F.linear(x, block.shared_expert_gate.weight)) * shared


@pytest.mark.parametrize("seed,tokens,top_k", [(0, 1, 1), (1, 7, 3), (2, 33, 8), (3, 64, 2)])
def test_the_moe_block_matches_transformers(seed, tokens, top_k):
    block = hf_block(seed, top_k=top_k)
    x = torch.randn(1, tokens, 32, generator=torch.Generator().manual_seed(100 + seed))
    with torch.no_grad():
        want = block(x)[0]
        got = ours(block, x[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_routing_renormalises_the_top_k_of_the_fp32_softmax():  # no ties: topk's order among equals is free
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.0, 3.0, -1.0]], dtype=torch.bfloat16)
    w, ids = moe_route(logits, 2)
    p = torch.softmax(logits.float(), -1)
    assert ids.tolist() == [[0, 1], [2, 0]]
    assert w.dtype == torch.bfloat16 and torch.allclose(w.float().sum(-1), torch.ones(2), atol=1e-2)
    torch.testing.assert_close(w[0].float(), (p[0, :2] / p[0, :2].sum()), rtol=1e-2, atol=1e-2)


def test_bad_shapes_are_named():
    x = torch.zeros(3, 8)
    gate_up, down = torch.zeros(4, 6, 8), torch.zeros(4, 8, 3)
    ids, w = torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="gate_up must be"):
        moe_experts(x, torch.zeros(4, 5, 8), down, ids, w)
    with pytest.raises(ValueError, match="down must be"):
        moe_experts(x, gate_up, torch.zeros(4, 3, 8), ids, w)
    with pytest.raises(ValueError, match="ids .* and weights"):
        moe_experts(x, gate_up, down, ids[:2], w[:2])
    with pytest.raises(ValueError, match="top_k"):
        moe_route(torch.zeros(3, 4), 5)
