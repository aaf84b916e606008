"""Readback: a unit's tokens and logprobs come back from one packed copy, row for row (CPU)."""

import torch

from ninfer.core.readback import CopyStream, Readback, upload


def test_tokens_only():
    rb = Readback.launch(torch.tensor([7, 0, 123456789]), copies=CopyStream())
    assert rb.event is None and rb.want == ()
    tokens, lp = rb.wait()
    assert tokens == [7, 0, 123456789] and lp == {}


def test_tokens_and_logprobs_of_the_rows_that_want_them():
    tokens = torch.tensor([3, 150_000, 9, 2])
    want = (1, 3)
    chosen = torch.tensor([-0.125, -3.5])
    top_ids = torch.tensor([[150_000, 7], [2, 151_935]])
    top_lp = torch.tensor([[-0.125, -2.0625], [-1.5, -1e-7]])
    got, lp = Readback.launch(tokens, want, 2, (chosen, top_ids, top_lp), copies=CopyStream()).wait()
    assert got == [3, 150_000, 9, 2] and all(type(t) is int for t in got)
    assert sorted(lp) == [1, 3]
    c, (ids, lps) = lp[1]
    assert c == -0.125 and ids == [150_000, 7] and lps == [-0.125, -2.0625]
    c, (ids, lps) = lp[3]
    assert c == -3.5 and ids == [2, 151_935] and lps == [-1.5, float(torch.tensor(-1e-7))]  # fp32 values exactly


def test_upload_to_cpu_is_a_plain_copy():
    t = torch.arange(4, dtype=torch.float32)
    assert torch.equal(upload(t, torch.device("cpu")), t)
