"""Qwen4Exp's stores (StateImage fields, KV pool) and Qwen4ExpProgram over a toy model whose logits read only the PLE n-gram history in the StateImage.

The toy's next-token distribution is a table row chosen by a hash of the last three tokens, with transformers'
n-gram rule: context tokens before the segment (the previous EOS included) read as EOS. It keeps the last two
token ids in ``views.ngram`` and starts from EOS when a row has no initial state, so every path that loses,
clears or misplaces the int64 history (a prefill chunk boundary, a Snapshot, a Replay rebuild, a fork, a
context-cache restore) changes tokens; a closed form of the same rule over the whole ledger is the reference.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.contract.batch import RowDecision
from ninfer.contract.memory import ProgramCapacity
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.core.device import Device
from ninfer.core.forward_batch import ForwardBatch
from ninfer.core.state_store import StateImageStorage
from ninfer_qwen4exp.config import parse_config
from ninfer_qwen4exp.execution.forward_batch import Qwen4ExpStateViews
from ninfer_qwen4exp.program import Qwen4ExpProgram
from ninfer_qwen4exp.state import kv_pools, state_layout


def raw_config(**over) -> dict:
    """A tiny Qwen4Exp text config in transformers' names (QSA on the attention layer, PLE on layer 2)."""
    raw = dict(vocab_size=448, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=16, shared_expert_intermediate_size=16, hc_count=4, hc_lowrank=8,
               ple_layer_ids=[2], ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=101,
               make_ngram_vocab_size_divisible_by=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
               indexer_budget=8, indexer_compress_ratio=4, eos_token_id=3, rms_norm_eps=1e-6,
               max_position_embeddings=4096, tie_word_embeddings=False, model_type="qwen4_exp_text",
               layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"])
    raw.update(over)
    return {k: v for k, v in raw.items() if v is not None}


def test_state_layout_adds_ple_conv_and_ngram_history():
    config = parse_config(raw_config())
    layout = state_layout(config, "float32")
    names = [f.name for f in layout.fields]
    assert names == ["conv", "recurrent", "ple_conv", "ngram"]
    ple_conv, ngram = layout.field("ple_conv"), layout.field("ngram")
    # (kernel - 1) * dilation (= ngram_size) earlier positions of the 4 x 32 wide residual, for the one PLE layer
    assert (ple_conv.shape, ple_conv.layers, ple_conv.dtype) == ((9, 128), 1, "float32")
    assert (ngram.shape, ngram.layers, ngram.dtype) == ((2,), 1, "int64")
    conv, rec = layout.field("conv"), layout.field("recurrent")
    assert conv.layers == rec.layers == 3  # one per GDN layer
    assert conv.shape == (2 * 2 * 8 + 4 * 8, 3) and rec.shape == (4, 8, 8) and rec.dtype == "float32"
    aligned = [-(-n // 256) * 256 for n in (64 * 3 * 4 * 3, 4 * 8 * 8 * 4 * 3, 9 * 128 * 4, 2 * 8)]
    assert layout.nbytes_per_slot == sum(aligned)


def test_state_layout_without_ple_is_qwen35s():
    config = parse_config(raw_config(ple_layer_ids=None))
    layout = state_layout(config, "bfloat16")
    assert [f.name for f in layout.fields] == ["conv", "recurrent"]
    assert layout.field("conv").dtype == "bfloat16" and layout.field("recurrent").dtype == "float32"


def test_state_storage_views_of_the_layout():
    """The int64 n-gram history and the PLE conv history are typed views of each slot's one image."""
    config = parse_config(raw_config())
    states = StateImageStorage(state_layout(config, "bfloat16"), 3, Device.parse("cpu"))
    ngram, ple = states.view("ngram"), states.view("ple_conv")
    assert ngram.shape == (3, 1, 2) and ngram.dtype == torch.int64
    assert ple.shape == (3, 1, 9, 128) and ple.dtype == torch.bfloat16
    a, b = states.allocate(), states.allocate()
    ngram[a, 0] = torch.tensor([7, 3])
    ple[a].fill_(1.5)
    states.copy_slot(a, b)  # a fork copies the whole image: the histories come with it
    assert ngram[b, 0].tolist() == [7, 3] and bool((ple[b] == 1.5).all())
    host = states.save(b)
    states.zero(b)
    states.restore(b, host)
    assert ngram[b, 0].tolist() == [7, 3]


def test_kv_pool_main_over_the_attention_layers():
    config = parse_config(raw_config(indexer_n_heads=None, indexer_kv_heads=None, indexer_head_dim=None,
                                     indexer_budget=None, indexer_compress_ratio=None))
    (pool,) = kv_pools(config, page_size=8, dtype="float32")
    assert (pool.name, pool.layers, pool.kv_heads, pool.head_dim, pool.page_size) == ("main", 1, 2, 16, 8)
    assert pool.dtype == "float32"


def test_layout_refuses_a_config_without_gdn_layers():
    with pytest.raises(ValueError, match="no linear_attention layers"):
        state_layout(parse_config(raw_config(num_hidden_layers=1, layer_types=["indexed_attention"],
                                             ple_layer_ids=None)))


CONFIG = parse_config(raw_config(indexer_n_heads=None, indexer_kv_heads=None, indexer_head_dim=None,
                                 indexer_budget=None, indexer_compress_ratio=None, vocab_size=24))
V, EOS, ROWS = 24, 3, 97
GREEDY = SamplingParams(temperature=0.0)


def contexts(history: list[int]) -> list[tuple[int, int, int]]:
    """(t[p-2], t[p-1], t[p]) of each position after the history's first two, a context token read as EOS when
    an EOS lies between it and p (transformers' ``_shift_right_ignore_eos``)."""
    out = []
    for p in range(2, len(history)):
        a, b, c = history[p - 2], history[p - 1], history[p]
        b = EOS if b == EOS else b  # an EOS ends its own segment: it is still the previous token
        a = EOS if b == EOS or a == EOS else a
        out.append((a, b, c))
    return out


class NGramToy:
    def __init__(self, seed: int) -> None:
        self.table = torch.randn(ROWS, V, generator=torch.Generator().manual_seed(seed))

    def row(self, a: int, b: int, c: int) -> torch.Tensor:
        return self.table[(a * 31 + b * 7 + c) % ROWS]

    def forward(self, batch: ForwardBatch, views: Qwen4ExpStateViews) -> torch.Tensor:
        qsl, out = batch.query_start_loc.tolist(), []
        for i, slot in enumerate(batch.state_slots.tolist()):
            fresh = not bool(batch.has_initial_state[i])
            past = [EOS, EOS] if fresh else views.ngram[slot].tolist()
            new = batch.input_ids[qsl[i]:qsl[i + 1]].tolist()
            out += [self.row(*ctx) for ctx in contexts(past + new)]
            views.ngram[slot] = torch.tensor((past + new)[-2:])
        return torch.stack(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float()


def reference(model: NGramToy, prompt: list[int], n: int) -> list[int]:
    ledger = list(prompt)
    for _ in range(n):
        ledger.append(int(model.row(*contexts([EOS, EOS] + ledger)[-1]).argmax()))
    return ledger[len(prompt):]


def program(model: NGramToy, *, static_decode: bool = False, **capacity) -> Qwen4ExpProgram:
    (pool,) = kv_pools(CONFIG, page_size=4, dtype="float32")
    return Qwen4ExpProgram(model, config=CONFIG, state_layout=state_layout(CONFIG, "float32"), kv_pool=pool,
                           device="cpu", max_concurrency=3, vocab_size=V, cuda_graphs=False,
                           static_decode=static_decode,
                           capacity=ProgramCapacity(kv_pages=capacity.pop("kv_pages", 32),
                                                    host_budget_bytes=1 << 20, **capacity))


def prefill_all(prog, sid, chunk) -> list[int]:
    got = []
    while prog.input_remaining(sid):
        n = min(chunk, prog.input_remaining(sid))
        assert prog.reserve_units(sid, n)
        batch = prog.prefill(sid, n)
        if batch is not None:
            got.append(batch.rows[0].tokens[0])
            prog.commit(batch, [RowDecision(accepted=1)])
    return got


def decode_steps(prog, sids, steps) -> dict[int, list[int]]:
    got = {s: [] for s in sids}
    for _ in range(steps):
        for s in sids:
            assert prog.reserve_units(s, 1)
        batch = prog.decode(sids)
        for row in batch.rows:
            got[row.sequence_id].append(row.tokens[0])
        prog.commit(batch, [RowDecision(accepted=1)] * len(sids))
    return got


PROMPTS = [[5, 6, EOS, 7, 8, 9, 10, 11, 12], [13, 14], [EOS, 20, 21, EOS, EOS, 22]]


def test_views_are_the_stores():
    prog = program(NGramToy(0))
    assert prog.views.ngram.shape == (4, 2) and prog.views.ngram.dtype == torch.int64
    assert prog.views.ple_conv.shape == (4, 1, 9, 128)
    assert prog.views.conv.data_ptr() == prog.states.view("conv").data_ptr()
    assert prog.views.index_keys == () and len(prog.views.kv) == 1 and prog.views.experts is None


@pytest.mark.parametrize("chunk", [1, 2, 4, 100])
@pytest.mark.parametrize("static_decode", [False, True])
def test_greedy_in_any_chunks_follows_the_ngram_rule(chunk, static_decode):
    model = NGramToy(1)
    prog = program(model, static_decode=static_decode)
    sids = [prog.open_sequence(PreparedPrompt(token_ids=p), GREEDY) for p in PROMPTS]
    first = {s: prefill_all(prog, s, chunk) for s in sids}
    steps = decode_steps(prog, sids, 7)
    for s, p in zip(sids, PROMPTS, strict=True):
        assert first[s] + steps[s] == reference(model, p, 8)
    for s in sids:
        prog.release(s)
    usage = prog.usage()
    assert (usage.state_slots_used, usage.kv_pages_used, usage.reserved_pages, usage.host_bytes_used) == (0, 0, 0, 0)


def test_snapshot_replay_rollback_and_fork_keep_the_history():
    model = NGramToy(2)
    sampled = SamplingParams(temperature=0.9, seed=3)

    def run(interrupt) -> list[int]:
        prog = program(model)
        sid = prog.open_sequence(PreparedPrompt(token_ids=PROMPTS[0]), sampled)
        got = prefill_all(prog, sid, 4) + decode_steps(prog, [sid], 4)[sid]
        sid = interrupt(prog, sid)
        got += prefill_all(prog, sid, 3)
        got += decode_steps(prog, [sid], 6)[sid]
        prog.release(sid)
        assert prog.usage().state_slots_used == prog.usage().kv_pages_used == prog.host_bytes_used == 0
        return got

    def snapshot(prog, sid):
        state = prog.pause(sid, "snapshot")
        assert state.host_bytes >= prog.states.image_bytes
        return prog.resume(state)

    def replay(prog, sid):
        return prog.resume(prog.pause(sid, "replay"))

    def aborted(prog, sid):
        assert prog.reserve_units(sid, 1)
        prog.abort_pending(prog.decode([sid]))
        return sid

    def forked(prog, sid):
        child = prog.fork(sid)
        prog.release(sid)
        return child

    plain = run(lambda prog, sid: sid)
    assert len(plain) == 11
    for interrupt in (snapshot, replay, aborted, forked):
        assert run(interrupt) == plain, interrupt.__name__


def test_score_window_starts_from_eos():
    model = NGramToy(4)
    prog = program(model)
    ids = [3, 9, 17, 1, EOS, 2, 2, 17, 13, 5, 8]
    lp = prog.score_window(ids, 2, chunk=3, logits_rows=2)
    rows = contexts([EOS, EOS] + ids)
    want = [float(model.row(*rows[i - 1]).log_softmax(-1)[ids[i]]) for i in range(2, len(ids))]
    assert lp.tolist() == pytest.approx(want, abs=1e-5)
    assert prog.usage().kv_pages_used == 0 and prog.usage().state_slots_used == 0


def test_kv_pool_pages_the_qsa_index_keys():
    config = parse_config(raw_config())
    (pool,) = kv_pools(config, page_size=8, dtype="bfloat16")
    (keys,) = pool.aux
    assert (keys.name, keys.layers, keys.shape, keys.dtype) == ("index_keys", 1, (16,), "bfloat16")
    # K and V of 2 heads x 16, and one 16-wide index key, per token of the one attention layer, in bf16
    assert pool.nbytes_per_page == 8 * (2 * 2 * 16 + 16) * 2


def test_program_views_hold_the_index_keys_paged_like_the_kv():
    config = parse_config(raw_config(vocab_size=24))
    (pool,) = kv_pools(config, page_size=4, dtype="float32")
    prog = Qwen4ExpProgram(NGramToy(0), config=config, state_layout=state_layout(config, "float32"), kv_pool=pool,
                           device="cpu", max_concurrency=2, vocab_size=24, cuda_graphs=False,
                           capacity=ProgramCapacity(kv_pages=6))
    ((k, _v),) = prog.views.kv
    (keys,) = prog.views.index_keys
    assert keys.shape == (*k.shape[:2], 16) and keys.dtype == torch.float32
    assert keys.data_ptr() == prog.pool.aux_caches("index_keys")[0].data_ptr()
