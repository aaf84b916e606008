"""Sparse mixture-of-experts ops (Qwen3.5 MoE, qwen35_arch.md section 2.6): the softmax top-k router and the
routed experts over a fused expert bank.

Expert bank layout (the published Qwen3.5 MoE storage, kept as is): ``gate_up`` [E, 2I, H] (rows 0..I-1 the gate
projection, I..2I-1 the up projection) and ``down`` [E, H, I]. Routing: p = softmax(x Wr^T) in fp32, the top k of
p, renormalised to sum to 1 (always, in Qwen3.5), then cast to the activations' dtype; the routed output of a
token is sum_j w_j * down_e(silu(gate_e x) * up_e x) over its k experts. The shared expert and its sigmoid gate
are a dense SwiGLU the model adds itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops._dispatch import triton_kernel


def moe_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k] int64), renormalised top-k
    of the fp32 softmax."""
    if logits.dim() != 2 or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"moe_route: logits must be [N, E] with 1 <= top_k <= E, got {tuple(logits.shape)} and "
                         f"top_k={top_k}")
    kernel = triton_kernel("moe_route", "moe_route", logits)
    if kernel is not None:
        return kernel(logits, top_k)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def moe_experts_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor, shared: torch.Tensor | None = None,
                    shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts, the reference: x [N, H], ``gate_up`` [E, 2I, H], ``down`` [E, H, I], ``ids`` / ``weights``
    [N, k] -> [N, H] in x's dtype. Each hit expert runs once over the tokens routed to it (one host read of
    which experts were hit: the reference is for the CPU and for checking kernels). With ``shared`` [N, H] and
    ``shared_gate`` [N, 1] (the shared expert's output and gate logit) the block's output: routed +
    sigmoid(shared_gate) * shared."""
    N, H = x.shape
    E, two_i, _ = gate_up.shape
    out = torch.zeros_like(x)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # token-slots grouped by expert
    counts = torch.bincount(flat, minlength=E).tolist()
    token_of = order // ids.shape[1]
    w = weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start:start + n]
        h = F.linear(x[rows], gate_up[e])
        g, u = h.split(two_i // 2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e])
        out.index_add_(0, rows, (y * w[start:start + n, None]).to(out.dtype))
        start += n
    return out if shared is None else out + torch.sigmoid(shared_gate) * shared


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, *, shared: torch.Tensor | None = None,
                shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts over a fused bank (see the module docstring); shapes are checked here, once. With
    ``shared`` / ``shared_gate`` the shared expert joins in the same last step (``moe_experts_ref``)."""
    N, H = x.shape
    if gate_up.dim() != 3 or gate_up.shape[2] != H or gate_up.shape[1] % 2:
        raise ValueError(f"moe_experts: gate_up must be [E, 2I, {H}], got {tuple(gate_up.shape)}")
    E, two_i, _ = gate_up.shape
    if down.shape != (E, H, two_i // 2):
        raise ValueError(f"moe_experts: down must be [{E}, {H}, {two_i // 2}], got {tuple(down.shape)}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != N:
        raise ValueError(f"moe_experts: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be "
                         f"[{N}, k]")
    if (shared is None) != (shared_gate is None) or (shared is not None and (
            shared.shape != x.shape or shared_gate.shape != (N, 1))):
        raise ValueError(f"moe_experts: shared must be [{N}, {H}] with shared_gate [{N}, 1], both or neither; got "
                         f"{None if shared is None else tuple(shared.shape)} and "
                         f"{None if shared_gate is None else tuple(shared_gate.shape)}")
    kernel = triton_kernel("moe", "moe_experts", x)
    if kernel is not None:
        return kernel(x, gate_up, down, ids, weights, shared=shared, shared_gate=shared_gate)
    return moe_experts_ref(x, gate_up, down, ids, weights, shared, shared_gate)
