"""Quantized linear weights as the ops take them, and their pure-torch references.

A ``QuantizedWeight`` is the resident form of a weight ``[N, K]`` in one of the artifact's block-scaled formats
(``ninfer.contract.quant``): its planes are the artifact's original bytes (the loader uploads them as stored) and
``dequantize`` is the format's definition. ``activation`` is the executable path Startup chose for its input:
``a16`` (weight-only: the weight is dequantized next to the math, the input stays bf16 / fp32) or ``a8`` (W8A8:
the input is quantized to FP8 per token and 128-wide group, as Qwen's ``activation_scheme: dynamic`` says).

The references here define the numbers; ``ninfer.ops.linear`` dispatches a quantized weight to them or to its
Triton kernels. ``quantize_fp8_block`` / ``quantize_nvfp4`` make the formats from a float weight (``ninfer convert
--quantize``, tests).
"""

from __future__ import annotations

import math

import attrs
import torch

from ninfer.contract.quant import (
    A8,
    A16,
    E2M1_MAX,
    FP8_BLOCK,
    FP8_MAX,
    NVFP4,
    NVFP4_GROUP,
    QUANTIZED_FORMATS,
    blocks_fit,
)

# e2m1 codes 0..15 -> value (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# magnitudes at which rounding moves to the next code (round half to even, as the e2m1 casts do)
_E2M1_STEPS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@attrs.frozen(kw_only=True, eq=False)
class QuantizedWeight:
    """A weight ``[N, K]`` in ``format`` (planes ``data``, ``scale``, ``global_scale``; see the module doc)."""

    format: str = attrs.field(validator=attrs.validators.in_(QUANTIZED_FORMATS))
    data: torch.Tensor = attrs.field(repr=False)
    scale: torch.Tensor = attrs.field(repr=False)
    global_scale: torch.Tensor | None = attrs.field(default=None, repr=False)
    block: tuple[int, int] = attrs.field(converter=tuple)
    activation: str = attrs.field(default=A16, validator=attrs.validators.in_((A16, A8)))

    def __attrs_post_init__(self) -> None:
        *lead, n, k = self.shape
        lead = tuple(lead)
        if self.format == FP8_BLOCK:
            want = (*lead, math.ceil(n / self.block[0]), math.ceil(k / self.block[1]))
            ok = self.data.dtype == torch.float8_e4m3fn and self.scale.dtype == torch.float32 and \
                tuple(self.scale.shape) == want and self.global_scale is None
            expected = f"data float8_e4m3fn [.., N, K], scale float32 {list(want)}"
        else:
            ok = self.data.dtype == torch.uint8 and self.scale.dtype == torch.float8_e4m3fn and \
                self.block == (1, NVFP4_GROUP) and tuple(self.scale.shape) == (*lead, n, k // NVFP4_GROUP) and \
                k % NVFP4_GROUP == 0 and self.global_scale is not None and \
                self.global_scale.dtype == torch.float32 and tuple(self.global_scale.shape) == (*lead, n)
            expected = ("data uint8 [.., N, K/2], scale float8_e4m3fn [.., N, K/16], global_scale float32 [.., N], "
                        "block (1, 16)")
        if not ok or self.data.dim() not in (2, 3):
            raise ValueError(f"{self.format} weight {self.shape}: planes {self.describe_planes()} do not match "
                             f"{expected}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape: ``[N, K]``, or ``[E, N, K]`` for a bank of experts."""
        *lead, n, k = self.data.shape
        return (*lead, n, k * 2 if self.format == NVFP4 else k)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.planes())

    def planes(self) -> tuple[torch.Tensor, ...]:
        return (self.data, self.scale) if self.global_scale is None else (self.data, self.scale, self.global_scale)

    def describe_planes(self) -> str:
        return ", ".join(f"{t.dtype} {list(t.shape)}" for t in self.planes())

    def dim(self) -> int:
        return self.data.dim()

    def expert(self, e: int) -> QuantizedWeight:
        """Expert ``e`` of a bank ``[E, N, K]``: a 2-D view."""
        return attrs.evolve(self, data=self.data[e], scale=self.scale[e],
                            global_scale=None if self.global_scale is None else self.global_scale[e])

    def rows(self, lo: int, hi: int) -> QuantizedWeight:
        """Rows ``lo:hi`` (a logical part of a fused parent): views of the planes, no copy. FP8 blocks must not
        straddle the cut."""
        if self.dim() != 2:
            raise ValueError(f"rows of a {self.dim()}-D weight: take an expert first")
        n = self.shape[0]
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"rows {lo}:{hi} outside a weight of {n} rows")
        if self.format == NVFP4:
            return attrs.evolve(self, data=self.data[lo:hi], scale=self.scale[lo:hi],
                                global_scale=self.global_scale[lo:hi])
        b0 = self.block[0]
        if lo % b0 or (hi % b0 and hi != n):
            raise ValueError(f"rows {lo}:{hi} of an FP8 weight with {b0}-row scale blocks cut through a block")
        return attrs.evolve(self, data=self.data[lo:hi], scale=self.scale[lo // b0:math.ceil(hi / b0)])

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return attrs.evolve(self, data=self.data.to(device), scale=self.scale.to(device),
                            global_scale=None if self.global_scale is None else self.global_scale.to(device))

    def with_activation(self, activation: str) -> QuantizedWeight:
        return self if activation == self.activation else attrs.evolve(self, activation=activation)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight (``[N, K]`` or ``[E, N, K]``) the format defines (computed in fp32, then cast)."""
        *_, n, k = self.shape
        if self.format == FP8_BLOCK:
            b0, b1 = self.block
            s = self.scale.repeat_interleave(b0, -2)[..., :n, :].repeat_interleave(b1, -1)[..., :k]
            return (self.data.float() * s).to(dtype)
        s = self.scale.float().repeat_interleave(NVFP4_GROUP, -1) * self.global_scale[..., None]
        return (unpack_e2m1(self.data) * s).to(dtype)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Parts of one format and block stacked by rows (a fused call over separately stored weights)."""
        first = parts[0]
        if any(p.format != first.format or p.block != first.block or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("cannot stack quantized weights of different formats, blocks or input widths: "
                             f"{[(p.format, p.block, p.shape) for p in parts]}")
        if first.format == FP8_BLOCK and not blocks_fit([p.shape[0] for p in parts], first.block[0]):
            raise ValueError(f"cannot stack FP8 weights of {[p.shape[0] for p in parts]} rows: each but the last "
                             f"must fill its {first.block[0]}-row scale blocks")
        g = None if first.global_scale is None else torch.cat([p.global_scale for p in parts])
        return attrs.evolve(first, data=torch.cat([p.data for p in parts]), scale=torch.cat([p.scale for p in parts]),
                            global_scale=g)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` (two e2m1 codes per byte, the even element low) -> float32 ``[..., K]``."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).long()
    return lut[codes].flatten(-2)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """float ``[..., K]`` (K even) -> uint8 ``[..., K/2]``: each value rounded to the nearest e2m1 code, ties to
    even, beyond 6 saturated."""
    mag = values.abs().float()
    steps = torch.tensor(_E2M1_STEPS, device=values.device)
    code = torch.bucketize(mag, steps)  # index of the first step >= mag: ties go down here...
    tie = (code < 7) & (mag == steps[code.clamp(max=6)]) & (code % 2 == 1)
    code = code + tie.long()  # ...and up where the upper code is the even one
    code = code | ((values < 0) & (code > 0)).long() << 3
    code = code.to(torch.uint8)
    return code[..., 0::2] | code[..., 1::2] << 4


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> QuantizedWeight:
    """Block-scaled FP8 as Qwen's fine-grained FP8: scale = amax / 448 per block (1 for an all-zero block)."""
    n, k = weight.shape
    b0, b1 = block
    w = weight.float()
    pad = torch.zeros(math.ceil(n / b0) * b0, math.ceil(k / b1) * b1, device=w.device)
    pad[:n, :k] = w.abs()
    amax = pad.view(pad.shape[0] // b0, b0, pad.shape[1] // b1, b1).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))  # correctly rounded
    s = scale.repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :k]
    data = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(format=FP8_BLOCK, data=data, scale=scale.contiguous(), block=block)


def quantize_nvfp4(weight: torch.Tensor, shards: tuple[int, ...] | None = None) -> QuantizedWeight:
    """NVFP4 with one global scale per shard (``shards``: row counts, default the whole weight): global = amax /
    (448 * 6), block scale = block amax / (6 * global) in e4m3, data = the e2m1 code nearest w / (scale * global)."""
    n, k = weight.shape
    if k % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs an input width that is a multiple of {NVFP4_GROUP}, got {k}")
    w = weight.float()
    shards = shards or (n,)
    g = torch.cat([torch.full((rows,), float(part.abs().amax()), device=w.device)
                   for rows, part in zip(shards, w.split(list(shards)), strict=True)])
    g = torch.where(g > 0, g / (FP8_MAX * E2M1_MAX), torch.ones_like(g))
    blocks = w.view(n, k // NVFP4_GROUP, NVFP4_GROUP)
    scale = (blocks.abs().amax(-1) / (E2M1_MAX * g[:, None])).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    denom = scale.float() * g[:, None]
    q = torch.where(denom[..., None] > 0, blocks / denom[..., None], torch.zeros_like(blocks))
    return QuantizedWeight(format=NVFP4, data=pack_e2m1(q.view(n, k)), scale=scale, global_scale=g,
                           block=(1, NVFP4_GROUP))


def quantize_activation_fp8(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token, per-``group`` FP8 quantization of ``x [M, K]``: (float8 ``[M, K]``, float32 scales
    ``[M, ceil(K / group)]``), scale = amax / 448 (a tiny floor keeps an all-zero group finite)."""
    m, k = x.shape
    xf = x.float()
    pad = torch.zeros(m, math.ceil(k / group) * group, device=x.device)
    pad[:, :k] = xf
    amax = pad.view(m, -1, group).abs().amax(-1)
    # a tensor divisor: CUDA torch divides by a Python scalar as a multiplication by its reciprocal (not correctly
    # rounded), which would make the definition depend on the device
    scale = amax.clamp(min=1e-10) / torch.full_like(amax, FP8_MAX)
    q = (xf / scale.repeat_interleave(group, 1)[:, :k]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def linear_quant_ref(x: torch.Tensor, weight: QuantizedWeight, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T`` for a quantized ``W``: weight-only (``a16``) multiplies x by the dequantized weight;
    ``a8`` first quantizes x per token and 128-group to FP8 (what a W8A8 GEMM computes, in fp32)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if weight.activation == A8:
        q, s = quantize_activation_fp8(x2)
        xs = q.float() * s.repeat_interleave(128, 1)[:, :x2.shape[1]]
        y = xs @ weight.dequantize(torch.float32).T
    else:
        y = torch.nn.functional.linear(x2, weight.dequantize(x.dtype))
    return y.to(out_dtype or x.dtype).reshape(*lead, weight.shape[0])
