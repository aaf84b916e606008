"""Qwen4ExpModel's verify forward (every row R tokens, the state after each position kept aside): its logits equal
decoding the same tokens one by one, the slots' GDN / PLE state and n-gram history are left as they were, and the
state kept after step t equals the slot's state after decoding t + 1 tokens, so committing any step rolls a
rejected draft back exactly (fp32, CPU, transformers' tiny random configs of ``test_model_oracle``; the tokens
include an EOS, where the n-gram history resets)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from ninfer_qwen4exp.execution.layers import Qwen4ExpVerifySteps

pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location("_oracle", Path(__file__).with_name("test_model_oracle.py"))
_oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_oracle)
tiny, Runner, prompt, EOS = _oracle.tiny, _oracle.Runner, _oracle.prompt, _oracle.EOS



def _steps(model, B: int, R: int) -> Qwen4ExpVerifySteps:
    c, b = model.config, model.config.base
    gdn = len(c.gdn_layers)
    return Qwen4ExpVerifySteps(
        conv=torch.full((B, R, gdn, b.conv_dim, b.linear_conv_kernel_dim - 1), float("nan")),
        recurrent=torch.full((B, R, gdn, b.linear_num_value_heads, b.linear_key_head_dim, b.linear_value_head_dim),
                             float("nan")),
        ple_conv=torch.full((B, R, len(c.ple_layers), c.ple.conv_state_len, c.hc_hidden_size), float("nan")),
        ngram=torch.full((B, R, c.ple.context_len), -1, dtype=torch.int64))


def _slot_state(views, slot: int) -> dict[str, torch.Tensor]:
    return {"conv": views.conv[slot].clone(), "recurrent": views.recurrent[slot].clone(),
            "ple_conv": views.ple_conv[slot].clone(), "ngram": views.ngram[slot].clone()}


@pytest.mark.parametrize("R", [2, 4])
def test_verify_equals_decoding_one_by_one(tiny, R):
    model = tiny.model
    runner = Runner(model)
    rows = [(runner.new(), prompt(9, 192, seed=1)), (runner.new(), prompt(14, 192, seed=2))]
    runner.step(rows)
    drafts = [[5, EOS, 11, 3][:R], [17, 2, EOS, 40][:R]]
    reference = copy.deepcopy(runner)
    before = [_slot_state(runner.views, s.slot) for s, _ in rows]

    # one by one on a copy: logits and the slot's state after each token
    want_logits, want_states = [[] for _ in rows], [[] for _ in rows]
    seqs = [copy.deepcopy(s) for s, _ in rows]
    for t in range(R):
        out = reference.step([(s, [d[t]]) for s, d in zip(seqs, drafts, strict=True)])
        for b, s in enumerate(seqs):
            want_logits[b].append(out[b][0])
            want_states[b].append(_slot_state(reference.views, s.slot))

    steps = _steps(model, len(rows), R)
    batch = runner.pack([(s, d) for (s, _), d in zip(rows, drafts, strict=True)])
    logits = model.logits(model.forward(batch, runner.views, steps)).view(len(rows), R, -1)
    for b, (seq, _) in enumerate(rows):
        torch.testing.assert_close(logits[b], torch.stack(want_logits[b]), atol=2e-5, rtol=2e-5)
        for name, value in _slot_state(runner.views, seq.slot).items():  # the slot untouched
            assert torch.equal(value, before[b][name]), name
        for t in range(R):
            want = want_states[b][t]
            torch.testing.assert_close(steps.conv[b, t], want["conv"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(steps.recurrent[b, t], want["recurrent"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(steps.ple_conv[b, t], want["ple_conv"], atol=1e-5, rtol=1e-5)
            assert torch.equal(steps.ngram[b, t], want["ngram"])


def test_verify_refuses_rows_that_are_not_the_steps_width(tiny):
    model = tiny.model
    runner = Runner(model)
    seq = runner.new()
    runner.step([(seq, prompt(6, 192, seed=3))])
    batch = runner.pack([(seq, [1, 2, 3])])
    with pytest.raises(ValueError, match="every row must be"):
        model.forward(batch, runner.views, _steps(model, 1, 2))
