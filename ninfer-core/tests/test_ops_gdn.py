"""Gated DeltaNet references: chunked prefill vs the per-token recurrence, state carry, decode steps."""

import pytest
import torch
import torch.nn.functional as F

from ninfer.ops import gdn_decode, gdn_gates, gdn_prefill


def recurrence(q, k, v, g, beta, S0):
    """Plain per-token recurrence in float64 (the definition)."""
    T, HK, Dk = q.shape
    HV = v.shape[1]
    r = HV // HK
    S = S0.double().clone()
    out = torch.empty(T, HV, v.shape[2], dtype=torch.float64)
    for t in range(T):
        for h in range(HV):
            qt, kt = F.normalize(q[t, h // r].double(), dim=0), F.normalize(k[t, h // r].double(), dim=0)
            qt = qt / Dk ** 0.5
            S[h] *= torch.exp(g[t, h].double())
            S[h] += torch.outer(kt, beta[t, h].double() * (v[t, h].double() - S[h].t() @ kt))
            out[t, h] = S[h].t() @ qt
    return out, S


def inputs(T, HK, HV, Dk=8, Dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, HK, Dk, generator=gen), torch.randn(T, HK, Dk, generator=gen)
    v = torch.randn(T, HV, Dv, generator=gen)
    a, b = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    g, beta = gdn_gates(a, b, torch.randn(HV, generator=gen) * 0.5, torch.randn(HV, generator=gen))
    return q, k, v, g, beta


def test_gates():
    a, b, A_log, dt = torch.randn(3, 2), torch.randn(3, 2), torch.randn(2), torch.randn(2)
    g, beta = gdn_gates(a.bfloat16(), b.bfloat16(), A_log, dt)
    assert g.dtype == beta.dtype == torch.float32
    torch.testing.assert_close(g, -A_log.exp() * torch.log1p(torch.exp(a.bfloat16().float() + dt)))
    torch.testing.assert_close(beta, torch.sigmoid(b.bfloat16().float()))


@pytest.mark.parametrize("T,HK,HV", [(1, 2, 2), (63, 1, 2), (64, 2, 2), (150, 2, 4)])
def test_prefill_matches_recurrence(T, HK, HV):
    q, k, v, g, beta = inputs(T, HK, HV)
    S0 = torch.randn(HV, 8, 6)
    state = S0.clone()
    o = gdn_prefill(q, k, v, g, beta, state, True)
    want_o, want_S = recurrence(q, k, v, g, beta, S0)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state.double(), want_S, rtol=1e-4, atol=1e-5)
    # Without an initial state the garbage in ``state`` is ignored.
    state.fill_(1e3)
    o0 = gdn_prefill(q, k, v, g, beta, state, False)
    want_o0, _ = recurrence(q, k, v, g, beta, torch.zeros(HV, 8, 6))
    torch.testing.assert_close(o0.double(), want_o0, rtol=1e-4, atol=1e-5)


def test_chunked_prefill_and_decode_continue_the_state():
    T, HK, HV = 100, 2, 4
    q, k, v, g, beta = inputs(T, HK, HV, seed=1)
    full_state = torch.empty(HV, 8, 6)
    full = gdn_prefill(q, k, v, g, beta, full_state, False)
    # Prefill 70 (crosses a chunk boundary), then 27 more, then 3 decode steps on slot 2 of a strided pool.
    pool = torch.zeros(4, 2, HV, 8, 6)[:, 1]
    parts = [gdn_prefill(q[:70], k[:70], v[:70], g[:70], beta[:70], pool[2], False),
             gdn_prefill(q[70:97], k[70:97], v[70:97], g[70:97], beta[70:97], pool[2], True)]
    slots = torch.tensor([2])
    for t in range(97, T):
        parts.append(gdn_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], pool, slots))
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[2], full_state, rtol=1e-4, atol=1e-5)
    assert pool[[0, 1, 3]].abs().sum() == 0


def test_decode_rows_are_independent():
    HK, HV = 1, 2
    q, k, v, g, beta = inputs(3, HK, HV, seed=2)
    pool = torch.randn(5, HV, 8, 6)
    alone = pool.clone()
    o = gdn_decode(q, k, v, g, beta, pool, torch.tensor([4, 0, 2]))
    for b, slot in enumerate([4, 0, 2]):
        ob = gdn_decode(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], alone, torch.tensor([slot]))
        torch.testing.assert_close(o[b:b + 1], ob)
    torch.testing.assert_close(pool, alone)


def test_shape_errors_are_named():
    q, k, v, g, beta = inputs(4, 2, 4)
    with pytest.raises(ValueError, match="gdn_prefill"):
        gdn_prefill(q, k, v, g, beta, torch.zeros(4, 8, 6, dtype=torch.bfloat16), False)
    with pytest.raises(ValueError, match="HV must be a multiple"):
        gdn_prefill(q, k, v[:, :3], g[:, :3], beta[:, :3], torch.zeros(3, 8, 6), False)
