"""Sparse mixture-of-experts ops (Qwen3.5 MoE, qwen35_arch.md section 2.6): the softmax top-k router and the
routed experts over a fused expert bank.

Expert bank layout (the published Qwen3.5 MoE storage, kept as is): ``gate_up`` [E, 2I, H] (rows 0..I-1 the gate
projection, I..2I-1 the up projection) and ``down`` [E, H, I]. Routing: p = softmax(x Wr^T) in fp32, the top k of
p, renormalised to sum to 1 (always, in Qwen3.5), then cast to the activations' dtype; the routed output of a
token is sum_j w_j * down_e(silu(gate_e x) * up_e x) over its k experts. ``moe_block`` is the whole block:
the routing, the routed experts and the shared SwiGLU expert scaled by sigmoid of its gate logit.

A bank may be quantized (``QuantizedWeight`` [E, N, K], FP8 or NVFP4): the reference runs each hit expert's matmul
through ``linear`` on that expert's view (weight-only); on the GPU the routed experts take the quantized grouped
kernels (``ninfer.ops.triton.moe_quant``) where their tiles fit the scales, and the fused block kernels
(``moe_block``, ``moe_one_token``) take dense banks only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops.dispatch import triton_kernel, triton_selected
from ninfer.ops.quant import QuantizedWeight

Bank = torch.Tensor | QuantizedWeight


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


def moe_experts_ref(x: torch.Tensor, gate_up: Bank, down: Bank, ids: torch.Tensor,
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
        h = _expert_linear(x[rows], gate_up, e)
        g, u = h.split(two_i // 2, dim=-1)
        y = _expert_linear(F.silu(g) * u, down, e)
        out.index_add_(0, rows, (y * w[start:start + n, None]).to(out.dtype))
        start += n
    return out if shared is None else out + torch.sigmoid(shared_gate) * shared


def _expert_linear(x: torch.Tensor, bank: Bank, e: int) -> torch.Tensor:
    if isinstance(bank, QuantizedWeight):
        from ninfer.ops.linear import linear_quantized

        return linear_quantized(x, bank.expert(e))
    return F.linear(x, bank[e])


def _kernel(module: str, name: str, x: torch.Tensor, *banks: Bank):
    """The grouped kernel for dense banks; for FP8 and NVFP4 banks the routed experts' quantized kernels
    (``moe_quant``) where their tiles fit the scales. A quantized block as a whole runs its parts."""
    if not any(isinstance(b, QuantizedWeight) for b in banks):
        return triton_kernel(module, name, x)
    kernel = triton_kernel("moe_quant", "moe_experts_quant", x) if name == "moe_experts" else None
    if kernel is None:
        return None
    from ninfer.ops.triton.moe_quant import fits  # a kernel was found: triton is importable here

    return kernel if fits(x, *banks) else None


def moe_experts(x: torch.Tensor, gate_up: Bank, down: Bank, ids: torch.Tensor,
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
    kernel = _kernel("moe", "moe_experts", x, gate_up, down)
    if kernel is not None:
        return kernel(x, gate_up, down, ids, weights, shared=shared, shared_gate=shared_gate)
    return moe_experts_ref(x, gate_up, down, ids, weights, shared, shared_gate)


def moe_block_ref(x: torch.Tensor, logits: torch.Tensor, shared_gate: torch.Tensor, gate_up: Bank,
                  down: Bank, shared_gate_up: Bank, shared_down: Bank, top_k: int
                  ) -> torch.Tensor:
    """The block as its parts: ``moe_route``, the shared expert's two linears, ``moe_experts`` joining them."""
    from ninfer.ops.linear import linear, swiglu

    weights, ids = moe_route(logits, top_k)
    shared = linear(swiglu(x, shared_gate_up), shared_down)
    return moe_experts(x, gate_up, down, ids, weights, shared=shared, shared_gate=shared_gate)


def moe_block(x: torch.Tensor, logits: torch.Tensor, shared_gate: torch.Tensor, gate_up: Bank,
              down: Bank, shared_gate_up: Bank, shared_down: Bank, top_k: int, *,
              summed: bool = True) -> torch.Tensor:
    """The sparse MoE block of x [N, H]: router ``logits`` [N, E] and the shared expert's gate logit
    ``shared_gate`` [N, 1] (both may be views of one fused projection), the routed banks ``gate_up`` [E, 2I, H] /
    ``down`` [E, H, I], the shared SwiGLU expert ``shared_gate_up`` [2Is, H] / ``shared_down`` [H, Is] ->
    routed + sigmoid(shared_gate) * shared, [N, H] in x's dtype. On the GPU a decode-sized call runs the shared
    expert as one more expert of the grouped kernels (``ninfer.ops.triton.moe.moe_block``).

    ``summed=False``: [N, S, H] terms whose in-order fp32 sum, rounded, is that output (``add_rms_norm`` adds
    them in its own pass, so the block's last launch goes): the k + 1 weighted slot rows of a folded GPU call,
    else the output itself as one term."""
    N, H = x.shape
    if logits.dim() != 2 or logits.shape[0] != N or shared_gate.shape != (N, 1):
        raise ValueError(f"moe_block: logits must be [{N}, E] and shared_gate [{N}, 1], got {tuple(logits.shape)} "
                         f"and {tuple(shared_gate.shape)}")
    if gate_up.dim() != 3 or logits.shape[1] != gate_up.shape[0]:
        raise ValueError(f"moe_block: logits {tuple(logits.shape)} do not match the bank {tuple(gate_up.shape)}")
    if shared_gate_up.dim() != 2 or shared_down.dim() != 2 or shared_gate_up.shape[1] != H or \
            shared_down.shape != (H, shared_gate_up.shape[0] // 2):
        raise ValueError(f"moe_block: the shared expert must be [2Is, {H}] and [{H}, Is], got "
                         f"{tuple(shared_gate_up.shape)} and {tuple(shared_down.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"moe_block: top_k must be in 1..{logits.shape[1]}, got {top_k}")
    kernel = _kernel("moe", "moe_block", x, gate_up, down, shared_gate_up, shared_down)
    if kernel is not None:
        return kernel(x, logits, shared_gate, gate_up, down, shared_gate_up, shared_down, top_k, summed=summed,
                      one_launch=triton_selected("moe_one_token", "moe_one_token"))
    out = moe_block_ref(x, logits, shared_gate, gate_up, down, shared_gate_up, shared_down, top_k)
    return out if summed else out[:, None]
