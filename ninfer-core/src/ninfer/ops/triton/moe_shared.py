"""What the grouped MoE kernels (``moe``, ``moe_quant``) and the one-token kernel (``moe_one_token``) share: their
tile configurations (read from the tuning table ``tables/moe.json``), the device functions that compute an expert's
gate_up tile and down products, the slot sum, and the shared expert's addressing as expert E of a bank."""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from ninfer.ops.launch import pdl_args
from ninfer.ops.triton import tuning
from ninfer.ops.triton._pdl_jit import pdl_prologue

FP32_BLOCK_K, FP32_STAGES = 32, 2  # fp32 tiles take twice the shared memory: a shorter K step, fewer stages


@attrs.frozen
class MoeConfig:
    """Tile sizes of both grouped GEMMs. ``block_n`` counts output columns of a program: for the gate_up GEMM
    it is split between the gate and the up half, so a program reads as many weight rows in both."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@attrs.frozen
class OneTokenTiles:
    """``up_n`` gate (and as many up) columns and ``up_k`` per K step of a gate_up program; ``down_n`` output
    columns and ``down_k`` per K step of a down program; ``shared_first``: the shared expert's gate_up programs start
    on their weights without routing the token."""

    up_n: int = 32
    up_k: int = 128
    down_n: int = 64
    down_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    shared_first: bool = True


def default_config(tokens: int, dtype: torch.dtype, device: tuning.DeviceKey = tuning.CPU) -> MoeConfig:
    """The grouped GEMMs' tiles for a call over ``tokens`` tokens on ``device``: the first ``by_tokens`` row of
    its table whose limit ``tokens`` does not pass, else ``largest``. fp32 tiles take twice the shared memory,
    so they use a shorter K step and at most two pipeline stages."""
    c = tuning.choices("moe", device)
    tiles = next((row["tiles"] for row in c["by_tokens"] if tokens <= row["tokens"]), c["largest"])
    cfg = MoeConfig(*tiles)
    if dtype == torch.float32:
        cfg = attrs.evolve(cfg, block_k=min(cfg.block_k, FP32_BLOCK_K), num_stages=min(cfg.num_stages, FP32_STAGES))
    return cfg


def one_token_tiles(device: tuning.DeviceKey = tuning.CPU) -> OneTokenTiles:
    """The one-token kernel's tiles on ``device`` (its table's ``one_token``)."""
    return OneTokenTiles(**tuning.choices("moe", device)["one_token"])


@triton.jit
def expert_base(expert, s_we, bank_experts, shared_off, SHARED: tl.constexpr):
    """Where ``expert``'s matrices start, in elements from the bank's base; with SHARED, expert ``bank_experts``
    is the shared expert, ``shared_off`` elements away (its weights keep the bank's row and column strides)."""
    expert = expert.to(tl.int64)
    if SHARED:
        return tl.where(expert == bank_experts, shared_off, expert * s_we)
    return expert * s_we



@triton.jit
def gate_up_tile(x_ptr, w_ptr, token, valid, pid_n, INTER, H, s_xm, s_xk, s_wn, s_wk, dtype: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """silu(x Wg^T) * (x Wu^T) of the rows ``token`` (where ``valid``) for intermediate column block ``pid_n`` of the
    expert whose gate rows start at ``w_ptr`` (its up rows INTER rows on), rounded as the unfused ops round."""
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = nn < INTER
    kk = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + token[:, None] * s_xm + kk[None, :] * s_xk
    gate_tile = w_ptr + nn.to(tl.int64)[:, None] * s_wn + kk[None, :] * s_wk
    up_tile = gate_tile + INTER * s_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        mask_k = kk < H - k0
        a = tl.load(x_tile, mask=valid[:, None] & mask_k[None, :], other=0.0)
        g = tl.load(gate_tile, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        u = tl.load(up_tile, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc_gate = tl.dot(a, tl.trans(g), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, tl.trans(u), acc_up, input_precision=PRECISION)
        x_tile += BLOCK_K * s_xk
        gate_tile += BLOCK_K * s_wk
        up_tile += BLOCK_K * s_wk
    # Round as the unfused ops do: both projections, silu(gate), the product.
    gate = acc_gate.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return (act * acc_up.to(dtype).to(tl.float32)).to(dtype)



@triton.jit
def down_acc(h_rows, w_rows, valid, pid_n, H, INTER, s_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, H_L2: tl.constexpr = False):
    """The fp32 products of the hidden rows at ``h_rows`` [BLOCK_M, 1] (where ``valid``) with the down rows at
    ``w_rows`` [BLOCK_N, 1] (output column block ``pid_n``) over the INTER intermediate columns; ``H_L2``: the hidden
    loads bypass L1 (".cg")."""
    mask_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N) < H
    kk = tl.arange(0, BLOCK_K)
    h_tile = h_rows + kk[None, :]
    w_tile = w_rows + kk[None, :] * s_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        mask_k = kk < INTER - k0
        if H_L2:
            a = tl.load(h_tile, mask=valid[:, None] & mask_k[None, :], other=0.0, cache_modifier=".cg")
        else:
            a = tl.load(h_tile, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_tile, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        h_tile += BLOCK_K
        w_tile += BLOCK_K * s_wk
    return acc


@triton.jit
def store_weighted(y_rows, acc, route, valid, pid_n, H, BLOCK_N: tl.constexpr):
    """The expert's output rounded as the unfused projection does, then scaled by the pair's routing weight,
    stored at ``y_rows`` [BLOCK_M, 1] (where ``valid``), output column block ``pid_n``."""
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = y_rows.dtype.element_ty
    y = (acc.to(dtype).to(tl.float32) * route[:, None]).to(dtype)
    tl.store(y_rows + nn[None, :], y, mask=valid[:, None] & (nn < H)[None, :])



@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, shared_ptr, gate_ptr, H, s_om, s_sm, s_gm, TOP_K: tl.constexpr,
                      BLOCK: tl.constexpr, HAS_SHARED: tl.constexpr, USE_PDL: tl.constexpr = False):
    token = tl.program_id(0).to(tl.int64)
    cc = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cc < H
    pdl_prologue(USE_PDL)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + slot) * H + cc, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype)
    if HAS_SHARED:  # + sigmoid(gate) * shared, rounded where the unfused ops round
        g = tl.load(gate_ptr + token * s_gm).to(tl.float32)
        scale = tl.sigmoid(g).to(dtype).to(tl.float32)
        s = tl.load(shared_ptr + token * s_sm + cc, mask=mask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + (scale * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + token * s_om + cc, out, mask=mask)


def sum_slots(per_pair: torch.Tensor, out: torch.Tensor, slots: int, shared: torch.Tensor | None,
              shared_gate: torch.Tensor | None) -> None:
    """out[t] = the sum of the ``slots`` rows of token t in ``per_pair`` [N * slots, H], in fp32 and in slot order
    (the same on every run, whichever tokens share the batch); with ``shared`` [N, H] / ``shared_gate`` [N, 1], plus
    sigmoid(gate) * shared."""
    N, H = out.shape
    block = min(1024, triton.next_power_of_2(H))
    has_shared = shared is not None
    if has_shared and shared.stride(1) != 1:
        shared = shared.contiguous()
    _sum_slots_kernel[(N, triton.cdiv(H, block))](
        per_pair, out, shared if has_shared else out, shared_gate if has_shared else out, H, out.stride(0),
        shared.stride(0) if has_shared else 0, shared_gate.stride(0) if has_shared else 0, TOP_K=slots,
        BLOCK=block, HAS_SHARED=has_shared, num_warps=4, **pdl_args(out.device))


def precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # only fp32 operands are affected


def tile(width: int, dim: int) -> int:
    return max(16, min(width, triton.next_power_of_2(dim)))


def as_expert(bank: torch.Tensor, shared: torch.Tensor) -> bool:
    """Whether ``shared`` is laid out as one expert of ``bank`` [E, ...]: its shape, strides and dtype."""
    return shared.shape == bank.shape[1:] and shared.stride() == bank.stride()[1:] and shared.dtype == bank.dtype


def shared_args(bank: torch.Tensor, shared: torch.Tensor | None) -> dict:
    """The kernels' arguments that make expert E (one past ``bank`` [E, ...]) the ``shared`` matrix."""
    if shared is None:
        return {"bank_experts": bank.shape[0], "shared_off": 0, "SHARED": False}
    offset, rem = divmod(shared.data_ptr() - bank.data_ptr(), bank.element_size())
    if rem or not as_expert(bank, shared):
        raise ValueError(f"moe: the shared expert {tuple(shared.shape)} {shared.dtype} must be laid out as one "
                         f"expert of the bank {tuple(bank.shape)} {bank.dtype}")
    return {"bank_experts": bank.shape[0], "shared_off": offset, "SHARED": True}
