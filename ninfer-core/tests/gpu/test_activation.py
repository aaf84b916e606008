"""The SiLU-and-multiply kernel (ninfer.ops.triton.activation) against its fp32 reference, bf16, on the GPU."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_silu_and_mul(model, case, tokens):
    from ninfer.ops.activation import silu_and_mul_ref
    from ninfer.ops.triton.activation import silu_and_mul

    x = case.randn(tokens, 2 * model.inter)
    out = case.nans(tokens, model.inter)
    silu_and_mul(x, out=out)
    case.within(out, silu_and_mul_ref(x.float()), 5e-3)
