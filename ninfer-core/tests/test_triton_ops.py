"""The Triton kernels against the torch references, on the CPU through Triton's interpreter.

The root conftest sets TRITON_INTERPRET=1 when there is no CUDA device; shapes are tiny because the
interpreter is slow, and dtypes are fp32/fp16 because it has no bf16 arithmetic. Real shapes and bf16 are the
job of the GPU tests (ninfer-core/tests/gpu, `scripts/gpu tests`).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from ninfer.ops import activation, attention, conv1d, gdn, norm, rope  # noqa: E402
from ninfer.ops.triton import activation as t_activation  # noqa: E402
from ninfer.ops.triton import attention as t_attention  # noqa: E402
from ninfer.ops.triton import conv1d as t_conv1d  # noqa: E402
from ninfer.ops.triton import gdn as t_gdn  # noqa: E402
from ninfer.ops.triton import norm as t_norm  # noqa: E402
from ninfer.ops.triton import rope as t_rope  # noqa: E402
from ninfer.ops.triton.gdn_shared import default_block_v  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter converts 1-element arrays to ints, which numpy deprecates; not our code.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, device=DEV, dtype=torch.float32).to(dtype)


def _close(out, ref, tol):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_rms_norms(dtype, tol):
    gen = _gen(0)
    x = _randn(3, 5, 48, gen=gen, dtype=dtype)
    w = _randn(48, gen=gen, dtype=dtype) * 0.1
    for one_plus in (True, False):
        _close(t_norm.rms_norm(x, w, 1e-6, one_plus=one_plus), norm.rms_norm_ref(x, w, 1e-6, one_plus=one_plus),
               tol)
    z = _randn(3, 5, 48, gen=gen, dtype=dtype)
    _close(t_norm.rms_norm_gated(x, z, w, 1e-6), norm.rms_norm_gated_ref(x, z, w, 1e-6), tol)
    # A strided input (a slice of a wider row) is read through its strides.
    wide = _randn(7, 96, gen=gen, dtype=dtype)
    _close(t_norm.rms_norm(wide[:, 10:58], w, 1e-6), norm.rms_norm_ref(wide[:, 10:58], w, 1e-6), tol)
    # Per-head rows of a column slice of a wider projection output (q of [q|gate] blocks, GDN's z), as the
    # model hands them over: [N, heads, D] views whose rows cannot be flattened without a copy.
    proj = _randn(3, 4 * 96 + 20, gen=gen, dtype=dtype)
    q = proj[:, :4 * 96].view(3, 4, 96)[..., :48]
    zs = proj[:, 20:20 + 4 * 48].reshape(3, 4, 48)
    xs = _randn(3, 4, 48, gen=gen, dtype=dtype)
    _close(t_norm.rms_norm(q, w, 1e-6), norm.rms_norm_ref(q, w, 1e-6), tol)
    _close(t_norm.rms_norm_gated(xs, zs, w, 1e-6), norm.rms_norm_gated_ref(xs, zs, w, 1e-6), tol)
    assert t_norm.rms_norm(x[:0], w, 1e-6).shape == (0, 5, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_embed_rms_norm_is_the_gather_then_the_norm(dtype):
    """The embedding rows and their norm in one kernel: the rows bitwise the table's, the norm bitwise the rms_norm
    kernel's of those rows (same tile, same reductions); an id out of the table reads a zero row."""
    gen = _gen(1)
    table = _randn(11, 48, gen=gen, dtype=dtype)
    w = _randn(48, gen=gen, dtype=dtype) * 0.1
    for ids in (torch.tensor([3, 0, 10, 3, 7], device=DEV), torch.tensor([5], device=DEV, dtype=torch.int32)):
        for one_plus in (True, False):
            x, y = t_norm.embed_rms_norm(ids, table, w, 1e-6, one_plus=one_plus)
            assert torch.equal(x, table[ids.long()])
            assert torch.equal(y, t_norm.rms_norm(table[ids.long()], w, 1e-6, one_plus=one_plus))
            ref_x, ref_y = norm.embed_rms_norm_ref(ids, table, w, 1e-6, one_plus=one_plus)
            assert torch.equal(x, ref_x)
            _close(y, ref_y, 1e-5 if dtype == torch.float32 else 2e-3)
    x, _ = t_norm.embed_rms_norm(torch.tensor([-1, 11, 2], device=DEV), table, w, 1e-6)
    assert torch.equal(x[:2], torch.zeros_like(x[:2])) and torch.equal(x[2], table[2])
    x, y = t_norm.embed_rms_norm(torch.empty(0, dtype=torch.int64, device=DEV), table, w, 1e-6)
    assert x.shape == y.shape == (0, 48)


