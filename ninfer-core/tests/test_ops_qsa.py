"""QSA (Qwen4Exp's sparse attention) against transformers' ``Qwen4ExpTextAttention`` on a tiny random config, fp32:
our indexer queries, raw keys in a paged store with a shuffled page table, ``qsa_select`` and the gated
``paged_attention`` with ``selected_blocks`` give transformers' selected token sets for every query and its output;
chunked prefill and decode select what the whole prompt does. Four index heads, as published: with fewer, scores
tie at exactly zero (every head's dot negative) at the budget's edge, where we keep the earlier block and
transformers keeps torch.topk's order (``ninfer.ops.qsa``; ``test_ops_qsa_static`` tests the tie rule)."""

from __future__ import annotations

import pytest
import torch

from ninfer.ops import apply_rope, norm_rope_write_kv, paged_attention, qsa_select, rms_norm, rope_cos_sin
from ninfer.ops.rope import rope_inv_freq

pytest.importorskip("transformers.models.qwen4_exp")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
INDEX_HEADS, RATIO, BUDGET, THETA = 4, 4, 8, 10000.0
PAGE = 4


def hf_attention(partial: float, seed: int, index_dim: int = 16):
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    section = [2, 1, 1] if partial == 0.5 else [4, 2, 2]
    cfg = Qwen4ExpTextConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_hidden_layers=1, layer_types=["indexed_attention"], indexer_n_heads=INDEX_HEADS, indexer_kv_heads=1,
        indexer_head_dim=index_dim, indexer_budget=BUDGET, indexer_compress_ratio=RATIO,
        rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": partial,
                         "mrope_section": section, "mrope_interleaved": True},
        moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
        vocab_size=32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = hf.Qwen4ExpTextAttention(cfg, 0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.3)
    return attn, hf.Qwen4ExpTextRotaryEmbedding(cfg), int(HEAD_DIM * partial), cfg.rms_norm_eps


