"""Partial rotary position embedding (NeoX rotate_half on the first rotary_dim dims of each head).

MRoPE (vision prompts) gives each token three positions (t, h, w); each frequency slot reads one of them
(``mrope_axes``), so the cos/sin tables keep their shape and ``apply_rope`` is the same.
"""

from __future__ import annotations

import torch

from ninfer.ops.dispatch import triton_kernel


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [rotary_dim // 2]: the rotation rate of each dim pair, theta ** (-2i / rotary_dim) (as HF)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be positive and even, got {rotary_dim}")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    return 1.0 / (theta ** exponent)


def mrope_axes(rotary_dim: int, section: tuple[int, ...], device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [rotary_dim // 2]: which of the (t, h, w) positions each frequency slot rotates by, interleaved as
    Qwen3.5 does: slot j takes h when j % 3 == 1 and j < 3 * section[1], w when j % 3 == 2 and j < 3 * section[2],
    t otherwise (transformers' ``recomposition_frequencies``)."""
    if len(section) != 3 or min(section) < 0:
        raise ValueError(f"mrope_section must be three non-negative slot counts (t, h, w), got {section}")
    j = torch.arange(rotary_dim // 2)
    axes = torch.zeros_like(j)
    axes[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axes.to(device)


def rope_angles_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                        axes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, len(inv_freq)] of the fp32 angles positions * inv_freq, rounded to ``dtype``. ``positions``
    is [N], or [3, N] (t, h, w) with ``axes`` (``mrope_axes``) naming the row each frequency slot reads."""
    inv = inv_freq.to(positions.device)
    if positions.dim() == 2:
        if axes is None or positions.shape[0] != 3 or axes.shape != inv.shape:
            raise ValueError(f"MRoPE positions {tuple(positions.shape)} need [3, N] and axes of one entry per "
                             f"frequency slot ({inv.numel()})")
        angles = positions.to(torch.float32)[axes.to(positions.device)].T * inv[None, :]
    else:
        angles = positions.to(torch.float32)[:, None] * inv[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, rotary_dim // 2] for int64 positions [N] (angles computed in fp32)."""
    return rope_angles_cos_sin(positions, rope_inv_freq(rotary_dim, theta, positions.device), dtype)


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    half = rotary_dim // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x[N, H, D] with the first rotary_dim dims rotated (pairs (i, i + rotary_dim/2)); the rest unchanged."""
    if x.dim() != 3 or rotary_dim > x.shape[-1] or cos.shape != (x.shape[0], rotary_dim // 2):
        raise ValueError(f"apply_rope: x {tuple(x.shape)}, cos {tuple(cos.shape)}, rotary_dim {rotary_dim} "
                         "do not fit (want x[N, H, D], cos[N, rotary_dim // 2])")
    kernel = triton_kernel("rope", "apply_rope", x)
    if kernel is not None:
        return kernel(x, cos, sin, rotary_dim)
    return apply_rope_ref(x, cos, sin, rotary_dim)