def test_silu_and_mul_rope_and_gates():
    gen = _gen(1)
    x = _randn(4, 3, 2 * 40, gen=gen, dtype=torch.float16)
    _close(t_activation.silu_and_mul(x), activation.silu_and_mul_ref(x), 1e-3)

    q = _randn(6, 3, 32, gen=gen)
    cos, sin = rope.rope_cos_sin(torch.arange(6, device=DEV) * 7, 16, 10000.0, torch.float32)
    _close(t_rope.apply_rope(q, cos, sin, 16), rope.apply_rope_ref(q, cos, sin, 16), 1e-6)

    a, b = _randn(5, 6, gen=gen) * 10, _randn(5, 6, gen=gen)
    a_log, dt_bias = _randn(6, gen=gen), _randn(6, gen=gen)
    for got, want in zip(t_gdn.gdn_gates(a, b, a_log, dt_bias), gdn.gdn_gates_ref(a, b, a_log, dt_bias),
                         strict=True):
        _close(got, want, 1e-5)


def test_gdn_decode_updates_only_its_slots():
    gen = _gen(2)
    B, HK, HV, DK, DV, S = 3, 2, 4, 16, 32, 6
    q, k = _randn(B, HK, DK, gen=gen), _randn(B, HK, DK, gen=gen)
    v = _randn(B, HV, DV, gen=gen)
    g = -torch.rand(B, HV, generator=gen, device=DEV)
    beta = torch.rand(B, HV, generator=gen, device=DEV)
    # The states are a strided view into a wider per-slot image, as the state store hands them out.
    image = _randn(S, HV * DK * DV + 40, gen=gen)
    states = image[:, 8:8 + HV * DK * DV].view(S, HV, DK, DV)
    slots = torch.tensor([4, 0, 2], device=DEV)
    ref_image = image.clone()
    ref_states = ref_image[:, 8:8 + HV * DK * DV].view(S, HV, DK, DV)
    o_ref = gdn.gdn_decode_ref(q, k, v, g, beta, ref_states, slots)
    o = t_gdn.gdn_decode(q, k, v, g, beta, states, slots, block_v=16)
    _close(o, o_ref, 1e-5)
    _close(image, ref_image, 1e-5)  # the updated slots match; every other byte is untouched
    assert torch.equal(image[[1, 3, 5]], ref_image[[1, 3, 5]])


