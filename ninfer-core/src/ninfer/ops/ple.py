"""Per-layer embeddings of hashed token n-grams (PLE) and the dilated causal conv that follows them.

A token's 2..n-gram ids hash its window (itself and up to n - 1 earlier tokens of its sequence, each shift
replaced by EOS once an EOS lies between: an n-gram never spans a document boundary) with odd 64-bit multipliers
XOR'd, wrapping as int64 does, into ``heads_per_ngram`` prime-sized slices of one table per layer (the primes
and the table's layout are the model config's). Sequences
are packed (``query_start_loc``) and each carries a short history across calls: its last ``n - 1`` token ids and
the conv's last ``(kernel - 1) * dilation`` inputs, read from and returned to per-sequence state rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ninfer.ops.hyper_connection import grouped_rms_norm
from ninfer.ops.linear import linear

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _MIX1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX2) & _MASK64
    return value ^ (value >> 31)


def ngram_multipliers(vocab_size: int, ngram_size: int, layer_index: int, seed: int) -> list[int]:
    """The odd hash multiplier of each shift 0..ngram_size-1 for the ``layer_index``-th PLE layer, each small
    enough that token id * multiplier stays below 2**63."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_SEED_STRIDE * layer_index
    return [2 * (_splitmix64((base + _GAMMA * (s + 1)) & _MASK64) % half) + 1 for s in range(ngram_size)]


