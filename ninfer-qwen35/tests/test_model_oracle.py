"""Qwen3.5 model execution vs Hugging Face transformers (fp32, CPU, tiny random configs), and the
invariances the Program relies on: chunked prefill, prefill + decode, batch-neighbour independence.

The model runs over the real stores (StateImageStorage, PagedKVPool) filled with NaN first, so any
read of state a sequence does not own, or of an uninitialised state, shows up as NaN.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from ninfer.core.device import Device
from ninfer.core.kv_pool import PagedKVPool
from ninfer.core.state_store import StateImageStorage
from ninfer.models.common.weights import WeightSet
from ninfer.ops import sample
from ninfer_qwen35.config import parse_config
from ninfer_qwen35.execution.forward_batch import ForwardBatch, ModelStateViews
from ninfer_qwen35.execution.model import Qwen35Model
from ninfer_qwen35.execution.parameters import Qwen35Parameters
from ninfer_qwen35.source_mapping import fused_parents
from ninfer_qwen35.state import kv_pools, state_layout

transformers = pytest.importorskip("transformers")

RTOL = 1e-4  # logits: max |ours - HF| <= RTOL * max |HF| (fp32)

CONFIGS = {
    # tied embeddings, HV/HK = 1, 3 GDN layers then 1 attention layer
    "tied_r1": dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                    linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    tie_word_embeddings=True),
    # untied, HV/HK = 2, Dk != Dv, MQA, two attention layers interleaved
    "untied_r2": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                      tie_word_embeddings=False,
                      layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
}


@attrs.define
class Tiny:
    hf: torch.nn.Module
    model: Qwen35Model


def _randomise(hf: torch.nn.Module, seed: int) -> None:
    """HF's init is near-zero (flat logits); give every weight an O(1) effect so greedy paths are decisive."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.5, generator=gen))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = math.prod(p.shape[1:])
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(fan_in)))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request) -> Tiny:
    torch.manual_seed(0)
    hf_config = transformers.Qwen3_5TextConfig(**CONFIGS[request.param])
    hf_config._attn_implementation = "eager"
    hf = transformers.Qwen3_5ForCausalLM(hf_config).eval()
    _randomise(hf, seed=len(request.param))
    config = parse_config(hf_config.to_dict())
    tensors = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    weights = WeightSet.from_tensors(tensors, fused_parents(config))
    params = Qwen35Parameters.from_weights(config, weights, torch.float32)
    assert all(layer.mlp.gate_up.shares_parent for layer in params.layers)
    return Tiny(hf=hf, model=Qwen35Model(params))


@attrs.define
class Seq:
    slot: int
    pages: list[int] = attrs.field(factory=list)
    length: int = 0


