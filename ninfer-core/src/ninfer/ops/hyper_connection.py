"""Hyper-connections: a residual of S parallel streams ([..., S * H]) that each sublayer reads through a learned
mix and writes back through learned per-stream weights.

A gated residual step normalises every stream (its own RMS, (1 + w)), derives per-element mix weights through
a low-rank bottleneck (down, silu(. / S), up, sigmoid), and feeds the sublayer the mean over streams of weight *
normed stream. The sublayer's output joins each stream s scaled by 2 * sigmoid(inject_s(normed) / S). The model's
last mixer has no injection: its mixed rows are the hidden states.

The elementwise parts (``grouped_rms_norm``, ``hyper_connection_gates``, ``stream_mix``,
``hyper_connection_inject``) each have a Triton kernel (``ninfer.ops.triton.hyper_connection``, used on CUDA once
listed in ``ninfer.ops.dispatch.TRITON_OPS``); the low-rank mix and the injection weights are linears.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops.dispatch import triton_kernel
from ninfer.ops.linear import linear


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int) -> torch.Tensor:
    """x [..., G * group_size]: each group of ``group_size`` consecutive features normalised by its own RMS, times
    (1 + weight) (weight [G * group_size]); math in fp32, result in x.dtype."""
    if x.shape[-1] % group_size or weight.shape != x.shape[-1:]:
        raise ValueError(f"grouped_rms_norm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not split into "
                         f"groups of {group_size}")
    kernel = triton_kernel("hyper_connection", "grouped_rms_norm", x)
    if kernel is not None:
        return kernel(x, weight, eps, group_size)
    return grouped_rms_norm_ref(x, weight, eps, group_size)


def grouped_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int) -> torch.Tensor:
    xf = x.float().unflatten(-1, (-1, group_size))
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (y * (1.0 + weight.float())).to(x.dtype)


def hyper_connection_mix(x: torch.Tensor, norm_weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
                         inject: torch.Tensor | None, streams: int, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, S * H] -> (the sublayer's input [N, H], injection weights [N, S] or None without ``inject``).

    ``down`` [R, S * H] and ``up`` [S * H, R]: the low-rank mix; ``inject`` [S, S * H]: the per-stream output
    weights (None for the final mixer)."""
    if x.dim() != 2 or x.shape[-1] % streams or up.shape != (x.shape[-1], down.shape[0]) \
            or down.shape[1] != x.shape[-1] or (inject is not None and inject.shape != (streams, x.shape[-1])):
        raise ValueError(f"hyper_connection_mix: x {tuple(x.shape)}, down {tuple(down.shape)}, up {tuple(up.shape)}, "
                         f"inject {None if inject is None else tuple(inject.shape)} do not fit {streams} streams")
    hidden = x.shape[-1] // streams
    normed = grouped_rms_norm(x, norm_weight, eps, hidden)
    low, weights = hyper_connection_gates(linear(normed, down), None if inject is None else linear(normed, inject),
                                          streams)
    return stream_mix(linear(low, up), normed, streams), weights


def hyper_connection_gates(low: torch.Tensor, logits: torch.Tensor | None, streams: int
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The low-rank mix's activation silu(low / S) and the injection weights 2 sigmoid(logits / S) (None without
    ``logits``: the final mixer), of [N, R] and [N, S] rows."""
    kernel = triton_kernel("hyper_connection", "hyper_connection_gates", low) if low.dim() == 2 else None
    if kernel is not None:
        return kernel(low, logits, streams)
    return hyper_connection_gates_ref(low, logits, streams)


def hyper_connection_gates_ref(low: torch.Tensor, logits: torch.Tensor | None, streams: int
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    return F.silu(low / streams), None if logits is None else 2 * torch.sigmoid(logits / streams)


def stream_mix(mix: torch.Tensor, normed: torch.Tensor, streams: int) -> torch.Tensor:
    """The sublayer's input [N, H]: the mean over the streams of sigmoid(mix) * normed (both [N, S * H])."""
    if mix.shape != normed.shape or mix.dim() != 2 or mix.shape[1] % streams:
        raise ValueError(f"stream_mix: mix {tuple(mix.shape)} and normed {tuple(normed.shape)} must be the same "
                         f"[N, {streams} * H]")
    kernel = triton_kernel("hyper_connection", "stream_mix", mix)
    if kernel is not None:
        return kernel(mix, normed, streams)
    return stream_mix_ref(mix, normed, streams)


def stream_mix_ref(mix: torch.Tensor, normed: torch.Tensor, streams: int) -> torch.Tensor:
    hidden = mix.shape[-1] // streams
    return (torch.sigmoid(mix).unflatten(-1, (streams, hidden)) * normed.unflatten(-1, (streams, hidden))).mean(-2)


def hyper_connection_inject(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The residual after a sublayer: x [N, S * H] + out [N, H] scaled per stream by weights [N, S]."""
    streams = weights.shape[-1]
    if x.shape[:-1] != out.shape[:-1] or x.shape[-1] != streams * out.shape[-1] or weights.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"hyper_connection_inject: x {tuple(x.shape)}, out {tuple(out.shape)}, weights "
                         f"{tuple(weights.shape)} do not fit")
    kernel = triton_kernel("hyper_connection", "hyper_connection_inject", x) if x.dim() == 2 else None
    if kernel is not None:
        return kernel(x, out, weights)
    return hyper_connection_inject_ref(x, out, weights)


def hyper_connection_inject_ref(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return x + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
