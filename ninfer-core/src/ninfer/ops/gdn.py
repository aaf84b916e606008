"""Gated DeltaNet: gates, chunked prefill with initial/final state, the one-step decode update, and the
fused decode step (conv update + gates + recurrent step).

Per value head h (key head h // (HV // HK)), with q and k L2-normalised and q scaled by Dk^-1/2:
    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
The state S is [Dk, Dv] in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops.conv1d import causal_conv1d_decode
from ninfer.ops.dispatch import triton_kernel

CHUNK = 64


def gdn_gates_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias) (log decay), beta = sigmoid(b); both fp32 [N, HV]."""
    kernel = triton_kernel("gdn", "gdn_gates", a)
    if kernel is not None:
        return kernel(a, b, A_log, dt_bias)
    return gdn_gates_ref(a, b, A_log, dt_bias)


def _normalised_qk(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q, k L2-normalised over Dk, q scaled by Dk^-1/2, key heads repeated for their value heads."""
    def l2(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    q, k = l2(q) * q.shape[-1] ** -0.5, l2(k)
    r = hv // q.shape[-2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
    return q, k


def _check(q, k, v, g, beta, what: str) -> None:
    lead = q.shape[:-2]
    hk = q.shape[-2]
    hv = v.shape[-2]
    if (k.shape != q.shape or v.shape[:-2] != lead or g.shape != (*lead, hv) or beta.shape != g.shape
            or hv % hk):
        raise ValueError(f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
                         f"beta {tuple(beta.shape)} do not fit (HV must be a multiple of HK)")


def gdn_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, has_initial_state: bool) -> torch.Tensor:
    """Chunked (UT-transform) form, exact in fp32.

    Inside a chunk with cumulative log decay c_t, the corrections D_t = beta_t (v_t - (state before t)^T k_t)
    solve (I + A) D = beta V - beta e^c K S0, with A[t, s] = beta_t e^(c_t - c_s) k_t.k_s for s < t;
    then O = e^c Q S0 + (e^(c_t - c_s) q_t.k_s)_(s<=t) D and S_end = e^c_end S0 + (e^(c_end - c) K)^T D.
    """
    T, hv, dv = v.shape
    dk = q.shape[-1]
    qf, kf = _normalised_qk(q, k, hv)  # [T, HV, Dk]
    n = -(-T // CHUNK)
    pad = n * CHUNK - T

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, HV, ...] -> [HV, n, CHUNK, ...]; padding is inert
        x = F.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.reshape(n, CHUNK, hv, *x.shape[2:]).movedim(2, 0)

    Q, K, V = chunks(qf), chunks(kf), chunks(v)              # [HV, n, C, D]
    G = chunks(g[..., None])[..., 0]                         # [HV, n, C]
    Bt = chunks(beta[..., None])                             # [HV, n, C, 1]
    c = G.cumsum(-1)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    strict = lower.clone().fill_diagonal_(False)
    rel = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # e^(c_t - c_s), s <= t
    A = (Bt * (K @ K.transpose(-1, -2)) * rel).masked_fill(~strict, 0.0)
    eye = torch.eye(CHUNK, dtype=A.dtype, device=A.device)
    U = torch.linalg.solve_triangular(eye + A, Bt * V, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(eye + A, Bt * c.exp()[..., None] * K, upper=False, unitriangular=True)
    QK = (Q @ K.transpose(-1, -2)) * rel
    Qd = Q * c.exp()[..., None]
    Kd = K * (c[..., -1:] - c).exp()[..., None]
    end = c[..., -1].exp()[..., None, None]                  # [HV, n, 1, 1]

    S = state.float() if has_initial_state else torch.zeros(hv, dk, dv, dtype=torch.float32, device=q.device)
    out = torch.empty(hv, n, CHUNK, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        D = U[:, i] - W[:, i] @ S
        out[:, i] = Qd[:, i] @ S + QK[:, i] @ D
        S = end[:, i] * S + Kd[:, i].transpose(-1, -2) @ D
    state.copy_(S)
    return out.reshape(hv, n * CHUNK, dv)[:, :T].transpose(0, 1).to(v.dtype)


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, has_initial_state: bool) -> torch.Tensor:
    """One sequence: q, k [T, HK, Dk], v [T, HV, Dv], g, beta fp32 [T, HV]; state [HV, Dk, Dv] fp32 is the
    initial state (zeros when has_initial_state is False) and is overwritten with the final one.
    Returns o [T, HV, Dv] in v.dtype."""
    _check(q, k, v, g, beta, "gdn_prefill")
    if state.shape != (v.shape[1], q.shape[2], v.shape[2]) or state.dtype != torch.float32:
        raise ValueError(f"gdn_prefill: state must be fp32 [HV, Dk, Dv], got {state.dtype} {tuple(state.shape)}")
    kernel = triton_kernel("gdn", "gdn_prefill", q)
    if kernel is not None:
        return kernel(q, k, v, g, beta, state, has_initial_state)
    return gdn_prefill_ref(q, k, v, g, beta, state, has_initial_state)


def gdn_decode_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    qf, kf = _normalised_qk(q, k, v.shape[1])                # [B, HV, Dk]
    S = states[slots] * g.float().exp()[..., None, None]     # [B, HV, Dk, Dv]
    delta = beta.float()[..., None] * (v.float() - torch.einsum("bhkv,bhk->bhv", S, kf))
    S = S + kf[..., :, None] * delta[..., None, :]
    states[slots] = S
    return torch.einsum("bhkv,bhk->bhv", S, qf).to(v.dtype)


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One step per row: q, k [B, HK, Dk], v [B, HV, Dv], g, beta [B, HV]; states [S, HV, Dk, Dv] fp32
    (a strided view), row b reads and updates states[slots[b]] in place. Returns o [B, HV, Dv]."""
    _check(q, k, v, g, beta, "gdn_decode")
    if states.shape[1:] != (v.shape[1], q.shape[2], v.shape[2]) or states.dtype != torch.float32 \
            or slots.shape != q.shape[:1]:
        raise ValueError(f"gdn_decode: states must be fp32 [S, HV, Dk, Dv] and slots [B], got {states.dtype} "
                         f"{tuple(states.shape)}, slots {tuple(slots.shape)}")
    kernel = triton_kernel("gdn", "gdn_decode", q)
    if kernel is not None:
        return kernel(q, k, v, g, beta, states, slots)
    return gdn_decode_ref(q, k, v, g, beta, states, slots)


def _fused_head_counts(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                       conv_states: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor) -> tuple[int, int, int, int]:
    """(HK, HV, Dk, Dv) read off the shapes, or a ValueError naming what does not fit."""
    def bad(why: str) -> ValueError:
        return ValueError(f"gdn_decode_fused: {why} (mixed_qkv {tuple(mixed_qkv.shape)}, a {tuple(a.shape)}, "
                          f"b {tuple(b.shape)}, conv_weight {tuple(conv_weight.shape)}, conv_states "
                          f"{tuple(conv_states.shape)}, A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)}, "
                          f"states {tuple(states.shape)}, slots {tuple(slots.shape)})")

    if mixed_qkv.dim() != 2 or states.dim() != 4 or conv_weight.dim() != 2:
        raise bad("mixed_qkv must be [B, conv_dim], conv_weight [conv_dim, K] and states [S, HV, Dk, Dv]")
    B, conv_dim = mixed_qkv.shape
    _, hv, dk, dv = states.shape
    if states.dtype != torch.float32:
        raise bad(f"states must be fp32, got {states.dtype}")
    if a.shape != (B, hv) or b.shape != (B, hv) or A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise bad("a and b must be [B, HV], A_log and dt_bias [HV]")
    if slots.shape != (B,):
        raise bad("slots must be [B]")
    if conv_weight.shape[0] != conv_dim or conv_states.shape[1:] != (conv_dim, conv_weight.shape[1] - 1):
        raise bad("conv_weight must be [conv_dim, K] and conv_states [S, conv_dim, K-1]")
    key_channels = conv_dim - hv * dv
    hk = key_channels // (2 * dk) if key_channels > 0 else 0
    if hk == 0 or 2 * hk * dk != key_channels or hv % hk:
        raise bad("conv_dim must be 2 * HK * Dk + HV * Dv with HV a multiple of HK")
    return hk, hv, dk, dv


def gdn_decode_fused_ref(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                         conv_states: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                         states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # Exactly the unfused sequence through the public (dispatching) ops: what the fused kernel must reproduce,
    # and on CUDA without that kernel the same validated kernels the model ran before the fusion.
    hk, hv, dk, dv = _fused_head_counts(mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots)
    B = mixed_qkv.shape[0]
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    qkv = causal_conv1d_decode(mixed_qkv, conv_weight, conv_states, slots)
    q, k, v = qkv.split((hk * dk, hk * dk, hv * dv), dim=-1)
    return gdn_decode(q.reshape(B, hk, dk), k.reshape(B, hk, dk), v.reshape(B, hv, dv), g, beta, states, slots)


def gdn_decode_fused(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                     conv_states: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The whole GDN decode step between in_proj and the gated norm, one token per row.

    mixed_qkv [B, conv_dim] (q | k | v channels, conv_dim = 2 HK Dk + HV Dv), a, b [B, HV]; conv_weight
    [conv_dim, K]; conv_states [S, conv_dim, K-1] and states [S, HV, Dk, Dv] fp32 are (strided) views whose
    rows slots[b] are read and updated in place. Runs the causal conv1d update (+SiLU), the gates and the
    recurrent step; returns o [B, HV, Dv] in mixed_qkv.dtype.
    """
    _fused_head_counts(mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots)
    kernel = triton_kernel("gdn", "gdn_decode_fused", mixed_qkv)
    if kernel is not None:
        return kernel(mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots)
    return gdn_decode_fused_ref(mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots)


def gdn_verify_ref(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                   conv_states: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor,
                   slots: torch.Tensor, step_conv: torch.Tensor, step_states: torch.Tensor) -> torch.Tensor:
    # Step t starts from step t-1's copy (step 0 from the slot) and runs the fused decode step on it in place:
    # exactly R decode steps, each one's state kept.
    B, R = step_conv.shape[:2]
    rows = torch.arange(B, device=mixed_qkv.device)
    x, a_, b_ = (t.view(B, R, -1) for t in (mixed_qkv, a, b))
    out = []
    for t in range(R):
        step_conv[:, t] = conv_states[slots] if t == 0 else step_conv[:, t - 1]
        step_states[:, t] = states[slots] if t == 0 else step_states[:, t - 1]
        out.append(gdn_decode_fused(x[:, t], a_[:, t], b_[:, t], conv_weight, step_conv[:, t], A_log, dt_bias,
                                    step_states[:, t], rows))
    return torch.stack(out, dim=1).flatten(0, 1)


def gdn_verify(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
               conv_states: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor,
               slots: torch.Tensor, step_conv: torch.Tensor, step_states: torch.Tensor) -> torch.Tensor:
    """R decode steps per row that keep every step's state (speculative verification), the slot left as it was.

    mixed_qkv [B*R, conv_dim], a, b [B*R, HV] hold row b's R tokens at b*R..b*R+R-1; conv_states [S, conv_dim,
    K-1] and states [S, HV, Dk, Dv] fp32 are read at slots[b]; step_conv [B, R, conv_dim, K-1] and step_states
    [B, R, HV, Dk, Dv] receive the state after each token (step t = after token t). Returns o [B*R, HV, Dv],
    equal to R successive ``gdn_decode_fused`` steps. ``gdn_verify_commit`` then moves the accepted step in.
    """
    B, R = step_conv.shape[:2]
    if mixed_qkv.shape[0] != B * R or a.shape[:1] != (B * R,) or b.shape[:1] != (B * R,) \
            or step_states.shape[:2] != (B, R) or slots.shape != (B,) \
            or step_conv.shape[2:] != conv_states.shape[1:] or step_states.shape[2:] != states.shape[1:]:
        raise ValueError(f"gdn_verify: mixed_qkv {tuple(mixed_qkv.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
                         f"slots {tuple(slots.shape)}, step_conv "
                         f"{tuple(step_conv.shape)}, step_states {tuple(step_states.shape)} must be [B*R, ...], [B] "
                         f"and [B, R, ...] of conv_states {tuple(conv_states.shape[1:])} / states "
                         f"{tuple(states.shape[1:])}")
    kernel = triton_kernel("gdn", "gdn_verify", mixed_qkv)
    if kernel is not None:
        return kernel(mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots, step_conv,
                      step_states)
    return gdn_verify_ref(mixed_qkv, a, b, conv_weight, conv_states, A_log, dt_bias, states, slots, step_conv,
                          step_states)


def gdn_verify_commit(conv_states: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, step_conv: torch.Tensor,
                      step_states: torch.Tensor, steps: torch.Tensor) -> None:
    """Move each row's kept step into its slot: conv_states[slots[b]] = step_conv[b, steps[b]] (and the recurrent
    state alike), for every layer at once (the views may carry a layer axis after the slot / step axes)."""
    B, R = step_conv.shape[:2]
    if step_states.shape[:2] != (B, R) or slots.shape != (B,) or steps.shape != (B,) \
            or step_conv.shape[2:] != conv_states.shape[1:] or step_states.shape[2:] != states.shape[1:]:
        raise ValueError(f"gdn_verify_commit: slots {tuple(slots.shape)}, steps {tuple(steps.shape)}, step_conv "
                         f"{tuple(step_conv.shape)}, step_states {tuple(step_states.shape)} must be [B], [B] and "
                         f"[B, R, ...] of conv_states {tuple(conv_states.shape[1:])} / states {tuple(states.shape[1:])}")
    kernel = triton_kernel("gdn", "gdn_verify_commit", states)
    if kernel is not None:
        return kernel(conv_states, states, slots, step_conv, step_states, steps)
    return gdn_verify_commit_ref(conv_states, states, slots, step_conv, step_states, steps)


def gdn_verify_commit_ref(conv_states: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                          step_conv: torch.Tensor, step_states: torch.Tensor, steps: torch.Tensor) -> None:
    rows = torch.arange(slots.shape[0], device=slots.device)
    conv_states[slots] = step_conv[rows, steps]
    states[slots] = step_states[rows, steps]
