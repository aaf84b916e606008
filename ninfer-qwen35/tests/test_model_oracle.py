"""Qwen3.5 model execution (dense and MoE) vs Hugging Face transformers (fp32, CPU, tiny random configs), and the
invariances the Program relies on: chunked prefill, prefill + decode, batch-neighbour independence.

The model runs over the real stores (StateImageStorage, PagedKVPool) filled with NaN first, so any
read of state a sequence does not own, or of an uninitialised state, shows up as NaN.
"""

from __future__ import annotations

import math
import os

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
from ninfer_qwen35.source_mapping import expected_parameters, fused_parents
from ninfer_qwen35.state import kv_pools, state_layout
from ninfer_qwen35.testing.hf_model import randomise

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
    # Qwen3.5 MoE: every MLP a sparse block (8 experts, top-3, a shared expert)
    "moe_r2": dict(vocab_size=288, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False, num_experts=8,
                   num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48),
}


@attrs.define
class Tiny:
    hf: torch.nn.Module
    model: Qwen35Model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request) -> Tiny:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    kind = "Qwen3_5Moe" if "num_experts" in CONFIGS[request.param] else "Qwen3_5"
    hf_config = getattr(transformers, f"{kind}TextConfig")(**CONFIGS[request.param])
    hf_config._attn_implementation = "eager"
    hf = getattr(transformers, f"{kind}ForCausalLM")(hf_config).eval()
    randomise(hf, seed=len(request.param))
    config = parse_config(hf_config.to_dict())
    tensors = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    weights = WeightSet.from_tensors(tensors, fused_parents(config))
    params = Qwen35Parameters.from_weights(config, weights, torch.float32)
    splits = [layer.mlp.shared.gate_up if config.moe else layer.mlp.gate_up for layer in params.layers]
    assert all(split.shares_parent for split in splits)
    return Tiny(hf=hf, model=Qwen35Model(params))


@attrs.define
class Seq:
    slot: int
    pages: list[int] = attrs.field(factory=list)
    length: int = 0


class Runner:
    """A minimal driver over the real stores: packs sequences' new tokens into one ForwardBatch."""

    def __init__(self, model: Qwen35Model, num_slots: int = 6, num_pages: int = 160, page_size: int = 4) -> None:
        c, p = model.config, model.params
        self.model, self.page_size, self.device = model, page_size, p.embed.device
        dtype = str(p.dtype).removeprefix("torch.")
        where = Device.parse(self.device)
        self.states = StateImageStorage(state_layout(c, dtype), num_slots, where)
        self.kv = PagedKVPool(kv_pools(c, page_size, dtype)[0], num_pages, where)
        for name in ("conv", "recurrent"):
            self.states.view(name).fill_(float("nan"))
        self.kv.storage.fill_(float("nan"))
        self.views = ModelStateViews(conv=self.states.view("conv"), recurrent=self.states.view("recurrent"),
                                     kv=self.kv.caches(), page_size=page_size)

    def new(self) -> Seq:
        return Seq(slot=self.states.allocate())

    def step(self, work: list[tuple[Seq, list[int]]], *, tell_initial: bool = True) -> list[torch.Tensor]:
        """Run one forward over every (sequence, new tokens); returns each sequence's logits [len, V]."""
        batch = self.pack(work, tell_initial=tell_initial)
        logits = self.model.logits(self.model.forward(batch, self.views)[batch.logits_indices]).cpu()
        for seq, toks in work:
            seq.length += len(toks)
        return list(logits.split([len(t) for _, t in work]))

    def pack(self, work: list[tuple[Seq, list[int]]], *, tell_initial: bool = True) -> ForwardBatch:
        """The ForwardBatch for ``work`` (allocating KV pages as needed)."""
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
        def on(x, dtype=None):
            return torch.tensor(x, dtype=dtype, device=self.device)

        return ForwardBatch(
            input_ids=on(ids), positions=on(pos), query_start_loc=on(qsl, torch.int32),
            seq_lens=on(lens, torch.int32), state_slots=on(slots), has_initial_state=on(init),
            block_tables=on(tables, torch.int32), slot_mapping=on(smap),
            logits_indices=torch.arange(len(ids), device=self.device), max_query_len=max(len(t) for _, t in work),
            max_seq_len=max(lens), all_initial_state=all(init) if tell_initial else None)

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





