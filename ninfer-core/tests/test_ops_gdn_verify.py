"""gdn_verify, the speculative verification step of the GDN layers: R fused decode steps per row that keep every
step's state and leave the slot as it was; gdn_verify_commit; the Triton kernel against the reference (on the
CPU through Triton's interpreter: tiny shapes, fp32/fp16 since the interpreter has no bf16)."""

from __future__ import annotations

import os

import attrs
import pytest
import torch

from ninfer.ops import gdn

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
LAYERS, LAYER = 3, 1  # the step buffers are [B, R, L, ...]; the op gets one layer's strided view


@attrs.frozen
class Case:
    """The op's inputs as the Program hands them over: mixed_qkv, a and b column slices of one in_proj output,
    the slot states strided views into wider per-slot images, the step buffers one layer of [B, R, L, ...]
    buffers poisoned with NaN."""

    mixed: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    conv_w: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    conv_image: torch.Tensor
    state_image: torch.Tensor
    slots: torch.Tensor
    step_conv_buf: torch.Tensor
    step_state_buf: torch.Tensor
    dims: tuple[int, int, int, int]  # HV, Dk, Dv, K

    @property
    def R(self) -> int:
        return self.step_conv_buf.shape[1]

    def slot_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        HV, DK, DV, K = self.dims
        return self.conv_image[:, :, 1:K], self.state_image[:, 8:8 + HV * DK * DV].view(-1, HV, DK, DV)

    def step_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.step_conv_buf[:, :, LAYER], self.step_state_buf[:, :, LAYER]

    def args(self) -> tuple:
        conv_states, states = self.slot_views()
        return (self.mixed, self.a, self.b, self.conv_w, conv_states, self.A_log, self.dt_bias, states, self.slots,
                *self.step_views())


def _case(seed: int, B=3, R=3, HK=2, HV=4, DK=16, DV=32, K=4, S=6, dtype=torch.float32, slot_conv_dtype=None,
          step_conv_dtype=None) -> Case:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=gen, device=DEV).to(dtype)

    conv_dim = 2 * HK * DK + HV * DV
    wide = randn(B * R, conv_dim + 2 * HV + 24)
    # Scattered slots, read through a strided index tensor.
    slots = torch.tensor([4, 1, 0, 3, 2, 5], device=DEV)[::2][:B]
    return Case(
        mixed=wide[:, 8:8 + conv_dim], a=wide[:, 8 + conv_dim:8 + conv_dim + HV], b=wide[:, 8 + conv_dim + HV:-16],
        conv_w=randn(conv_dim, K) * 0.5, A_log=torch.rand(HV, generator=gen, device=DEV).log(),
        dt_bias=torch.randn(HV, generator=gen, device=DEV),
        conv_image=randn(S, conv_dim, K + 2, dtype=slot_conv_dtype or dtype),
        state_image=torch.randn(S, HV * DK * DV + 40, generator=gen, device=DEV) * 0.1, slots=slots,
        step_conv_buf=torch.full((B, R, LAYERS, conv_dim, K - 1), float("nan"), device=DEV,
                                 dtype=step_conv_dtype or slot_conv_dtype or dtype),
        step_state_buf=torch.full((B, R, LAYERS, HV, DK, DV), float("nan"), device=DEV), dims=(HV, DK, DV, K))


