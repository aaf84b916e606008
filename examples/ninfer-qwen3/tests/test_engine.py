"""Acceptance through ``ninfer.Engine`` (the plugin's Startup, the shared DenseProgram and Qwen Frontend)
against transformers' ``Qwen3ForCausalLM`` on the tiny random checkpoint, fp32 on the CPU.

Greedy generation picks transformers' tokens one for one (``generate(do_sample=False)``), with prompts longer
than the prefill chunk (chunked prefill) and requests decoding together (batched decode); each generated
token's logprob and the top-5 logprobs agree with transformers' log-softmax within LOGPROB_ATOL (the two
differ only in summation order). Forced preemption (Snapshot and Replay) changes no token, and every slot,
page and host byte is free once the work is done.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import ninfer  # noqa: E402
from ninfer.contract import (  # noqa: E402
    GenerationRequest,
    GenerationResult,
    ModelInstance,
    OutputDelta,
    ProgramCapacity,
    SamplingParams,
    StartupFeatures,
    StateImageLayout,
    TextInput,
)
from ninfer.core.device_plan import PlanError  # noqa: E402
from ninfer.models.common.dense import DenseProgram  # noqa: E402
from ninfer.testing.scheduling import submit_together  # noqa: E402

LOGPROB_ATOL = 1e-4
NEW_TOKENS = 24
TOP = 5
PAGE = 4
PROMPTS = ((5, 17, 300, 42, 42, 7, 99, 260, 1, 3, 480), (250, 4, 61, 61, 200, 9, 13),
           (11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25), (480,))


@pytest.fixture(scope="module")
def reference(converted):
    """transformers' greedy tokens and the log-softmax of its raw logits at each generated position."""
    hf, _ = converted
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            g = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            tokens = tuple(g.sequences[0, len(prompt):].tolist())
            assert len(tokens) == NEW_TOKENS
            out.append((tokens, torch.log_softmax(torch.cat(g.logits).float(), dim=-1)))
    return out


def request(prompt, **sampling) -> GenerationRequest:
    return GenerationRequest(input=TextInput(token_ids=tuple(prompt)), sampling=SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **sampling))


def watch(program: DenseProgram) -> tuple[list[int], list[int]]:
    """Record the sequence of every prefill chunk and the rows of every decode step the engine runs."""
    chunks, rows = [], []
    prefill, launch = program.prefill, program.launch_decode

    def watched_prefill(seq, max_tokens, **kw):
        chunks.append(seq)
        return prefill(seq, max_tokens, **kw)

    def watched_launch(ids, *, after=None, **kw):
        rows.append(len(ids))
        return launch(ids, after=after, **kw)

    program.prefill, program.launch_decode = watched_prefill, watched_launch
    return chunks, rows


def settled(engine: ninfer.Engine) -> None:
    usage = engine.usage()
    assert usage.idle, usage  # what remains is the context cache's, and clearing it frees everything
    assert engine.metrics().outstanding == 0
    engine.clear_context_cache()
    assert engine.usage().all_free


def test_greedy_generation_and_logprobs_match_transformers(converted, reference):
    _, path = converted
    with ninfer.Engine(path, ninfer.EngineConfig(device="cpu", dtype="float32", max_concurrency=3,
                                                 page_size=PAGE, prefill_chunk=4)) as engine:
        chunks, rows = watch(engine.instance.program)
        handles = submit_together(engine, [request(p, logprobs=True, top_logprobs=TOP) for p in PROMPTS])
        for handle, (tokens, logprobs) in zip(handles, reference, strict=True):
            events = list(handle)
            result = events[-1]
            assert isinstance(result, GenerationResult) and result.token_ids == tokens
            entries = [lp for e in events if isinstance(e, OutputDelta) for lp in e.logprobs]
            assert [e.token_id for e in entries] == list(tokens)
            for entry, want in zip(entries, logprobs, strict=True):
                assert entry.logprob == pytest.approx(float(want[entry.token_id]), abs=LOGPROB_ATOL)
                top_values, top_ids = want.topk(TOP)
                assert [t[0] for t in entry.top] == top_ids.tolist()
                assert [t[2] for t in entry.top] == pytest.approx(top_values.tolist(), abs=LOGPROB_ATOL)
        assert max(chunks.count(seq) for seq in set(chunks)) >= 4  # a 15-token prompt in chunks of 4
        assert max(rows) == 3  # three requests decoding in one step
        settled(engine)


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_forced_preemption_changes_no_token(converted, reference, mode):
    # 10 pages of 4 positions; each request reaches 25..39 positions (up to 10 pages): two cannot stay resident.
    _, path = converted
    with ninfer.Engine(path, ninfer.EngineConfig(device="cpu", dtype="float32", max_concurrency=2,
                                                 page_size=PAGE, num_pages=10, prefill_chunk=4,
                                                 pause_mode=mode,
                                                 host_budget_bytes=(1 << 24) if mode == "snapshot" else 0)) as engine:
        results = [h.result(timeout=120) for h in submit_together(engine, [request(p) for p in PROMPTS])]
        metrics = engine.metrics()
        assert metrics.preemptions > 0
        assert (metrics.preemptions_snapshot if mode == "snapshot" else metrics.preemptions_replay) \
            == metrics.preemptions
        assert [r.token_ids for r in results] == [tokens for tokens, _ in reference]
        settled(engine)


