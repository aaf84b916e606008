"""Qwen35Vision: the Qwen3.5 vision encoder (``visual.*``), pixel patches -> LM-hidden image/video tokens.

A torch reference of HF ``Qwen3_5VisionModel`` (``shared/reference/qwen35_arch.md`` sections 1.3, 5.2):

    x = patch_embed(pixels) + pos_embed(bilinear, align_corners)       [patches in 2x2-merge-block order]
    27 x:  x += attn(LN1 x) (fused qkv, 2-D axial RoPE in fp32, non-causal per frame);  x += mlp(LN2 x)
    tokens = fc2(gelu(fc1(group4(LN x))))                               [one token per 2x2 block]

The processor emits each frame's patches in merge-block order (the 4 patches of a 2x2 block are consecutive),
so positions, the interpolated position embeddings and the merger's grouping all follow that order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from ninfer.models.common.weights import WeightSet
from ninfer.ops import apply_rope
from ninfer_qwen35.config import Qwen35Config
from ninfer_qwen35.execution.parameters import check_weights
from ninfer_qwen35.source_mapping import _VISION_DEFAULTS

LAYER_NORM_EPS = 1e-6  # every vision LayerNorm (blocks and merger), fixed in HF's modeling code
_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_act -> F.gelu(approximate=...)


@attrs.frozen(kw_only=True)
class VisionConfig:
    """The vision tower's instance parameters (HF ``Qwen3_5VisionConfig`` names and defaults)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    out_hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10_000.0

    def __attrs_post_init__(self) -> None:
        sizes = {k: getattr(self, k) for k in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                                               "patch_size", "temporal_patch_size", "spatial_merge_size",
                                               "num_position_embeddings", "out_hidden_size")}
        bad = [f"{k}={n!r}" for k, n in sizes.items() if not isinstance(n, int) or n <= 0]
        if bad:
            raise ValueError(f"vision config needs positive integers: {', '.join(bad)}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size {self.hidden_size} / num_heads {self.num_heads} must give a head "
                             "dim that is a multiple of 4 (2-D axial RoPE: half the head for rows, half for columns)")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings {self.num_position_embeddings} is not a square grid")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported (want one of "
                             f"{sorted(_ACTIVATIONS)})")
        if self.rope_theta <= 0:
            raise ValueError(f"vision rope_theta must be positive, got {self.rope_theta}")

    @classmethod
    def from_config(cls, config: Qwen35Config) -> VisionConfig:
        """From ``config.vision`` (the config.json ``vision_config``); keys it leaves out take HF's defaults, and
        ``out_hidden_size`` defaults to the LM hidden size (as the source mapping assumes)."""
        if not config.vision:
            raise ValueError("this Qwen3.5 config has no vision_config (a text-only checkpoint)")
        raw: dict[str, Any] = {**_VISION_DEFAULTS, "num_heads": 16, "hidden_act": "gelu_pytorch_tanh",
                               "out_hidden_size": config.hidden_size, **config.vision}
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type {rope['rope_type']!r} is not supported (Qwen3.5 uses 'axial')")
        return cls(**{f.name: raw[f.name] for f in attrs.fields(cls) if f.name in raw},
                   rope_theta=float(rope.get("rope_theta", 10_000.0)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Values in one pixel_values row: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)


@attrs.frozen(kw_only=True, eq=False)
class Affine:
    """y = x @ weight.T + bias (a linear layer or a LayerNorm's scale and shift)."""

    weight: torch.Tensor
    bias: torch.Tensor


@attrs.frozen(kw_only=True, eq=False)
class VisionBlockParams:
    norm1: Affine
    qkv: Affine               # rows [q | k | v], each num_heads x head_dim
    proj: Affine
    norm2: Affine
    fc1: Affine
    fc2: Affine


@attrs.frozen(kw_only=True, eq=False)
class VisionParams:
    """The vision tower's weights in one dtype on one device (the ``vision`` feature of an artifact)."""

    config: VisionConfig
    dtype: torch.dtype
    patch_embed: Affine       # the Conv3d as a linear over pixel rows: weight [hidden, patch_values]
    pos_embed: torch.Tensor   # [grid_side ** 2, hidden], row-major over the learned square grid
    blocks: tuple[VisionBlockParams, ...]
    merger_norm: Affine
    merger_fc1: Affine
    merger_fc2: Affine

    @classmethod
    def from_weights(cls, config: Qwen35Config, weights: WeightSet, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> VisionParams:
        vc = VisionConfig.from_config(config)
        check_weights(config, weights, ("vision",))
        first = weights["visual.patch_embed.proj.weight"]
        dtype = dtype if dtype is not None else first.dtype
        device = torch.device(device) if device is not None else first.device

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        def affine(prefix: str) -> Affine:
            return Affine(weight=w(prefix + ".weight"), bias=w(prefix + ".bias"))

        blocks = tuple(
            VisionBlockParams(norm1=affine(f"{b}norm1"), qkv=affine(f"{b}attn.qkv"), proj=affine(f"{b}attn.proj"),
                              norm2=affine(f"{b}norm2"), fc1=affine(f"{b}mlp.linear_fc1"),
                              fc2=affine(f"{b}mlp.linear_fc2"))
            for b in (f"visual.blocks.{j}." for j in range(vc.depth)))
        patch = affine("visual.patch_embed.proj")
        return cls(config=vc, dtype=dtype,
                   patch_embed=Affine(weight=patch.weight.reshape(vc.hidden_size, vc.patch_values), bias=patch.bias),
                   pos_embed=w("visual.pos_embed.weight"), blocks=blocks, merger_norm=affine("visual.merger.norm"),
                   merger_fc1=affine("visual.merger.linear_fc1"), merger_fc2=affine("visual.merger.linear_fc2"))



Grid = tuple[int, int, int]


class Qwen35Vision:
    """The vision encoder over one batch of images and videos, packed patch rows in, merged tokens out."""

    def __init__(self, params: VisionParams) -> None:
        self.params = params
        self.config = params.config

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """pixel_values [n_patches, patch_values] (every image/video's patches in order, each frame's in
        merge-block order, as the HF processor emits them); grid_thw: (t, h, w) per image/video in patches
        (t = temporal patches: a still image is 1). Returns [n_patches / merge ** 2, out_hidden_size]:
        the tokens of every image/video concatenated in order."""
        grids = self.check_inputs(pixel_values, grid_thw)
        p, c = self.params, self.config
        x = F.linear(pixel_values.to(device=p.pos_embed.device, dtype=p.dtype), p.patch_embed.weight,
                     p.patch_embed.bias)
        x = x + interpolated_pos_embed(p.pos_embed, grids, c.grid_side, c.spatial_merge_size).to(x.dtype)
        cos, sin = axial_rope_cos_sin(grids, c.spatial_merge_size, c.head_dim, c.rope_theta, x.device)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for block in p.blocks:
            x = x + self._attention(_layer_norm(x, block.norm1), block, cos, sin, frames)
            hidden = F.gelu(F.linear(_layer_norm(x, block.norm2), block.fc1.weight, block.fc1.bias),
                            approximate=_ACTIVATIONS[c.hidden_act])
            x = x + F.linear(hidden, block.fc2.weight, block.fc2.bias)
        merged = _layer_norm(x, p.merger_norm).reshape(-1, c.hidden_size * c.spatial_merge_size ** 2)
        merged = F.gelu(F.linear(merged, p.merger_fc1.weight, p.merger_fc1.bias))  # exact GELU here, as HF
        return F.linear(merged, p.merger_fc2.weight, p.merger_fc2.bias)

    __call__ = forward

    def _attention(self, x: torch.Tensor, block: VisionBlockParams, cos: torch.Tensor, sin: torch.Tensor,
                   frames: list[int]) -> torch.Tensor:
        n, heads, d = x.shape[0], self.config.num_heads, self.config.head_dim
        qkv = F.linear(x, block.qkv.weight, block.qkv.bias).view(n, 3 * heads, d)
        qk = apply_rope(qkv[:, : 2 * heads], cos, sin, d)  # q and k heads together; the angles are per patch
        out = frame_attention(qk[:, :heads], qk[:, heads:], qkv[:, 2 * heads:], frames)
        return F.linear(out.reshape(n, heads * d), block.proj.weight, block.proj.bias)

    def check_inputs(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]] | torch.Tensor) -> list[Grid]:
        """The grids as int triples; ValueError naming the problem when the inputs do not fit the config."""
        c = self.config
        rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(g) for g in grid_thw]
        if not rows:
            raise ValueError("grid_thw is empty: give one (t, h, w) per image or video")
        grids: list[Grid] = []
        for i, g in enumerate(rows):
            if len(g) != 3 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in g):
                raise ValueError(f"grid_thw[{i}] = {g!r}: want three positive integers (t, h, w)")
            t, h, w = g
            if h % c.spatial_merge_size or w % c.spatial_merge_size:
                raise ValueError(f"grid_thw[{i}] = {tuple(g)}: h and w must be multiples of the spatial merge size "
                                 f"{c.spatial_merge_size}")
            grids.append((t, h, w))
        if pixel_values.dim() != 2 or pixel_values.shape[1] != c.patch_values:
            raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}: want [n_patches, {c.patch_values}] "
                             f"({c.in_channels} channels x {c.temporal_patch_size} frames x {c.patch_size}^2 pixels)")
        total = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != total:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patch rows but grid_thw "
                             f"{[tuple(g) for g in grids]} needs {total}")
        if not pixel_values.is_floating_point():
            raise ValueError(f"pixel_values must be floating point, got {pixel_values.dtype}")
        return grids


