"""The RMS norm kernels (ninfer.ops.triton.norm) against fp32 references at Qwen3.5 shapes, bf16, on the GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
TOL = 5e-3  # a bf16 output: one rounding is about 2e-3 relative at most


def test_rms_norm_rows_and_heads(model, case, tokens):
    from ninfer.ops.norm import rms_norm_ref
    from ninfer.ops.triton.norm import rms_norm

    for shape in ((tokens, model.hidden), (tokens, model.heads, model.head_dim)):
        x, w = case.randn(*shape), case.randn(shape[-1], scale=0.1)
        out = case.nans(*shape)
        rms_norm(x, w, model.eps, out=out)
        case.within(out, rms_norm_ref(x.float(), w.float(), model.eps), TOL, f"x{list(shape)}")


def test_rms_norm_reads_q_of_query_gate_blocks_in_place(model, case, tokens):
    """The model's q: the query half of each head's [query | gate] block, read through its strides."""
    from ninfer.ops.norm import rms_norm_ref
    from ninfer.ops.triton.norm import rms_norm

    q = case.randn(tokens, model.heads, 2 * model.head_dim)[..., :model.head_dim]
    w = case.randn(model.head_dim, scale=0.1)
    out = case.nans(*q.shape)
    rms_norm(q, w, model.eps, out=out)
    case.within(out, rms_norm_ref(q.float(), w.float(), model.eps), TOL)


def test_rms_norm_gated(model, case, tokens):
    from ninfer.ops.norm import rms_norm_gated_ref
    from ninfer.ops.triton.norm import rms_norm_gated

    n, hv, dv = tokens, model.hv, model.dv
    x, w = case.randn(n, hv, dv), 1.0 + case.randn(dv, scale=0.1)
    # z as contiguous heads, and as the model passes it: a column slice of the in_proj output row.
    C, V = model.conv_dim, hv * dv
    proj = case.randn(n, C + V + 2 * hv)
    for label, z in (("z", case.randn(n, hv, dv)), ("z sliced from in_proj", proj[:, C:C + V].reshape(n, hv, dv))):
        out = case.nans(n, hv, dv)
        rms_norm_gated(x, z, w, model.eps, out=out)
        case.within(out, rms_norm_gated_ref(x.float(), z.float(), w.float(), model.eps), TOL, label)


def test_embed_rms_norm_equals_the_gather_then_rms_norm(model, case, tokens):
    """The model's first op: bitwise F.embedding then the rms_norm kernel, at every row count."""
    from ninfer.ops.triton.norm import embed_rms_norm, rms_norm

    V, H = 4099, model.hidden
    table, w = case.randn(V, H), case.randn(H, scale=0.1)
    ids = torch.randint(0, V, (tokens,), generator=torch.Generator(device="cuda").manual_seed(tokens),
                        device="cuda")
    x, y = embed_rms_norm(ids, table, w, model.eps)
    rows = torch.nn.functional.embedding(ids, table)
    assert torch.equal(x, rows)
    assert torch.equal(y, rms_norm(rows, w, model.eps))


def test_add_rms_norm(model, case, tokens):
    from ninfer.ops.norm import add_rms_norm_ref
    from ninfer.ops.triton.norm import add_rms_norm

    H = model.hidden
    x, r, w = case.randn(tokens, H), case.randn(tokens, H), case.randn(H, scale=0.1)
    out, r_out = case.nans(tokens, H), case.nans(tokens, H)
    add_rms_norm(x, r, w, model.eps, out=out, residual_out=r_out)
    case.within((out, r_out), add_rms_norm_ref(x.float(), r.float(), w.float(), model.eps), TOL)


def test_add_rms_norm_in_place_on_rows_of_a_wider_buffer(model, case, tokens):
    """residual_out=residual, the residual a row slice of a larger buffer: the rows around it keep their bits."""
    from ninfer.ops.norm import add_rms_norm_ref
    from ninfer.ops.triton.norm import add_rms_norm

    H = model.hidden
    image = case.randn(tokens + 2, H)
    x, r, w = case.randn(tokens, H), image[1:tokens + 1], case.randn(H, scale=0.1)
    ref = add_rms_norm_ref(x.float(), r.float(), w.float(), model.eps)
    edges = image[[0, -1]].clone()
    out = case.nans(tokens, H)
    add_rms_norm(x, r, w, model.eps, out=out, residual_out=r)
    case.within((out, r), ref, TOL)
    assert torch.equal(image[[0, -1]], edges)


def test_add_rms_norm_of_terms_is_that_of_their_sum(model, case, tokens):
    """x as a MoE block's nine weighted slot rows [N, 9, H]: bitwise the call on their in-order sum."""
    from ninfer.ops.norm import sum_terms
    from ninfer.ops.triton.norm import add_rms_norm

    H = model.hidden
    terms, r, w = case.randn(tokens, 9, H), case.randn(tokens, H), case.randn(H, scale=0.1)
    got = add_rms_norm(terms, r, w, model.eps)
    want = add_rms_norm(sum_terms(terms), r, w, model.eps)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("hidden,projected", [(2048, 257), (3072, 513), (4096, 129)], ids=("A3B", "A10B", "D4096"))
@pytest.mark.parametrize("rows", (1, 3, 8, 16))
@pytest.mark.parametrize("pdl", (False, True), ids=("plain", "pdl"))
def test_add_rms_norm_linear(case, hidden, projected, rows, pdl):
    """A MoE router's projection in the post-mixer norm's kernel (the 35B-A3B's [E + 1, H] router and shared gate,
    wider models): the normed rows and the residual bitwise add_rms_norm's, the projection within bf16 rounding of
    an fp32 product of those rows; the same under PDL and in a CUDA graph."""
    from ninfer.ops import launch
    from ninfer.ops.triton.norm import add_rms_norm, add_rms_norm_linear

    x, r = case.randn(rows, hidden), case.randn(rows, hidden)
    w, proj = case.randn(hidden, scale=0.1), case.randn(projected, hidden, scale=hidden ** -0.5)
    with launch.scope(pdl):
        normed, residual, out = add_rms_norm_linear(x, r, w, 1e-6, proj)
        want_normed, want_residual = add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(normed, want_normed) and torch.equal(residual, want_residual)
        case.within(out, normed.float() @ proj.float().T, TOL, "projection")
        alone = add_rms_norm_linear(x[-1:], r[-1:], w, 1e-6, proj)  # not changed by its batch neighbours
        assert all(torch.equal(a, b[-1:]) for a, b in zip(alone, (normed, residual, out), strict=True))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = add_rms_norm_linear(x, r, w, 1e-6, proj)
        x.copy_(case.randn(rows, hidden))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, add_rms_norm_linear(x, r, w, 1e-6, proj), strict=True):
            assert torch.equal(got, want)


def test_add_rms_norm_linear_leaves_other_calls_to_the_parts(case):
    """Prefill-sized calls and fp32 take the unfused ops (the kernel wrapper says None)."""
    from ninfer.ops.triton.norm import add_rms_norm_linear

    x, r, w = case.randn(17, 2048), case.randn(17, 2048), case.randn(2048, scale=0.1)
    assert add_rms_norm_linear(x, r, w, 1e-6, case.randn(257, 2048)) is None
    assert add_rms_norm_linear(x[:1].float(), r[:1].float(), w, 1e-6, case.randn(257, 2048).float()) is None
