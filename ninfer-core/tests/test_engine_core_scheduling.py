"""The engine's scheduler on the ledger Program (ninfer.testing.ledger): random lifecycles, fresh admission
past a paused request, host pressure revoking Snapshots, requests that cannot fit or bind, failures of one
request's frontend, and what an engine over a built instance takes from it."""

from __future__ import annotations

import random
import time

import pytest

from ninfer.contract import EngineConfig
from ninfer.contract.events import FinishReason, GenerationResult, GenerationStart
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine
from ninfer.testing.ledger import (
    EOS,
    PAGE_BYTES,
    REJECTED_BY_PROGRAM,
    UNREADABLE,
    drained,
    ledger_instance,
    make_engine,
    prompts,
    reference_tokens,
    req,
)
from ninfer.testing.scheduling import submit_together


@pytest.mark.parametrize("seed", range(12))
def test_randomized_lifecycle(seed):
    """Arrivals, cancellations at every state, deadlines and tiny KV budgets forcing pauses."""
    rng = random.Random(seed)
    conc = rng.choice([1, 2, 3, 4, 8])
    pages = rng.choice([17, 20, 26, 40])  # 17 pages hold one request's longest history (24 + 40 positions)
    host = rng.choice([0, 6 * PAGE_BYTES, 1 << 20])  # 0: every pause is a Replay
    eng = make_engine(max_concurrency=conc, pages=pages, host_bytes=host, prefill_chunk=rng.choice([1, 3, 8]),
                      bypass_limit=rng.choice([0, 1, 2]))
    specs, handles, expected = [], [], []
    for _ in range(24):
        p = [rng.randrange(1, 47) for _ in range(rng.randint(1, 24))]
        s = dict(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.7)
        if rng.random() < 0.3:
            s.update(temperature=0.7, seed=rng.randrange(100))
        deadline = rng.choice([None, None, None, rng.uniform(0.001, 0.05)])
        r = GenerationRequest(input=TextInput(token_ids=tuple(p)), sampling=SamplingParams(**s), deadline_s=deadline,
                              queue_timeout_s=rng.choice([None, None, 0.02]))
        handles.append(eng.submit(r))
        specs.append((p, s))
        expected.append(reference_tokens(p, SamplingParams(**{**s, "temperature": s.get("temperature", 0.0)})))
        if rng.random() < 0.25:
            rng.choice(handles).cancel()  # any state: waiting, prefill, decode, paused, finished
        if rng.random() < 0.3:
            time.sleep(rng.uniform(0, 0.004))
    results = []
    for h in handles:
        evs = list(h)
        finals = [e for e in evs if isinstance(e, GenerationResult)]
        assert len(finals) == 1 and evs[-1] is finals[0], "exactly one terminal result, last"
        starts = [e for e in evs if isinstance(e, GenerationStart)]
        assert len(starts) <= 1 and (not starts or evs[0] is starts[0])
        results.append(finals[0])
    for (_p, s), res, exp, h in zip(specs, results, expected, handles, strict=True):
        assert res.finish_reason is not FinishReason.ERROR or res.extra["error_kind"] in ("queue_timeout",), res
        # Whatever was published is a prefix of running alone; complete requests equal it.
        assert list(res.token_ids) == exp[:len(res.token_ids)], (h.request_id, res)
        if res.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            if s["ignore_eos"]:
                assert len(res.token_ids) == s["max_tokens"] or exp[len(res.token_ids) - 1] == EOS
            else:
                assert list(res.token_ids) == exp
    drained(eng)
    assert eng._core.scheduler.max_bypass_seen <= eng._core.scheduler.bypass_limit
    eng.close()


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_fresh_admission_bypasses_a_paused_request_at_most_the_bound(limit):
    """A paused request that cannot resume yet is overtaken by at most ``limit`` fresh admissions."""
    eng = make_engine(max_concurrency=4, pages=62, host_bytes=0, bypass_limit=limit)
    prog = eng.instance.program
    prog.gate.clear()  # hold the worker at A's first decode until B is submitted too
    prog.close_gate_on_pause = True
    a = eng.submit(req([1, 2, 3, 4], max_tokens=200, ignore_eos=True))   # grows to 51 pages
    # B is paused for A near position 140 and needs ~37 pages to resume: not before A ends.
    b = eng.submit(req(list(range(1, 41)), max_tokens=200, ignore_eos=True))
    prog.gate.set()
    assert prog.paused_once.wait(10)
    fresh = [eng.submit(req([40 + i, 41], max_tokens=2, ignore_eos=True)) for i in range(3)]
    prog.gate.set()
    results = [h.result(timeout=20) for h in (a, b, *fresh)]
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    assert results[1].timings.preemptions == 1
    order = [entry for entry in prog.log]
    b_resumed = order.index(("resume", tuple(range(1, 41))))
    fresh_opened = [order.index(("open", (40 + i, 41))) for i in range(3)]
    assert sum(pos < b_resumed for pos in fresh_opened) == limit  # exactly the bound overtook B
    assert eng._core.scheduler.max_bypass_seen == limit
    drained(eng)
    eng.close()


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("snapshots", [1, 2])
def test_host_pressure_revokes_paused_snapshots_and_outputs_stay_exact(seeded, snapshots):
    rng = random.Random(7)
    ps = prompts(8, rng, 3, 20)
    samp = [dict(max_tokens=rng.randint(10, 30), ignore_eos=True, **(
        dict(temperature=0.8, seed=rng.randrange(1000)) if seeded else {})) for _ in ps]
    expected = [reference_tokens(p, SamplingParams(**{"temperature": 0.0, **s})) for p, s in zip(ps, samp, strict=True)]
    # 14 pages force pauses; the host holds about `snapshots` Snapshots, so later pauses compete for it.
    with make_engine(max_concurrency=4, pages=14, host_bytes=snapshots * 6 * PAGE_BYTES) as eng:
        core, prog = eng._core, eng.instance.program
        decisions = []
        revoke = core.policy.revoke_snapshots

        def watched(need):  # runs on the worker: the host shortfall, and what the engine revoked for it
            u, before = prog.usage(), len(prog.demoted)
            revoke(need)
            revoked = prog.demoted[before:]
            decisions.append((need, u.host_bytes_used + need.host_bytes - u.host_bytes_total, revoked))
            if revoked:  # the pause that revoked keeps its own Snapshot
                assert prog.host_used + need.host_bytes <= prog.host_limit

        core.policy.revoke_snapshots = watched
        handles = submit_together(eng, [req(p, **s) for p, s in zip(ps, samp, strict=True)])
        events = [list(h) for h in handles]
        m = eng.metrics()
        drained(eng)
    for evs, exp in zip(events, expected, strict=True):
        assert sum(isinstance(e, GenerationResult) for e in evs) == 1 and isinstance(evs[-1], GenerationResult)
        assert evs[-1].finish_reason is FinishReason.LENGTH and list(evs[-1].token_ids) == exp
    assert m.snapshots_revoked == len(prog.demoted) > 0
    for need, shortfall, revoked in decisions:
        if revoked:  # it made room, and lost less replay than the new Snapshot saves
            assert sum(c.host_bytes for c in revoked) >= shortfall > 0
            assert sum(c.replay_positions for c in revoked) < need.replay_positions


