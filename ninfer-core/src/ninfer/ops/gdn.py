"""Gated DeltaNet: gates, chunked prefill with initial/final state, and the one-step decode update.

Per value head h (key head h // (HV // HK)), with q and k L2-normalised and q scaled by Dk^-1/2:
    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
The state S is [Dk, Dv] in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops._dispatch import triton_kernel

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
    hk, dk = q.shape[-2:]
    hv = v.shape[-2]
    if (k.shape != q.shape or v.shape[:-2] != lead or g.shape != (*lead, hv) or beta.shape != g.shape
            or hv % hk):
        raise ValueError(f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
                         f"beta {tuple(beta.shape)} do not fit (HV must be a multiple of HK)")
    del dk


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
