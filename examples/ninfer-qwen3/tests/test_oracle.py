"""Our Qwen3 forward, over the converted artifact and a paged KV cache, against transformers' Qwen3ForCausalLM.

fp32 on the CPU; logits agree within ATOL (the two differ only in summation order). Greedy decoding through
the cache picks transformers' tokens, one by one.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ninfer.artifact import load_weights, open_artifact  # noqa: E402
from ninfer.core.forward_batch import ForwardBatch, PagedKVViews  # noqa: E402
from ninfer_qwen3.config import parse_config  # noqa: E402
from ninfer_qwen3.model import Qwen3Model, Qwen3Parameters, kv_pool  # noqa: E402

ATOL = 1e-4
PAGE_SIZE, PAGES_PER_SEQ = 4, 8


@pytest.fixture(scope="module")
def ours(converted):
    hf, path = converted
    with open_artifact(path) as art:
        weights, _ = load_weights(art, features=("text",), device="cpu")
        config = parse_config(art.config)
    return hf, Qwen3Model(Qwen3Parameters.from_weights(config, weights, torch.float32))


def kv_caches(model: Qwen3Model, num_seqs: int) -> PagedKVViews:
    spec = kv_pool(model.config, page_size=PAGE_SIZE, dtype="float32")
    shape = (num_seqs * PAGES_PER_SEQ, spec.page_size, spec.kv_heads, spec.head_dim)
    return PagedKVViews(kv=[(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.layers)],
                        page_size=PAGE_SIZE)


def make_batch(chunks: list[tuple[list[int], int]]) -> ForwardBatch:
    """chunks[i] = (new tokens of sequence i, how many of its tokens the cache holds already); sequence i owns
    pages i * PAGES_PER_SEQ ... (i + 1) * PAGES_PER_SEQ - 1."""
    ids, positions, slots, starts, lens = [], [], [], [0], []
    for i, (tokens, cached) in enumerate(chunks):
        for pos, token in enumerate(tokens, start=cached):
            ids.append(token)
            positions.append(pos)
            slots.append((i * PAGES_PER_SEQ + pos // PAGE_SIZE) * PAGE_SIZE + pos % PAGE_SIZE)
        starts.append(starts[-1] + len(tokens))
        lens.append(cached + len(tokens))
    B = len(chunks)
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(positions),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        state_slots=torch.arange(B), has_initial_state=torch.ones(B, dtype=torch.bool),
        block_tables=torch.arange(B * PAGES_PER_SEQ, dtype=torch.int32).reshape(B, PAGES_PER_SEQ),
        slot_mapping=torch.tensor(slots), logits_indices=torch.arange(len(ids)),
        max_query_len=max(len(t) for t, _ in chunks), max_seq_len=max(lens))


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


PROMPTS = ([5, 17, 300, 42, 42, 7, 99, 260, 1, 3, 480], [250, 4, 61, 61, 200, 9, 13])


def test_packed_prefill_and_a_chunk_with_earlier_context_match_transformers(ours):
    hf, model = ours
    a, b = PROMPTS
    kv = kv_caches(model, 2)
    first = model.logits(model.forward(make_batch([(a[:6], 0), (b, 0)]), kv))
    second = model.logits(model.forward(make_batch([(a[6:], 6), ([], len(b))]), kv))  # b has no new tokens
    torch.testing.assert_close(torch.cat([first[:6], second]), hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(first[6:], hf_logits(hf, b), atol=ATOL, rtol=0)


def test_greedy_decode_through_the_paged_cache_matches_transformers(ours):
    hf, model = ours
    seqs = [list(p) for p in PROMPTS]
    kv = kv_caches(model, 2)
    logits = model.logits(model.forward(make_batch([(s, 0) for s in seqs]), kv))
    last = logits[[len(seqs[0]) - 1, -1]]
    for _ in range(10):  # two decode rows per step, each at its own position
        for s, row in zip(seqs, last, strict=True):
            want = hf_logits(hf, s)[-1]
            torch.testing.assert_close(row, want, atol=ATOL, rtol=0)
            assert int(row.argmax()) == int(want.argmax())  # greedy picks transformers' token
            s.append(int(row.argmax()))
        last = model.logits(model.forward(make_batch([(s[-1:], len(s) - 1) for s in seqs]), kv))