@torch.no_grad()
def hf_run(attn, rotary, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers on one whole prompt x [L, hidden]: (selected token mask [L, L], attention output [L, hidden])."""
    L = x.shape[0]
    cos, sin = rotary(x[None], torch.arange(L).view(1, 1, L).expand(3, 1, L))
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, L, L).masked_fill(~causal, torch.finfo(torch.float32).min)
    selected = attn.indexer(x[None], (cos, sin), mask, None)[0, 0] & causal
    return selected, attn(x[None], (cos, sin), mask)[0][0]


class Paged:
    """Our side: the attention layer's weights over paged K/V and a paged store of raw indexer keys."""

    def __init__(self, attn, rotary_dim: int, eps: float, n_seqs: int, max_len: int):
        self.w = {n: p.detach() for n, p in attn.named_parameters()}
        self.rot, self.eps = rotary_dim, eps
        self.di = self.w["indexer.q_layernorm.weight"].shape[0]
        per_seq = -(-max_len // PAGE)
        n_pages = n_seqs * per_seq + 3
        # Shuffled page tables; the unused rows hold garbage that must never be read.
        self.tables = torch.randperm(n_pages)[:n_seqs * per_seq].view(n_seqs, per_seq).int()
        self.index_keys = torch.randn(n_pages, PAGE, self.di)
        self.k_cache = torch.randn(n_pages, PAGE, KV_HEADS, HEAD_DIM)
        self.v_cache = torch.randn(n_pages, PAGE, KV_HEADS, HEAD_DIM)

    @torch.no_grad()
    def step(self, xs: list[torch.Tensor], spans: list[tuple[int, int, int]]):
        """One batch: span (seq, lo, hi) runs tokens lo..hi-1 of xs[seq] (tokens before lo already written).
        Returns (selected blocks [N, topk], attention output [N, hidden])."""
        w, rot, di = self.w, self.rot, self.di
        x = torch.cat([xs[i][lo:hi] for i, lo, hi in spans])
        positions = torch.cat([torch.arange(lo, hi) for _, lo, hi in spans])
        slots = torch.cat([self.tables[i, torch.arange(lo, hi) // PAGE].long() * PAGE + torch.arange(lo, hi) % PAGE
                           for i, lo, hi in spans])
        tables = self.tables[[i for i, _, _ in spans]]
        seq_lens = torch.tensor([hi for _, _, hi in spans], dtype=torch.int32)
        qsl = torch.tensor([0] + [hi - lo for _, lo, hi in spans], dtype=torch.int32).cumsum(0).int()
        n = x.shape[0]
        inv_freq = rope_inv_freq(rot, THETA)

        qk = x @ w["indexer.index_qk_proj.weight"].T
        self.index_keys.view(-1, di)[slots] = qk[:, INDEX_HEADS * di:]
        cos, sin = rope_cos_sin(positions, rot, THETA, torch.float32)
        iq = apply_rope(rms_norm(qk[:, :INDEX_HEADS * di].reshape(n, INDEX_HEADS, di),
                                 w["indexer.q_layernorm.weight"], self.eps), cos, sin, rot)
        sel = qsa_select(iq, self.index_keys, tables, seq_lens, qsl, w["indexer.k_layernorm.weight"], self.eps,
                         inv_freq, rot, RATIO, BUDGET // RATIO)

        qg = (x @ w["q_proj.weight"].T).view(n, HEADS, 2 * HEAD_DIM)
        k = (x @ w["k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
        v = (x @ w["v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
        q = norm_rope_write_kv(qg[..., :HEAD_DIM].contiguous(), k, v, w["q_norm.weight"], w["k_norm.weight"],
                               self.eps, positions, inv_freq, self.k_cache, self.v_cache, slots)
        o = paged_attention(q, self.k_cache, self.v_cache, tables, seq_lens, qsl, int((qsl[1:] - qsl[:-1]).max()),
                            int(seq_lens.max()), HEAD_DIM ** -0.5, gate=qg[..., HEAD_DIM:].contiguous(),
                            selected_blocks=sel, block_size=RATIO)
        return sel, o.reshape(n, HEADS * HEAD_DIM) @ w["o_proj.weight"].T


def token_mask(sel: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """bool [hi - lo, hi]: the tokens the queries at positions lo..hi-1 read, from their selected blocks
    (a row each, -1 unused) and their open tails, spelled out token by token."""
    out = torch.zeros(hi - lo, hi, dtype=torch.bool)
    for j, p in enumerate(range(lo, hi)):
        for b in sel[j].tolist():
            if b >= 0:
                assert (b + 1) * RATIO <= p + 1, f"block {b} is not complete at position {p}"
                out[j, b * RATIO:(b + 1) * RATIO] = True
        out[j, (p + 1) // RATIO * RATIO:p + 1] = True
    return out


@pytest.mark.parametrize(("partial", "index_dim"), [(0.5, 16), (1.0, 16), (1.0, 32)])
def test_whole_prompts_select_and_attend_as_transformers(partial, index_dim):
    """The rotary dims are the attention's (head_dim * partial), over an index head that may be wider."""
    attn, rotary, rot, eps = hf_attention(partial, seed=3, index_dim=index_dim)
    lengths = [1, 2, 4, 7, 8, 12, 13, 16, 23, 41, 60]
    torch.manual_seed(4)
    xs = [torch.randn(L, HIDDEN) for L in lengths]
    ours = Paged(attn, rot, eps, len(lengths), max(lengths))
    sel, out = ours.step(xs, [(i, 0, L) for i, L in enumerate(lengths)])
    assert sel.dtype == torch.int32 and sel.shape == (sum(lengths), BUDGET // RATIO)
    start, sparse = 0, 0
    for x, L in zip(xs, lengths, strict=True):
        want_mask, want_out = hf_run(attn, rotary, x)
        got_mask = token_mask(sel[start:start + L], 0, L)
        assert torch.equal(got_mask, want_mask), f"prompt of {L}: selected tokens differ"
        torch.testing.assert_close(out[start:start + L], want_out, atol=1e-5, rtol=1e-5)
        sparse += int((want_mask.sum(1) < torch.arange(1, L + 1)).sum())
        start += L
    assert sparse > 50  # selection mattered (not only the dense regime)


def test_chunks_and_decode_select_as_the_whole_prompt():
    attn, rotary, rot, eps = hf_attention(0.5, seed=5)
    torch.manual_seed(6)
    xs = [torch.randn(60, HIDDEN), torch.randn(60, HIDDEN)]
    whole = Paged(attn, rot, eps, 2, 60)
    want_sel, want_out = whole.step(xs, [(0, 0, 60), (1, 0, 60)])
    # Sequence 0 in 5-token chunks, sequence 1 a 37-token prefill then decode steps, batched together.
    a = [(0, lo, lo + 5) for lo in range(0, 60, 5)]
    b = [(1, 0, 37)] + [(1, p, p + 1) for p in range(37, 60)]
    chunked = Paged(attn, rot, eps, 2, 60)
    got_sel, got_out = {0: [], 1: []}, {0: [], 1: []}
    for t in range(max(len(a), len(b))):
        spans = ([a[t]] if t < len(a) else []) + ([b[t]] if t < len(b) else [])
        sel, out = chunked.step(xs, spans)
        row = 0
        for i, lo, hi in spans:
            got_sel[i].append(sel[row:row + hi - lo])
            got_out[i].append(out[row:row + hi - lo])
            row += hi - lo
    for i in (0, 1):
        assert torch.equal(torch.cat(got_sel[i]), want_sel[60 * i:60 * (i + 1)])
        torch.testing.assert_close(torch.cat(got_out[i]), want_out[60 * i:60 * (i + 1)], atol=1e-5, rtol=1e-5)
        mask, hf_out = hf_run(attn, rotary, xs[i])
        assert torch.equal(token_mask(torch.cat(got_sel[i]), 0, 60), mask)
        torch.testing.assert_close(torch.cat(got_out[i]), hf_out, atol=1e-5, rtol=1e-5)


def test_bad_input_is_named():
    q, keys = torch.randn(3, 2, 16), torch.randn(4, 4, 16)
    one = (torch.zeros(1, 4, dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
           torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="qsa_select: q"):
        qsa_select(q, torch.randn(4, 4, 8), *one, torch.zeros(8), 1e-6, rope_inv_freq(8, THETA), 8, 4, 2)
    with pytest.raises(ValueError, match="rotary_dim"):
        qsa_select(q, keys, *one, torch.zeros(16), 1e-6, rope_inv_freq(8, THETA), 16, 4, 2)
    with pytest.raises(ValueError, match="block_size"):
        paged_attention(torch.randn(3, 2, 8), torch.randn(4, 4, 1, 8), torch.randn(4, 4, 1, 8), *one, 3, 3, 1.0,
                        selected_blocks=torch.zeros(3, 2, dtype=torch.int32))
