"""CausalScoring: windows with stride over a long text, against one full transformers forward."""

from __future__ import annotations

import math

import pytest
import torch

from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.engine.scoring import CausalScoreCore

transformers = pytest.importorskip("transformers")
qwen35 = pytest.importorskip("ninfer_qwen35")

from ninfer_qwen35.program import ProgramError  # noqa: E402
from ninfer_qwen35.testing import float32_program, model_from_hf  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(1)
    hf_cfg = transformers.Qwen3_5TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True)
    hf = transformers.Qwen3_5ForCausalLM(hf_cfg).eval()
    prog = float32_program(model_from_hf(hf), page_size=8, num_pages=32)
    return hf, prog


def hf_logprobs(hf, ids):
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


TEXT = [int(x) for x in torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(3))]


def test_total_nll_equals_one_full_forward(tiny):
    hf, prog = tiny
    result = CausalScoreCore(prog, window=256).score(TEXT)
    ref = hf_logprobs(hf, TEXT)
    assert result.windows == 1 and result.num_scored == len(TEXT) - 1
    assert result.total_nll == pytest.approx(-float(ref.sum()), rel=1e-5)
    assert torch.allclose(torch.tensor(result.logprobs, dtype=torch.float64), ref, atol=1e-4)
    assert result.perplexity == pytest.approx(math.exp(result.total_nll / result.num_scored))
    assert prog.usage().all_free  # the temporary slot and pages are returned


def test_windows_with_stride_score_every_token_once(tiny):
    hf, prog = tiny
    core = CausalScoreCore(prog, window=64, stride=40)
    spans = core.windows(len(TEXT))
    assert spans[0] == (0, 64, 1) and spans[-1][1] == len(TEXT)
    covered = [p for _, end, first in spans for p in range(first, end)]
    assert covered == list(range(1, len(TEXT)))
    result = core.score(TEXT)
    ref = torch.cat([hf_logprobs(hf, TEXT[b:e])[f - b - 1:] for b, e, f in spans])
    assert result.windows == len(spans)
    assert torch.allclose(torch.tensor(result.logprobs, dtype=torch.float64), ref, atol=1e-4)
    assert prog.usage().all_free


def test_scoring_rejects_bad_settings(tiny):
    _, prog = tiny
    with pytest.raises(ValueError, match="stride must be"):
        CausalScoreCore(prog, window=64, stride=64)
    with pytest.raises(ValueError, match="window must be"):
        CausalScoreCore(prog, window=10_000)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        CausalScoreCore(prog).score([5])
    with pytest.raises(ValueError, match="vocabulary"):
        CausalScoreCore(prog).score([5, 1000])
    with pytest.raises(TypeError, match="cannot score"):
        CausalScoreCore(object())
    sid = prog.open_sequence(PreparedPrompt(token_ids=[1, 2]), SamplingParams(temperature=0))
    try:
        with pytest.raises(ProgramError, match="free StateImage slot"):
            CausalScoreCore(prog).score([1, 2, 3])
    finally:
        prog.release(sid)
    assert prog.usage().all_free



def test_score_window_in_chunks_equals_full_forward(tiny):
    hf, prog = tiny
    ref = hf_logprobs(hf, TEXT)
    lp = prog.score_window(TEXT, 1, chunk=40, logits_rows=16)  # several prefill chunks and logits blocks
    assert torch.allclose(lp.double(), ref, atol=1e-4)
    tail = prog.score_window(TEXT, 100, chunk=33)
    assert torch.allclose(tail.double(), ref[99:], atol=1e-4)
    assert prog.usage().all_free
