"""A Qwen3.5 decode step through captured CUDA graphs syncs only where it must (GPU)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_cuda_graph_decode_step_syncs_once(monkeypatch):
    """A graph decode step (load, replay, greedy sampling with and without logprobs) never syncs while it is
    launched, and collecting it waits on one event: the tokens' copy to the host."""
    import warnings

    from benchmarks.programs import build_program
    from ninfer.contract.batch import RowDecision
    from ninfer.contract.prompt import PreparedPrompt
    from ninfer.contract.request import SamplingParams

    # a published shape: the Triton kernels were validated at real head sizes, not the tiny test ones
    _, program = build_program("0.8b", "cuda", max_batch=2, context=16, steps=40, graphs=True,
                               dtype=torch.bfloat16)
    assert program.graphs is not None and program.graphs.graphs, program.graph_error
    settings = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), SamplingParams(temperature=0.0)]
    sids = []
    for k, sp in enumerate(settings):
        sid = program.open_sequence(PreparedPrompt(token_ids=list(range(3 + k, 19 + k))), sp)
        assert program.reserve_units(sid, 16)
        program.commit(program.prefill(sid, 16), [RowDecision(accepted=1)])
        sids.append(sid)
    waits = []
    event_sync = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda ev: (waits.append(ev), event_sync(ev))[1])
    for rows in (sids, sids[:1], sids[1:], sids):  # across page boundaries and memberships
        for _ in range(6):
            for sid in rows:
                assert program.reserve_units(sid, 1)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    unit = program.launch_decode(rows)
                    waits.clear()
                    batch = program.collect(unit)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
            assert syncs == [] and len(waits) == 1, (syncs, waits)
            program.commit(batch, [RowDecision(accepted=1)] * len(rows))