def test_frontend_failure_ends_only_that_request():
    rng = random.Random(3)
    with make_engine(max_concurrency=4) as eng:
        # Find prompts whose greedy output reaches UNREADABLE (fragile) and ones that do not.
        fragile = next(p for p in prompts(200, rng, 1, 8)
                       if UNREADABLE in reference_tokens(p, SamplingParams(max_tokens=30, ignore_eos=True))
                       and REJECTED_BY_PROGRAM not in p)
        healthy = [[1, 2, 3], [4, 5]]
        hs = [eng.submit(req(fragile, max_tokens=30, ignore_eos=True, stop=("fragile",)))]
        hs += [eng.submit(req(p, max_tokens=20, ignore_eos=True)) for p in healthy]
        bad, *good = [h.result(timeout=10) for h in hs]
        assert bad.finish_reason is FinishReason.ERROR and bad.extra["error_kind"] == "request_failed"
        assert "UnicodeDecodeError" in bad.error
        assert UNREADABLE not in bad.token_ids  # the failing row accepted nothing
        for p, r in zip(healthy, good, strict=True):
            assert list(r.token_ids) == reference_tokens(p, SamplingParams(max_tokens=20, ignore_eos=True))
        assert not eng.failed
        drained(eng)


def test_program_validation_at_binding_is_a_request_error():
    with make_engine(max_concurrency=1) as eng:
        h = eng.submit(req([1, REJECTED_BY_PROGRAM, 2]))
        ok = eng.submit(req([1, 2]))
        r = h.result(timeout=10)
        assert r.finish_reason is FinishReason.ERROR and r.extra["error_kind"] == "invalid"
        assert "vocabulary" in r.error and not eng.failed
        assert ok.result(timeout=10).finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        drained(eng)


