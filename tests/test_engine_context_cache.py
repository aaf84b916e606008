"""The context cache through the Engine on a tiny random Qwen3.5 (CPU): outputs identical with it on and off.

Acceptance (issue 17): restores at prompt end, turn end and grid points give the same greedy tokens (and
logprobs within fp32 tolerance) and the same seeded samples as no cache; ``n > 1`` prefills once and forks;
session keys find their continuation; pressure reclaims the cache (to host replicas, or away) before
any resident is paused; preemption, cancellation and randomized lifecycles leave every page, slot,
lease and host byte accounted: idle after the workload, all free after ``clear_context_cache``.
"""

from __future__ import annotations

import random

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer.contract.config import EngineConfig
from ninfer.contract.events import GenerationStart, OutputDelta
from ninfer.contract.model import ModelInstance
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.contract.resources import FrontendResources
from ninfer.engine.engine import Engine
from ninfer.models.common.qwen.frontend import QwenFrontend
from ninfer.testing.scheduling import submit_together
from ninfer_qwen35.testing.checkpoints import make_tokenizer_json

transformers = pytest.importorskip("transformers")

from ninfer_qwen35.testing import decisive_tiny_hf, float32_program, model_from_hf  # noqa: E402

VOCAB = 448
PAGE = 4

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def parts():
    tokenizer_json, special = make_tokenizer_json()
    hf = decisive_tiny_hf(7, vocab_size=VOCAB)
    resources = FrontendResources(tokenizer_json=tokenizer_json, eos_token_ids=(special["<|im_end|>"],),
                                  embedding_vocab=VOCAB)
    return model_from_hf(hf), Resources(resources, hf)


class Resources:
    """The tiny model's FrontendResources, and the transformers model (a CUDA test builds ours from it)."""

    def __init__(self, resources, hf):
        self.resources, self.hf = resources, hf


def make_engine(parts, *, cache=True, max_concurrency=2, pages=96, slots=8, cache_host=1 << 24, host_bytes=1 << 24,
                prefill_chunk=16, grid=8, pause_mode="auto", device="cpu") -> Engine:
    model, resources = parts
    if device != "cpu":
        model = model_from_hf(resources.hf, device=device)
    prog = float32_program(model, page_size=PAGE, num_pages=pages, max_concurrency=max_concurrency, device=device,
                           host_budget_bytes=host_bytes, max_model_len=256, cuda_graphs=device != "cpu",
                           checkpoint_slots=slots if cache else 0, cache_host_budget_bytes=cache_host if cache else 0)
    inst = ModelInstance(architecture="qwen35", config=model.config, model=model, parameters=model.params,
                         frontend=QwenFrontend.from_resources(resources.resources), program=prog)
    return Engine.from_instance(inst, config=EngineConfig(
        max_concurrency=max_concurrency, device=device, prefill_chunk=prefill_chunk, pause_mode=pause_mode,
        context_cache=cache, checkpoint_grid=grid))


def req(tokens, session=None, **s) -> GenerationRequest:
    s.setdefault("temperature", 0.0)
    s.setdefault("ignore_eos", True)
    s.setdefault("max_tokens", 6)
    s.setdefault("logprobs", True)
    return GenerationRequest(input=TextInput(token_ids=tuple(tokens)), sampling=SamplingParams(**s),
                             session_key=session)


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


def logprobs(engine, request):
    """The result and the logprob of every generated token, from the handle's deltas."""
    handle = engine.submit(request)
    lps = [lp.logprob for e in handle if isinstance(e, OutputDelta) for lp in e.logprobs]
    return handle.result(120), lps


def check_clean(engine):
    u = engine.usage()
    assert u.idle, u
    engine.clear_context_cache()
    u = engine.usage()
    assert u.all_free, u


def run_all(engine, requests):
    """Each request alone, in order (so earlier ones can publish what later ones restore)."""
    return [engine.generate(r, timeout=120) for r in requests]


