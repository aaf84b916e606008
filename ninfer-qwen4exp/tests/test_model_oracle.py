"""Qwen4Exp model execution vs transformers' ``Qwen4ExpForCausalLM`` (fp32, CPU, tiny random configs), and the
invariances the Program relies on: chunked prefill then decode == the whole prompt, batch neighbours independent.

Configs cover QSA while every query still attends all it sees (``dense``) and QSA with selection active within
40 tokens (``select``: blocks of 4, a budget of 8), PLE on two GDN layers, the MoE block (8 experts, top-2) and
both GDN output gates. transformers initialises norms, gates and convs to zero or one: every weight gets noise.
The model runs over state tensors filled with NaN (n-gram history with junk ids) first, so any read of state a
sequence does not own, or of a fresh row's state, shows up.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from ninfer.artifact.weights import WeightSet
from ninfer_qwen4exp.config import parse_config
from ninfer_qwen4exp.execution.forward_batch import ForwardBatch, Qwen4ExpStateViews
from ninfer_qwen4exp.execution.model import Qwen4ExpModel
from ninfer_qwen4exp.execution.parameters import Qwen4ExpParameters
from ninfer_qwen4exp.source_mapping import fused_parents
from ninfer_qwen35.testing.hf_model import randomise

transformers = pytest.importorskip("transformers")

RTOL = 1e-4  # logits: max |ours - HF| <= RTOL * max |HF| (fp32)
EOS = 7

_COMMON = dict(
    vocab_size=192, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    layer_types=["linear_attention", "indexed_attention", "linear_attention", "linear_attention", "indexed_attention"],
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    hc_count=4, hc_lowrank=12, ple_layer_ids=[1, 3], ple_embed_dim=32, ple_conv_kernel_size=3, ngram_size=3,
    heads_per_ngram=2, ngram_vocab_size_base=600, make_ngram_vocab_size_divisible_by=16, eos_token_id=EOS,
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=24, tie_word_embeddings=False,
    max_position_embeddings=512)

CONFIGS = {
    # every query attends all it sees up to 131 tokens; sigmoid output gate, full rotary, tied embeddings
    "dense": dict(_COMMON, indexer_budget=128, indexer_compress_ratio=4, output_gate_type="sigmoid",
                  tie_word_embeddings=True),
    # QSA keeps the 2 best complete blocks of 4 and the open tail from 12 tokens on; partial rotary, silu gate
    "select": dict(_COMMON, indexer_budget=8, indexer_compress_ratio=4, output_gate_type="silu",
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}


@attrs.define
class Tiny:
    hf: torch.nn.Module
    model: Qwen4ExpModel


def model_from_hf_state_dict(hf: torch.nn.Module) -> Qwen4ExpModel:
    """Our model over a transformers model's own tensors, fused as the converter lays them out (the names are the
    artifact's; transformers' n-gram hash buffers are derived from the config, not bound)."""
    config = parse_config(hf.config.to_dict())
    tensors = {k: v.detach().clone() for k, v in hf.state_dict().items()
               if not k.endswith(("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"))}
    if config.base.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    weights = WeightSet.from_tensors(tensors, fused_parents(config))
    return Qwen4ExpModel(Qwen4ExpParameters.from_weights(config, weights, torch.float32))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request) -> Tiny:
    torch.manual_seed(0)
    hf_config = transformers.Qwen4ExpTextConfig(**CONFIGS[request.param])
    hf_config._attn_implementation = "eager"
    hf = transformers.Qwen4ExpForCausalLM(hf_config).eval()
    randomise(hf, seed=len(request.param))
    return Tiny(hf=hf, model=model_from_hf_state_dict(hf))


@attrs.define
class Seq:
    slot: int
    pages: list[int] = attrs.field(factory=list)
    length: int = 0


class Runner:
    """A minimal driver over state tensors built here (the engine's Program owns them): packs sequences' new
    tokens into one ForwardBatch."""

    def __init__(self, model: Qwen4ExpModel, num_slots: int = 4, num_pages: int = 96, page_size: int = 4) -> None:
        c, b = model.config, model.config.base
        self.model, self.page_size, self.free_pages, self.free_slots = model, page_size, list(range(num_pages)), \
            list(range(num_slots))
        nan, S = float("nan"), num_slots
        gdn, attn = len(c.gdn_layers), len(c.attention_layers)
        kv = (num_pages, page_size, b.num_key_value_heads, b.head_dim)
        self.views = Qwen4ExpStateViews(
            conv=torch.full((S, gdn, b.conv_dim, b.linear_conv_kernel_dim - 1), nan),
            recurrent=torch.full((S, gdn, b.linear_num_value_heads, b.linear_key_head_dim,
                                  b.linear_value_head_dim), nan),
            kv=[(torch.full(kv, nan), torch.full(kv, nan)) for _ in range(attn)], page_size=page_size,
            index_keys=[torch.full((num_pages, page_size, c.qsa.head_dim), nan) for _ in range(attn)],
            ple_conv=torch.full((S, len(c.ple_layers), c.ple.conv_state_len, c.hc_hidden_size), nan),
            ngram=torch.full((S, c.ple.context_len), 12345, dtype=torch.int64))

    def new(self) -> Seq:
        return Seq(slot=self.free_slots.pop(0))

    def step(self, work: list[tuple[Seq, list[int]]]) -> list[torch.Tensor]:
        """Run one forward over every (sequence, new tokens); returns each sequence's logits [len, V]."""
        batch = self.pack(work)
        logits = self.model.logits(self.model.forward(batch, self.views)[batch.logits_indices])
        for seq, toks in work:
            seq.length += len(toks)
        return list(logits.split([len(t) for _, t in work]))

    def pack(self, work: list[tuple[Seq, list[int]]]) -> ForwardBatch:
        ids, pos, qsl, lens, slots, init, smap = [], [], [0], [], [], [], []
        for seq, toks in work:
            end = seq.length + len(toks)
            while len(seq.pages) * self.page_size < end:
                seq.pages.append(self.free_pages.pop(len(self.free_pages) // 2))  # scattered pages
            ids += toks
            pos += range(seq.length, end)
            smap += [seq.pages[t // self.page_size] * self.page_size + t % self.page_size
                     for t in range(seq.length, end)]
            qsl.append(qsl[-1] + len(toks))
            lens.append(end)
            slots.append(seq.slot)
            init.append(seq.length > 0)
        width = max(len(s.pages) for s, _ in work)
        tables = [s.pages + [s.pages[0]] * (width - len(s.pages)) for s, _ in work]
        return ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.tensor(pos), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), state_slots=torch.tensor(slots),
            has_initial_state=torch.tensor(init), block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(smap), logits_indices=torch.arange(len(ids)),
            max_query_len=max(len(t) for _, t in work), max_seq_len=max(lens), all_initial_state=all(init))


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    ids[5::23] = EOS  # n-grams reset inside the prompt
    return ids.tolist()


def hf_logits(tiny: Tiny, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return tiny.hf(torch.tensor([ids])).logits[0].float()


def logit_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| relative to max |ref|."""
    assert torch.isfinite(ours).all()
    return (ours - ref).abs().max().item() / ref.abs().max().item()


@pytest.mark.parametrize("length", [1, 2, 13, 40, 100])
def test_prefill_logits_match_transformers(tiny, length):
    ids = prompt(length, tiny.model.config.base.vocab_size, seed=length)
    runner = Runner(tiny.model)
    err = logit_error(runner.step([(runner.new(), ids)])[0], hf_logits(tiny, ids))
    assert err <= RTOL, f"max relative logit error {err:.2e}"


def test_chunked_prefill_then_decode_equals_whole(tiny):
    ids = prompt(47, tiny.model.config.base.vocab_size, seed=3)
    whole = Runner(tiny.model)
    want = whole.step([(whole.new(), ids)])[0]
    runner = Runner(tiny.model)
    seq, parts, lo = runner.new(), [], 0
    for size in (7, 1, 13, 2, 5):  # then 1-token decode steps
        parts += runner.step([(seq, ids[lo:lo + size])])
        lo += size
    while lo < len(ids):
        parts += runner.step([(seq, ids[lo:lo + 1])])
        lo += 1
    err = logit_error(torch.cat(parts), want)
    assert err <= 1e-5, f"chunked vs whole: {err:.2e}"


def test_packed_sequences_equal_each_alone(tiny):
    vocab = tiny.model.config.base.vocab_size
    a, b = prompt(29, vocab, seed=11), prompt(19, vocab, seed=12)
    alone = []
    for ids in (a, b):
        r = Runner(tiny.model)
        alone.append(r.step([(r.new(), ids)])[0])
    runner = Runner(tiny.model)
    sa, sb = runner.new(), runner.new()
    # a prefill chunk of both (fresh rows), one where both continue, then decode rows of both, then a alone
    first = runner.step([(sa, a[:20]), (sb, b[:9])])
    second = runner.step([(sa, a[20:27]), (sb, b[9:18])])
    third = runner.step([(sa, a[27:28]), (sb, b[18:19])])
    fourth = runner.step([(sa, a[28:29])])
    err_a = logit_error(torch.cat([first[0], second[0], third[0], fourth[0]]), alone[0])
    err_b = logit_error(torch.cat([first[1], second[1], third[1]]), alone[1])
    assert max(err_a, err_b) <= 1e-5, (err_a, err_b)


def test_greedy_tokens_match_transformers(tiny):
    """40 greedy tokens, ours one decode step at a time, transformers one step at a time through its own cache.
    EOS is an ordinary token here (no stop): a generated EOS resets the n-grams."""
    ids, n = prompt(23, tiny.model.config.base.vocab_size, seed=5), 40
    want = []
    with torch.no_grad():
        out = tiny.hf(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            want.append(int(out.logits[0, -1].argmax()))
            out = tiny.hf(torch.tensor([want[-1:]]), cache=out.cache, use_cache=True)
    runner = Runner(tiny.model)
    seq, got = runner.new(), []
    last = runner.step([(seq, ids)])[0][-1]
    for _ in range(n):
        got.append(int(last.argmax()))
        last = runner.step([(seq, got[-1:])])[0][-1]
    assert got == want
