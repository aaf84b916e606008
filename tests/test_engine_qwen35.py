"""The engine driving the real Qwen3.5 Program and Qwen Frontend on a tiny random model (CPU).

Acceptance: concurrent residents give the same tokens as running alone; forced preemption
(Snapshot and Replay) gives the same tokens as none, greedy and seeded; randomized lifecycles end
every request in exactly one terminal state and leave every page, slot and host byte free.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from ninfer.contract.events import FinishReason, GenerationResult, GenerationStart
from ninfer.contract.model import ModelInstance
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.contract.resources import FrontendResources
from ninfer.core.cpu_executor import CpuExecutor
from ninfer.engine.engine import Engine
from ninfer.models.common.moe.host_experts import HostExperts
from ninfer.models.common.qwen.frontend import QwenFrontend
from ninfer.testing.scheduling import submit_together
from ninfer_qwen35.testing.checkpoints import make_tokenizer_json

transformers = pytest.importorskip("transformers")

from ninfer.contract import EngineConfig  # noqa: E402
from ninfer_qwen35.execution.model import Qwen35Model  # noqa: E402
from ninfer_qwen35.testing import decisive_tiny_hf, float32_program, model_from_hf  # noqa: E402

VOCAB = 448  # the tiny tokenizer's 433 ids, padded like published embeddings
PAGE = 4


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def parts():
    return _parts(moe=False)


@pytest.fixture(scope="module")
def moe_parts():
    """The same engine over a Qwen3.5 MoE model (every MLP a sparse block)."""
    return _parts(moe=True)


def _parts(*, moe: bool):
    tokenizer_json, special = make_tokenizer_json()
    hf = decisive_tiny_hf(5, vocab_size=VOCAB, moe=moe)
    resources = FrontendResources(tokenizer_json=tokenizer_json, eos_token_ids=(special["<|im_end|>"],),
                                  embedding_vocab=VOCAB)
    models: dict[str, Qwen35Model] = {}

    def model_on(device: str) -> Qwen35Model:
        if device not in models:
            models[device] = model_from_hf(hf, device=device)
        return models[device]

    return model_on("cpu").config, model_on, resources


def make_engine(parts, *, max_concurrency=2, pages=64, host_bytes=1 << 24, pause_mode="auto", prefill_chunk=16,
                bypass_limit=None, device="cpu", cuda_graphs=False, host_experts=False) -> Engine:
    """``host_experts``: the MoE banks served through a HostExperts runtime (3 cached experts, prompts of 4
    tokens or more streamed), as the host-experts placement runs them."""
    cfg, model_on, resources = parts
    model = model_on(device)
    runtime = None
    if host_experts:
        blocks = [layer.mlp for layer in model.params.layers]
        routers = [b.router_shared_gate.weight[:-1] for b in blocks[1:]] + [None]  # [E routing | shared gate]
        runtime = HostExperts([(b.gate_up, b.down) for b in blocks], device=torch.device(device), cache_slots=3,
                              team=CpuExecutor(1), top_k=blocks[0].top_k, next_routers=routers,
                              stream_min_tokens=4)
    prog = float32_program(model, page_size=PAGE, num_pages=pages, device=device, max_concurrency=max_concurrency,
                           host_budget_bytes=host_bytes, max_model_len=128, cuda_graphs=cuda_graphs,
                           host_experts=runtime)
    inst = ModelInstance(architecture="qwen35", config=cfg, model=model, parameters=model.params,
                         frontend=QwenFrontend.from_resources(resources), program=prog)
    return Engine.from_instance(inst, EngineConfig(max_concurrency=max_concurrency, device=device,
                                                   prefill_chunk=prefill_chunk, pause_mode=pause_mode,
                                                   bypass_limit=max_concurrency if bypass_limit is None
                                                   else bypass_limit))


def req(prompt, **s) -> GenerationRequest:
    s.setdefault("temperature", 0.0)
    s.setdefault("ignore_eos", True)
    return GenerationRequest(input=TextInput(token_ids=tuple(prompt)), sampling=SamplingParams(**s))


def workload(n, seed, *, seeded=False):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(0, 400) for _ in range(rng.randint(1, 14))]
        s = dict(max_tokens=rng.randint(10, 14))  # long enough for 8 rows to decode together
        if seeded:
            s.update(temperature=1.0, top_k=0, top_p=1.0, seed=rng.randrange(1 << 30))
        out.append((p, s))
    return out


def run(eng, work):
    hs = submit_together(eng, [req(p, **s) for p, s in work])  # batching and pauses follow from the workload
    return [h.result(timeout=120) for h in hs]


def settled(eng):
    u = eng.usage()
    assert u.all_free, u
    assert eng.metrics().outstanding == 0


@pytest.fixture(scope="module")
def alone(parts):
    """Each request of the standard workloads run by itself (max_concurrency=1, submitted one at a time)."""
    eng = make_engine(parts, max_concurrency=1)
    out = {}
    for seeded in (False, True):
        work = workload(8, 11, seeded=seeded)
        out[seeded] = [eng.generate(req(p, **s), timeout=120).token_ids for p, s in work]
    settled(eng)
    eng.close()
    return out


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("concurrency", [1, 2, 8])
def test_concurrent_residents_match_running_alone(parts, alone, concurrency, seeded):
    eng = make_engine(parts, max_concurrency=concurrency)
    prog, seen = eng.instance.program, []
    launch = prog.launch_decode

    def watched(ids, *, after=None, masks=None):  # on the worker: requests resident, rows decoding, chained or not
        seen.append((len(eng._core.scheduler.residents), len(ids), after is not None))
        return launch(ids, after=after, masks=masks)

    prog.launch_decode = watched
    results = run(eng, workload(8, 11, seeded=seeded))
    assert [r.token_ids for r in results] == alone[seeded]
    assert max(r for r, _, _ in seen) == concurrency and max(b for _, b, _ in seen) == concurrency
    # Steady decode phases queue the next step behind the uncollected one (PipelinedDecode).
    assert any(chained for _, _, chained in seen)
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    settled(eng)
    eng.close()


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
@pytest.mark.parametrize("seeded", [False, True])
def test_forced_preemption_matches_no_preemption(parts, alone, mode, seeded):
    # 10 pages of 4 positions cannot hold 4 residents of up to 28 positions: pauses are forced.
    eng = make_engine(parts, max_concurrency=4, pages=10, pause_mode=mode, prefill_chunk=8,
                      host_bytes=(1 << 24) if mode == "snapshot" else 0)
    results = run(eng, workload(8, 11, seeded=seeded))
    m = eng.metrics()
    assert m.preemptions > 0
    assert (m.preemptions_snapshot if mode == "snapshot" else m.preemptions_replay) == m.preemptions
    assert [r.token_ids for r in results] == alone[seeded]
    settled(eng)
    eng.close()


@pytest.mark.parametrize("snapshots", [1, 2])
@pytest.mark.parametrize("seeded", [False, True])
def test_host_pressure_revokes_paused_snapshots_and_matches_running_alone(parts, alone, seeded, snapshots):
    """A host budget of about one or two Snapshots (StateImage + 5 KV pages): later pauses revoke earlier
    Snapshots to Replay, and every request still produces exactly its solo tokens."""
    probe = make_engine(parts, max_concurrency=4, pages=10)
    prog = probe.instance.program
    snapshot = prog.states.image_bytes + 5 * prog.pool.nbytes_per_page
    probe.close()
    eng = make_engine(parts, max_concurrency=4, pages=10, prefill_chunk=8, host_bytes=snapshots * snapshot)
    hs = submit_together(eng, [req(p, **s) for p, s in workload(8, 11, seeded=seeded)])
    events = [list(h) for h in hs]
    for evs in events:
        assert sum(isinstance(e, GenerationResult) for e in evs) == 1 and isinstance(evs[-1], GenerationResult)
    assert [evs[-1].token_ids for evs in events] == alone[seeded]
    m = eng.metrics()
    assert m.snapshots_revoked > 0 and m.preemptions_snapshot > 0
    settled(eng)
    eng.close()


def test_events_and_text_through_the_qwen_frontend(parts):
    eng = make_engine(parts)
    h = eng.submit(req([1, 2, 3, 4], max_tokens=5))
    evs = list(h)
    assert isinstance(evs[0], GenerationStart) and isinstance(evs[-1], GenerationResult)
    res = evs[-1]
    assert len(res.token_ids) == 5 and res.usage.completion_tokens == 5
    assert "".join(e.content for e in evs[1:-1]) + "".join(e.reasoning for e in evs[1:-1]) \
        == res.content + res.reasoning
    settled(eng)
    eng.close()


@pytest.mark.parametrize("kind,seed", [("dense", 0), ("dense", 1), ("dense", 2), ("dense", 3), ("moe", 4),
                                       ("moe", 5), ("moe-host", 6), ("moe-host", 7)])
def test_randomized_lifecycle_on_the_real_program(request, kind, seed):
    """Arrivals, cancellations, deadlines and a tiny KV pool forcing pauses, through the real Program (dense,
    MoE, and MoE with host experts whose reference is the all-device solo run)."""
    parts = request.getfixturevalue("parts" if kind == "dense" else "moe_parts")
    rng = random.Random(seed)
    work = workload(10, 100 + seed, seeded=seed % 2 == 1)
    solo = make_engine(parts, max_concurrency=1)
    reference = [solo.generate(req(p, **s), timeout=120).token_ids for p, s in work]
    solo.close()
    eng = make_engine(parts, max_concurrency=rng.choice([2, 4]), pages=rng.choice([7, 10]),
                      host_bytes=rng.choice([0, 1 << 24]), prefill_chunk=rng.choice([3, 8]), bypass_limit=1,
                      host_experts=kind == "moe-host")
    hs = []
    for p, s in work:
        sampling = SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **s})
        hs.append(eng.submit(GenerationRequest(input=TextInput(token_ids=tuple(p)), sampling=sampling,
                                               deadline_s=rng.choice([None, None, 0.3]))))
        if rng.random() < 0.3:
            rng.choice(hs).cancel()
    for h, ref in zip(hs, reference, strict=True):
        evs = list(h)
        assert sum(isinstance(e, GenerationResult) for e in evs) == 1 and isinstance(evs[-1], GenerationResult)
        res = evs[-1]
        assert res.finish_reason in (FinishReason.LENGTH, FinishReason.CANCELLED, FinishReason.DEADLINE), res
        assert res.token_ids == ref[:len(res.token_ids)]  # published output is always the solo output's prefix
        if res.finish_reason is FinishReason.LENGTH:
            assert res.token_ids == ref
    settled(eng)
    if kind == "moe-host":
        assert eng.instance.program.host_experts.stats.mixed_calls > 0
    assert eng._core.scheduler.max_bypass_seen <= 1
    eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind,seeded", [("dense", False), ("dense", True), ("moe", False), ("moe", True)])
def test_cuda_graph_replay_matches_eager(request, kind, seeded):
    """Decode through CUDA graphs captured per exact B (1..8) gives the eager path's tokens (MoE: the routed
    experts' Triton kernels inside the graphs)."""
    parts = request.getfixturevalue("parts" if kind == "dense" else "moe_parts")
    work = workload(12, 21, seeded=seeded)
    tokens = {}
    for graphs in (False, True):
        eng = make_engine(parts, max_concurrency=8, device="cuda", cuda_graphs=graphs)
        prog = eng.instance.program
        assert (prog.graphs is not None) == graphs, prog.graph_error
        tokens[graphs] = [r.token_ids for r in run(eng, work)]
        settled(eng)
        eng.close()
    assert tokens[True] == tokens[False]


