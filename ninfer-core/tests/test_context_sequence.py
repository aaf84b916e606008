"""The sequence ledger: resolved sampling settings, counter-based draw seeds, frontiers (CPU)."""

from ninfer.contract.request import SamplingParams
from ninfer.models.common.context import RowSampling, SequenceRecord, draw_seed


def test_sampling_defaults_resolve_and_seed_is_fixed():
    defaults = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
    s = RowSampling.resolve(SamplingParams(top_p=0.95, seed=11), defaults)
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.seed) == (0.7, 20, 0.95, 0.0, 11)
    assert not s.greedy and not s.logprobs
    neutral = RowSampling.resolve(SamplingParams(top_logprobs=2), None)
    assert (neutral.temperature, neutral.top_k, neutral.top_p) == (1.0, 0, 1.0)
    assert neutral.logprobs and neutral.top_logprobs == 2 and 0 <= neutral.seed < 2 ** 63
    assert RowSampling.resolve(SamplingParams(temperature=0.0), defaults).greedy


def test_draw_seed_depends_only_on_seed_and_index():
    assert draw_seed(5, 3) == draw_seed(5, 3)
    seeds = {draw_seed(s, i) for s in range(4) for i in range(64)}
    assert len(seeds) == 4 * 64 and all(0 <= x < 2 ** 63 for x in seeds)


def test_frontiers():
    s = SequenceRecord(id=1, slot=0, prompt_len=3, ledger=[4, 5, 6],
                       sampling=RowSampling.resolve(SamplingParams(seed=1), None))
    assert (s.generated, s.target, s.input_remaining) == (0, 3, 3)
    s.computed = 3
    s.ledger.append(9)  # the first sampled token is the next input
    assert (s.generated, s.target, s.input_remaining) == (1, 3, 0)
    s.computed = 0  # rolled back: the accepted history is re-run
    assert s.input_remaining == 3
