"""Qwen4Exp MTP speculative decoding through the whole engine is lossless (fp32, CPU): on tiny checkpoints
transformers wrote (with random ``mtp.*`` tensors) and the real converter converted, greedy decoding with k = 1..3
MTP drafts gives plain greedy decoding's tokens token for token, with concurrent rows, Snapshot and Replay
preemption mid-generation, and every page and slot free afterwards. Variants: ``ple`` (PLE on two GDN layers) and
``full`` (4 streams, sigmoid GDN gate, selecting QSA, PLE, 8 experts); the prompts hold EOS, where the n-gram
history resets.

The random MTP head's drafts are mostly rejected, so a second drafter stands in for it too: the reference
continuation with a wrong token (often EOS) at a varying place, so every unit accepts 0..k drafts and the rollback
of GDN, PLE conv and n-gram state after a rejected draft, EOS included, is exercised with acceptance > 0. (That
the MTP head's own proposal is SGLang's formula is ``test_mtp_block``'s.)
"""

from __future__ import annotations

import random

import attrs
import pytest

from ninfer.contract.config import EngineConfig, StartupFeatures
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine
from ninfer.testing.scheduling import submit_together

transformers = pytest.importorskip("transformers")
pytest.importorskip("ninfer_convert")
from ninfer_qwen4exp.testing import convert_tiny, make_tiny_checkpoint  # noqa: E402

STEPS = 24



@attrs.frozen
class Tiny:
    artifact: str
    eos: int
    prompts: tuple[tuple[int, ...], ...]
    plain: tuple[tuple[int, ...], ...]  # each prompt's greedy tokens without speculation


def engine(tiny: Tiny, k: int, **config) -> Engine:
    features = StartupFeatures(speculative="mtp", num_draft_tokens=k) if k else StartupFeatures()
    options = dict(device="cpu", dtype="float32", max_concurrency=3, context_cache=False, prefill_chunk=8,
                   features=features) | config
    return Engine(tiny.artifact, EngineConfig(**options))


def req(prompt) -> GenerationRequest:
    return GenerationRequest(input=TextInput(token_ids=tuple(prompt)),
                             sampling=SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))


def run(eng: Engine, prompts) -> list[tuple[int, ...]]:
    return [tuple(h.result(timeout=120).token_ids) for h in submit_together(eng, [req(p) for p in prompts])]


def settled(eng: Engine) -> None:
    assert eng.usage().all_free, eng.usage()
    assert eng.metrics().outstanding == 0


def watch(eng: Engine) -> list[int]:
    """[verify rows, tokens they produced], counted as the worker collects units."""
    prog, counts = eng.instance.program, [0, 0]
    collect = prog.collect

    def counted(unit):
        batch = collect(unit)
        for row in batch.rows:
            counts[0] += 1
            counts[1] += row.produced
        return batch

    prog.collect = counted
    return counts


@pytest.fixture(scope="module", params=["ple", "full"])
def tiny(request, tmp_path_factory) -> Tiny:
    root = tmp_path_factory.mktemp(request.param)
    ckpt = make_tiny_checkpoint(root / "ckpt", variant=request.param, seed=13)
    art = convert_tiny(ckpt, root / "tiny.ninfer")
    eos = transformers.AutoConfig.from_pretrained(ckpt).eos_token_id
    rng = random.Random(3)
    ids = [[rng.randrange(3, 400) for _ in range(n)] for n in (6, 17, 11)]
    ids[1][8] = ids[2][3] = ids[2][4] = eos  # n-grams reset after EOS (twice in a row in the third)
    ids[0][-1] = eos  # the last prompt token, the first decode input, is EOS
    prompts = tuple(tuple(p) for p in ids)
    part = Tiny(str(art), eos, prompts, ())
    with engine(part, 0) as eng:
        plain = tuple(run(eng, prompts))
        settled(eng)
    return attrs.evolve(part, plain=plain)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_with_mtp_equals_plain_greedy(tiny, k):
    with engine(tiny, k) as eng:
        counts = watch(eng)
        assert run(eng, tiny.prompts) == list(tiny.plain)
        assert counts[0] > 0 and counts[1] >= counts[0]
        settled(eng)


