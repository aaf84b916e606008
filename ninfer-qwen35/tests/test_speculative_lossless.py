"""Stochastic speculative decoding is lossless end to end: through the real Program on the embedded model (whose
trained MTP head makes drafts that are accepted as well as rejected), the joint distribution of the first two
generated tokens is the same with k = 2 drafts as without (Pearson chi-square over the (first, second) table,
top-k 3 sampling, fixed seeds: the outcome is deterministic, the threshold generous).

The prompt is prefilled once, up to its last token (a prompt-end checkpoint, as the context cache keeps it); each
sampled row restores that checkpoint, so its last prompt token is its first decode input, as in the engine with the
cache on. The rows then cost decode steps of ROWS sequences, not one prefill each."""

from __future__ import annotations

import collections

import pytest
import torch

from ninfer import default_model_path
from ninfer.contract.batch import RowDecision
from ninfer.contract.config import StartupFeatures, StartupOptions
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import SamplingParams

pytest.importorskip("transformers")
from ninfer.artifact import open_artifact  # noqa: E402
from ninfer_qwen35.startup import build  # noqa: E402

SAMPLES, ROWS = 320, 8


def first_two_tokens(k: int) -> tuple[collections.Counter, int]:
    """(Counter of the (first, second) generated tokens over SAMPLES seeds, decode rows that accepted a draft)."""
    features = StartupFeatures(speculative="mtp", num_draft_tokens=k) if k else StartupFeatures()
    with open_artifact(default_model_path()) as art:
        inst = build(art, StartupOptions(device="cpu", dtype="float32", max_concurrency=ROWS, num_pages=64,
                                         context_cache=True, features=features))
    prog, prompt = inst.program, inst.frontend.prepare(TextInput(text="ROMEO:\n"))
    sid = prog.open_sequence(prompt, SamplingParams(temperature=0.0))
    prog.plan_saves(sid, [len(prompt) - 1])
    assert prog.reserve_units(sid, len(prompt) - 1)
    assert prog.prefill(sid, len(prompt)) is None  # no token sampled: the last prompt token is left to decode
    (end,) = prog.published()
    prog.release(sid)
    counts, accepted = collections.Counter(), 0
    for start in range(0, SAMPLES, ROWS):
        prog.lease(end.id)
        tokens = {prog.open_cached(prompt, SamplingParams(temperature=1.0, top_k=3, top_p=1.0, seed=seed), end.id):
                  [] for seed in range(start, start + ROWS)}
        prog.unlease(end.id)
        assert None not in tokens
        live = list(tokens)
        while live:
            for row in live:
                assert prog.reserve_units(row, prog.decode_span)
            batch = prog.decode(live)
            for row in batch.rows:
                tokens[row.sequence_id] += row.tokens[:row.produced]
                accepted += row.produced > 1
            prog.commit(batch, [RowDecision(accepted=r.produced, terminal=len(tokens[r.sequence_id]) >= 2)
                                for r in batch.rows])
            live = [row for row in live if len(tokens[row]) < 2]
        for row, got in tokens.items():
            counts[got[0], got[1]] += 1
            prog.release(row)
    prog.retire(end.id)
    assert prog.usage().all_free and prog.cache_usage().empty
    return counts, accepted


@pytest.fixture
def one_cpu_thread():
    """The embedded model's small matmuls run fastest single-threaded, above all beside another test worker."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_cpu_thread")
def test_sampled_tokens_keep_their_distribution_with_drafts():
    plain, _ = first_two_tokens(0)
    spec, accepted = first_two_tokens(2)
    assert accepted > SAMPLES // 10  # drafts really were accepted (and the rest rejected)
    cells = sorted(set(plain) | set(spec))
    # two-sample Pearson chi-square over the cells with enough mass (the rest pooled)
    big = [c for c in cells if plain[c] + spec[c] >= 20]
    table = [(plain[c], spec[c]) for c in big] + [(sum(plain[c] for c in cells if c not in big),
                                                   sum(spec[c] for c in cells if c not in big))]
    table = [t for t in table if sum(t) > 0]
    n1, n2 = sum(a for a, _ in table), sum(b for _, b in table)
    stat = sum((a * n2 - b * n1) ** 2 / (n1 * n2 * (a + b)) for a, b in table)
    dof = len(table) - 1
    # the 0.999 quantile of chi-square is below dof + 3.1 sqrt(2 dof) + 10 for these sizes: a broken rule (e.g.
    # the correction drawn from p instead of the residual) moves mass by far more
    assert stat < dof + 3.1 * (2 * dof) ** 0.5 + 10, (stat, dof, table)