def test_a_request_that_can_never_fit_ends_with_a_capacity_error():
    with make_engine(max_concurrency=2, pages=2, prefill_chunk=16) as eng:
        first_chunk_too_big = eng.submit(req(list(range(1, 13))))  # 12 positions > 2 pages of 4
        grows_too_big = eng.submit(req([1, 2], max_tokens=40, ignore_eos=True))  # outgrows 8 positions
        r1, r2 = first_chunk_too_big.result(timeout=10), grows_too_big.result(timeout=10)
        assert r1.extra["error_kind"] == "capacity" and r1.usage.completion_tokens == 0
        assert r2.extra["error_kind"] == "capacity" and 1 <= r2.usage.completion_tokens <= 7
        drained(eng)


def test_worker_binds_an_explicit_cuda_ordinal_only(monkeypatch):
    import torch

    from ninfer.engine.core import bind_device

    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(d))
    for device in (None, "cpu", "cuda", "cuda:1"):
        bind_device(device)
    assert seen == [torch.device("cuda:1")]


def test_an_engine_over_a_built_instance_takes_the_devices_prefill_chunk():
    """One prefill_chunk rule for Engine(model) and Engine.from_instance: on a CUDA device both take
    default_prefill_chunk("cuda") (from_instance used to take 512 everywhere)."""
    from ninfer.contract.config import default_prefill_chunk

    inst = ledger_instance(slots=1, pages=1000, max_model_len=4096)
    chunks = []
    prefill = inst.program.prefill

    def recorded(sequence_id, max_tokens, *, masks=None):
        chunks.append(max_tokens)
        return prefill(sequence_id, max_tokens, masks=masks)

    inst.program.prefill = recorded
    prompt = [1 + i % 46 for i in range(1500)]
    # "cuda" alone binds no ordinal, so the ledger Program runs on any machine; only the default differs.
    with Engine.from_instance(inst, EngineConfig(max_concurrency=1, device="cuda")) as eng:
        assert eng.config.prefill_chunk == default_prefill_chunk("cuda") == 2048
        assert eng.generate(req(prompt, max_tokens=1, ignore_eos=True)).usage.completion_tokens == 1
    assert chunks == [1500]


def test_startup_options_do_not_apply_to_a_built_instance():
    from ninfer.contract.config import EngineConfig

    with pytest.raises(ValueError, match="already built; startup options dtype, num_pages do not apply"):
        Engine.from_instance(ledger_instance(), config=EngineConfig(device="cpu", dtype="float32",
                                                                    num_pages=3))