def _token_seqs(query_start_loc: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence of each packed token [N], its offset within the sequence's new tokens [N])."""
    starts = query_start_loc.long()
    seq = torch.repeat_interleave(torch.arange(starts.shape[0] - 1, device=starts.device), starts.diff(),
                                  output_size=num_tokens)
    return seq, torch.arange(num_tokens, device=starts.device) - starts[seq]


def _window_index(starts: torch.Tensor, seq: torch.Tensor, local: torch.Tensor, back: torch.Tensor,
                  history_len: int, num_seqs: int) -> torch.Tensor:
    """Rows of ``cat([history.flatten(0, 1), new])`` (history [B, L, ...], new [N, ...]) holding the element
    ``back`` steps before offset ``local`` of sequence ``seq``'s new elements: [M, T] for back [T] <= L."""
    j = local[:, None] - back[None, :]
    seq = seq[:, None]
    return torch.where(j >= 0, num_seqs * history_len + starts[seq] + j, seq * history_len + history_len + j)


def _history_and_windows(new: torch.Tensor, history: torch.Tensor, query_start_loc: torch.Tensor,
                         backs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(windows [N, T, ...]: for each new element, the elements ``backs`` steps before it in its sequence; the new
    history [B, L, ...]: each sequence's last L elements)."""
    B, L = history.shape[:2]
    starts = query_start_loc.long()
    seq, local = _token_seqs(query_start_loc, new.shape[0])
    buf = torch.cat([history.flatten(0, 1), new])
    windows = buf[_window_index(starts, seq, local, backs, L, B)]
    ends = torch.arange(B, device=starts.device)
    last = _window_index(starts, ends, starts.diff(), torch.arange(L, 0, -1, device=starts.device), L, B)
    return windows, buf[last]


def ngram_windows(ids: torch.Tensor, history: torch.Tensor, query_start_loc: torch.Tensor,
                  has_initial_state: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N] packed, history [B, n - 1] (each sequence's last ids; a row without initial state starts as all
    EOS) -> (windows [N, n] int64: column s the token s steps back, EOS once an EOS lies within those s steps;
    the new history [B, n - 1])."""
    B, ctx = history.shape
    if query_start_loc.shape != (B + 1,) or has_initial_state.shape != (B,) or ids.dim() != 1:
        raise ValueError(f"ngram_windows: ids {tuple(ids.shape)}, history {tuple(history.shape)}, query_start_loc "
                         f"{tuple(query_start_loc.shape)}, has_initial_state {tuple(has_initial_state.shape)} do not fit")
    history = torch.where(has_initial_state[:, None], history.long(), eos_token_id)
    windows, new_history = _history_and_windows(ids.long(), history, query_start_loc,
                                                torch.arange(ctx + 1, device=ids.device))
    eos_seen = (windows[:, 1:] == eos_token_id).cumsum(dim=1) > 0
    windows = torch.cat([windows[:, :1], torch.where(eos_seen, eos_token_id, windows[:, 1:])], dim=1)
    return windows, new_history


def ngram_hash_ids(windows: torch.Tensor, multipliers: torch.Tensor, head_vocab: torch.Tensor,
                   head_offsets: torch.Tensor, heads_per_ngram: int) -> torch.Tensor:
    """windows [N, n] -> table rows [N, (n - 1) * heads_per_ngram]: for each order k = 2..n, the XOR of the first k
    shifts times their multipliers (int64, wrapping), modulo each of its heads' prime sizes, plus the heads'
    offsets in the table."""
    n = windows.shape[1]
    if multipliers.shape != (n,) or head_vocab.shape != ((n - 1) * heads_per_ngram,) \
            or head_offsets.shape != head_vocab.shape:
        raise ValueError(f"ngram_hash_ids: windows {tuple(windows.shape)}, multipliers {tuple(multipliers.shape)}, "
                         f"head sizes {tuple(head_vocab.shape)} / offsets {tuple(head_offsets.shape)} do not fit "
                         f"{heads_per_ngram} heads per order")
    terms = windows * multipliers
    mixed, blocks = terms[:, 0], []
    for k in range(2, n + 1):
        mixed = torch.bitwise_xor(mixed, terms[:, k - 1])
        heads = slice((k - 2) * heads_per_ngram, (k - 1) * heads_per_ngram)
        blocks.append(torch.remainder(mixed[:, None], head_vocab[heads]) + head_offsets[heads])
    return torch.cat(blocks, dim=1)


def gather_rows(table: torch.Tensor, ids: torch.Tensor, device: torch.device | str,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """table[ids] where the table lives (host memory included), then only those rows go to ``device``."""
    rows = F.embedding(ids.to(table.device), table)
    return rows.to(device=device, dtype=dtype or table.dtype, non_blocking=True)


def dilated_causal_conv(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor, query_start_loc: torch.Tensor,
                        dilation: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of packed rows x [N, C] with weight [C, K] and dilation d: out[t] = sum_k w[:, k] *
    x[t - (K - 1 - k) * d], earlier inputs of the sequence from history [B, (K - 1) * d, C]. Returns (out [N, C],
    the new history)."""
    C, K = weight.shape
    if x.dim() != 2 or x.shape[1] != C or history.shape[1:] != ((K - 1) * dilation, C):
        raise ValueError(f"dilated_causal_conv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, history "
                         f"{tuple(history.shape)} do not fit dilation {dilation}")
    backs = torch.arange(K - 1, -1, -1, device=x.device) * dilation
    windows, new_history = _history_and_windows(x, history.to(x.dtype), query_start_loc, backs)
    out = (windows.float() * weight.float().T).sum(dim=1)
    return out.to(x.dtype), new_history


def ple_gated_values(x: torch.Tensor, embeddings: torch.Tensor, key_proj: torch.Tensor, value_proj: torch.Tensor,
                     norm_key: torch.Tensor, norm_query: torch.Tensor, norm_conv: torch.Tensor, streams: int,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The n-gram embedding [N, E] gated into each residual stream of x [N, S * H]: one value, one key per stream,
    gate = sigmoid(signed sqrt of <normed key, normed stream> / sqrt(H)). Returns (gated [N, S * H], its grouped
    norm, the conv's input)."""
    hidden = x.shape[-1] // streams
    key = grouped_rms_norm(linear(embeddings, key_proj), norm_key, eps, hidden).unflatten(-1, (streams, hidden))
    query = grouped_rms_norm(x, norm_query, eps, hidden).unflatten(-1, (streams, hidden))
    score = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hidden)
    score = score.abs().clamp_min(1e-6).sqrt() * score.sign()
    gated = (torch.sigmoid(score) * linear(embeddings, value_proj).unsqueeze(-2)).flatten(-2)
    return gated, grouped_rms_norm(gated, norm_conv, eps, hidden)


def ple_layer(x: torch.Tensor, embeddings: torch.Tensor, key_proj: torch.Tensor, value_proj: torch.Tensor,
              norm_key: torch.Tensor, norm_query: torch.Tensor, norm_conv: torch.Tensor, conv_weight: torch.Tensor,
              conv_history: torch.Tensor, query_start_loc: torch.Tensor, *, streams: int, dilation: int,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What a PLE layer adds to the residual x [N, S * H]: gated + silu(dilated conv of its norm). conv_history
    [B, (K - 1) * dilation, S * H] (zeros for a fresh sequence). Returns (addend [N, S * H], new conv history)."""
    gated, normed = ple_gated_values(x, embeddings, key_proj, value_proj, norm_key, norm_query, norm_conv, streams,
                                     eps)
    conv, new_history = dilated_causal_conv(normed, conv_weight, conv_history, query_start_loc, dilation)
    return gated + F.silu(conv), new_history
