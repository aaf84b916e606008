"""The fused residual add + RMSNorm: the op against the unfused sequence, the Triton kernel against the reference.

The kernel runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set by the root conftest without
CUDA) at toy sizes in fp32/fp16; bf16 and 9B shapes are its GPU test (`scripts/gpu tests`).
"""

from __future__ import annotations

import os

import pytest
import torch

from ninfer.ops import add_rms_norm, rms_norm
from ninfer.ops.norm import add_rms_norm_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1")
# Triton's interpreter converts 1-element arrays to ints, which numpy deprecates; not our code.
interpreter_warning = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _randn(*shape, seed, dtype=torch.float32):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=DEV).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_plus", [True, False])
def test_op_is_the_unfused_sequence_bitwise(dtype, one_plus):
    x, res, w = _randn(5, 64, seed=0, dtype=dtype), _randn(5, 64, seed=1, dtype=dtype), _randn(64, seed=2) * 0.1
    normed, new_res = add_rms_norm(x, res, w, 1e-6, one_plus=one_plus)
    want_res = res + x
    assert torch.equal(new_res, want_res) and new_res.dtype == dtype
    assert torch.equal(normed, rms_norm(want_res, w, 1e-6, one_plus=one_plus))
    ref_normed, ref_res = add_rms_norm_ref(x, res, w, 1e-6, one_plus=one_plus)
    assert torch.equal(ref_normed, normed) and torch.equal(ref_res, new_res)


def test_op_rejects_mismatched_inputs():
    x, w = torch.zeros(3, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="add_rms_norm: x .* residual"):
        add_rms_norm(x, torch.zeros(1, 8), w, 1e-6)  # would broadcast silently
    with pytest.raises(ValueError, match="add_rms_norm: x .* residual"):
        add_rms_norm(x, x.bfloat16(), w, 1e-6)
    with pytest.raises(ValueError, match="add_rms_norm: last dimension 8"):
        add_rms_norm(x, x, torch.zeros(6), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_terms_are_added_in_order_then_rounded(dtype):
    """x as [N, S, D] terms (a MoE block's slot rows): their in-order fp32 sum, rounded once, joins the stream."""
    from ninfer.ops.norm import sum_terms

    terms, res, w = _randn(4, 9, 32, seed=8, dtype=dtype), _randn(4, 32, seed=9, dtype=dtype), _randn(32, seed=10)
    want = terms[:, 0].float()
    for t in range(1, 9):
        want = want + terms[:, t].float()
    assert torch.equal(sum_terms(terms), want.to(dtype))
    normed, new_res = add_rms_norm(terms, res, w, 1e-6)
    want_normed, want_res = add_rms_norm(want.to(dtype), res, w, 1e-6)
    assert torch.equal(new_res, want_res) and torch.equal(normed, want_normed)
    ref_normed, ref_res = add_rms_norm_ref(terms, res, w, 1e-6)
    assert torch.equal(ref_normed, normed) and torch.equal(ref_res, new_res)
    with pytest.raises(ValueError, match="terms of it"):
        add_rms_norm(terms[:3], res, w, 1e-6)


@needs_triton
@interpreter_warning
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_adds_terms_as_the_reference(dtype):
    """The kernel's terms (S = 1, 2, 9; rows strided as a [N, S, D] view of a wider buffer) give bitwise what
    it gives for their sum; one term is the plain call."""
    from ninfer.ops.norm import sum_terms
    from ninfer.ops.triton.norm import add_rms_norm as t_add_rms_norm

    res, w = _randn(5, 48, seed=11, dtype=dtype), _randn(48, seed=12, dtype=dtype) * 0.1
    for n_terms in (1, 2, 9):
        terms = _randn(5, n_terms, 64, seed=13 + n_terms, dtype=dtype)[..., 8:56]
        normed, new_res = t_add_rms_norm(terms, res, w, 1e-6)
        want_normed, want_res = t_add_rms_norm(sum_terms(terms), res, w, 1e-6)
        assert torch.equal(new_res, want_res) and torch.equal(normed, want_normed)
        ref_normed, ref_res = add_rms_norm_ref(terms, res, w, 1e-6)
        assert torch.equal(new_res, ref_res)


@needs_triton
@interpreter_warning
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_kernel_matches_reference(dtype, tol):
    from ninfer.ops.triton.norm import add_rms_norm as t_add_rms_norm

    x, res = _randn(3, 5, 48, seed=3, dtype=dtype), _randn(3, 5, 48, seed=4, dtype=dtype)
    w = _randn(48, seed=5, dtype=dtype) * 0.1
    for one_plus in (True, False):
        want_normed, want_res = add_rms_norm_ref(x, res, w, 1e-6, one_plus=one_plus)
        normed, new_res = t_add_rms_norm(x, res, w, 1e-6, one_plus=one_plus)
        assert normed.dtype == new_res.dtype == dtype
        torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)  # one rounding of the same sum
        torch.testing.assert_close(normed.float(), want_normed.float(), atol=tol, rtol=tol)
    # Strided inputs (slices of wider rows) are read through their strides; outputs come back contiguous.
    wide_x, wide_r = _randn(7, 96, seed=6, dtype=dtype), _randn(7, 96, seed=7, dtype=dtype)
    want_normed, want_res = add_rms_norm_ref(wide_x[:, 10:58], wide_r[:, 40:88], w, 1e-6)
    normed, new_res = t_add_rms_norm(wide_x[:, 10:58], wide_r[:, 40:88], w, 1e-6)
    torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(normed.float(), want_normed.float(), atol=tol, rtol=tol)


