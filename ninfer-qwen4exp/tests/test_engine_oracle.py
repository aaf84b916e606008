"""Qwen4Exp end to end on the CPU: tiny ``Qwen4ExpForCausalLM`` checkpoints written by transformers, converted by
the real converter and run by ``ninfer.Engine``, against transformers on the same fp32 checkpoint.

Three configs: ``qsa`` (QSA keeps 2 blocks of 4 tokens plus the open tail, so selection matters from the 12th
token on), ``ple`` (PLE on two GDN layers; the prompts hold EOS, where n-grams reset) and ``full`` (both, with 4
streams, the sigmoid GDN gate and 8 experts). For each: 40 greedy tokens equal transformers' ``generate``;
chunked prefill, concurrent neighbours, Snapshot and Replay preemption, host experts and the context cache all
give the tokens of the request run alone; ``Engine.score`` is within 1e-4 of transformers' log-probs; after
every workload each page, slot and host byte is free again.
"""

from __future__ import annotations

import random

import attrs
import pytest
import torch

from ninfer.contract.config import EngineConfig
from ninfer.contract.memory import ProgramCapacity
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine
from ninfer.testing.scheduling import submit_together

transformers = pytest.importorskip("transformers")
from ninfer_qwen4exp.testing import convert_tiny, make_tiny_checkpoint  # noqa: E402

STEPS = 40



@attrs.frozen
class Tiny:
    variant: str
    artifact: str
    hf: object
    prompts: tuple[tuple[int, ...], ...]
    alone: tuple[tuple[int, ...], ...]  # each prompt's 40 greedy tokens from an engine running it by itself


def engine(tiny: Tiny, **config) -> Engine:
    options = dict(device="cpu", dtype="float32", max_concurrency=1, context_cache=False) | config
    return Engine(tiny.artifact, EngineConfig(**options))


def req(prompt, session: str | None = None, **s) -> GenerationRequest:
    sampling = dict(temperature=0.0, max_tokens=STEPS, ignore_eos=True) | s
    return GenerationRequest(input=TextInput(token_ids=tuple(prompt)), sampling=SamplingParams(**sampling),
                             session_key=session)


def settled(eng: Engine) -> None:
    usage = eng.usage()
    assert usage.all_free, usage
    assert eng.metrics().outstanding == 0


def prompts(eos: int) -> tuple[tuple[int, ...], ...]:
    rng = random.Random(7)
    ids = [[rng.randrange(3, 400) for _ in range(n)] for n in (5, 19, 33)]
    ids[1][9] = ids[2][4] = ids[2][5] = eos  # n-grams reset after EOS (twice in a row in the third)
    return tuple(tuple(p) for p in ids)


@pytest.fixture(scope="module", params=["qsa", "ple", "full"])
def tiny(request, tmp_path_factory) -> Tiny:
    root = tmp_path_factory.mktemp(request.param)
    ckpt = make_tiny_checkpoint(root / "ckpt", variant=request.param, mtp=False, seed=11)
    art = convert_tiny(ckpt, root / "tiny.ninfer")
    hf = transformers.Qwen4ExpForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ps = prompts(hf.config.eos_token_id)
    part = Tiny(request.param, str(art), hf, ps, ())
    with engine(part) as eng:
        alone = tuple(tuple(eng.generate(req(p), timeout=120).token_ids) for p in ps)
        settled(eng)
    return attrs.evolve(part, alone=alone)


def hf_greedy(hf, prompt: tuple[int, ...], steps: int) -> tuple[int, ...]:
    """transformers' greedy ``generate`` through its own cache, EOS not stopping it."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


def test_greedy_tokens_equal_transformers_generate(tiny):
    for prompt, ours in zip(tiny.prompts, tiny.alone, strict=True):
        assert len(ours) == STEPS
        assert ours == hf_greedy(tiny.hf, prompt, STEPS)


def test_chunked_prefill_equals_whole(tiny):
    """Chunks of 3 (not a multiple of the QSA block of 4) over pages of 8 positions."""
    with engine(tiny, prefill_chunk=3, page_size=8) as eng:
        assert [tuple(eng.generate(req(p), timeout=120).token_ids) for p in tiny.prompts] == list(tiny.alone)
        settled(eng)


def test_batch_neighbours_are_independent(tiny):
    with engine(tiny, max_concurrency=3, prefill_chunk=8) as eng:
        hs = submit_together(eng, [req(p) for p in tiny.prompts])
        assert [tuple(h.result(timeout=120).token_ids) for h in hs] == list(tiny.alone)
        settled(eng)


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_preemption_resumes_exactly(tiny, mode):
    """10 pages of 8 positions cannot hold 3 residents of up to 73 positions: pauses are forced."""
    with engine(tiny, max_concurrency=3, page_size=8, num_pages=10, prefill_chunk=8, pause_mode=mode,
                host_budget_bytes=(1 << 26) if mode == "snapshot" else 0) as eng:
        hs = submit_together(eng, [req(p) for p in tiny.prompts])
        assert [tuple(h.result(timeout=120).token_ids) for h in hs] == list(tiny.alone)
        m = eng.metrics()
        assert m.preemptions > 0
        assert (m.preemptions_snapshot if mode == "snapshot" else m.preemptions_replay) == m.preemptions
        settled(eng)


def test_decode_through_the_graph_buffers(tiny):
    """Decode rows through the CUDA graphs' static input buffers, as captured decode runs them (every row
    continuing, kernels seeing the Program's whole context, padded block tables): the solo tokens."""
    from ninfer.contract.config import StartupOptions
    from ninfer.engine.startup import build_instance
    from ninfer_qwen4exp.program import Qwen4ExpProgram

    options = StartupOptions(device="cpu", dtype="float32", max_concurrency=3, context_cache=False, num_pages=32)
    instance, _, artifact = build_instance(tiny.artifact, options)
    try:
        eager = instance.program
        static = Qwen4ExpProgram(instance.model.executor, config=instance.config, state_layout=eager.state_layout,
                                 kv_pool=eager.kv_pools[0], device="cpu", max_concurrency=3, vocab_size=eager.vocab_size,
                                 capacity=ProgramCapacity(kv_pages=32), cuda_graphs=False, static_decode=True)
        assert static.graphs is not None
        eng = Engine.from_instance(attrs.evolve(instance, program=static),
                                   EngineConfig(device="cpu", max_concurrency=3, context_cache=False))
        with eng:
            hs = submit_together(eng, [req(p) for p in tiny.prompts])
            assert [tuple(h.result(timeout=120).token_ids) for h in hs] == list(tiny.alone)
            settled(eng)
    finally:
        artifact.close()


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(tiny):
    """On CUDA (fp32), decode through the captured graphs (QSA's static selection and attention, the n-gram rows
    gathered from the table on the device) gives the eager path's tokens for the three prompts side by side."""
    tokens = {}
    for graphs in (False, True):
        with engine(tiny, device="cuda", max_concurrency=3, cuda_graphs=graphs) as eng:
            prog = eng.instance.program
            assert (prog.graphs is not None) == graphs, prog.graph_error
            hs = submit_together(eng, [req(p) for p in tiny.prompts])
            tokens[graphs] = [tuple(h.result(timeout=300).token_ids) for h in hs]
            settled(eng)
    assert tokens[True] == tokens[False]


