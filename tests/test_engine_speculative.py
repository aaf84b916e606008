"""MTP speculative decoding through the whole engine, on the embedded model (whose MTP head is trained, so drafts
are accepted and rejected for real), in fp32 on the CPU.

Acceptance: greedy speculative decoding gives plain greedy decoding's tokens, token for token, for k = 1..3 and
B = 1..8, with chunked prefill, forced preemption (Snapshot and Replay), stops inside the accepted drafts,
cancellations and grammar constraints; seeded sampling is reproducible whatever the batch or the pauses;
logprobs match; every page, slot and host byte is free afterwards.
"""

from __future__ import annotations

import random

import attrs
import pytest

from ninfer import default_model_path
from ninfer.contract import EngineConfig, ProgramCapacity
from ninfer.contract.config import StartupFeatures
from ninfer.contract.constraint import JsonConstraint
from ninfer.contract.events import FinishReason, GenerationResult
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine
from ninfer.testing.scheduling import submit_together
from ninfer_qwen35.program.mtp_program import Qwen35MTPProgram

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

LINES = ["To be, or not to be, that is the question:", "Friends, Romans, countrymen, lend me your ears;",
         "Now is the winter of our discontent", "O Romeo, Romeo! wherefore art thou Romeo?",
         "All the world's a stage,", "If music be the food of love, play on;", "KING HENRY. Once more unto the breach,",
         "Double, double toil and trouble;"]


def make_engine(k: int, *, max_concurrency: int = 8, static: bool = False, **options) -> Engine:
    """``static``: the verify unit runs through its graphs' static input buffers (the CUDA-graph input path)."""
    features = StartupFeatures(speculative="mtp", num_draft_tokens=k) if k else StartupFeatures()
    options.setdefault("prefill_chunk", 8)
    options.setdefault("context_cache", False)
    eng = Engine(default_model_path(), EngineConfig(device="cpu", dtype="float32", features=features,
                                                    max_concurrency=max_concurrency, **options))
    if not static:
        return eng
    eng.close()
    inst, prog = eng.instance, eng.instance.program
    static_prog = Qwen35MTPProgram(prog.model, mtp=prog.mtp, steps=prog.steps, draft_tokens=k, static_decode=True,
                                   state_layout=prog.state_layout, kv_pool=prog.kv_pools[0], device="cpu",
                                   max_concurrency=max_concurrency, vocab_size=prog.vocab_size,
                                   capacity=ProgramCapacity(kv_pages=prog.pool.num_pages - 1,
                                                            max_model_len=prog.max_model_len),
                                   sampling_defaults=prog.sampling_defaults)
    assert static_prog.graphs is not None
    return Engine.from_instance(attrs.evolve(inst, program=static_prog), EngineConfig(max_concurrency=max_concurrency,
                                                                                      device="cpu",
                                                                                      prefill_chunk=options["prefill_chunk"],
                                                                                      context_cache=False))


def req(text: str, **s) -> GenerationRequest:
    s.setdefault("temperature", 0.0)
    s.setdefault("ignore_eos", True)
    s.setdefault("max_tokens", 24)
    return GenerationRequest(input=TextInput(text=text), sampling=SamplingParams(**s))


def seeded(i: int) -> dict:
    return dict(temperature=0.8, top_k=50, top_p=0.95, seed=1000 + i)


def run(eng: Engine, requests) -> list[GenerationResult]:
    return [h.result(timeout=300) for h in submit_together(eng, requests)]


def settled(eng: Engine) -> None:
    assert eng.usage().all_free, eng.usage()
    assert eng.metrics().outstanding == 0


def acceptance(eng: Engine) -> tuple[int, int]:
    """(verify rows, tokens they produced) so far, read off the Program's collected units."""
    return eng._spec_counts  # set by watch()