def conversation():
    """A prompt, the identical prompt, an extension, a shorter sharer, and a second turn on the first's output."""
    base = prompt(1, 37)
    return base, [base, base, base + prompt(2, 5), base[:21] + prompt(3, 9)]


def test_restores_give_the_same_outputs_as_no_cache(parts):
    base, prompts = conversation()
    with make_engine(parts, cache=False) as off:
        ref = [logprobs(off, req(p)) for p in prompts]
        turn2_ref = off.generate(req(base + list(ref[0][0].token_ids) + prompt(4, 6)))
    with make_engine(parts, slots=16) as on:  # room for every checkpoint: no eviction here
        with_lps = [logprobs(on, req(p)) for p in prompts]
        got = [r for r, _ in with_lps]
        turn2 = on.generate(req(base + list(got[0].token_ids) + prompt(4, 6)))
        for (a, a_lps), (b, b_lps) in zip(with_lps, ref, strict=True):
            assert a.token_ids == b.token_ids
            assert len(a_lps) == len(b_lps) and a_lps == pytest.approx(b_lps, abs=1e-4)
        assert [r.usage.cached_tokens for r in got] == [0, len(base) - 1, len(base) - 1, 16]  # grid 8: 16 <= 21
        assert turn2.token_ids == turn2_ref.token_ids
        # the first request's continuation: everything but its last token
        assert turn2.usage.cached_tokens == len(base) + len(got[0].token_ids) - 1
        m = on.metrics()  # counters are recorded as they happen (gauges when the worker observes)
        assert m.prefix_cache_hits == sum(r.usage.cached_tokens for r in [*got, turn2])
        assert m.prefix_cache_queries == sum(len(p) for p in prompts) + len(base) + 6 + 6
        assert on.usage().checkpoints > 0
        check_clean(on)


def test_logprobs_and_seeded_samples_match(parts):
    base, prompts = conversation()
    sampled = dict(temperature=0.9, top_p=0.95, seed=11, logprobs=True, top_logprobs=2)
    with make_engine(parts, cache=False) as off:
        ref = run_all(off, [req(p, **sampled) for p in prompts])
    with make_engine(parts) as on:
        got = run_all(on, [req(p, **sampled) for p in prompts])
        assert any(r.usage.cached_tokens for r in got)
        check_clean(on)
    for a, b in zip(got, ref, strict=True):
        assert a.token_ids == b.token_ids


def test_n_identical_prompts_prefill_once_and_fork(parts):
    p = prompt(5, 41)
    with make_engine(parts, max_concurrency=4, cache=False) as off:
        ref = off.generate(req(p, temperature=0.8, seed=3))
    with make_engine(parts, max_concurrency=4) as on:
        handles = submit_together(on, [req(p, temperature=0.8, seed=3) for _ in range(4)])
        results = [h.result(120) for h in handles]
        starts = [h for h in handles]
        assert sorted(r.usage.cached_tokens for r in results) == [0, len(p) - 1, len(p) - 1, len(p) - 1]
        for r in results:
            assert r.token_ids == ref.token_ids  # the same seed: each fork draws the same sample
        assert on.metrics().prefix_cache_hits == 3 * (len(p) - 1)
        del starts
        check_clean(on)


def test_generation_start_reports_cached_tokens(parts):
    p = prompt(6, 20)
    with make_engine(parts) as on:
        on.generate(req(p))
        events = list(on.submit(req(p)))
        start = next(e for e in events if isinstance(e, GenerationStart))
        assert start.cached_tokens == len(p) - 1
        check_clean(on)


def test_session_key_prefers_its_latest_continuation(parts):
    p = prompt(7, 24)
    with make_engine(parts) as on:
        first = on.generate(req(p, session="chat-1"))
        history = p + list(first.token_ids)
        second = on.generate(req(history + prompt(8, 4), session="chat-1"))
        assert second.usage.cached_tokens == len(history) - 1
        check_clean(on)


