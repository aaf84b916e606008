"""``qsa_select_static`` (static shapes, no host reads: the CUDA-graph decode's selection) against ``qsa_select``,
fp32, on random paged indexer keys with shuffled page tables and junk past each sequence: decode rows and prefill
chunks packed together, text and MRoPE positions. The kept blocks are the reference's for every query, ties
(exactly 0: every index head's dot negative) going to the earliest blocks in both; ``qsa_attention_static``
against ``paged_attention`` with the same selection."""

from __future__ import annotations

import math
import os

import pytest
import torch

from ninfer.ops import qsa_select, qsa_select_static
from ninfer.ops.qsa import block_keys
from ninfer.ops.rope import mrope_axes, rope_inv_freq

DIM, RATIO, TOPK, PAGE, ROT, EPS = 16, 4, 5, 4, 8, 1e-6


def _case(lengths, qlens, heads, seed, extra_pages=6, mrope=False):
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-max(lengths) // PAGE) + 2  # wider than needed: the extra columns hold other sequences' pages
    n_pages = len(lengths) * per_seq + extra_pages
    tables = torch.randperm(n_pages, generator=gen)[:len(lengths) * per_seq].view(len(lengths), per_seq).int()
    keys = torch.randn(n_pages, PAGE, DIM, generator=gen)
    q = torch.randn(sum(qlens), heads, DIM, generator=gen)
    k_norm = torch.randn(DIM, generator=gen) * 0.1
    kw = {}
    if mrope:
        kw = {"key_positions": torch.randint(0, 50, (n_pages, PAGE, 3), dtype=torch.int32, generator=gen),
              "rope_axes": mrope_axes(ROT, (2, 1, 1))}
    qsl = torch.tensor([0, *qlens]).cumsum(0).int()
    args = (q, keys, tables, torch.tensor(lengths).int(), qsl, k_norm, EPS, rope_inv_freq(ROT, 10000.0), ROT,
            RATIO, TOPK)
    return args, kw