def _successive_fused_steps(case: Case) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(o, conv and recurrent state of the slots after each token): R gdn_decode_fused steps on copies of the
    slot images."""
    conv_image, state_image = case.conv_image.clone(), case.state_image.clone()
    copy = attrs.evolve(case, conv_image=conv_image, state_image=state_image)
    conv_states, states = copy.slot_views()
    outs, convs, recurrent = [], [], []
    for t in range(case.R):
        outs.append(gdn.gdn_decode_fused(case.mixed[t::case.R], case.a[t::case.R], case.b[t::case.R],
                                         case.conv_w, conv_states, case.A_log, case.dt_bias, states, case.slots))
        convs.append(conv_states[case.slots].clone())
        recurrent.append(states[case.slots].clone())
    return torch.stack(outs, dim=1).flatten(0, 1), convs, recurrent


def _assert_slots_and_other_layers_untouched(case: Case, before: Case) -> None:
    assert torch.equal(case.conv_image, before.conv_image) and torch.equal(case.state_image, before.state_image)
    others = [layer for layer in range(LAYERS) if layer != LAYER]
    assert case.step_conv_buf[:, :, others].isnan().all() and case.step_state_buf[:, :, others].isnan().all()


def test_reference_keeps_each_of_r_fused_steps_and_leaves_the_slot_alone():
    case = _case(0)
    before = attrs.evolve(case, conv_image=case.conv_image.clone(), state_image=case.state_image.clone())
    o = gdn.gdn_verify_ref(*case.args())  # the reference itself (on CUDA the public op is the kernel)
    o_want, convs, recurrent = _successive_fused_steps(before)
    step_conv, step_states = case.step_views()
    assert torch.equal(o, o_want)
    for t in range(case.R):
        assert torch.equal(step_conv[:, t], convs[t]) and torch.equal(step_states[:, t], recurrent[t])
    assert not torch.equal(step_states[:, 0], step_states[:, 1])  # every step really moved the state
    _assert_slots_and_other_layers_untouched(case, before)


@pytest.mark.parametrize("layered", [False, True], ids=["one-layer", "all-layers"])
def test_commit_moves_each_rows_chosen_step_into_its_slot(layered):
    case = _case(1)
    gdn.gdn_verify(*case.args())
    for layer in range(LAYERS):  # fill every layer of the step buffers, as a whole verify pass does
        if layer != LAYER:
            case.step_conv_buf[:, :, layer] = case.step_conv_buf[:, :, LAYER] + layer
            case.step_state_buf[:, :, layer] = case.step_state_buf[:, :, LAYER] - layer
    S, B = case.conv_image.shape[0], case.slots.shape[0]
    # Slot pools with a layer axis after the slot axis; the one-layer form commits layer LAYER's views only.
    conv_pool = torch.randn(S, LAYERS, *case.step_conv_buf.shape[3:], device=DEV)
    state_pool = torch.randn(S, LAYERS, *case.step_state_buf.shape[3:], device=DEV)
    pool_before = conv_pool.clone(), state_pool.clone()
    steps = torch.tensor([2, 0, 1], device=DEV)
    if layered:
        gdn.gdn_verify_commit(conv_pool, state_pool, case.slots, case.step_conv_buf, case.step_state_buf, steps)
    else:
        gdn.gdn_verify_commit(conv_pool[:, LAYER], state_pool[:, LAYER], case.slots, *case.step_views(), steps)
    layers = list(range(LAYERS)) if layered else [LAYER]
    for i in range(B):
        slot, step = int(case.slots[i]), int(steps[i])
        for layer in layers:
            assert torch.equal(conv_pool[slot, layer], case.step_conv_buf[i, step, layer])
            assert torch.equal(state_pool[slot, layer], case.step_state_buf[i, step, layer])
    untouched = torch.ones(S, LAYERS, dtype=torch.bool, device=DEV)
    untouched[case.slots[:, None], torch.tensor(layers, device=DEV)] = False
    assert torch.equal(conv_pool[untouched], pool_before[0][untouched])
    assert torch.equal(state_pool[untouched], pool_before[1][untouched])


def test_shape_errors_name_the_shapes():
    case = _case(2)
    mixed, a, b, w, conv_states, A_log, dt_bias, states, slots, step_conv, step_states = case.args()
    with pytest.raises(ValueError, match=r"gdn_verify: mixed_qkv \(8, 192\)"):
        gdn.gdn_verify(mixed[1:], a[1:], b[1:], w, conv_states, A_log, dt_bias, states, slots, step_conv,
                       step_states)
    with pytest.raises(ValueError, match=r"gdn_verify: mixed_qkv \(9, 192\), a \(8, 4\)"):
        gdn.gdn_verify(mixed, a[1:], b, w, conv_states, A_log, dt_bias, states, slots, step_conv, step_states)
    with pytest.raises(ValueError, match=r"step_states \(3, 2, 4, 16, 32\)"):
        gdn.gdn_verify(mixed, a, b, w, conv_states, A_log, dt_bias, states, slots, step_conv, step_states[:, 1:])
    with pytest.raises(ValueError, match=r"slots \(2,\)"):
        gdn.gdn_verify(mixed, a, b, w, conv_states, A_log, dt_bias, states, slots[:2], step_conv, step_states)
    with pytest.raises(ValueError, match=r"conv_states \[S, conv_dim, K-1\]"):
        gdn.gdn_verify(mixed, a, b, w, conv_states[..., 1:], A_log, dt_bias, states, slots, step_conv[..., 1:],
                       step_states)


def _interpreted_kernel():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from ninfer.ops.triton import gdn_verify as t_verify

    return t_verify


def test_triton_wrapper_shape_errors_name_the_shapes():
    t_verify = _interpreted_kernel()
    case = _case(3)
    mixed, a, b, w, conv_states, A_log, dt_bias, states, slots, step_conv, step_states = case.args()
    with pytest.raises(ValueError, match=r"gdn_verify: .*R rows per slot.*a \(8, 4\)"):
        t_verify.gdn_verify(mixed, a[1:], b, w, conv_states, A_log, dt_bias, states, slots, step_conv, step_states)
    with pytest.raises(ValueError, match=r"gdn_verify: .*fp32.*torch.float64"):
        t_verify.gdn_verify(mixed, a, b, w, conv_states, A_log, dt_bias, states, slots, step_conv,
                            step_states.double())
    with pytest.raises(ValueError, match=r"gdn_verify: one step does not fit: .*A_log and dt_bias \[HV\]"):
        t_verify.gdn_verify(mixed, a, b, w, conv_states, A_log[1:], dt_bias, states, slots, step_conv, step_states)
    with pytest.raises(ValueError, match=r"gdn_verify: .*step_conv \[B, R, conv_dim, K-1\]"):
        t_verify.gdn_verify(mixed, a, b, w, conv_states, A_log, dt_bias, states, slots, step_conv[0], step_states)


def test_dispatcher_finds_the_kernels_in_their_own_module():
    t_verify = _interpreted_kernel()
    from ninfer.ops import dispatch

    assert dispatch._load("gdn", "gdn_verify") is t_verify.gdn_verify
    assert dispatch._load("gdn", "gdn_verify_commit") is t_verify.gdn_verify_commit


@pytest.mark.parametrize("dtype,tol,block_v,hk,R,step_conv_dtype", [
    (torch.float32, 1e-5, 16, 2, 3, None), (torch.float16, 2e-3, 32, 2, 2, None),
    (torch.float32, 1e-5, 32, 4, 4, None), (torch.float32, 1e-5, 16, 2, 2, torch.float16)],
    ids=["fp32", "fp16", "hk=hv", "fp16-step-conv"])
def test_triton_kernel_matches_the_reference(dtype, tol, block_v, hk, R, step_conv_dtype):
    """Every q/k channel's step conv state is written by one program, every v channel's by its own: the step
    buffers match exactly (they only move values, rounded through the step buffer's dtype) and the slot and the
    other layers stay as they were."""
    t_verify = _interpreted_kernel()
    case = _case(4, R=R, HK=hk, dtype=dtype, slot_conv_dtype=dtype, step_conv_dtype=step_conv_dtype)
    before = attrs.evolve(case, conv_image=case.conv_image.clone(), state_image=case.state_image.clone())
    ref = attrs.evolve(before, conv_image=case.conv_image.clone(), state_image=case.state_image.clone(),
                       step_conv_buf=case.step_conv_buf.clone(), step_state_buf=case.step_state_buf.clone())
    o_ref = gdn.gdn_verify_ref(*ref.args())
    out = torch.full_like(o_ref, float("nan"))
    o = t_verify.gdn_verify(*case.args(), out=out, block_v=block_v)
    assert o is out and o.dtype == dtype and not o.isnan().any()
    torch.testing.assert_close(o.float(), o_ref.float(), atol=tol, rtol=tol)
    # The fp32 states see the conv output rounded to the input dtype on both sides: no looser for fp16.
    torch.testing.assert_close(case.step_state_buf, ref.step_state_buf, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.equal(case.step_conv_buf.nan_to_num(7.0), ref.step_conv_buf.nan_to_num(7.0))
    _assert_slots_and_other_layers_untouched(case, before)


def test_triton_kernel_without_rows_launches_nothing():
    t_verify = _interpreted_kernel()
    case = _case(5, B=0)
    assert t_verify.gdn_verify(*case.args()).shape == (0, 4, 32)


@pytest.mark.parametrize("layered", [True, False], ids=["all-layers", "one-layer"])
def test_triton_commit_copies_rows_like_the_reference(layered):
    """The Triton commit (two row copies; a layout that is not row-contiguous takes the reference) moves exactly
    what the reference moves, into StateImage-like strided slot pools."""
    t_verify = _interpreted_kernel()
    g = torch.Generator(device=DEV).manual_seed(5)
    B, R, S, L = 3, 3, 6, 2
    image = torch.randn(S, 2 * L * 5 * 3 + 7, device=DEV, generator=g)  # slot stride past both fields
    conv_pool = image[:, :L * 5 * 3].view(S, L, 5, 3)
    state_pool = image[:, L * 5 * 3:2 * L * 5 * 3].view(S, L, 5, 3)
    step_conv = torch.randn(B, R, L, 5, 3, device=DEV, generator=g)
    step_states = torch.randn(B, R, L, 5, 3, device=DEV, generator=g)
    slots, steps = torch.tensor([4, 0, 2], device=DEV), torch.tensor([2, 0, 1], device=DEV)
    expected = image.clone()
    e_conv, e_state = expected[:, :L * 15].view(S, L, 5, 3), expected[:, L * 15:2 * L * 15].view(S, L, 5, 3)
    if layered:
        gdn.gdn_verify_commit_ref(e_conv, e_state, slots, step_conv, step_states, steps)
        t_verify.gdn_verify_commit(conv_pool, state_pool, slots, step_conv, step_states, steps)
    else:
        gdn.gdn_verify_commit_ref(e_conv[:, 1], e_state[:, 1], slots, step_conv[:, :, 1], step_states[:, :, 1], steps)
        t_verify.gdn_verify_commit(conv_pool[:, 1], state_pool[:, 1], slots, step_conv[:, :, 1],
                                   step_states[:, :, 1], steps)
    assert torch.equal(image, expected)
    assert t_verify._row_view(step_conv.transpose(3, 4), 2) is None and t_verify._row_view(conv_pool, 1) is not None
