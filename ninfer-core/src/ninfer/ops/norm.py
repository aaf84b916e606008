"""RMSNorm variants of Qwen3.5: zero-centred (1 + w) and the GDN output norm gated by silu(z) (or sigmoid(z))."""

from __future__ import annotations

import torch

from ninfer.ops.dispatch import triton_kernel
from ninfer.ops.linear import linear


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, *, one_plus: bool = True) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    # The whole product stays in fp32 and is cast once (HF casts after the multiply).
    return (y * (1.0 + w if one_plus else w)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, one_plus: bool = True) -> torch.Tensor:
    """x[..., D] * rsqrt(mean(x^2) + eps) * (1 + w) (or * w), math in fp32, result in x.dtype."""
    kernel = triton_kernel("norm", "rms_norm", x)
    if kernel is not None:
        return kernel(x, weight, eps, one_plus=one_plus)
    return rms_norm_ref(x, weight, eps, one_plus=one_plus)


def embed_rms_norm_ref(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       one_plus: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.nn.functional.embedding(ids, table)
    return x, rms_norm_ref(x, weight, eps, one_plus=one_plus)


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   one_plus: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): the embedding rows of ``ids`` [N] in ``table`` [V, D] (a model's residual stream) and their
    ``rms_norm`` (its first norm), one kernel on the GPU."""
    kernel = triton_kernel("norm", "embed_rms_norm", table)
    if kernel is not None:
        return kernel(ids, table, weight, eps, one_plus=one_plus)
    return embed_rms_norm_ref(ids, table, weight, eps, one_plus=one_plus)


_GATES = {"silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid}


def rms_norm_gated_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       activation: str = "silu") -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    # Norm first, then the gate; the normed value is rounded to x.dtype before the weight, as in HF.
    y = (weight * normed).float() * _gate(activation)(z.float())
    return y.to(x.dtype)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   activation: str = "silu") -> torch.Tensor:
    """GDN output norm over the last dim D: (w * normed(x)) * act(z), plain w (not 1 + w); ``activation`` is
    "silu" (Qwen3.5) or "sigmoid" (Qwen4Exp's ``output_gate_type``), each its own Triton entry."""
    _gate(activation)
    kernel = triton_kernel("norm", "rms_norm_gated" if activation == "silu" else "rms_norm_gated_sigmoid", x)
    if kernel is not None:
        return kernel(x, z, weight, eps)
    return rms_norm_gated_ref(x, z, weight, eps, activation=activation)


def _gate(activation: str):
    if activation not in _GATES:
        raise ValueError(f"rms_norm_gated: unknown gate activation {activation!r} (known: {', '.join(_GATES)})")
    return _GATES[activation]


def _addend(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What joins the residual: x, or ``sum_terms(x)`` for [..., S, D] terms; mismatches raise."""
    # A mismatch would silently broadcast in `residual + x`; say what is wrong instead.
    terms = x.dim() == residual.dim() + 1
    if (x[..., 0, :] if terms else x).shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} must have the same shape and dtype (or x [..., S, D] terms of it)")
    if x.shape[-1:] != weight.shape:
        raise ValueError(f"add_rms_norm: last dimension {x.shape[-1]} does not match the weight's "
                         f"{tuple(weight.shape)}")
    return sum_terms(x) if terms else x


def sum_terms(x: torch.Tensor) -> torch.Tensor:
    """x [..., S, D] -> [..., D]: the S terms added in order in fp32, rounded once to x's dtype (what the MoE slot
    sum and the fused norm's terms do; torch's own sum may add in another order)."""
    acc = x[..., 0, :].float()
    for t in range(1, x.shape[-2]):
        acc = acc + x[..., t, :].float()
    return acc.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                     one_plus: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = residual + _addend(x, residual, weight)  # rounded to the model dtype before the norm reads it, as the unfused model
    return rms_norm_ref(new_residual, weight, eps, one_plus=one_plus), new_residual


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 one_plus: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream step of a decoder layer: (rms_norm(residual + x), residual + x).

    The sum is rounded to the model dtype before it is normed. x may also be [..., S, D] terms of the
    sublayer's output (a MoE block's slot rows, ``moe_block(summed=False)``): ``sum_terms`` of them is
    added. Without the fused kernel this is exactly the unfused sequence (the terms' sum, a torch add, then
    the dispatched ``rms_norm``).
    """
    kernel = triton_kernel("norm", "add_rms_norm", x)
    if kernel is not None:
        return kernel(x, residual, weight, eps, one_plus=one_plus)
    new_residual = residual + _addend(x, residual, weight)
    return rms_norm(new_residual, weight, eps, one_plus=one_plus), new_residual


def add_rms_norm_linear_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            projection: torch.Tensor, *, one_plus: bool = True
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    normed, new_residual = add_rms_norm_ref(x, residual, weight, eps, one_plus=one_plus)
    return normed, new_residual, torch.nn.functional.linear(normed, projection)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        projection: torch.Tensor, *, one_plus: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` and a small projection of its normed rows: (normed, residual + x, normed @ projection.T)
    with projection [P, D] (a MoE router's logits). On the GPU, a decode batch runs it as one kernel whose
    programs load their projection rows before the previous kernel has finished; otherwise it is exactly
    ``add_rms_norm`` then ``linear``. x holds plain rows here (no terms)."""
    if projection.dim() != 2 or projection.shape[1] != weight.shape[0] or projection.dtype != x.dtype:
        raise ValueError(f"add_rms_norm_linear: projection {tuple(projection.shape)} {projection.dtype} must be "
                         f"[P, {weight.shape[0]}] in {x.dtype}")
    if x.dim() != residual.dim():
        raise ValueError(f"add_rms_norm_linear: x {tuple(x.shape)} must be rows like residual "
                         f"{tuple(residual.shape)} (no terms)")
    kernel = triton_kernel("norm", "add_rms_norm_linear", x)
    if kernel is not None:
        fused = kernel(x, residual, weight, eps, projection, one_plus=one_plus)
        if fused is not None:
            return fused
    normed, new_residual = add_rms_norm(x, residual, weight, eps, one_plus=one_plus)
    return normed, new_residual, linear(normed, projection)
