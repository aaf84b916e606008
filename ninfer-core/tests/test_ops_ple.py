"""PLE ops against transformers' Qwen4Exp n-gram embedding and PLE layer (fp32, random weights): the hash
constants, the n-gram ids with their EOS resets, the dilated conv, and the per-sequence histories that make a
prompt run in chunks (or packed beside another) equal to the whole."""

from __future__ import annotations

import itertools

import pytest
import torch

from ninfer.ops import (
    dilated_causal_conv,
    gather_rows,
    ngram_hash_ids,
    ngram_multipliers,
    ngram_windows,
    ple_layer,
)

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

EOS = 5
HIDDEN, STREAMS = 16, 3


def _config(**kw):
    base = dict(vocab_size=50, hidden_size=HIDDEN, hc_count=STREAMS, num_hidden_layers=3,
                layer_types=["linear_attention"] * 3, ple_layer_ids=[1, 3], ple_embed_dim=24, ngram_size=3,
                heads_per_ngram=3, ngram_vocab_size_base=40, make_ngram_vocab_size_divisible_by=16,
                ple_conv_kernel_size=3, eos_token_id=EOS, rms_norm_eps=1e-6)
    return transformers.Qwen4ExpTextConfig(**{**base, **kw})


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))


def _tokens(n: int, seed: int) -> torch.Tensor:
    ids = torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(seed))
    ids[[i for i in (3, 4, 11, 20) if i < n]] = EOS  # two EOS in a row, and resets inside chunks
    return ids


def _chunks(total: int, sizes: list[int]) -> list[tuple[int, int]]:
    bounds, lo = [], 0
    for size in itertools.cycle(sizes):
        hi = min(lo + size, total)
        bounds.append((lo, hi))
        lo = hi
        if lo == total:
            return bounds


class Ours:
    """Our PLE pipeline for one layer of ``hf``: the multipliers computed, the heads' primes and offsets (the
    model config's) taken from transformers' buffers."""

    def __init__(self, config, emb: torch.nn.Module, ple_index: int):
        c = config
        self.heads, self.eos = c.heads_per_ngram, EOS
        self.mult = torch.tensor(ngram_multipliers(c.vocab_size, c.ngram_size, ple_index, c.seed))
        self.sizes, self.offsets = emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets
        self.table = emb.ngram_embedding.weight

    def embed(self, ids, history, qsl, initial):
        windows, history = ngram_windows(ids, history, qsl, initial, self.eos)
        rows = ngram_hash_ids(windows, self.mult, self.sizes, self.offsets, self.heads)
        return gather_rows(self.table, rows, "cpu").flatten(1), history


@pytest.mark.parametrize("ple_index", [0, 1])
def test_hash_multipliers_match_transformers(ple_index):
    c = _config()
    emb = modeling.Qwen4ExpTextNGramEmbedding(c, 24, layer_idx=0, ple_layer_index=ple_index)
    assert ngram_multipliers(c.vocab_size, c.ngram_size, ple_index, c.seed) == emb.layer_multipliers.tolist()
    # the published multipliers' size: token id * multiplier stays within int64
    big = ngram_multipliers(248320, 3, 5, 1234)
    assert all(m % 2 == 1 and m * 248320 < 2 ** 63 for m in big)