def _paged_case(gen, seq_lens, q_lens, kvh=2, group=2, d=32, page=4, dtype=torch.float32):
    B = len(seq_lens)
    width = max(-(-s // page) for s in seq_lens)
    n_pages = B * width + 3
    perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(0))[: B * width]
    block_tables = perm.view(B, width).to(torch.int32).to(DEV)
    k_cache = _randn(n_pages, page, kvh, d, gen=gen, dtype=dtype)
    v_cache = _randn(n_pages, page, kvh, d, gen=gen, dtype=dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = _randn(int(qsl[-1]), kvh * group, d, gen=gen, dtype=dtype)
    args = (q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEV), qsl,
            max(q_lens), max(seq_lens), d ** -0.5)
    return args


def test_paged_attention_decode_with_splits_and_prefill_with_context():
    gen = _gen(3)
    decode = _paged_case(gen, [9, 30, 1], [1, 1, 1])
    ref = attention.paged_attention_ref(*decode)
    for splits in (1, 4):
        _close(t_attention.paged_attention(*decode, num_splits=splits, tile_n=16), ref, 1e-5)
    # Mixed batch: a prompt, a chunk with earlier context and a decode row; q blocks smaller than the chunk.
    mixed = _paged_case(gen, [7, 21, 13], [7, 5, 1])
    _close(t_attention.paged_attention(*mixed, block_q=2, tile_n=16), attention.paged_attention_ref(*mixed), 1e-5)
    half = _paged_case(gen, [12, 5], [3, 5], dtype=torch.float16)
    _close(t_attention.paged_attention(*half, tile_n=16), attention.paged_attention_ref(*half), 2e-3)


@pytest.mark.parametrize("splits", [1, 4])
def test_paged_attention_gated_epilogue(splits):
    """The output gate applied by the attention kernel (its epilogue, or the split merge's) == o * sigmoid(gate)
    after the plain kernel, for a gate that is a strided per-head slice ([query | gate] blocks)."""
    gen = _gen(13)
    case = _paged_case(gen, [9, 30, 1], [1, 1, 1], dtype=torch.float16)
    q = case[0]
    q_gate = _randn(q.shape[0], q.shape[1], 2 * q.shape[2], gen=gen, dtype=torch.float16)
    gate = q_gate[..., q.shape[2]:]
    plain = t_attention.paged_attention(*case, num_splits=splits, tile_n=16)
    gated = t_attention.paged_attention_gated(*case, gate, num_splits=splits, tile_n=16)
    _close(gated, plain * torch.sigmoid(gate), 1e-3)
    assert gated.dtype == q.dtype
    prefill = _paged_case(gen, [12, 5], [3, 5], dtype=torch.float16)
    g2 = _randn(*prefill[0].shape, gen=gen, dtype=torch.float16)
    _close(t_attention.paged_attention_gated(*prefill, g2, tile_n=16),
           t_attention.paged_attention(*prefill, tile_n=16) * torch.sigmoid(g2), 1e-3)
    with pytest.raises(ValueError, match="gate"):
        t_attention.paged_attention_gated(*case, gate[:1])


def test_write_kv_touches_only_its_slots():
    gen = _gen(4)
    k_cache = _randn(5, 4, 2, 8, gen=gen)
    v_cache = _randn(5, 4, 2, 8, gen=gen)
    k, v = _randn(3, 2, 8, gen=gen), _randn(3, 2, 8, gen=gen)
    slots = torch.tensor([17, 2, 8], device=DEV)
    rk, rv = k_cache.clone(), v_cache.clone()
    attention.write_kv_ref(k, v, rk, rv, slots)
    t_attention.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, rk) and torch.equal(v_cache, rv)


@pytest.mark.parametrize("T,has_state", [(1, True), (2, False), (9, True), (9, False)])
def test_conv1d_prefill(T, has_state):
    gen = _gen(5)
    C, K = 12, 4
    x, w = _randn(T, C, gen=gen), _randn(C, K, gen=gen)
    state = _randn(C, K - 1, gen=gen)
    ref_state = state.clone()
    ref = conv1d.causal_conv1d_prefill_ref(x, w, ref_state, has_state)
    _close(t_conv1d.causal_conv1d_prefill(x, w, state, has_state, block_t=4, block_c=8), ref, 1e-5)
    _close(state, ref_state, 0)


def test_conv1d_decode_strided_states():
    gen = _gen(6)
    B, C, K, S = 3, 12, 4, 5
    x, w = _randn(B, C, gen=gen), _randn(C, K, gen=gen)
    image = _randn(S, C, K + 2, gen=gen)
    states = image[:, :, 1:K]  # [S, C, K-1], strided
    slots = torch.tensor([3, 0, 4], device=DEV)
    ref_image = image.clone()
    ref = conv1d.causal_conv1d_decode_ref(x, w, ref_image[:, :, 1:K], slots)
    _close(t_conv1d.causal_conv1d_decode(x, w, states, slots, block_c=8), ref, 1e-5)
    assert torch.equal(image, ref_image)