def _layer_norm(x: torch.Tensor, norm: Affine) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), norm.weight, norm.bias, LAYER_NORM_EPS)


def merge_block_rows_cols(h: int, w: int, merge: int, device: torch.device | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of one h x w frame, listed in merge-block order: blocks in raster order, and
    within a block its merge x merge patches in raster order."""
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)

    def blocked(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()

    return blocked(rows), blocked(cols)


def interpolated_pos_embed(table: torch.Tensor, grids: Sequence[Grid], side: int, merge: int) -> torch.Tensor:
    """[n_patches, hidden] fp32: the learned side x side position grid resampled bilinearly (align_corners=True)
    to each frame's h x w patch grid, in merge-block order, repeated for every frame."""
    pe, out = table.float(), []
    for t, h, w in grids:
        rows, cols = merge_block_rows_cols(h, w, merge, table.device)
        (r0, r1), wr = _bilinear_taps(rows, h, side)
        (c0, c1), wc = _bilinear_taps(cols, w, side)
        frame = ((1 - wr) * (1 - wc))[:, None] * pe[r0 * side + c0] + ((1 - wr) * wc)[:, None] * pe[r0 * side + c1] \
            + (wr * (1 - wc))[:, None] * pe[r1 * side + c0] + (wr * wc)[:, None] * pe[r1 * side + c1]
        out.append(frame.repeat(t, 1))
    return torch.cat(out)


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The two source taps of each target index on one axis and the far tap's weight (align_corners=True:
    target 0 and size-1 land exactly on source 0 and side-1)."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    lo = src.floor()
    return (lo.long(), (lo.long() + 1).clamp(max=side - 1)), src - lo