def test_a_request_without_the_cache_leaves_nothing(parts):
    p = prompt(9, 30)
    with make_engine(parts) as on:
        on.generate(GenerationRequest(input=TextInput(token_ids=tuple(p)), context_cache=False,
                                      sampling=SamplingParams(temperature=0.0, max_tokens=4)))
        u = on.usage()
        assert u.all_free and on.metrics().prefix_cache_queries == 0
        again = on.generate(req(p))
        assert again.usage.cached_tokens == 0


def test_pressure_reclaims_the_cache_before_pausing_anyone(parts):
    long = prompt(10, 120)
    work = (prompt(11, 60), prompt(11, 60), long, prompt(11, 60))
    with make_engine(parts, cache=False, pages=48) as off:
        ref = [off.generate(req(p, max_tokens=8)) for p in work]
    with make_engine(parts, pages=48, slots=3, grid=64) as on:
        got = [on.generate(req(p, max_tokens=8)) for p in work]
        m = on.metrics()
        assert m.preemptions == 0 and m.cache_evictions["host"] > 0 and m.cache_evictions["dropped"] > 0
        # the repeated prompt's checkpoint had been restored (demand): it went to the host and came back
        assert got[1].usage.cached_tokens == got[3].usage.cached_tokens == 59
        for a, b in zip(got, ref, strict=True):
            assert a.token_ids == b.token_ids
        check_clean(on)


def test_host_replica_restores_when_the_device_copy_is_gone(parts):
    p = prompt(12, 30)
    with make_engine(parts, slots=1) as on, make_engine(parts, cache=False) as off:
        first = on.generate(req(p, session="chat"))  # its continuation is the session's: worth a host copy
        on.generate(req(prompt(13, 30)))  # its save needs the only slot: the continuation goes to the host
        assert on.metrics().cache_evictions["host"] == 1
        turn2 = p + list(first.token_ids) + prompt(14, 5)
        again = on.generate(req(turn2, session="chat"))
        assert again.usage.cached_tokens == len(p) + len(first.token_ids) - 1
        assert again.token_ids == off.generate(req(turn2)).token_ids
        check_clean(on)


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_preemption_with_the_cache_gives_the_same_outputs(parts, mode):
    prompts = [prompt(20 + i, 30 + 7 * i) for i in range(4)]
    shared = prompts[0][:24]
    prompts += [shared + prompt(30, 9), shared + prompt(31, 3)]
    with make_engine(parts, cache=False, pages=200) as off:
        ref = run_all(off, [req(p, max_tokens=10) for p in prompts])
    with make_engine(parts, max_concurrency=3, pages=28, pause_mode=mode, slots=4) as on:
        on.generate(req(prompts[0], max_tokens=2))  # something to restore
        handles = submit_together(on, [req(p, max_tokens=10) for p in prompts])
        got = [h.result(120) for h in handles]
        assert on.metrics().preemptions > 0
        for a, b in zip(got, ref, strict=True):
            assert a.token_ids == b.token_ids
        check_clean(on)


@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(["auto", "replay"]))
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_cancellations_and_randomized_lifecycles_account_exactly(parts, seed, mode):
    """Arrivals sharing prefixes, turns of sessions, cancellations (some before their restore runs), pressure
    that evicts and preempts: every request ends once, and what remains is the cache's, all of it freed by
    clearing it."""
    rng = random.Random(seed)
    stems = [prompt(40 + i, 26) for i in range(3)]
    with make_engine(parts, max_concurrency=3, pages=56, slots=3, cache_host=1 << 16, grid=8, pause_mode=mode) as on:
        for round_ in range(6):
            reqs, cancel = [], []
            for i in range(rng.randrange(2, 6)):
                p = rng.choice(stems)[:rng.randrange(5, 26)] + prompt(round_ * 10 + i, rng.randrange(1, 12))
                reqs.append(req(p, max_tokens=rng.randrange(1, 8), session=rng.choice([None, "a", "b"])))
                cancel.append(rng.random() < 0.3)
            handles = submit_together(on, reqs)
            for h, c in zip(handles, cancel, strict=True):
                if c:
                    h.cancel()
            for h in handles:
                h.result(120)
            assert on.usage().idle
        check_clean(on)


