"""The penalties kernel (ninfer.ops.triton.penalties) on the GPU against apply_penalties_ref: Qwen3.5's and
Qwen3's vocabularies, fp32 and bf16 logits, penalized rows in any order over shared history rows, the other rows
untouched, in a CUDA graph; and the sampler's adjustments of a verify unit on the device equal to the CPU's."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
VOCABS = (248320, 151936)


def _inputs(case, rows: int, hist_rows: int, vocab: int, dtype: torch.dtype):
    logits = case.randn(rows, vocab, scale=3.0, dtype=dtype)
    counts = (case.randint(4, hist_rows, vocab) * (case.rand(hist_rows, vocab) < 0.01)).to(torch.int32)
    prompt = case.rand(hist_rows, vocab) < 0.005
    sel = case.randperm(rows)[:max(rows - 1, 1)]
    hist = case.randint(hist_rows, sel.shape[0])
    knobs = torch.stack([case.rand(sel.shape[0]) * 4 - 2, case.rand(sel.shape[0]) * 4 - 2,
                         case.rand(sel.shape[0]) * 1.5 + 0.5])
    return logits, counts, prompt, sel, hist, knobs


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", (1, 8, 32), ids=lambda b: f"B{b}")
def test_apply_penalties_equals_reference(case, rows, vocab, dtype):
    from ninfer.ops.penalties import apply_penalties_ref
    from ninfer.ops.triton.penalties import apply_penalties

    logits, counts, prompt, sel, hist, knobs = _inputs(case, rows, 5, vocab, dtype)
    want = apply_penalties_ref(logits.clone(), sel, hist, counts, prompt, *knobs)
    got = logits.clone()
    assert apply_penalties(got, sel, hist, counts, prompt, *knobs) is got
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-5)
    untouched = torch.ones(rows, dtype=torch.bool, device=case.device)
    untouched[sel] = False
    assert torch.equal(got[untouched], logits[untouched])


def test_apply_penalties_in_a_cuda_graph(case):
    from ninfer.ops.penalties import apply_penalties_ref
    from ninfer.ops.triton.penalties import apply_penalties

    logits, counts, prompt, sel, hist, knobs = _inputs(case, 8, 8, 248320, torch.float32)
    apply_penalties(logits.clone(), sel, hist, counts, prompt, *knobs)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_penalties(logits, sel, hist, counts, prompt, *knobs)
    for _ in range(3):
        fresh, fresh_counts = case.randn(8, 248320, dtype=torch.float32), counts.roll(1, 0)
        logits.copy_(fresh)
        counts.copy_(fresh_counts)
        graph.replay()
        torch.testing.assert_close(logits, apply_penalties_ref(fresh, sel, hist, fresh_counts, prompt, *knobs),
                                   rtol=1e-6, atol=1e-5)


def test_verify_adjustments_on_the_device_equal_the_cpu(case, monkeypatch):
    """The sampler's adjustments of a verify unit (history rows, drafts, logit_bias, min_tokens) on CUDA, through
    the kernel (listed or not)."""
    from ninfer.contract.request import SamplingParams
    from ninfer.models.common.context import RowSampling, SequenceRecord
    from ninfer.models.common.sampler import Sampler

    vocab = 248320
    gen = torch.Generator().manual_seed(1)

    def seqs():
        out = []
        for i, knobs in enumerate([dict(repetition_penalty=1.3, presence_penalty=0.5),
                                   dict(frequency_penalty=1.0, logit_bias={7: 3.0}, min_tokens=12,
                                        stop_token_ids=(11,))]):
            ledger = torch.randint(0, 3000, (40,), generator=torch.Generator().manual_seed(i)).tolist()
            out.append(SequenceRecord(id=i + 1, slot=i, prompt_len=30, ledger=ledger,
                                      sampling=RowSampling.resolve(SamplingParams(temperature=0.0, **knobs), None)))
        return out

    drafts = [[5, 5, 9], [11, 2, 2]]
    logits = torch.randn(2 * 4, vocab, generator=gen) * 3
    cpu = logits.clone()
    Sampler(torch.device("cpu")).adjust_verify(seqs(), drafts, cpu, [10, 10])
    dev = logits.to(case.device)
    monkeypatch.setenv("NINFER_OPS", "triton")
    Sampler(case.device).adjust_verify(seqs(), drafts, dev, [10, 10])
    torch.testing.assert_close(dev.cpu(), cpu, rtol=1e-6, atol=1e-5)