def axial_rope_cos_sin(grids: Sequence[Grid], merge: int, head_dim: int, theta: float,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin [n_patches, head_dim / 2] of the 2-D axial RoPE: the angles are [row * f, col * f] with
    f = theta ** (-2i / (head_dim / 2)) (head_dim / 4 rates), applied with rotate_half over the whole head."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=device) / (head_dim // 2))
    angles = []
    for t, h, w in grids:
        rows, cols = merge_block_rows_cols(h, w, merge, device)
        frame = torch.cat([rows.float()[:, None] * inv_freq, cols.float()[:, None] * inv_freq], dim=-1)
        angles.append(frame.repeat(t, 1))
    a = torch.cat(angles)
    return a.cos(), a.sin()


def frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Non-causal attention within each frame's span of patches (q, k, v [N, heads, head_dim], spans of
    ``lengths`` back to back); [N, heads, head_dim]. Per-span SDPA is the reference; on the GPU a variable-length
    flash kernel over cu_seqlens = cumsum(lengths) would serve all spans in one launch."""
    out = []
    start = 0
    for n in lengths:
        span = [x[start:start + n].transpose(0, 1) for x in (q, k, v)]  # [heads, n, d]
        out.append(F.scaled_dot_product_attention(*span).transpose(0, 1))
        start += n
    return torch.cat(out)
