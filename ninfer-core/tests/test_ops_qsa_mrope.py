"""QSA block selection with MRoPE positions (a prompt with media), fp32: ``qsa_select`` given each cached token's
(t, h, w) positions (``key_positions``, paged as the indexer keys) and the MRoPE axes selects what transformers'
``Qwen4ExpTextQSAIndexer`` selects under 3-D position ids (a block key rotates at its first token's position); for
text tokens, positions (p, p, p) select exactly what no positions do."""

from __future__ import annotations

import pytest
import torch

from ninfer.ops import apply_rope, qsa_select, rms_norm
from ninfer.ops.rope import mrope_axes, rope_angles_cos_sin, rope_inv_freq

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
INDEX_HEADS, INDEX_DIM, RATIO, BUDGET, THETA = 2, 16, 4, 8, 10000.0
SECTION = (2, 1, 1)  # 4 frequency slots of 8 rotary dims: t, h, w, t
ROT = HEAD_DIM // 2
PAGE = 4


def _paged(n_pages: int, n_seqs: int, per_seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randperm(n_pages, generator=gen)[:n_seqs * per_seq].view(n_seqs, per_seq).int()
    return tables, torch.randn(n_pages, PAGE, INDEX_DIM, generator=gen)


def _slots(table: torch.Tensor, n: int) -> torch.Tensor:
    t = torch.arange(n)
    return table[t // PAGE].long() * PAGE + t % PAGE


def test_text_positions_select_as_no_positions():
    """Several sequences, prefill and decode rows packed: (p, p, p) per token == today's text selection, and a
    shifted position history (p + 7 on every axis) changes it (the positions are read)."""
    lengths, qlens = [60, 23, 41, 9], [60, 1, 5, 9]
    per_seq = -(-max(lengths) // PAGE)
    tables, keys = _paged(len(lengths) * per_seq + 5, len(lengths), per_seq, seed=1)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(qlens), INDEX_HEADS, INDEX_DIM, generator=gen)
    positions = torch.randint(-1000, 1000, (*keys.shape[:2], 3), dtype=torch.int32, generator=gen)  # junk rows
    for i, L in enumerate(lengths):
        positions.view(-1, 3)[_slots(tables[i], L)] = torch.arange(L, dtype=torch.int32)[:, None].expand(L, 3)
    args = (q, keys, tables, torch.tensor(lengths, dtype=torch.int32),
            torch.tensor([0, *qlens], dtype=torch.int32).cumsum(0).int(), torch.randn(INDEX_DIM, generator=gen), 1e-6,
            rope_inv_freq(ROT, THETA), ROT, RATIO, BUDGET // RATIO)
    axes = mrope_axes(ROT, SECTION)
    want = qsa_select(*args)
    assert torch.equal(qsa_select(*args, key_positions=positions, rope_axes=axes), want)
    assert (want[:, -1] >= 0).sum() > 50  # selection is active
    shifted = positions.clone()
    for i, L in enumerate(lengths):
        shifted.view(-1, 3)[_slots(tables[i], L)] += 7
    assert not torch.equal(qsa_select(*args, key_positions=shifted, rope_axes=axes), want)


def _media_positions() -> torch.Tensor:
    """[3, L] (t, h, w): 6 text tokens, an image of 4 x 6 merged patches, 5 text tokens, a 2-frame video of
    3 x 4, then text, as transformers' ``get_rope_index`` lays them out."""
    rows, nxt = [], 0

    def text(n):
        nonlocal nxt
        rows.append(torch.arange(nxt, nxt + n).expand(3, n))
        nxt += n

    def grid(t, h, w):
        nonlocal nxt
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        rows.append(torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + nxt)
        nxt += max(t, h, w)

    text(6), grid(1, 4, 6), text(5), grid(2, 3, 4), text(14)
    return torch.cat(rows, dim=1)


@torch.no_grad()
def test_mrope_selection_matches_transformers():
    pytest.importorskip("transformers.models.qwen4_exp")
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    cfg = Qwen4ExpTextConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_hidden_layers=1, layer_types=["indexed_attention"], indexer_n_heads=INDEX_HEADS, indexer_kv_heads=1,
        indexer_head_dim=INDEX_DIM, indexer_budget=BUDGET, indexer_compress_ratio=RATIO,
        rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 0.5,
                         "mrope_section": list(SECTION), "mrope_interleaved": True},
        moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
        vocab_size=32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(3)
    indexer = hf.Qwen4ExpTextQSAIndexer(cfg, 0).eval()
    for p in indexer.parameters():
        p.normal_(0.0, 0.3)
    rotary = hf.Qwen4ExpTextRotaryEmbedding(cfg)
    pos = _media_positions()
    L = pos.shape[1]
    x = torch.randn(L, HIDDEN)
    cos, sin = rotary(x[None], pos[:, None, :])
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, L, L).masked_fill(~causal, torch.finfo(torch.float32).min)
    want = indexer(x[None], (cos, sin), mask, None)[0, 0] & causal

    # Ours: keys and (t, h, w) written to a shuffled paged store; prefill in two chunks, then decode rows.
    per_seq = -(-L // PAGE)
    tables, keys = _paged(per_seq + 3, 1, per_seq, seed=4)
    key_positions = torch.full((*keys.shape[:2], 3), -5, dtype=torch.int32)
    w = {n: t.detach() for n, t in indexer.named_parameters()}
    inv, axes = rope_inv_freq(ROT, THETA), mrope_axes(ROT, SECTION)
    qk = x @ w["index_qk_proj.weight"].T
    slots = _slots(tables[0], L)
    cs = rope_angles_cos_sin(pos, inv, torch.float32, axes)
    queries = apply_rope(rms_norm(qk[:, :INDEX_HEADS * INDEX_DIM].reshape(L, INDEX_HEADS, INDEX_DIM),
                                  w["q_layernorm.weight"], cfg.rms_norm_eps), *cs, ROT)
    got, text_only = [], []
    for lo, hi in [(0, 19), (19, 40), *((p, p + 1) for p in range(40, L))]:
        keys.view(-1, INDEX_DIM)[slots[lo:hi]] = qk[lo:hi, INDEX_HEADS * INDEX_DIM:]
        key_positions.view(-1, 3)[slots[lo:hi]] = pos[:, lo:hi].T.int()
        args = (queries[lo:hi], keys, tables, torch.tensor([hi], dtype=torch.int32),
                torch.tensor([0, hi - lo], dtype=torch.int32), w["k_layernorm.weight"], cfg.rms_norm_eps, inv, ROT,
                RATIO, BUDGET // RATIO)
        got.append(qsa_select(*args, key_positions=key_positions, rope_axes=axes))
        text_only.append(qsa_select(*args))
    got_mask = _token_mask(torch.cat(got), L)
    assert torch.equal(got_mask, want)
    assert not torch.equal(_token_mask(torch.cat(text_only), L), want)  # the block keys' positions mattered


def _token_mask(sel: torch.Tensor, L: int) -> torch.Tensor:
    out = torch.zeros(L, L, dtype=torch.bool)
    for p in range(L):
        for b in sel[p].tolist():
            if b >= 0:
                out[p, b * RATIO:(b + 1) * RATIO] = True
        out[p, (p + 1) // RATIO * RATIO:p + 1] = True
    return out


def test_bad_positions_are_named():
    q, keys = torch.randn(3, 2, 16), torch.randn(4, 4, 16)
    one = (torch.zeros(1, 4, dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
           torch.tensor([0, 3], dtype=torch.int32), torch.zeros(16), 1e-6, rope_inv_freq(8, THETA), 8, 4, 2)
    with pytest.raises(ValueError, match="go together"):
        qsa_select(q, keys, *one, key_positions=torch.zeros(4, 4, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="key_positions"):
        qsa_select(q, keys, *one, key_positions=torch.zeros(4, 3, 3, dtype=torch.int32),
                   rope_axes=mrope_axes(8, SECTION))