def test_host_experts_give_the_all_device_tokens(tiny):
    """Placement host-experts: the routed expert banks in host memory behind a Program-owned expert cache."""
    with engine(tiny, max_concurrency=3, placement="host-experts", expert_cache_bytes=0) as eng:
        assert eng.instance.program.host_experts is not None
        hs = submit_together(eng, [req(p) for p in tiny.prompts])
        assert [tuple(h.result(timeout=120).token_ids) for h in hs] == list(tiny.alone)
        settled(eng)


def test_context_cache_on_equals_off(tiny):
    """A prompt, the same prompt, and a second turn over the first's output: restored from checkpoints (the GDN,
    PLE conv and n-gram state and the QSA keys of the cached prefix) they give the uncached tokens."""
    first = tiny.prompts[2]
    turn = [*first, *tiny.alone[2], 17, 18, 19]
    requests = [req(first), req(first), req(turn, max_tokens=12)]
    with engine(tiny, context_cache=False) as off:
        ref = [off.generate(r, timeout=120).token_ids for r in requests]
        settled(off)
    with engine(tiny, context_cache=True, checkpoint_grid=8) as on:
        got = [on.generate(r, timeout=120) for r in requests]
        assert [r.token_ids for r in got] == ref
        assert got[1].usage.cached_tokens > 0 and got[2].usage.cached_tokens > len(first)
        assert on.usage().idle
        on.clear_context_cache()
        settled(on)


def test_a_host_replica_restores_exactly(tiny):
    """One device checkpoint slot: a session's continuation goes to a host replica (its StateImage and its pages
    with their index keys) when another save needs the slot, and the second turn restores from the host."""
    first_prompt = tiny.prompts[2]
    with engine(tiny, context_cache=True, checkpoint_slots=1) as on, engine(tiny) as off:
        first = on.generate(req(first_prompt, session="chat", max_tokens=8), timeout=120)
        on.generate(req(tiny.prompts[1], max_tokens=8), timeout=120)  # its save takes the only slot
        assert on.metrics().cache_evictions["host"] == 1
        turn = [*first_prompt, *first.token_ids, 17, 18, 19]
        again = on.generate(req(turn, session="chat", max_tokens=12), timeout=120)
        assert again.usage.cached_tokens == len(first_prompt) + len(first.token_ids) - 1
        assert again.token_ids == off.generate(req(turn, max_tokens=12), timeout=120).token_ids
        on.clear_context_cache()
        settled(on)
        settled(off)


def test_forks_of_one_prompt_equal_their_solo_runs(tiny):
    """Identical prompts submitted together prefill once and fork (the StateImage copied, the pages shared, the
    shared tail page copied with its index keys on a fork's first write): each seeded sample is its solo run's."""
    prompt = tiny.prompts[2][:30]  # 29 cached positions: the forks share a tail page of 8 holding 5 of them
    requests = [req(prompt, temperature=0.9, seed=seed, max_tokens=12) for seed in (1, 2, 3)]
    with engine(tiny, context_cache=False) as off:
        ref = [off.generate(r, timeout=120).token_ids for r in requests]
        settled(off)
    assert len(set(ref)) == 3
    with engine(tiny, context_cache=True, max_concurrency=3, page_size=8) as on:
        results = [h.result(timeout=120) for h in submit_together(on, requests)]
        assert [r.token_ids for r in results] == ref
        assert sorted(r.usage.cached_tokens for r in results) == [0, len(prompt) - 1, len(prompt) - 1]
        on.clear_context_cache()
        settled(on)


def test_score_matches_transformers_logprobs(tiny):
    ids = [*tiny.prompts[2], *tiny.alone[2]]
    with engine(tiny) as eng:
        result = eng.score(ids)
        settled(eng)
    with torch.no_grad():
        logits = tiny.hf(torch.tensor([ids])).logits[0].double()
    ref = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert result.num_scored == len(ids) - 1
    assert torch.allclose(torch.tensor(result.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
