"""Routed experts computed by the CPU team from host banks: the pairs the device cache does not hold.

Two collectives per call, each dividing contiguous ranges among the team's ranks so no two ranks write the
same bytes: first the experts' hidden activations (rank r takes a range of all the experts' intermediate
columns, computing silu(gate)·up for them), then the down projections (rank r takes a range of the hidden
columns and adds every expert's weighted output for them). Every scratch buffer is made by the caller before
the collectives. Rounding follows ``ninfer.ops.moe.moe_experts_ref``: projections, silu(gate)·up and each
pair's weighted output are rounded to the activations' dtype, the sum over pairs is in that dtype too.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from ninfer.core.cpu_executor import CpuExecutor


@attrs.frozen(eq=False)
class ExpertRows:
    """One expert's share of a call: its number, the tokens routed to it (``rows`` [n] int64), their inputs
    (``x`` [n, H]), their routing weights (``weights`` [n, 1]) and the scratch of its activations ([n, I])."""

    expert: int
    rows: torch.Tensor
    x: torch.Tensor
    weights: torch.Tensor
    hidden: torch.Tensor


def cpu_experts(team: CpuExecutor, work: list[ExpertRows], gate_up: torch.Tensor, down: torch.Tensor,
                out: torch.Tensor) -> None:
    """out[t] += sum over the pairs of ``work`` routed from token t of weight · down_e(silu(gate_e x) · up_e x),
    with the host banks ``gate_up`` [E, 2I, H] and ``down`` [E, H, I]; ``out`` [N, H] (zeroed by the caller)."""
    if not work:
        return
    inter = gate_up.shape[1] // 2
    columns = len(work) * inter

    @torch.inference_mode()  # thread-local: the caller's mode does not reach the workers
    def activations(rank: int, size: int) -> None:
        span = CpuExecutor.split(columns, rank, size)
        for i, item in enumerate(work):
            lo, hi = max(span.start, i * inter), min(span.stop, (i + 1) * inter)
            if lo >= hi:
                continue
            lo, hi = lo - i * inter, hi - i * inter
            bank = gate_up[item.expert]
            gate = F.linear(item.x, bank[lo:hi])
            up = F.linear(item.x, bank[inter + lo:inter + hi])
            item.hidden[:, lo:hi] = F.silu(gate) * up

    @torch.inference_mode()
    def projections(rank: int, size: int) -> None:
        span = CpuExecutor.split(out.shape[1], rank, size)
        if not span:
            return
        cols = slice(span.start, span.stop)
        for item in work:
            y = F.linear(item.hidden, down[item.expert][cols])
            out[:, cols].index_add_(0, item.rows, y * item.weights)

    with team.keep_active():
        team.run(activations)
        team.run(projections)