@pytest.mark.parametrize("ngram_size", [2, 3, 4])
def test_ngram_embedding_whole_chunked_and_packed(ngram_size):
    c = _config(ngram_size=ngram_size, ple_embed_dim=(ngram_size - 1) * 3 * 4)
    emb = modeling.Qwen4ExpTextNGramEmbedding(c, c.ple_embed_dim, layer_idx=0, ple_layer_index=1)
    _randomise(emb, 4)
    ours = Ours(c, emb, 1)
    ids = _tokens(29, ngram_size)
    with torch.no_grad():
        want = emb(ids[None], None)[0]
    ctx = ngram_size - 1
    # whole, from a fresh row (its history content is ignored)
    got, hist = ours.embed(ids, torch.full((1, ctx), 7), torch.tensor([0, 29]), torch.tensor([False]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert hist[0].tolist() == ids[-ctx:].tolist()
    # chunks of 7, 1 and 5 tokens, the history carried
    hist, parts = torch.zeros(1, ctx, dtype=torch.long), []
    for n, (lo, hi) in enumerate(_chunks(29, [7, 1, 5])):
        out, hist = ours.embed(ids[lo:hi], hist, torch.tensor([0, hi - lo]), torch.tensor([n > 0]))
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts), want, rtol=0, atol=0)
    # packed: a second sequence (fresh) and an empty row beside the first's continuation
    other = _tokens(9, 11)
    with torch.no_grad():
        want_other = emb(other[None], None)[0]
    _, hist = ours.embed(ids[:12], torch.zeros(1, ctx, dtype=torch.long), torch.tensor([0, 12]), torch.tensor([False]))
    history = torch.cat([torch.full((1, ctx), 3), hist, torch.full((1, ctx), 2)])
    got, new_hist = ours.embed(torch.cat([other, ids[12:]]), history, torch.tensor([0, 9, 26, 26]),
                               torch.tensor([False, True, True]))
    torch.testing.assert_close(got[:9], want_other, rtol=0, atol=0)
    torch.testing.assert_close(got[9:], want[12:], rtol=0, atol=0)
    assert new_hist[2].tolist() == [2] * ctx  # no new tokens: the row's history stays


def test_dilated_conv_matches_torch_conv1d():
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(20, 6, generator=gen), torch.randn(6, 3, generator=gen)
    want = torch.nn.functional.conv1d(torch.nn.functional.pad(x.T[None], (6, 0)), w[:, None], groups=6,
                                      dilation=3)[0].T
    got, hist = dilated_causal_conv(x, w, torch.zeros(1, 6, 6), torch.tensor([0, 20]), 3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hist[0], x[-6:])
    with pytest.raises(ValueError, match="dilated_causal_conv"):
        dilated_causal_conv(x, w, torch.zeros(1, 5, 6), torch.tensor([0, 20]), 3)


def test_ple_layer_whole_chunked_and_packed():
    c = _config()
    hf = modeling.Qwen4ExpTextPLELayer(c, layer_idx=2, ple_layer_index=1)
    _randomise(hf, 6)
    ours = Ours(c, hf.ple_embedding, 1)
    T = 31
    ids, x = _tokens(T, 8), torch.randn(T, STREAMS * HIDDEN, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = hf(x[None], ids[None], None)[0]
    conv_len = (c.ple_conv_kernel_size - 1) * c.ngram_size
    weights = dict(key_proj=hf.key_proj.weight, value_proj=hf.value_proj.weight, norm_key=hf.norm_key.weight,
                   norm_query=hf.norm_query.weight, norm_conv=hf.norm_conv.weight, conv_weight=hf.conv1d.weight[:, 0])

    def run(lo, hi, ngram_hist, conv_hist, initial):
        qsl = torch.tensor([0, hi - lo])
        emb, ngram_hist = ours.embed(ids[lo:hi], ngram_hist, qsl, torch.tensor([initial]))
        conv_hist = conv_hist if initial else torch.zeros_like(conv_hist)
        out, conv_hist = ple_layer(x[lo:hi], emb, **weights, conv_history=conv_hist, query_start_loc=qsl,
                                   streams=STREAMS, dilation=c.ngram_size, eps=c.rms_norm_eps)
        return out, ngram_hist, conv_hist

    nan_conv = torch.full((1, conv_len, STREAMS * HIDDEN), float("nan"))
    got, _, _ = run(0, T, torch.zeros(1, 2, dtype=torch.long), nan_conv, False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    parts, ngram_hist, conv_hist = [], torch.zeros(1, 2, dtype=torch.long), nan_conv
    for n, (lo, hi) in enumerate(_chunks(T, [4, 1, 9])):
        out, ngram_hist, conv_hist = run(lo, hi, ngram_hist, conv_hist, n > 0)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts), want, rtol=1e-5, atol=1e-5)


def test_gather_rows_reads_the_table_where_it_lives():
    table = torch.randn(40, 6).to(torch.bfloat16)  # a host table in its stored dtype
    ids = torch.tensor([[3, 39], [0, 3]])
    rows = gather_rows(table, ids, "cpu", torch.float32)
    assert rows.shape == (2, 2, 6) and rows.dtype == torch.float32
    torch.testing.assert_close(rows, table[ids].float(), rtol=0, atol=0)