def forced_drafts(eng: Engine, tiny: Tiny) -> None:
    """Replace the MTP's drafts by the reference continuation with one wrong token (EOS every other time) at a
    place that cycles through 0..k (k: none wrong)."""
    prog = eng.instance.program
    k, turn = prog.draft_tokens, [0]
    full = {p: list(p) + list(t) for p, t in zip(tiny.prompts, tiny.plain, strict=True)}

    def drafts(seq):
        ledger = full[tuple(seq.ledger[:seq.prompt_len])]
        nxt = ledger[seq.computed + 1:seq.computed + 1 + k]
        nxt += [0] * (k - len(nxt))
        turn[0] += 1
        wrong = turn[0] % (k + 1)
        if wrong < k:
            nxt[wrong] = tiny.eos if turn[0] % 2 else (nxt[wrong] + 1) % 400
        return tuple(nxt)

    prog._drafts_of = drafts


@pytest.mark.parametrize("k", [2, 3])
def test_accepted_and_rejected_drafts_roll_back_exactly(tiny, k):
    with engine(tiny, k) as eng:
        forced_drafts(eng, tiny)
        counts = watch(eng)
        assert run(eng, tiny.prompts) == list(tiny.plain)
        assert counts[1] > 1.5 * counts[0]  # many drafts accepted (and many rejected)
        settled(eng)


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_preemption_mid_generation_resumes_exactly(tiny, mode):
    """8 pages of 8 positions cannot hold 3 residents of up to 41 positions (and the verify span): pauses are
    forced mid-generation."""
    with engine(tiny, 2, page_size=8, num_pages=8, pause_mode=mode,
                host_budget_bytes=(1 << 26) if mode == "snapshot" else 0) as eng:
        forced_drafts(eng, tiny)
        assert run(eng, tiny.prompts) == list(tiny.plain)
        m = eng.metrics()
        assert m.preemptions > 0
        assert (m.preemptions_snapshot if mode == "snapshot" else m.preemptions_replay) == m.preemptions
        settled(eng)


def test_verify_through_the_graph_buffers(tiny):
    """The verify unit through its graphs' static input buffers (the CUDA-graph input path, here on the CPU)."""
    from ninfer.contract.memory import ProgramCapacity
    from ninfer_qwen4exp.program.mtp_program import Qwen4ExpMTPProgram

    eng = engine(tiny, 2)
    eng.close()
    inst, prog = eng.instance, eng.instance.program
    static = Qwen4ExpMTPProgram(prog.model, mtp=prog.mtp, steps=prog.steps, draft_tokens=2, static_decode=True,
                                config=prog.config, state_layout=prog.state_layout, kv_pool=prog.kv_pools[0],
                                device="cpu", max_concurrency=3, vocab_size=prog.vocab_size,
                                capacity=ProgramCapacity(kv_pages=prog.pool.num_pages - 1,
                                                         max_model_len=prog.max_model_len),
                                sampling_defaults=prog.sampling_defaults)
    assert static.graphs is not None
    with Engine.from_instance(attrs.evolve(inst, program=static),
                              EngineConfig(max_concurrency=3, device="cpu", prefill_chunk=8,
                                           context_cache=False)) as eng:
        forced_drafts(eng, tiny)
        assert run(eng, tiny.prompts) == list(tiny.plain)
        settled(eng)


def test_host_experts_and_the_context_cache(tiny):
    """Placement host-experts (the MTP layer's routed experts in host memory too) and the context cache on: the same
    tokens, and a second run of the prompts (restored from the cache) too."""
    with engine(tiny, 2, placement="host-experts", expert_cache_bytes=0, context_cache=True) as eng:
        assert eng.instance.program.host_experts is not None
        forced_drafts(eng, tiny)
        assert run(eng, tiny.prompts) == list(tiny.plain)
        assert run(eng, tiny.prompts) == list(tiny.plain)
        assert eng.metrics().outstanding == 0