def watch(eng: Engine) -> None:
    """Count verify rows and their tokens as the worker collects them."""
    prog = eng.instance.program
    collect = prog.collect
    eng._spec_counts = [0, 0]

    def counted(unit):
        batch = collect(unit)
        for row in batch.rows:
            assert row.drafted == prog.draft_tokens and 1 <= row.produced <= row.drafted + 1
            eng._spec_counts[0] += 1
            eng._spec_counts[1] += row.produced
        return batch

    prog.collect = counted


@pytest.fixture(scope="module")
def plain():
    """Every workload run without speculation (the reference), greedy and seeded-free."""
    eng = make_engine(0)
    out = {"greedy": [r.token_ids for r in run(eng, [req(t) for t in LINES])]}
    settled(eng)
    eng.close()
    return out


@pytest.mark.parametrize(("k", "static"), [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_greedy_speculative_equals_plain_greedy(plain, k, static):
    eng = make_engine(k, static=static)
    watch(eng)
    results = run(eng, [req(t) for t in LINES])
    assert [r.token_ids for r in results] == plain["greedy"]
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    rows, produced = acceptance(eng)
    assert rows > 0 and produced > rows  # drafts were accepted: fewer units than tokens
    settled(eng)
    eng.close()


@pytest.mark.parametrize("concurrency", [1, 3])
def test_any_batch_size_gives_the_same_tokens(plain, concurrency):
    eng = make_engine(2, max_concurrency=concurrency)
    assert [r.token_ids for r in run(eng, [req(t) for t in LINES])] == plain["greedy"]
    settled(eng)
    eng.close()


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_forced_preemption_keeps_the_tokens(plain, mode):
    # 16 pages of 4 positions cannot hold 4 residents of up to ~38 positions: pauses are forced.
    eng = make_engine(2, max_concurrency=4, num_pages=16, page_size=4, pause_mode=mode,
                      host_budget_bytes=(1 << 26) if mode == "snapshot" else 0)
    results = run(eng, [req(t) for t in LINES])
    m = eng.metrics()
    assert m.preemptions > 0
    assert (m.preemptions_snapshot if mode == "snapshot" else m.preemptions_replay) == m.preemptions
    assert [r.token_ids for r in results] == plain["greedy"]
    settled(eng)
    eng.close()


def test_seeded_sampling_is_reproducible_across_batches_and_pauses():
    work = [req(t, **seeded(i)) for i, t in enumerate(LINES)]
    outs = []
    for options in (dict(max_concurrency=1), dict(max_concurrency=8, static=True),
                    dict(max_concurrency=4, num_pages=16, page_size=4, pause_mode="snapshot",
                         host_budget_bytes=1 << 26)):
        eng = make_engine(2, **options)
        outs.append([r.token_ids for r in run(eng, work)])
        settled(eng)
        eng.close()
    assert outs[0] == outs[1] == outs[2]


def test_stops_inside_the_accepted_drafts_end_the_row_there(plain):
    """A stop token and a stop string known to come mid-way: each result is the plain output cut there."""
    eng = make_engine(3)
    requests, cuts = [], []
    for i, (text, solo) in enumerate(zip(LINES, plain["greedy"], strict=True)):
        stop = solo[len(solo) // 2 + i % 3]
        cuts.append(solo[:solo.index(stop) + 1])
        requests.append(req(text, stop_token_ids=(stop,)))
    results = run(eng, requests)
    assert [r.token_ids for r in results] == cuts
    assert all(r.finish_reason is FinishReason.STOP for r in results)
    # max_tokens inside a verify unit: the row ends with exactly its budget
    short = run(eng, [req(t, max_tokens=5 + i) for i, t in enumerate(LINES)])
    assert [r.token_ids for r in short] == [p[:5 + i] for i, p in enumerate(plain["greedy"])]
    settled(eng)
    eng.close()


def test_stop_strings_match_plain_decoding():
    texts = {}
    for k in (0, 2):
        eng = make_engine(k)
        texts[k] = [(r.content, r.finish_reason) for r in run(eng, [req(t, stop=["e", "th"]) for t in LINES])]
        settled(eng)
        eng.close()
    assert texts[2] == texts[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_cancellations_leave_nothing_held(plain, seed):
    rng = random.Random(seed)
    eng = make_engine(2, max_concurrency=4, num_pages=24, page_size=4)
    hs = []
    for t in LINES:
        hs.append(eng.submit(req(t)))
        if rng.random() < 0.4:
            rng.choice(hs).cancel()
    for h, ref in zip(hs, plain["greedy"], strict=True):
        res = h.result(timeout=300)
        assert res.finish_reason in (FinishReason.LENGTH, FinishReason.CANCELLED)
        assert res.token_ids == ref[:len(res.token_ids)]
    settled(eng)
    eng.close()


def test_logprobs_match_plain_decoding():
    got = {}
    for k in (0, 3):
        eng = make_engine(k)
        hs = submit_together(eng, [req(t, max_tokens=10, logprobs=True, top_logprobs=2) for t in LINES[:3]])
        got[k] = [[lp for e in list(h)[1:-1] for lp in e.logprobs] for h in hs]
        settled(eng)
        eng.close()
    for plain_lps, spec_lps in zip(got[0], got[3], strict=True):
        assert [lp.token_id for lp in spec_lps] == [lp.token_id for lp in plain_lps] and len(plain_lps) == 10
        for a, b in zip(plain_lps, spec_lps, strict=True):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
            assert [t for t, _, _ in b.top] == [t for t, _, _ in a.top]
            assert [lp for _, _, lp in b.top] == pytest.approx([lp for _, _, lp in a.top], abs=1e-4)


def test_context_cache_restores_then_drafts_again(plain):
    """The second turn restores the first's checkpointed prefix (its whole prompt but the last token: no drafts
    yet, the row verifies its last token repeated) and still gives the plain tokens."""
    eng = make_engine(2, context_cache=True)
    first = run(eng, [req(t) for t in LINES[:2]])
    again = run(eng, [req(t) for t in LINES[:2]])
    assert [r.token_ids for r in first] == [r.token_ids for r in again] == plain["greedy"][:2]
    assert all(r.usage.cached_tokens > 0 for r in again)
    u = eng.usage()
    assert u.state_slots_used == 0 and u.reserved_pages == 0 and u.kv_pages_used == u.cache_pages
    eng.close()


def test_grammar_masks_apply_to_every_verify_row():
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    outs = {}
    for k in (0, 2):
        eng = make_engine(k)
        results = run(eng, [GenerationRequest(input=TextInput(text=t), constraint=JsonConstraint(schema=schema),
                                              sampling=SamplingParams(temperature=0.0, max_tokens=40))
                            for t in LINES[:4]])
        outs[k] = [(r.token_ids, r.finish_reason) for r in results]
        settled(eng)
        eng.close()
    assert outs[2] == outs[0]


@pytest.mark.gpu
@pytest.mark.parametrize("seeded_rows", [False, True])
def test_cuda_verify_graphs_match_eager_and_plain(seeded_rows):
    """On CUDA (fp32): the speculative unit through its captured graphs gives the eager unit's tokens, and greedy
    rows give plain decoding's."""
    work = [req(t, **(seeded(i) if seeded_rows and i % 2 else {})) for i, t in enumerate(LINES)]
    out = {}
    for k, graphs in ((0, True), (2, False), (2, True), (3, True)):
        eng = Engine(default_model_path(), EngineConfig(device="cuda", dtype="float32", max_concurrency=8, context_cache=False, cuda_graphs=graphs, features=StartupFeatures(speculative="mtp", num_draft_tokens=k) if k
                     else StartupFeatures()))
        prog = eng.instance.program
        assert (prog.graphs is not None) == graphs, prog.graph_error
        out[k, graphs] = [r.token_ids for r in run(eng, work)]
        settled(eng)
        eng.close()
    assert out[2, True] == out[2, False]
    greedy = [i for i in range(len(LINES)) if not (seeded_rows and i % 2)]
    for key in ((2, True), (3, True)):
        assert [out[key][i] for i in greedy] == [out[0, True][i] for i in greedy]