def test_logprobs_are_published_with_the_accepted_tokens(parts):
    eng = make_engine(parts)
    h = eng.submit(req([5, 6, 7], max_tokens=6, logprobs=True, top_logprobs=3))
    evs = list(h)
    res = evs[-1]
    entries = [lp for e in evs[1:-1] for lp in e.logprobs]
    assert [lp.token_id for lp in entries] == list(res.token_ids)
    for lp in entries:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][2], abs=1e-5) and lp.logprob <= 0
        assert lp.top[0][2] >= lp.top[1][2] >= lp.top[2][2]
    plain = eng.generate(req([5, 6, 7], max_tokens=6))
    assert plain.token_ids == res.token_ids
    settled(eng)
    eng.close()


def test_engine_refuses_more_lanes_than_the_program_has(parts):
    eng = make_engine(parts, max_concurrency=2)
    with pytest.raises(ValueError, match="built for 2 concurrent sequences"):
        Engine.from_instance(eng.instance, EngineConfig(max_concurrency=4, device="cpu"))
    eng.close()


@pytest.mark.parametrize("seeded", [False, True])
def test_stop_token_inside_a_pipelined_decode_phase(parts, alone, seeded):
    """Requests that end on a stop token while the next step is already launched: each result is its
    solo output cut at the stop token, the chained rows of ended requests are dropped, nothing leaks."""
    work = workload(8, 11, seeded=seeded)
    eng = make_engine(parts, max_concurrency=4)
    hs = []
    cuts = []
    for (p, s), solo in zip(work, alone[seeded], strict=True):
        stop = solo[len(solo) // 2]  # a token the request is known to produce mid-way
        cuts.append(solo[:solo.index(stop) + 1])
        hs.append(eng.submit(req(p, **s, stop_token_ids=(stop,))))
    results = [list(h)[-1] for h in hs]
    assert [r.token_ids for r in results] == cuts
    assert all(r.finish_reason is FinishReason.STOP for r in results)
    settled(eng)
    eng.close()


def test_queue_timeout_and_waiting_cancel_settle_while_a_resident_decodes(parts):
    """With every lane taken the resident's decode stays pipelined, yet requests waiting for a lane still
    time out and cancel while it decodes, and the resident's output is what it gives alone."""
    from ninfer.engine.errors import QueueTimeout

    alone = make_engine(parts, max_concurrency=1)
    solo = alone.generate(req([5, 6, 7], max_tokens=100), timeout=120).token_ids
    alone.close()
    eng = make_engine(parts, max_concurrency=1)
    prog, chained_with_queue, launches = eng.instance.program, [], [0]
    launch = prog.launch_decode
    queue_ready = threading.Event()  # the test has queued its requests behind the resident
    waiting: dict[str, object] = {}
    settled_at: dict[str, int] = {}  # the resident's decode launch at which each waiting request had ended

    def watched(ids, *, after=None, masks=None):  # on the worker
        launches[0] += 1
        assert queue_ready.wait(60)  # the resident's first decode step waits for the queue (hang guard)
        for name, h in waiting.items():
            if h.done:
                settled_at.setdefault(name, launches[0])
        if after is not None and eng._core.scheduler.waiting:
            chained_with_queue.append(len(ids))
        return launch(ids, after=after, masks=masks)

    prog.launch_decode = watched
    long = eng.submit(req([5, 6, 7], max_tokens=100))
    queued = eng.submit(GenerationRequest(input=TextInput(token_ids=(1, 2)),
                                          sampling=SamplingParams(max_tokens=4), queue_timeout_s=0.05))
    queue_deadline = time.monotonic() + 0.05  # at or after the engine's own deadline for ``queued``
    leaver = eng.submit(req([3, 4], max_tokens=4))
    leaver.cancel()
    waiter = eng.submit(req([3, 4], max_tokens=4))  # waits for the lane until the long request ends
    waiting.update(queued=queued, leaver=leaver)
    while time.monotonic() < queue_deadline:  # the resident cannot end before the queue timeout has passed
        time.sleep(0.01)
    queue_ready.set()
    assert queued.result(timeout=30).finish_reason is FinishReason.ERROR
    assert isinstance(queued.exception(), QueueTimeout)
    assert leaver.result(timeout=30).finish_reason is FinishReason.CANCELLED
    events = list(long)
    assert isinstance(events[0], GenerationStart)
    assert isinstance(events[-1], GenerationResult) and events[-1].token_ids == solo
    assert len(waiter.result(timeout=30).token_ids) == 4
    assert set(settled_at) == {"queued", "leaver"}  # both ended while the resident was still decoding
    assert chained_with_queue  # a full house with a queue still decodes pipelined
    settled(eng)
    eng.close()