class Runner:
    """A minimal driver over the real stores: packs sequences' new tokens into one ForwardBatch."""

    def __init__(self, model: Qwen35Model, num_slots: int = 6, num_pages: int = 160, page_size: int = 4) -> None:
        c = model.config
        self.model, self.page_size = model, page_size
        self.states = StateImageStorage(state_layout(c, "float32"), num_slots, Device("cpu"))
        self.kv = PagedKVPool(kv_pools(c, page_size, "float32")[0], num_pages, Device("cpu"))
        for name in ("conv", "recurrent"):
            self.states.view(name).fill_(float("nan"))
        self.kv.storage.fill_(float("nan"))
        self.views = ModelStateViews(conv=self.states.view("conv"), recurrent=self.states.view("recurrent"),
                                     kv=self.kv.caches(), page_size=page_size)

    def new(self) -> Seq:
        return Seq(slot=self.states.allocate())

    def step(self, work: list[tuple[Seq, list[int]]], *, tell_initial: bool = True) -> list[torch.Tensor]:
        """Run one forward over every (sequence, new tokens); returns each sequence's logits [len, V]."""
        ids, pos, qsl, lens, slots, init, smap = [], [], [0], [], [], [], []
        for seq, toks in work:
            end = seq.length + len(toks)
            need = -(-end // self.page_size) - len(seq.pages)
            seq.pages += self.kv.allocator.allocate(max(need, 0))
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
        batch = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.tensor(pos),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
            state_slots=torch.tensor(slots), has_initial_state=torch.tensor(init),
            block_tables=torch.tensor(tables, dtype=torch.int32), slot_mapping=torch.tensor(smap),
            logits_indices=torch.arange(len(ids)), max_query_len=max(len(t) for _, t in work),
            max_seq_len=max(lens), all_initial_state=all(init) if tell_initial else None)
        logits = self.model.logits(self.model.forward(batch, self.views)[batch.logits_indices])
        for seq, toks in work:
            seq.length += len(toks)
        return list(logits.split([len(t) for _, t in work]))

    def generate(self, prompt: list[int], n: int) -> list[int]:
        seq = self.new()
        last = self.step([(seq, prompt)])[0][-1:]
        out = []
        greedy = (torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.ones(1), torch.zeros(1))
        for _ in range(n):
            out.append(int(sample(last, *greedy, [None])))
            last = self.step([(seq, out[-1:])])[0]
        return out


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(tiny: Tiny, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return tiny.hf(torch.tensor([ids])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    assert torch.isfinite(ours).all()
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err <= rtol, f"max relative logit error {err:.2e} > {rtol:.0e}"


@pytest.mark.parametrize("length", [1, 37, 64, 130])
def test_prefill_logits_match_transformers(tiny, length):
    ids = prompt(length, tiny.model.config.vocab_size, seed=length)
    runner = Runner(tiny.model)
    ours = runner.step([(runner.new(), ids)])[0]
    assert_logits_close(ours, hf_logits(tiny, ids))


def test_greedy_generation_matches_transformers(tiny):
    ids = prompt(29, tiny.model.config.vocab_size, seed=7)
    n = 40
    with torch.no_grad():
        # An explicit all-ones mask: without it HF treats prompt tokens equal to pad_token_id as padding.
        hf_out = tiny.hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0)[0, len(ids):].tolist()
    assert len(hf_out) == n
    assert Runner(tiny.model).generate(ids, n) == hf_out


def test_chunked_prefill_equals_unchunked(tiny):
    ids = prompt(130, tiny.model.config.vocab_size, seed=3)
    runner = Runner(tiny.model)
    whole = runner.step([(runner.new(), ids)])[0]
    seq = runner.new()
    parts, at = [], 0
    for size in (50, 1, 60, 19):  # crosses the 64-token GDN chunk and several KV pages mid-chunk
        parts.append(runner.step([(seq, ids[at:at + size])])[0])
        at += size
    assert_logits_close(torch.cat(parts), whole)


def test_prefill_then_decode_equals_one_forward(tiny):
    ids = prompt(60, tiny.model.config.vocab_size, seed=4)
    runner = Runner(tiny.model)
    whole = runner.step([(runner.new(), ids)])[0]
    seq = runner.new()
    parts = [runner.step([(seq, ids[:41])])[0]]
    parts += [runner.step([(seq, [t])])[0] for t in ids[41:]]
    assert_logits_close(torch.cat(parts), whole)


def test_rows_do_not_depend_on_batch_neighbours(tiny):
    V = tiny.model.config.vocab_size
    prompts = [prompt(n, V, seed=10 + n) for n in (37, 5, 70)]
    alone = []
    for p in prompts:
        r = Runner(tiny.model)
        s = r.new()
        logits = [r.step([(s, p)])[0]] + [r.step([(s, [t])])[0] for t in (1, 2, 3)]
        alone.append(torch.cat(logits))
    # Together: one prefill unit of three prompts, then decode steps of B = 3, 2 (a different membership)
    # and a mixed step where a fresh one-token prompt joins two continuing rows.
    r = Runner(tiny.model)
    r.new()  # shift slots so the batch uses slots 1..3, not the ones used alone
    seqs = [r.new() for _ in prompts]
    got = [[x] for x in r.step(list(zip(seqs, prompts, strict=True)))]
    for i, x in enumerate(r.step([(seqs[2], [1]), (seqs[0], [1]), (seqs[1], [1])])):
        got[[2, 0, 1][i]].append(x)
    for i, x in enumerate(r.step([(seqs[1], [2]), (seqs[0], [2])])):
        got[[1, 0][i]].append(x)
    got[2].append(r.step([(seqs[2], [2])])[0])
    fresh = r.new()
    mixed = r.step([(seqs[0], [3]), (fresh, [5]), (seqs[2], [3]), (seqs[1], [3])], tell_initial=False)
    got[0].append(mixed[0])
    got[2].append(mixed[2])
    got[1].append(mixed[3])
    for want, parts in zip(alone, got, strict=True):
        assert_logits_close(torch.cat(parts), want)
    assert_logits_close(mixed[1], hf_logits(tiny, [5]))



