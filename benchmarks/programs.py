"""Program-level runs on random weights made on the device (no checkpoint: a model too large for the disk still
fits): a Qwen3.5 Program over them, sequences prefilled on it, decode steps timed as the engine runs them
(``reserve_units`` per row, one ``Program.decode`` of exactly B rows, ``Program.commit``), the decode graph
replayed alone, and the same rows through ``ninfer.Engine``. Used by ``numerics``, ``speculative`` and ``moe``.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from benchmarks.harness import sync
from benchmarks.shapes import SHAPES

WARMUP_STEPS = 3


def random_weights(config, device: str, dtype: torch.dtype, features: tuple[str, ...] = ("text",), seed: int = 0):
    """A WeightSet of random weights for ``config``'s parameters of ``features``, made directly on ``device``: no
    checkpoint, so a model too large for the disk still fits the device."""
    from ninfer.models.common.weights import WeightSet
    from ninfer_qwen35.source_mapping import expected_parameters, fused_parents

    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, (_, dims) in expected_parameters(config, features).items():
        if name.endswith("A_log"):
            t = torch.empty(dims, device=device, dtype=torch.float32).uniform_(-1.0, 1.0, generator=gen)
        elif name.endswith("dt_bias"):
            t = torch.zeros(dims, device=device, dtype=torch.float32)
        elif len(dims) == 1:
            t = torch.ones(dims, device=device, dtype=dtype)  # norm scales: timing only needs finite values
        else:
            t = torch.randn(dims, device=device, dtype=dtype, generator=gen) * (1.0 / math.sqrt(dims[-1]))
        tensors[name] = t
    return WeightSet.from_tensors(tensors, fused_parents(config))


def random_parameters(shape: str | dict, device: str, dtype: torch.dtype, seed: int = 0):
    """(config, Qwen35Parameters) with random weights of a published shape (a ``SHAPES`` name or a config.json
    dict), made on ``device``."""
    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.execution.parameters import Qwen35Parameters

    config = parse_config(dict(SHAPES[shape] if isinstance(shape, str) else shape))
    return config, Qwen35Parameters.from_weights(config, random_weights(config, device, dtype, seed=seed), dtype)


def auto_pdl(params, device: str) -> bool:
    """What a start chooses for these weights: ``prefers_pdl`` with the weight bytes a one-row decode step reads
    per decoder layer (the placements' ``step_bytes``: every dense weight and ``top_k`` experts of each MoE layer)."""
    if not device.startswith("cuda"):
        return False
    from ninfer.core.device_plan import resident_bytes
    from ninfer.models.common.moe.host_experts import expert_bytes
    from ninfer.ops.launch import prefers_pdl

    config, weights = params
    banks = weights.expert_banks()  # gate_up / down of every MoE layer, in pairs
    step = resident_bytes(weights.tensors()) - resident_bytes(banks)
    if banks:
        step += len(banks) // 2 * config.moe.num_experts_per_tok * expert_bytes(banks[0], banks[1])
    return prefers_pdl(step / config.num_hidden_layers)


def build_program(shape: str | dict, device: str, *, max_batch: int, context: int, steps: int, graphs: bool,
                  dtype: torch.dtype, static_decode: bool = False, params=None, pdl: bool = False):
    """A Qwen3.5 Program over random weights of ``shape``, or over ``params`` (config, Qwen35Parameters) made
    before, so several Programs can share one set of weights."""
    from ninfer.contract.memory import ProgramCapacity
    from ninfer_qwen35.execution.model import Qwen35Model
    from ninfer_qwen35.program.program import Qwen35Program
    from ninfer_qwen35.state import kv_pools, state_layout

    config, params = params or random_parameters(shape, device, dtype)
    pool = kv_pools(config, 16, "bfloat16" if dtype == torch.bfloat16 else "float32")[0]
    pages_per_seq = -(-(context + steps + 8) // pool.page_size)
    return config, Qwen35Program(
        Qwen35Model(params), state_layout=state_layout(config, "bfloat16" if dtype == torch.bfloat16 else "float32"),
        kv_pool=pool, device=device, max_concurrency=max_batch, vocab_size=config.vocab_size,
        capacity=ProgramCapacity(kv_pages=max_batch * pages_per_seq, max_model_len=context + steps + 8, pdl=pdl),
        cuda_graphs=graphs, static_decode=static_decode)


def prefill(program, sid: int, chunk: int = 512) -> None:
    """Run sequence ``sid``'s remaining prompt through ``program`` in units of at most ``chunk`` tokens."""
    from ninfer.contract.batch import RowDecision

    while program.input_remaining(sid):
        n = min(chunk, program.input_remaining(sid))
        if not program.reserve_units(sid, n):
            raise RuntimeError("the KV pool is too small for the benchmark's prefill")
        batch = program.prefill(sid, n)
        if batch is not None:
            program.commit(batch, [RowDecision(accepted=1)])


def prefilled_sequences(program, config, B: int, context: int) -> list[int]:
    """B greedy sequences opened on ``program``, each with ``context`` random prompt tokens prefilled."""
    from ninfer.contract.prompt import PreparedPrompt
    from ninfer.contract.request import SamplingParams

    gen = torch.Generator().manual_seed(B)
    seqs = []
    for _ in range(B):
        prompt = PreparedPrompt(token_ids=torch.randint(0, config.vocab_size, (context,), generator=gen).tolist())
        seqs.append(program.open_sequence(prompt, SamplingParams(temperature=0.0)))
        prefill(program, seqs[-1])
    return seqs


@contextlib.contextmanager
def warm_decode(program, config, B: int, context: int):
    """B greedy sequences after ``context`` prompt tokens each, warmed by ``WARMUP_STEPS`` decode steps; yields
    one step (reserve, decode, commit of every row) and releases the sequences on exit."""
    from ninfer.contract.batch import RowDecision

    seqs = prefilled_sequences(program, config, B, context)

    def step() -> None:
        for sid in seqs:
            if not program.reserve_units(sid, 1):
                raise RuntimeError("the KV pool is too small for the benchmark's decode")
        program.commit(program.decode(seqs), [RowDecision(accepted=1)] * B)

    try:
        for _ in range(WARMUP_STEPS):
            step()
        yield step
    finally:
        for sid in seqs:
            program.release(sid)


def timed_steps(step, device: str, steps: int) -> list[float]:
    """ms of each of ``steps`` calls of ``step``, the device synchronised around each."""
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure(program, config, device: str, B: int, *, context: int, steps: int) -> dict:
    """Median and mean ms per decode step (reserve + decode + commit) for B rows at ~``context`` tokens."""
    with warm_decode(program, config, B, context) as step:
        times = sorted(timed_steps(step, device, steps))
        graph_ms = replay_ms(program, B, steps) if program.graphs is not None and device.startswith("cuda") else None
    med = times[len(times) // 2]
    return {"batch": B, "ms_median": med, "ms_mean": sum(times) / len(times), "tokens_per_s": B / med * 1e3,
            "graphs": program.graphs is not None, "graph_ms": graph_ms}


def replay_ms(program, B: int, replays: int) -> float:
    """Device ms per replay of the B graph alone, back to back over the last step's inputs (no staging, no
    sampling, no readback): what a step costs without anything around the graph. The replays rewrite the rows'
    last KV position and advance their recurrent state; the caller releases the rows after."""
    program.graphs.replay(B)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        program.graphs.replay(B)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def measure_engine(program, config, device: str, B: int, *, context: int, steps: int) -> dict:
    """The same B rows through ``ninfer.Engine`` (scheduler, PendingBatch commit, Frontend, events): the mean
    inter-token gap per request, i.e. the engine's cycle time with B decode rows. The B requests are admitted
    together, so the first rows' early gaps include the other prompts' prefill chunks: the figure is taken over
    the steady part only (every row has its first token, none has finished), and over the whole run when that
    part is empty (``engine_steady`` says which)."""

    from ninfer.contract.config import EngineConfig
    from ninfer.contract.events import OutputDelta
    from ninfer.contract.model import ModelInstance
    from ninfer.contract.prompt import TextInput
    from ninfer.contract.request import GenerationRequest, SamplingParams
    from ninfer.contract.resources import FrontendResources
    from ninfer.engine.engine import Engine
    from ninfer.models.common.qwen.frontend import QwenFrontend
    from ninfer_qwen35.testing.checkpoints import make_tokenizer_json

    frontend = QwenFrontend.from_resources(FrontendResources(tokenizer_json=make_tokenizer_json()[0],
                                                             embedding_vocab=config.vocab_size))
    inst = ModelInstance(architecture="qwen35", config=config, model=program.model, parameters=None,
                         frontend=frontend, program=program)
    gen = torch.Generator().manual_seed(100 + B)
    config_ = EngineConfig(max_concurrency=program.max_concurrency, device=device, prefill_chunk=512)
    with Engine.from_instance(inst, config_) as engine:
        handles = [engine.submit(GenerationRequest(
            input=TextInput(token_ids=tuple(torch.randint(0, config.vocab_size, (context,), generator=gen).tolist())),
            sampling=SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))) for _ in range(B)]
        waiting = set(range(B))
        while waiting:  # until every row has its first token (or has ended)
            for i in list(waiting):
                try:
                    event = handles[i].next_event(timeout=0.001)
                except TimeoutError:
                    continue
                if event is None or isinstance(event, OutputDelta) and event.token_ids:
                    waiting.discard(i)
        before = engine.metrics().inter_token
        while not any(h.done for h in handles):
            time.sleep(0.0005)
        after = engine.metrics().inter_token
        for h in handles:
            h.result()
        whole = engine.metrics().inter_token
    count, total = after.count - before.count, after.total - before.total
    steady = count > 0
    gap = (total / count if steady else whole.total / whole.count) * 1e3
    res = {"batch": B, "engine_ms_per_step": gap, "engine_tokens_per_s": B / gap * 1e3, "engine_steady": steady,
           "engine_ms_whole_run": whole.total / whole.count * 1e3}
    return res

