"""apply_token_mask: the reference against the bit layout of ``ninfer.contract.constraint`` (bit ``t % 32`` of
word ``t // 32``: token t allowed), and the Triton kernel against the reference under the CPU interpreter."""

from __future__ import annotations

import os

import pytest
import torch

from ninfer.ops.sampling import apply_token_mask, apply_token_mask_ref

NEG_INF = float("-inf")


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """int32 [B, ceil(V / 32)] from a bool [B, V]: the layout written independently of the op under test."""
    B, V = allowed.shape
    words = torch.zeros(B, (V + 31) // 32, dtype=torch.int64)
    for t in range(V):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # two's complement: bit 31 set -> negative


def expected(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token by token, in Python integers: -inf where the bit is 0."""
    out = logits.clone()
    B, V = logits.shape
    for b in range(B):
        for t in range(V):
            if not (int(mask[b, t // 32]) >> (t % 32)) & 1:
                out[b, t] = NEG_INF
    return out


def special_masks(V: int, gen: torch.Generator) -> torch.Tensor:
    """Rows: random bits, all refused, all allowed (-1 words), only the bits at word edges (0, 31, 32, 63, ...),
    every bit but those, and random bits with junk set past V in the last word (which must be ignored)."""
    W = (V + 31) // 32
    rows = [torch.randint(-2**31, 2**31, (W,), generator=gen, dtype=torch.int64).to(torch.int32),
            torch.zeros(W, dtype=torch.int32), torch.full((W,), -1, dtype=torch.int32)]
    edges = torch.zeros(V, dtype=torch.bool)
    edges[[t for t in range(V) if t % 32 in (0, 31)]] = True
    edges[V - 1] = True  # the last token, in the last (maybe partial) word
    rows += [pack(edges[None])[0], pack(~edges[None])[0]]
    junk = rows[0].clone()
    junk[-1] = -1  # bits past V set: those tokens do not exist
    rows.append(junk)
    return torch.stack(rows)


@pytest.mark.parametrize("V", [1, 31, 32, 33, 64, 77, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_follows_the_bit_layout(V, dtype):
    gen = torch.Generator().manual_seed(V)
    mask = special_masks(V, gen)
    logits = torch.randn(mask.shape[0], V, generator=gen).to(dtype)
    want = expected(logits, mask)
    got = logits.clone()
    assert apply_token_mask(got, mask) is got  # in place, the same tensor back
    assert torch.equal(got, want)
    assert (got[1] == NEG_INF).all() and torch.equal(got[2], logits[2])  # all refused / all allowed rows
    edges = [t for t in range(V) if t % 32 in (0, 31)] + [V - 1]
    assert torch.equal(got[3, edges], logits[3, edges]) and (got[4, edges] == NEG_INF).all()


def test_packed_bits_round_trip():
    allowed = torch.zeros(2, 70, dtype=torch.bool)
    allowed[0, [0, 31, 32, 63, 64, 69]] = True
    allowed[1] = True
    mask = pack(allowed)
    assert mask.tolist() == [[-(2**31) + 1, -(2**31) + 1, 1 | (1 << 5)], [-1, -1, 0x3F]]
    out = apply_token_mask_ref(torch.zeros(2, 70), mask)
    assert torch.equal(out == 0, allowed)


def test_mask_that_does_not_fit_is_a_clear_error():
    logits = torch.zeros(2, 70)
    for bad in (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int32),
                torch.zeros(3, 3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="apply_token_mask"):
            apply_token_mask(logits, bad)
    for wrong_rank in (torch.zeros(70), torch.zeros(1, 2, 70)):  # named, not a tuple-unpacking error
        with pytest.raises(ValueError, match="apply_token_mask"):
            apply_token_mask(wrong_rank, torch.zeros(2, 3, dtype=torch.int32))


# -- the Triton kernel under the interpreter (on the GPU: ninfer-core/tests/gpu/test_sampling.py) ---------------

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1")


@needs_triton
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernel_equals_reference(dtype):
    """Bitwise: V below one word, not a multiple of 32, over more than one program's block of words; every
    special row; strided logits (a column slice of a wider buffer) with the columns outside left alone."""
    pytest.importorskip("triton")
    from ninfer.ops.triton import sampling as t_sampling

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(7)
    for V in (5, 77, 2048, 2048 * 2 + 33):
        mask = special_masks(V, gen)
        logits = torch.randn(mask.shape[0], V, generator=gen).to(dtype).to(dev)
        want = apply_token_mask_ref(logits.clone(), mask.to(dev))
        got = logits.clone()
        assert t_sampling.apply_token_mask(got, mask.to(dev)) is got
        assert torch.equal(got, want), V
    V = 3 * 32 + 5
    mask = special_masks(V, gen).to(dev)
    wide = torch.randn(mask.shape[0], V + 9, generator=gen).to(dtype).to(dev)
    before = wide.clone()
    t_sampling.apply_token_mask(wide[:, 4:4 + V], mask)
    assert torch.equal(wide[:, 4:4 + V], apply_token_mask_ref(before[:, 4:4 + V].clone(), mask))
    assert torch.equal(wide[:, :4], before[:, :4]) and torch.equal(wide[:, 4 + V:], before[:, 4 + V:])
    with pytest.raises(ValueError, match="apply_token_mask"):
        t_sampling.apply_token_mask(wide, mask[:, :-1])
    with pytest.raises(ValueError, match="apply_token_mask"):
        t_sampling.apply_token_mask(wide[0], mask[0])
