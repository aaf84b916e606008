"""Routed experts computed by the CPU team from host banks: the pairs the device cache does not hold.

One collective per call: the team's ranks take contiguous ranges of the missed experts, and each computes its
experts whole (gate_up, silu(gate)·up, down) for the tokens routed to them, into the expert's own output rows;
the caller then adds the weighted rows into the output in one step. Whole experts keep every matrix product the
same shape from call to call (the CPU GEMM libraries cache their plans by shape; splitting experts into
varying column ranges made each call re-plan, many times slower: docs/performance.md), and no two ranks write
the same bytes. Scratch comes from the caller before the collective. Rounding follows
``ninfer.ops.moe.moe_experts_ref``: projections, silu(gate)·up and each pair's weighted output are rounded to
the activations' dtype, and the sum over pairs is in that dtype too.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from ninfer.core.cpu_executor import CpuExecutor


@attrs.frozen(eq=False)
class ExpertRows:
    """One expert's share of a call: its number, the tokens routed to it (``rows`` [n] int64), their inputs
    (``x`` [n, H]), their routing weights (``weights`` [n, 1]) and the scratch of its outputs (``y`` [n, H])."""

    expert: int
    rows: torch.Tensor
    x: torch.Tensor
    weights: torch.Tensor
    y: torch.Tensor


def cpu_experts(team: CpuExecutor, work: list[ExpertRows], gate_up: torch.Tensor, down: torch.Tensor,
                out: torch.Tensor) -> None:
    """out[t] += sum over the pairs of ``work`` routed from token t of weight · down_e(silu(gate_e x) · up_e x),
    with the host banks ``gate_up`` [E, 2I, H] and ``down`` [E, H, I]; ``out`` [N, H]."""
    if not work:
        return
    inter = gate_up.shape[1] // 2

    @torch.inference_mode()  # thread-local: the caller's mode does not reach the workers
    def experts(rank: int, size: int) -> None:
        for i in CpuExecutor.split(len(work), rank, size):
            item = work[i]
            gate, up = F.linear(item.x, gate_up[item.expert]).split(inter, dim=-1)
            torch.mul(F.linear(F.silu(gate) * up, down[item.expert]), item.weights, out=item.y)

    team.run(experts)
    out.index_add_(0, torch.cat([item.rows for item in work]), torch.cat([item.y for item in work]))
