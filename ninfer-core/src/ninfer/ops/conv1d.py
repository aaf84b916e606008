"""Depthwise causal conv1d (+ SiLU) of the GDN mixer: prefill over a sequence and the one-step update.

The conv state of a sequence is its last K-1 inputs, [C, K-1], oldest first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops.dispatch import triton_kernel


def causal_conv1d_prefill_ref(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                              has_initial_state: bool) -> torch.Tensor:
    T, C = x.shape
    history = conv_state.float() if has_initial_state else x.new_zeros(conv_state.shape, dtype=torch.float32)
    window = torch.cat((history, x.float().t()), dim=1)  # [C, K-1+T]
    y = F.conv1d(window[None], weight.float()[:, None, :], groups=C)[0]  # [C, T]
    conv_state.copy_(window[:, window.shape[1] - conv_state.shape[1]:])
    return F.silu(y).t().to(x.dtype)


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                          has_initial_state: bool) -> torch.Tensor:
    """y[T, C] = silu(depthwise causal conv of x[T, C] with weight[C, K]), continuing from conv_state
    [C, K-1] (zeros when has_initial_state is False); conv_state is overwritten with the last K-1 inputs."""
    C, K = weight.shape
    if x.dim() != 2 or x.shape[1] != C or conv_state.shape != (C, K - 1):
        raise ValueError(f"causal_conv1d_prefill: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"conv_state {tuple(conv_state.shape)} do not fit")
    kernel = triton_kernel("conv1d", "causal_conv1d_prefill", x)
    if kernel is not None:
        return kernel(x, weight, conv_state, has_initial_state)
    return causal_conv1d_prefill_ref(x, weight, conv_state, has_initial_state)


def causal_conv1d_decode_ref(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                             slots: torch.Tensor) -> torch.Tensor:
    window = torch.cat((conv_states[slots].float(), x.float()[:, :, None]), dim=2)  # [B, C, K]
    y = (window * weight.float()[None]).sum(-1)
    conv_states[slots] = window[:, :, 1:].to(conv_states.dtype)
    return F.silu(y).to(x.dtype)


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """One conv step per row: x[B, C] continues conv_states[slots[b]] ([S, C, K-1], updated in place)."""
    C, K = weight.shape
    if x.dim() != 2 or x.shape[1] != C or conv_states.shape[1:] != (C, K - 1) or slots.shape != x.shape[:1]:
        raise ValueError(f"causal_conv1d_decode: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"conv_states {tuple(conv_states.shape)}, slots {tuple(slots.shape)} do not fit")
    kernel = triton_kernel("conv1d", "causal_conv1d_decode", x)
    if kernel is not None:
        return kernel(x, weight, conv_states, slots)
    return causal_conv1d_decode_ref(x, weight, conv_states, slots)