@pytest.mark.gpu
def test_cuda_graphs_with_restores_and_continuations_match_no_cache(parts):
    """On CUDA with decode graphs (adopted prefix pages in the graphs' block tables, the first token by a graphed
    decode step, pipelined decode saving continuations), cache on and off give the same greedy tokens."""
    base, prompts = conversation()
    outputs = {}
    for cache in (False, True):
        with make_engine(parts, cache=cache, device="cuda", max_concurrency=4) as eng:
            assert eng.instance.program.graphs is not None, eng.instance.program.graph_error
            first = run_all(eng, [req(p) for p in prompts])
            together = [h.result(120) for h in submit_together(eng, [req(p, max_tokens=9) for p in prompts])]
            turn2 = eng.generate(req(base + list(first[0].token_ids) + prompt(4, 6)))
            outputs[cache] = [r.token_ids for r in [*first, *together, turn2]]
            if cache:
                assert turn2.usage.cached_tokens > 0 and any(r.usage.cached_tokens for r in together)
            check_clean(eng)
    assert outputs[True] == outputs[False]


def test_a_request_cancelled_before_its_restore_runs_takes_nothing(parts):
    p = prompt(50, 33)
    with make_engine(parts) as on:
        on.generate(req(p))
        usage = on.usage()

        def submit_and_cancel():
            h = on.submit(req(p))  # would restore p's prompt-end checkpoint at the next cycle
            h.cancel()
            return h
        result = on._core.on_worker(submit_and_cancel).result(60)
        assert result.finish_reason.value == "cancelled" and result.usage.cached_tokens == 0
        after = on.usage()
        assert after.leases == 0 and after.kv_pages_used == usage.kv_pages_used and after.checkpoints == usage.checkpoints
        check_clean(on)


def salted(tokens, salt, session=None):
    return attrs.evolve(req(tokens, session), cache_salt=salt)


def test_cache_salts_scope_prefixes_and_sessions(parts):
    """A second user sending the same prompt under another salt (or none) restores nothing; the same salt
    restores; sessions are named within their salt; everything is freed after."""
    p = prompt(60, 29)
    with make_engine(parts, slots=16) as on:
        assert on.generate(salted(p, "alice")).usage.cached_tokens == 0
        assert on.generate(salted(p, "bob")).usage.cached_tokens == 0
        assert on.generate(salted(p, None)).usage.cached_tokens == 0
        assert on.generate(salted(p, "alice")).usage.cached_tokens == len(p) - 1
        assert on.generate(salted(p, None)).usage.cached_tokens == len(p) - 1
        q = prompt(61, 19)
        first = on.generate(salted(q, "alice", session="chat"))
        history = q + list(first.token_ids) + prompt(62, 3)
        assert on.generate(salted(history, "bob", session="chat")).usage.cached_tokens == 0
        assert on.generate(salted(history, None, session="chat")).usage.cached_tokens == 0
        assert on.generate(salted(history, "alice", session="chat")).usage.cached_tokens == len(history) - 4
        check_clean(on)


def test_a_burst_under_two_salts_forks_only_within_each(parts):
    """Identical prompts submitted together: a request waits for (and restores) a pending save of its own
    salt only."""
    p = prompt(63, 41)
    with make_engine(parts, max_concurrency=4) as on:
        handles = submit_together(on, [salted(p, s) for s in ("alice", "bob", "alice", "bob")])
        cached = [h.result(120).usage.cached_tokens for h in handles]
        assert sorted(cached[0::2]) == sorted(cached[1::2]) == [0, len(p) - 1], cached
        check_clean(on)