def test_shape_errors_are_clear():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="rms_norm"):
        t_norm.rms_norm(x, torch.zeros(6), 1e-6)
    with pytest.raises(ValueError, match="gdn_decode"):
        t_gdn.gdn_decode(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), torch.zeros(1, 3, 4), torch.zeros(1, 3),
                         torch.zeros(1, 3), torch.zeros(2, 3, 4, 4), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="num_splits"):
        t_attention.paged_attention(*_paged_case(_gen(7), [3], [1]), num_splits=3)


def test_launch_heuristics_depend_on_shapes_only():
    # Decode splits: powers of two, at most 64, never more than half the tiles of the longest context; a graph
    # captured with a capacity as max_seq_len only changes the speed (ranges come from the device lengths).
    from ninfer.ops.triton import tuning

    c = tuning.choices("attention", tuning.CPU)
    for batch in (1, 2, 8, 64):
        for ctx_len in (1, 100, 8192, 262144):
            s = t_attention._decode_splits(batch, 4, ctx_len, 32, c)
            assert s & (s - 1) == 0 and 1 <= s <= 64 and s <= max(1, -(-ctx_len // 64))
    assert t_attention._decode_splits(1, 4, 8192, 32, c) == 64 and t_attention._decode_splits(8, 4, 8192, 32, c) == 32
    block_v = [default_block_v(b, 32, 128, tuning.CPU) for b in (1, 2, 4, 8)]
    assert block_v == [16, 16, 32, 32]


def test_linear_rows_kernel():
    """The few-row linear (fp16 inputs) against an fp32 F.linear: one pass and split-K (last arrival reduces), ragged N
    and K, a row's result independent of its neighbours, counters back at zero, prefill rows via cuBLAS."""
    from ninfer.ops.launch import arrival_counters
    from ninfer.ops.linear import linear_ref
    from ninfer.ops.triton import linear as t_linear

    gen = _gen(7)
    N, K = 50, 200
    w = _randn(N, K, gen=gen, dtype=torch.float16) * 0.1
    x = _randn(5, K, gen=gen, dtype=torch.float16)
    ref = linear_ref(x.float(), w.float())
    for split in (1, 3):
        y = t_linear.linear(x, w, block_n=16, block_k=32, split_k=split)
        assert y.dtype == torch.float16 and y.shape == (5, N)
        _close(y, ref, 2e-3)
        # Row 2 alone gives bitwise what it gave among five rows (the configuration ignores M).
        assert torch.equal(t_linear.linear(x[2:3], w, block_n=16, block_k=32, split_k=split), y[2:3])
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0
    x3 = _randn(2, 3, K, gen=gen, dtype=torch.float16)  # leading dims are rows
    _close(t_linear.linear(x3, w, block_n=16, block_k=64), linear_ref(x3.float(), w.float()), 2e-3)
    many = _randn(t_linear.MAX_ROWS + 1, K, gen=gen, dtype=torch.float16)
    if DEV == "cuda":  # cuBLAS path for prefill-sized inputs (the CPU has no fp16 F.linear kernel everywhere)
        _close(t_linear.linear(many, w), linear_ref(many.float(), w.float()), 2e-3)
    cfg = t_linear.default_config(4096, 4096)
    assert cfg[2] > 1 and t_linear.default_config(248320, 4096)[2] == 1  # small N splits K, the lm_head does not


@pytest.mark.parametrize("split", [1, 3])
def test_swiglu_kernel(split):
    """swiglu (gate_up projection with silu_and_mul as its epilogue) == linear then silu_and_mul on the same
    configuration (bitwise: the same sums and roundings), near an fp32 reference, rows independent; more rows
    than MAX_ROWS take the unfused ops."""
    from ninfer.ops.linear import swiglu_ref
    from ninfer.ops.triton import linear as t_linear

    gen = _gen(11)
    inter, K = 40, 192
    w = _randn(2 * inter, K, gen=gen, dtype=torch.float16) * 0.1
    x = _randn(5, K, gen=gen, dtype=torch.float16)
    y = t_linear.swiglu(x, w, block_n=16, block_k=32, split_k=split)
    assert y.shape == (5, inter)
    unfused = t_activation.silu_and_mul(t_linear.linear(x, w, block_n=16, block_k=32, split_k=split))
    assert torch.equal(y, unfused)
    _close(y, swiglu_ref(x.float(), w.float()), 5e-3)
    assert torch.equal(t_linear.swiglu(x[3:4], w, block_n=16, block_k=32, split_k=split), y[3:4])
    _close(t_linear.swiglu(x, w), swiglu_ref(x.float(), w.float()), 5e-3)  # default configuration
    if DEV == "cuda":  # prefill-sized: the unfused ops (cuBLAS), which the CPU lacks for fp16 everywhere
        many = _randn(t_linear.MAX_ROWS + 1, K, gen=gen, dtype=torch.float16)
        _close(t_linear.swiglu(many, w), swiglu_ref(many.float(), w.float()), 5e-3)
    with pytest.raises(ValueError, match="gate; up"):
        t_linear.swiglu(x, w[1:])


def test_pdl_only_inside_an_enabled_scope_on_capable_cuda_devices(monkeypatch):
    """Programmatic dependent launch is requested only inside an enabled scope and on a CUDA device of sm_90
    or newer; the CPU interpreter never gets the launch keyword; leaving the scope restores the outer one."""
    from ninfer.ops import launch

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(launch, "_capable", lambda index: True)
    assert launch.pdl_args(cuda) == {"USE_PDL": False}  # no scope: off
    with launch.scope(True):
        assert launch.pdl_args(torch.device("cpu")) == {"USE_PDL": False}
        assert launch.pdl_args(cuda) == {"USE_PDL": True, "launch_pdl": True}
        with launch.scope(False):
            assert launch.pdl_args(cuda) == {"USE_PDL": False}
        assert launch.pdl_args(cuda) == {"USE_PDL": True, "launch_pdl": True}
        monkeypatch.setattr(launch, "_capable", lambda index: False)
        assert launch.pdl_args(cuda) == {"USE_PDL": False}
    monkeypatch.setattr(launch, "_capable", lambda index: True)
    assert launch.pdl_args(cuda) == {"USE_PDL": False}


def test_pdl_scope_is_per_thread():
    """One Program's scope does not leak into another thread (no process-global state)."""
    import threading

    from ninfer.ops import launch

    seen = []
    with launch.scope(True):
        worker = threading.Thread(target=lambda: seen.append(launch._PDL.get()))
        worker.start()
        worker.join()
        assert launch._PDL.get() is True
    assert seen == [False]


def test_pdl_preference_by_layer_size_and_environment(monkeypatch):
    """Small layers ask for PDL, large ones do not; NINFER_PDL=0/1 overrides the model's preference."""
    from ninfer.ops import launch

    monkeypatch.delenv("NINFER_PDL", raising=False)
    assert launch.prefers_pdl(60e6) is True
    assert launch.prefers_pdl(173e6) is True  # the 35B-A3B MoE: dense weights + 8 experts per layer
    assert launch.prefers_pdl(600e6) is False
    monkeypatch.setenv("NINFER_PDL", "1")
    assert launch.prefers_pdl(600e6) is True
    monkeypatch.setenv("NINFER_PDL", "0")
    assert launch.prefers_pdl(60e6) is False


@pytest.mark.parametrize("split", [1, 3])
def test_linear_fp32_out(split):
    """An fp32 result from fp16 inputs is the kernel's fp32 accumulator: near an fp32 F.linear, and rounding it
    gives bitwise the fp16 result of the same configuration (the same sums); split-K's last arrival stores it
    too; swiglu keeps the input dtype; prefill-sized inputs go to cuBLAS and cast."""
    from ninfer.ops.launch import arrival_counters
    from ninfer.ops.linear import linear_ref
    from ninfer.ops.triton import linear as t_linear

    gen = _gen(13)
    N, K = 50, 200
    w = _randn(N, K, gen=gen, dtype=torch.float16) * 0.1
    x = _randn(5, K, gen=gen, dtype=torch.float16)
    cfg = {"block_n": 16, "block_k": 32, "split_k": split}
    y = t_linear.linear(x, w, out_dtype=torch.float32, **cfg)
    assert y.dtype == torch.float32 and y.shape == (5, N)
    _close(y, linear_ref(x.float(), w.float()), 1e-5)
    half = t_linear.linear(x, w, **cfg)
    assert torch.equal(y.half(), half)
    _close(y, half, 2e-3)
    out = torch.full((5, N), float("nan"), device=DEV)
    assert t_linear.linear(x, w, out=out, **cfg) is out and torch.equal(out, y)
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0
    assert t_linear.swiglu(x, torch.cat([w, w]), **cfg).dtype == torch.float16
    many = _randn(t_linear.MAX_ROWS + 1, K, gen=gen, dtype=torch.bfloat16)  # cuBLAS (CPU: BLAS) rounds, then casts
    wb = w.to(torch.bfloat16)
    assert torch.equal(t_linear.linear(many, wb, out_dtype=torch.float32), linear_ref(many, wb).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_kernel(dtype):
    """The split-row argmax == torch.argmax bitwise: V below one block, not a multiple of it, over several chunks
    and loop steps per chunk; B = 1..5; ties (the first index wins, across chunks and lanes, -0.0 == +0.0), -inf
    rows, NaN (the first NaN wins, above +inf), strided rows; the arrival counters are back at zero."""
    from ninfer.ops.launch import arrival_counters
    from ninfer.ops.triton import sampling as t_sampling

    gen = _gen(17)
    for V, batches in [(5, (1, 3)), (2048, (2,)), (3001, (1, 4)), (5 * 2048 + 7, (5,)), (270_001, (1,))]:
        for B in batches:
            x = _randn(B, V, gen=gen, dtype=dtype)
            assert torch.equal(t_sampling.greedy(x), x.argmax(-1)), (V, B)
    chunk, S = t_sampling.splits(270_001, 128)
    assert S > 1 and chunk > t_sampling._BLOCK  # that row took more than one loop step per chunk
    V = 3 * 2048 + 100
    x = _randn(7, V, gen=gen, dtype=dtype)
    x[0, [5000, 70, 2100, 6000]] = 9.0  # ties across chunks: the first index
    x[1, [2047, 2048, 1]] = 9.0
    x[2] = float("-inf")
    x[3, [4000, 100]] = float("nan")  # NaN is the maximum, above +inf
    x[3, 50] = float("inf")
    x[4, 3000] = float("inf")
    x[5] = 0.0
    x[5, :3000] = -0.0  # -0.0 ties +0.0
    x[6, 10:] = float("-inf")
    x[6, :10] = float("nan")
    assert torch.equal(t_sampling.greedy(x), x.argmax(-1))
    assert t_sampling.greedy(x).tolist() == [70, 1, 0, 100, 3000, 0, 0]
    wide = _randn(3, V + 40, gen=gen, dtype=dtype)
    assert torch.equal(t_sampling.greedy(wide[:, 40:]), wide[:, 40:].argmax(-1))
    assert int(arrival_counters(x.device, 8).abs().sum()) == 0
    with pytest.raises(ValueError, match="greedy"):
        t_sampling.greedy(x[0])
