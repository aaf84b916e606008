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

from ninfer.artifact.weights import WeightSet
from ninfer.ops import apply_rope
from ninfer.ops.vision import PackedSequences, vision_attention, vision_attention_ref
from ninfer_qwen35.config import Qwen35Config
from ninfer_qwen35.execution.parameters import check_weights
from ninfer_qwen35.execution.vision_positions import (
    FrameTableCache,
    Grid,
    axial_rope_cos_sin,
    interpolated_pos_embed,
)
from ninfer_qwen35.source_mapping import _VISION_DEFAULTS

LAYER_NORM_EPS = 1e-6  # every vision LayerNorm (blocks and merger), fixed in HF's modeling code
_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_act -> F.gelu(approximate=...)
TABLE_CACHE_BYTES = 256 << 20  # the CUDA path's per-frame-size tables (a 1024 x 1024 image's: about 10 MiB)


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

    def workspace_bytes(self, patches: int, element_size: int) -> int:
        """The encoder's transient device peak for one call over ``patches`` patch rows (an upper estimate):
        the fp32 pixel rows, one block's live activations in the compute dtype (residual, norm, fused qkv,
        attention output, projection, both MLP halves) and its fp32 rotary tables, per patch; then the output
        rows (patches / merge² of ``out_hidden_size``), which outlive the call until their chunk has run."""
        h, inter = self.hidden_size, self.intermediate_size
        per_patch = self.patch_values * 4 + (6 * h + 2 * inter) * element_size + 2 * self.head_dim * 4
        return patches * per_patch + self.output_bytes(patches, element_size)

    def output_bytes(self, patches: int, element_size: int) -> int:
        """The encoder's output rows for ``patches`` patch rows (one embedding per merged block)."""
        return patches // self.spatial_merge_size ** 2 * self.out_hidden_size * element_size


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



class Qwen35Vision:
    """The vision encoder over one batch of images and videos, packed patch rows in, merged tokens out.

    Two paths compute the same function. The torch reference (``reference``; ``forward`` on the CPU or with fp32
    weights) follows HF's modeling step by step, attention by torch's SDPA. The CUDA path (``forward`` when the
    weights are bf16 or fp16 on a CUDA device) differs only where it saves work: the resampled positions and the
    rotary tables are kept per frame size (``FrameTableCache``), the positions and the patch embedding's bias
    join the patch projection as one cuBLAS addmm, and every frame's attention is one ``vision_attention``
    launch over the packed frames (the Triton kernel once validated, else SDPA per distinct frame length). No
    CUDA graphs: the shapes change with every batch of grids, and from a few hundred patches on the matmuls,
    not the launches, set the time.
    """

    def __init__(self, params: VisionParams, *, fast: bool | None = None,
                 table_cache_bytes: int = TABLE_CACHE_BYTES) -> None:
        """``fast``: None takes the CUDA path when the weights allow it (``fast_path_applies``), False always runs
        the reference, True the CUDA path's steps on any device and dtype (the CPU tests check them in fp32)."""
        self.params = params
        self.config = params.config
        self.fast = fast_path_applies(params) if fast is None else fast
        c = self.config
        self.tables = FrameTableCache(pos_table=params.pos_embed, patch_bias=params.patch_embed.bias,
                                      side=c.grid_side, merge=c.spatial_merge_size, head_dim=c.head_dim,
                                      theta=c.rope_theta, max_bytes=table_cache_bytes) if self.fast else None

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """pixel_values [n_patches, patch_values] (every image/video's patches in order, each frame's in
        merge-block order, as the HF processor emits them); grid_thw: (t, h, w) per image/video in patches
        (t = temporal patches: a still image is 1). Returns [n_patches / merge ** 2, out_hidden_size]:
        the tokens of every image/video concatenated in order, in the weights' dtype."""
        return self._encode(pixel_values, self.check_inputs(pixel_values, grid_thw), fast=self.fast)

    __call__ = forward

    def reference(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """``forward`` through the torch reference, whatever the device and dtype."""
        return self._encode(pixel_values, self.check_inputs(pixel_values, grid_thw), fast=False)

    def _encode(self, pixel_values: torch.Tensor, grids: list[Grid], *, fast: bool) -> torch.Tensor:
        p, c = self.params, self.config
        pixels = pixel_values.to(device=p.pos_embed.device).to(p.dtype)
        if fast:
            tables = self.tables.batch(grids)
            x = torch.addmm(tables.pos_bias, pixels, p.patch_embed.weight.t())
            cos, sin, attend = tables.cos, tables.sin, vision_attention
        else:
            x = F.linear(pixels, p.patch_embed.weight, p.patch_embed.bias)
            x += interpolated_pos_embed(p.pos_embed, grids, c.grid_side, c.spatial_merge_size).to(x.dtype)
            cos, sin = axial_rope_cos_sin(grids, c.spatial_merge_size, c.head_dim, c.rope_theta, x.device)
            attend = vision_attention_ref
        frames = PackedSequences.of([h * w for t, h, w in grids for _ in range(t)], x.device)
        for block in p.blocks:
            x += self._attention(_layer_norm(x, block.norm1), block, cos, sin, frames, attend)
            hidden = F.gelu(F.linear(_layer_norm(x, block.norm2), block.fc1.weight, block.fc1.bias),
                            approximate=_ACTIVATIONS[c.hidden_act])
            x += F.linear(hidden, block.fc2.weight, block.fc2.bias)
        merged = _layer_norm(x, p.merger_norm).reshape(-1, c.hidden_size * c.spatial_merge_size ** 2)
        merged = F.gelu(F.linear(merged, p.merger_fc1.weight, p.merger_fc1.bias))  # exact GELU here, as HF
        return F.linear(merged, p.merger_fc2.weight, p.merger_fc2.bias)

    def _attention(self, x: torch.Tensor, block: VisionBlockParams, cos: torch.Tensor, sin: torch.Tensor,
                   frames: PackedSequences, attend) -> torch.Tensor:
        n, heads, d = x.shape[0], self.config.num_heads, self.config.head_dim
        qkv = F.linear(x, block.qkv.weight, block.qkv.bias).view(n, 3 * heads, d)
        qk = apply_rope(qkv[:, : 2 * heads], cos, sin, d)  # q and k heads together; the angles are per patch
        out = attend(qk[:, :heads], qk[:, heads:], qkv[:, 2 * heads:], frames)
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


def fast_path_applies(params: VisionParams) -> bool:
    """Whether ``params`` can take the CUDA path: bf16 or fp16 weights on a CUDA device."""
    return params.pos_embed.is_cuda and params.dtype in (torch.bfloat16, torch.float16)


def _layer_norm(x: torch.Tensor, norm: Affine) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), norm.weight, norm.bias, LAYER_NORM_EPS)
