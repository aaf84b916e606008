"""The engine's start under a device budget: its MemorySummary, and a workload that stays inside the budget.

On the CPU: the summary of a start and a refusal that names the numbers. On CUDA (``-m gpu``): graph
calibration ran (the graphs' rebuild estimate is charged), no correction was needed, and the allocator's peak
over a workload that fills every concurrent row with a full prefill chunk stays within the budget, plain and
speculative.
"""

from __future__ import annotations

import pytest
import torch

from ninfer import default_model_path
from ninfer.contract import EngineConfig
from ninfer.contract.config import StartupFeatures
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.core.device_plan import GIB, MIB, PlanError
from ninfer.engine.engine import Engine
from ninfer.testing.scheduling import submit_together

WORDS = "the quick brown fox jumps over the lazy dog while a careful engine plans its memory".split()


def long_text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words))


def test_a_cpu_start_reports_its_memory_and_a_small_budget_is_refused_with_numbers():
    eng = Engine(default_model_path(), EngineConfig(device="cpu", max_concurrency=2,
                                                    device_budget_bytes=256 * MIB))
    try:
        m = eng.instance.memory
        assert m.budget_bytes == 256 * MIB and m.corrections == 0 and m.kv_automatic
        assert m.weights_bytes > 0 and m.runtime_reservation_bytes == eng.instance.program.backing_bytes()
        assert m.weights_bytes + m.runtime_reservation_bytes + m.workspace_bytes <= m.budget_bytes
        assert m.kv_tokens == m.kv_pages * m.page_size and m.max_model_len <= m.kv_tokens
    finally:
        eng.close()
    with pytest.raises(PlanError, match="does not fit: it needs .* short by"):
        Engine(default_model_path(), EngineConfig(device="cpu", device_budget_bytes=4 * MIB))


@pytest.mark.gpu
@pytest.mark.parametrize("features", [StartupFeatures(), StartupFeatures(speculative="mtp", num_draft_tokens=2)])
def test_a_cuda_start_calibrates_its_graphs_and_its_workload_stays_within_the_budget(features):
    budget = 2 * GIB
    torch.cuda.empty_cache()
    eng = Engine(default_model_path(), EngineConfig(device="cuda", max_concurrency=8,
                                                    device_budget_bytes=budget, prefill_chunk=2048,
                                                    features=features))
    try:
        m = eng.instance.memory
        assert eng.instance.program.graphs is not None, eng.instance.program.graph_error
        assert m.corrections == 0 and m.budget_bytes == budget and m.headroom_bytes == GIB
        assert m.cuda_graph.calibration_growth > 0 and m.cuda_graph.rebuild_estimate > 0
        assert m.reserved_bytes <= budget
        torch.cuda.reset_peak_memory_stats()
        prompt_words = 700  # most of the embedded model's 2,048-token context per row
        requests = [GenerationRequest(input=TextInput(text=long_text(i, prompt_words)),
                                      sampling=SamplingParams(temperature=0.0, max_tokens=24)) for i in range(8)]
        results = [h.result(timeout=300) for h in submit_together(eng, requests)]
        assert all(r.usage.completion_tokens > 0 for r in results)
        peak = torch.cuda.max_memory_reserved()
        assert peak <= budget, f"peak reserved {peak / MIB:.0f} MiB over the {budget / MIB:.0f} MiB budget"
    finally:
        eng.close()
