"""Program._sample packs tokens and logprobs of a mixed decode batch into one device->host copy (CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ninfer_qwen35")

from benchmarks.programs import build_program  # noqa: E402
from ninfer.contract.batch import RowDecision  # noqa: E402
from ninfer.contract.prompt import PreparedPrompt  # noqa: E402
from ninfer.contract.request import SamplingParams  # noqa: E402
from ninfer.ops.sampling import logprobs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.mark.parametrize("static_decode", [False, True])
def test_mixed_rows_get_their_own_logprobs(static_decode):
    config, program = build_program("tiny", "cpu", max_batch=4, context=8, steps=8, graphs=False,
                                    dtype=torch.float32, static_decode=static_decode)
    settings = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
                SamplingParams(temperature=0.0),
                SamplingParams(temperature=0.8, seed=7, logprobs=True, top_logprobs=0),
                SamplingParams(temperature=0.0, logprobs=True, top_logprobs=1)]
    sids = []
    for k, sp in enumerate(settings):
        sid = program.open_sequence(PreparedPrompt(token_ids=[k + 1, 2 * k + 3, 5, 7]), sp)
        program.reserve_units(sid, 4)
        program.commit(program.prefill(sid, 4), [RowDecision(accepted=1)])
        sids.append(sid)
    seen = []
    model_logits = program.model.logits
    program.model.logits = lambda hidden: seen.append(model_logits(hidden)) or seen[-1]
    for sid in sids:
        program.reserve_units(sid, 1)
    batch = program.decode(sids)
    logits = seen[-1]
    for i, (row, sp) in enumerate(zip(batch.rows, settings, strict=True)):
        tok = row.tokens[0]
        assert isinstance(tok, int) and 0 <= tok < config.vocab_size
        if sp.temperature == 0.0:
            assert tok == int(logits[i].argmax())
        if not sp.logprobs:
            assert row.logprobs is None and row.top_logprobs is None
            continue
        chosen, top_ids, top_lp = logprobs(logits[i:i + 1], torch.tensor([tok]), 3)
        assert row.logprobs == (pytest.approx(float(chosen[0]), abs=1e-6),)
        (top,) = row.top_logprobs
        assert [t for t, _ in top] == top_ids[0, :sp.top_logprobs].tolist()
        assert all(isinstance(t, int) for t, _ in top)
        assert [v for _, v in top] == pytest.approx(top_lp[0, :sp.top_logprobs].tolist(), abs=1e-6)
    program.commit(batch, [RowDecision(accepted=1)] * 4)