def _scores(args, kw, seq: int, pos: int) -> torch.Tensor:
    """The reference scores of one query (row of q at ``pos`` in sequence ``seq``) over its complete blocks."""
    q, keys, tables, lens, qsl, k_norm, eps, inv, rot, ratio, _ = args
    n = int(lens[seq])
    pages = tables[seq, :-(-n // PAGE)].long()
    k = keys[pages].reshape(-1, DIM)[:n]
    positions = None if not kw else kw["key_positions"][pages].reshape(-1, 3)[:n]
    kb = block_keys(k, k_norm, eps, inv, rot, ratio, positions, kw.get("rope_axes")).float()
    row = int(qsl[seq]) + pos - (n - int(qsl[seq + 1] - qsl[seq]))
    return torch.relu(q[row].float() @ kb.T).sum(0)[:(pos + 1) // ratio] / math.sqrt(DIM)


def _compare(args, kw, max_blocks) -> tuple[int, int]:
    """Assert the static choice equals the reference's for every row (both keep the earlier of equal blocks);
    returns (rows decided by a clear gap at the budget's edge, rows decided by a tie at exactly 0 there)."""
    ref = qsa_select(*args, **kw)
    got = qsa_select_static(*args, max_blocks, **kw)
    assert got.shape == ref.shape and got.dtype == torch.int32
    assert torch.equal(got, ref)
    lens, qsl = args[3].tolist(), args[4].tolist()
    clear = tied = 0
    for s, n in enumerate(lens):
        qlen = qsl[s + 1] - qsl[s]
        for j in range(qlen):
            row, pos = qsl[s] + j, n - qlen + j
            g = got[row]
            kept = g[g >= 0]
            assert (g[len(kept):] == -1).all() and (kept.diff() > 0).all()  # ascending, -1 after
            if (pos + 1) // RATIO <= TOPK:
                continue
            sc = _scores(args, kw, s, pos)
            vals = sc.sort(descending=True).values
            if vals[TOPK - 1] == 0 and vals[TOPK] == 0:
                above = (sc > 0).nonzero()[:, 0]
                zeros = (sc == 0).nonzero()[:, 0][:TOPK - len(above)]
                assert torch.equal(kept.long(), torch.cat([above, zeros]).sort().values), (row, g, sc)
                tied += 1
            else:
                assert vals[TOPK - 1] > vals[TOPK]
                clear += 1
    return clear, tied


@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_rows_match_the_reference(seed, mrope):
    """One token per row (decode), long and short sequences; max_blocks exactly the longest's complete blocks and
    with slack (blocks past the sequences gathered through junk pages, masked)."""
    lengths = [61, 4, 33, 20, 47, 3]
    for heads in (1, 2):
        args, kw = _case(lengths, [1] * len(lengths), heads, seed, mrope=mrope)
        for max_blocks in (max(lengths) // RATIO, max(lengths) // RATIO + 5):
            _compare(args, kw, max_blocks)


@pytest.mark.parametrize("mrope", [False, True])
def test_prefill_chunks_and_ties(mrope):
    """Prefill chunks packed with decode rows: every query's choice matches; one index head makes exact zero ties
    common, and the test sees both clear and tied rows (ties to the earliest blocks)."""
    lengths, qlens = [60, 23, 41, 9, 30], [60, 1, 17, 9, 1]
    clear = tied = 0
    for seed in range(3):
        for heads in (1, 3):
            args, kw = _case(lengths, qlens, heads, seed, mrope=mrope)
            c, t = _compare(args, kw, max(lengths) // RATIO + 1)
            clear, tied = clear + c, tied + t
    assert clear > 50 and tied > 5


def test_stable_sort_keeps_the_earlier_of_equal_scores():
    """All blocks equal (keys zero: every score 0): the first block_topk blocks are kept."""
    args, kw = _case([40], [1], 2, 0)
    args = (args[0], torch.zeros_like(args[1]), *args[2:])
    got = qsa_select_static(*args, 10)
    assert got.tolist() == [list(range(TOPK))]


def test_small_max_blocks_and_empty_rows():
    """max_blocks below block_topk pads with -1; a sequence whose query sees no complete block keeps none; zero
    max_blocks keeps nothing."""
    args, kw = _case([12, 2], [1, 1], 2, 0)
    assert qsa_select_static(*args, 3).tolist() == [[0, 1, 2, -1, -1], [-1] * TOPK]
    assert qsa_select_static(*args, 0).tolist() == [[-1] * TOPK] * 2
    with pytest.raises(ValueError, match="max_blocks"):
        qsa_select_static(*args, -1)


def test_no_host_reads():
    """The whole selection runs on meta tensors, which hold no values: any .tolist(), .item() or data-dependent
    shape would fail, so none is there (what a CUDA graph capture needs)."""
    args, kw = _case([61, 4, 33], [1, 1, 1], 2, 0, mrope=True)
    meta = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    kw = {k: v.to("meta") for k, v in kw.items()}
    out = qsa_select_static(*meta, 16, **kw)
    assert out.shape == (3, TOPK) and out.dtype == torch.int32 and out.device.type == "meta"


def test_block_runs_select_as_one(monkeypatch):
    """Block keys built in runs of a few blocks (the bound on a long context's temporaries) select as in one."""
    import ninfer.ops.qsa as qsa

    args, kw = _case([61, 4, 33, 20], [1, 1, 1, 1], 2, 3, mrope=True)
    whole = qsa_select_static(*args, 17, **kw)
    monkeypatch.setattr(qsa, "_SCORE_ELEMS", 4 * RATIO * DIM * 3)  # runs of 3 blocks
    assert torch.equal(qsa_select_static(*args, 17, **kw), whole)
    _compare(args, kw, 17)


def _attention_case(lengths, qlens, seed, kvh=2, group=2, head_dim=8, page=8):
    """Paged K/V with shuffled tables and junk everywhere (NaN past each sequence's end and in the pages no sequence
    owns, as unwritten memory may hold), packed queries and a selection of each query's complete blocks as
    ``qsa_select`` returns them (ascending, -1 after)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-max(lengths) // page) + 1
    n_pages = len(lengths) * per_seq + 3
    tables = torch.randperm(n_pages, generator=gen)[:len(lengths) * per_seq].view(len(lengths), per_seq).int()
    k_cache = torch.randn(n_pages, page, kvh, head_dim, generator=gen)
    v_cache = torch.randn(n_pages, page, kvh, head_dim, generator=gen)
    for row, n in enumerate(lengths):  # past each sequence's end (its own pages) and in the pages nobody owns
        unwritten = tables[row].long().repeat_interleave(page)[n:], torch.arange(n, per_seq * page) % page
        k_cache[unwritten] = v_cache[unwritten] = float("nan")
    unowned = torch.ones(n_pages, dtype=torch.bool)
    unowned[tables.flatten().long()] = False
    k_cache[unowned] = v_cache[unowned] = float("nan")
    N = sum(qlens)
    q = torch.randn(N, kvh * group, head_dim, generator=gen)
    gate = torch.randn(N, kvh * group, head_dim, generator=gen)
    selected = torch.full((N, TOPK), -1, dtype=torch.int32)
    row = 0
    for n, qlen in zip(lengths, qlens, strict=True):
        for pos in range(n - qlen, n):
            complete = (pos + 1) // RATIO
            keep = torch.randperm(complete, generator=gen)[:TOPK].sort().values
            selected[row, :len(keep)] = keep.int()
            row += 1
    qsl = torch.tensor([0, *qlens]).cumsum(0).int()
    return q, k_cache, v_cache, tables, torch.tensor(lengths).int(), qsl, selected, gate


@pytest.mark.parametrize("seed", [0, 1])
def test_static_attention_matches_the_reference(seed):
    """``qsa_attention_static`` against ``paged_attention`` with the same selection (its reference, which reads the
    lengths on the host): decode rows and prefill chunks, gated and not, fp32."""
    from ninfer.ops import paged_attention, qsa_attention_static

    lengths, qlens = [61, 4, 33, 20, 9], [1, 1, 7, 20, 1]
    q, kc, vc, tables, lens, qsl, sel, gate = _attention_case(lengths, qlens, seed)
    for g in (None, gate):
        ref = paged_attention(q, kc, vc, tables, lens, qsl, max(qlens), max(lengths), 0.3, g, selected_blocks=sel,
                              block_size=RATIO)
        got = qsa_attention_static(q, kc, vc, tables, lens, qsl, sel, RATIO, 0.3, g)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_static_attention_has_no_host_reads():
    """On meta tensors (no values): nothing reads the lengths or the selection on the host."""
    from ninfer.ops import qsa_attention_static

    args = _attention_case([61, 4, 33], [1, 1, 1], 0)
    meta = [a.to("meta") for a in args]
    out = qsa_attention_static(*meta[:6], meta[6], RATIO, 0.3, meta[7])
    assert out.shape == args[0].shape and out.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_the_kernel_matches_the_reference(num_splits):
    """The Triton kernel (through the interpreter on the CPU) against the reference: decode rows, prefill chunks,
    gated and not, one split or several merged; NaN in every slot no query may read."""
    from ninfer.ops.qsa import qsa_attention_static_ref
    from ninfer.ops.triton.qsa import qsa_attention_static as kernel

    q, kc, vc, tables, lens, qsl, sel, gate = _attention_case([61, 4, 33, 20, 9], [1, 1, 7, 20, 1], 3)
    for g in (None, gate):
        want = qsa_attention_static_ref(q, kc, vc, tables, lens, qsl, sel, RATIO, 0.3, g)
        got = kernel(q, kc, vc, tables, lens, qsl, sel, RATIO, 0.3, g, num_splits=num_splits)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_top_blocks_orders_scores_then_earlier_blocks():
    """Best scores first, ties (-0.0 is +0.0) to the earlier block, only complete blocks, ascending, -1 after."""
    from ninfer.ops.qsa import top_blocks

    scores = torch.tensor([[0.5, -0.0, 2.0, 0.0, 0.5, 9.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [3.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    complete = torch.tensor([5, 6, 1])
    assert top_blocks(scores, complete, 3).tolist() == [[0, 2, 4], [0, 1, 2], [0, -1, -1]]
    assert top_blocks(scores, complete, 5).tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, -1, -1, -1, -1]]


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
@pytest.mark.parametrize("mrope", [False, True])
def test_the_score_kernel_matches_the_reference(mrope):
    """The block-score kernel (through the interpreter) against the reference on every block a query sees, decode
    rows and prefill chunks, text and MRoPE; its selection is the reference's."""
    from ninfer.ops.qsa import qsa_block_scores_ref, query_positions, top_blocks
    from ninfer.ops.triton.qsa import qsa_block_scores

    lengths, qlens = [61, 4, 33, 20, 47], [1, 1, 9, 1, 1]
    args, kw = _case(lengths, qlens, 3, 5, mrope=mrope)
    q, keys, tables, lens, qsl, k_norm, eps, inv, rot, ratio, topk = args
    seq, pos = query_positions(qsl, lens, q.shape[0])
    M = max(lengths) // ratio + 2
    rest = (k_norm, eps, inv, rot, ratio, M, kw.get("key_positions"), kw.get("rope_axes"))
    want = qsa_block_scores_ref(q, keys, tables, seq, pos, *rest)
    got = qsa_block_scores(q, keys, tables, seq, pos, *rest)
    complete = torch.div(pos + 1, ratio, rounding_mode="floor")
    seen = torch.arange(M)[None, :] < complete[:, None]
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-6)
    assert torch.equal(top_blocks(got, complete, topk), top_blocks(want, complete, topk))