def test_decode_through_the_graph_input_buffers_matches_transformers(converted, reference):
    """The CUDA-graph input path (static buffers, exact-B), run eagerly on the CPU."""
    _, path = converted
    with ninfer.Engine(path, ninfer.EngineConfig(device="cpu", dtype="float32", max_concurrency=2,
                                                 page_size=PAGE)) as built:
        model, memory = built.instance.program.model, built.instance.memory
        program = DenseProgram(model, state_layout=StateImageLayout(fields=()), device="cpu", max_concurrency=2,
                               kv_pool=built.instance.program.kv_pools[0], vocab_size=model.config.vocab_size,
                               capacity=ProgramCapacity(kv_pages=memory.kv_pages, max_model_len=memory.max_model_len),
                               static_decode=True)
        assert program.graphs is not None
        instance = ModelInstance(architecture="qwen3", config=model.config, model=model,
                                                 parameters=model.params, frontend=built.frontend, program=program)
    with ninfer.Engine.from_instance(instance, ninfer.EngineConfig(device="cpu", max_concurrency=2,
                                                                   prefill_chunk=4)) as engine:
        results = [h.result(timeout=120) for h in submit_together(engine, [request(p) for p in PROMPTS])]
        assert [r.token_ids for r in results] == [tokens for tokens, _ in reference]
        settled(engine)


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(converted):
    """On CUDA the decode graphs captured per exact B give the eager path's tokens."""
    _, path = converted
    tokens = {}
    for graphs in (False, True):
        with ninfer.Engine(path, ninfer.EngineConfig(device="cuda", dtype="float32", max_concurrency=2,
                                                     page_size=PAGE, prefill_chunk=4,
                                                     cuda_graphs=graphs)) as engine:
            program = engine.instance.program
            assert (program.graphs is not None) == graphs, program.graph_error
            handles = submit_together(engine, [request(p) for p in PROMPTS])
            tokens[graphs] = [h.result(timeout=120).token_ids for h in handles]
            settled(engine)
    assert tokens[True] == tokens[False]


def test_startup_names_what_it_cannot_build(converted):
    _, path = converted
    with pytest.raises(ValueError, match="runs text only"):
        ninfer.Engine(path, ninfer.EngineConfig(device="cpu", features=StartupFeatures(vision=True)))
    with pytest.raises(PlanError, match=r"\(text, float32\) does not fit: it needs .*weights .*workspace"):
        ninfer.Engine(path, ninfer.EngineConfig(device="cpu",
                                                device_budget_bytes=1 << 20))  # less than the weights and workspace
    with ninfer.Engine(path, ninfer.EngineConfig(device="cpu", max_concurrency=2, num_pages=6,
                                                 page_size=PAGE)) as engine:
        memory = engine.instance.memory
        assert (memory.kv_pages, memory.max_model_len, memory.page_size, memory.kv_automatic) == (6, 24, PAGE, False)
        assert memory.weights_bytes > 0 and memory.runtime_reservation_bytes == engine.instance.program.backing_bytes()
        assert engine.max_model_len == 24 and engine.usage().kv_pages_total == 6
