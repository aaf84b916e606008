"""Causal conv1d prefill / decode references against a direct definition, and chunk continuity."""

import torch
import torch.nn.functional as F

from ninfer.ops import causal_conv1d_decode, causal_conv1d_prefill


def direct(x_full, w):
    """y[t, c] = silu(sum_j w[c, j] * x[t - K + 1 + j, c]) with zeros before the start."""
    T, C = x_full.shape
    K = w.shape[1]
    xp = torch.cat((torch.zeros(K - 1, C), x_full))
    y = torch.stack([(xp[t:t + K].t() * w).sum(-1) for t in range(T)])
    return F.silu(y)


def test_prefill_matches_direct_and_chunks_continue():
    torch.manual_seed(0)
    C, K, T = 12, 4, 11
    w, x = torch.randn(C, K), torch.randn(T, C)
    state = torch.full((C, K - 1), 7.0)  # garbage: has_initial_state=False must ignore it
    y = causal_conv1d_prefill(x, w, state, False)
    torch.testing.assert_close(y, direct(x, w))
    torch.testing.assert_close(state, x[-(K - 1):].t())
    # Chunks of 2, 1 (shorter than K-1) and 8 continue from the state.
    state2 = torch.empty(C, K - 1)
    parts = [causal_conv1d_prefill(x[:2], w, state2, False), causal_conv1d_prefill(x[2:3], w, state2, True),
             causal_conv1d_prefill(x[3:], w, state2, True)]
    torch.testing.assert_close(torch.cat(parts), y)
    torch.testing.assert_close(state2, state)


def test_decode_updates_slots_of_a_strided_view():
    torch.manual_seed(0)
    C, K, T, S = 6, 4, 5, 4
    w, xs = torch.randn(C, K), torch.randn(2, T, C)
    backing = torch.zeros(S, 3, C, K - 1)  # [slot, layer, C, K-1]; layer 1 is the view under test
    states = backing[:, 1]
    slots = torch.tensor([3, 0])
    ys = torch.stack([causal_conv1d_decode(xs[:, t], w, states, slots) for t in range(T)], dim=1)
    for b in range(2):
        torch.testing.assert_close(ys[b], direct(xs[b], w))
        torch.testing.assert_close(states[slots[b]], xs[b, -(K - 1):].t())
    assert backing[:, [0, 2]].abs().sum() == 0 and states[[1, 2]].abs().sum() == 0