# -- the same model on CUDA (scripts: run with pytest -m gpu on the GPU machine) ---------------------------

GPU_RAW = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "tie_word_embeddings": False}  # Qwen3.5's real head dims (256 attention, 128 GDN), few heads


def random_model(device: str, dtype: torch.dtype, seed: int = 0) -> Qwen35Model:
    config = parse_config(GPU_RAW)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (_, shape) in expected_parameters(config).items():
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(-1.0, 1.5, generator=gen)
        elif name.endswith("linear_attn.norm.weight"):
            t = 1 + 0.3 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            t = 0.3 * torch.randn(shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) * (1.5 / math.sqrt(math.prod(shape[1:])))
        tensors[name] = t.to(device)
    weights = WeightSet.from_tensors(tensors, fused_parents(config))
    return Qwen35Model(Qwen35Parameters.from_weights(config, weights, dtype))


def scenario(model: Qwen35Model) -> torch.Tensor:
    """Mixed prefill, a prefill chunk with context, decode of B=2, and a fresh row joining a decode step."""
    V = model.config.vocab_size
    r = Runner(model, page_size=16)
    a, b = r.new(), r.new()
    pa, pb = prompt(150, V, seed=1), prompt(37, V, seed=2)
    out = r.step([(a, pa), (b, pb[:20])])
    out += r.step([(b, pb[20:])])
    for t in range(4):
        out += r.step([(b, [t + 1]), (a, [t + 7])])
    out += r.step([(a, [3]), (r.new(), [9]), (b, [4])], tell_initial=False)
    return torch.cat(out)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def cpu_reference() -> torch.Tensor:
    return scenario(random_model("cpu", torch.float32))


@pytest.mark.gpu
def test_cuda_references_match_cpu(cpu_reference, monkeypatch):
    monkeypatch.setenv("NINFER_OPS", "torch")
    got = scenario(random_model("cuda", torch.float32))
    assert torch.isfinite(got).all()
    assert relative_error(got, cpu_reference) <= RTOL


@pytest.mark.gpu
def test_cuda_default_dispatch_bf16_tracks_fp32(cpu_reference):
    """Whatever kernels TRITON_OPS enables, in bf16: close to the fp32 CPU run and the same top-1 mostly."""
    from ninfer.ops.dispatch import TRITON_OPS

    got = scenario(random_model("cuda", torch.bfloat16))
    err = relative_error(got, cpu_reference)
    agree = (got.argmax(-1) == cpu_reference.argmax(-1)).float().mean().item()
    print(f"kernels {sorted(TRITON_OPS)}: bf16 relative logit error {err:.3e}, top-1 agreement {agree:.3f}")
    assert torch.isfinite(got).all()
    assert err <= 5e-2 and agree >= 0.9


@pytest.mark.gpu
def test_cuda_decode_step_needs_no_host_sync():
    """With every decode op on a Triton kernel, a decode forward never syncs (CUDA-graph capturable)."""
    from ninfer.ops.dispatch import TRITON_OPS

    needed = {"norm.rms_norm", "norm.rms_norm_gated", "activation.silu_and_mul", "rope.apply_rope",
              "conv1d.causal_conv1d_decode", "gdn.gdn_gates", "gdn.gdn_decode", "attention.write_kv",
              "attention.paged_attention"}
    if not needed <= TRITON_OPS and os.environ.get("NINFER_OPS", "").strip().lower() != "triton":
        pytest.skip(f"decode ops still on torch references: {sorted(needed - TRITON_OPS)}")
    model = random_model("cuda", torch.bfloat16)
    r = Runner(model, page_size=16)
    a, b = r.new(), r.new()
    r.step([(a, [1, 2, 3]), (b, [4, 5])])
    batch = r.pack([(a, [6]), (b, [7])])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.logits(model.forward(batch, r.views))
    finally:
        torch.cuda.set_sync_debug_mode("default")