@needs_triton
@interpreter_warning
def test_kernel_in_place_touches_only_its_rows():
    from ninfer.ops.triton.norm import add_rms_norm as t_add_rms_norm

    # The residual stream is a row slice of a wider buffer; in place, the rows around it stay as they were.
    image = _randn(9, 32, seed=8)
    res = image[2:7]
    x, w = _randn(5, 32, seed=9), _randn(32, seed=10) * 0.1
    want_normed, want_res = add_rms_norm_ref(x, res.clone(), w, 1e-6)
    before = image.clone()
    out = torch.full_like(x, float("nan"))
    normed, new_res = t_add_rms_norm(x, res, w, 1e-6, out=out, residual_out=res)
    assert normed is out and new_res is res
    assert torch.equal(res, want_res)
    torch.testing.assert_close(normed, want_normed, atol=1e-5, rtol=1e-5)
    assert torch.equal(image[:2], before[:2]) and torch.equal(image[7:], before[7:])
    # The normed rows may also overwrite x itself.
    x2, r2 = _randn(4, 32, seed=11), _randn(4, 32, seed=12)
    want_normed, want_res = add_rms_norm_ref(x2, r2, w, 1e-6)
    t_add_rms_norm(x2, r2, w, 1e-6, out=x2, residual_out=r2)
    torch.testing.assert_close(x2, want_normed, atol=1e-5, rtol=1e-5)
    assert torch.equal(r2, want_res)
    # No rows: nothing launched, empty results.
    normed, new_res = t_add_rms_norm(x[:0], res[:0], w, 1e-6)
    assert normed.shape == new_res.shape == (0, 32)


@needs_triton
def test_kernel_rejects_bad_buffers():
    from ninfer.ops.triton.norm import add_rms_norm as t_add_rms_norm

    x, w = torch.zeros(4, 8, device=DEV), torch.zeros(8, device=DEV)
    with pytest.raises(ValueError, match="add_rms_norm: x .* residual"):
        t_add_rms_norm(x, torch.zeros(1, 8, device=DEV), w, 1e-6)
    with pytest.raises(ValueError, match="add_rms_norm: last dimension"):
        t_add_rms_norm(x, x, torch.zeros(6, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="residual_out"):
        t_add_rms_norm(x, x, w, 1e-6, residual_out=torch.zeros(4, 8, device=DEV, dtype=torch.float16))
    with pytest.raises(ValueError, match="out .*viewable"):
        t_add_rms_norm(x, x, w, 1e-6, out=torch.zeros(8, 4, device=DEV).t())


@pytest.mark.parametrize("rows", [1, 5])
def test_linear_op_is_the_norm_then_the_projection(rows):
    """add_rms_norm_linear: bitwise add_rms_norm's rows and the projection of the normed rows (the unfused ops,
    which the CPU runs); the reference is the same."""
    from ninfer.ops import add_rms_norm_linear, linear
    from ninfer.ops.norm import add_rms_norm_linear_ref

    x, res, w = _randn(rows, 64, seed=20), _randn(rows, 64, seed=21), _randn(64, seed=22) * 0.1
    proj = _randn(9, 64, seed=23)
    normed, new_res, out = add_rms_norm_linear(x, res, w, 1e-6, proj)
    want_normed, want_res = add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(normed, want_normed) and torch.equal(new_res, want_res)
    assert torch.equal(out, linear(want_normed, proj))
    for got, want in zip(add_rms_norm_linear_ref(x, res, w, 1e-6, proj), (normed, new_res, out), strict=True):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match=r"projection \(9, 32\)"):
        add_rms_norm_linear(x, res, w, 1e-6, proj[:, :32])
    with pytest.raises(ValueError, match="no terms"):
        add_rms_norm_linear(x[:, None].expand(rows, 2, 64), res, w, 1e-6, proj)


@needs_triton
@interpreter_warning
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("one_plus", [True, False])
def test_linear_kernel_matches_the_parts(rows, one_plus):
    """The fused kernel (projection rows in blocks of 4 over 10 rows: a partial last block) gives the norm
    kernel's rows bitwise and the projection of those rows within fp16 rounding; other calls say None."""
    from ninfer.ops.triton.norm import add_rms_norm as t_add_rms_norm
    from ninfer.ops.triton.norm import add_rms_norm_linear as t_fused

    dtype = torch.float16
    x, res = _randn(rows, 48, seed=30, dtype=dtype), _randn(rows, 48, seed=31, dtype=dtype)
    w, proj = _randn(48, seed=32, dtype=dtype) * 0.1, _randn(10, 48, seed=33, dtype=dtype) * 0.2
    normed, new_res, out = t_fused(x, res, w, 1e-6, proj, one_plus=one_plus)
    want_normed, want_res = t_add_rms_norm(x, res, w, 1e-6, one_plus=one_plus)
    assert torch.equal(new_res, want_res) and torch.equal(normed, want_normed)
    torch.testing.assert_close(out.float(), normed.float() @ proj.float().T, atol=2e-3, rtol=2e-3)
    assert t_fused(x.float(), res.float(), w, 1e-6, proj.float()) is None
    assert t_fused(_randn(17, 48, seed=34, dtype=dtype), _randn(17, 48, seed=35, dtype=dtype), w, 1e-6, proj) is None
