"""Where each patch of a frame sits, for the Qwen3.5 vision encoder: the learned position grid resampled to the
frame, the 2-D axial rotary angles, and (for the CUDA path) both kept per frame size.

Patches are listed in merge-block order (the 4 patches of a 2x2 block consecutive), as the processor emits them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs
import torch

Grid = tuple[int, int, int]


def merge_block_rows_cols(h: int, w: int, merge: int, device: torch.device | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of one h x w frame, listed in merge-block order: blocks in raster order, and
    within a block its merge x merge patches in raster order."""
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)

    def blocked(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()

    return blocked(rows), blocked(cols)


def frame_pos_embed(table: torch.Tensor, h: int, w: int, side: int, merge: int) -> torch.Tensor:
    """[h * w, hidden] fp32: the learned side x side position grid resampled bilinearly (align_corners=True) to
    one h x w frame, in merge-block order."""
    pe = table.float()
    rows, cols = merge_block_rows_cols(h, w, merge, table.device)
    (r0, r1), wr = _bilinear_taps(rows, h, side)
    (c0, c1), wc = _bilinear_taps(cols, w, side)
    return ((1 - wr) * (1 - wc))[:, None] * pe[r0 * side + c0] + ((1 - wr) * wc)[:, None] * pe[r0 * side + c1] \
        + (wr * (1 - wc))[:, None] * pe[r1 * side + c0] + (wr * wc)[:, None] * pe[r1 * side + c1]


def interpolated_pos_embed(table: torch.Tensor, grids: Sequence[Grid], side: int, merge: int) -> torch.Tensor:
    """[n_patches, hidden] fp32: ``frame_pos_embed`` of every frame, repeated for each of a video's frames."""
    return torch.cat([frame_pos_embed(table, h, w, side, merge).repeat(t, 1) for t, h, w in grids])


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The two source taps of each target index on one axis and the far tap's weight (align_corners=True:
    target 0 and size-1 land exactly on source 0 and side-1)."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    lo = src.floor()
    return (lo.long(), (lo.long() + 1).clamp(max=side - 1)), src - lo


def frame_rope_angles(h: int, w: int, merge: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """fp32 [h * w, head_dim / 2]: the angles [row * f, col * f] of one frame's patches, f = theta ** (-2i /
    (head_dim / 2)) (head_dim / 4 rates)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=device) / (head_dim // 2))
    rows, cols = merge_block_rows_cols(h, w, merge, device)
    return torch.cat([rows.float()[:, None] * inv_freq, cols.float()[:, None] * inv_freq], dim=-1)


def axial_rope_cos_sin(grids: Sequence[Grid], merge: int, head_dim: int, theta: float,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin [n_patches, head_dim / 2] of the 2-D axial RoPE, applied with rotate_half over the whole
    head (the angles of ``frame_rope_angles`` for every frame)."""
    a = torch.cat([frame_rope_angles(h, w, merge, head_dim, theta, device).repeat(t, 1) for t, h, w in grids])
    return a.cos(), a.sin()


@attrs.frozen(kw_only=True, eq=False)
class FrameTables:
    """What one frame size needs before the first block: ``pos_bias`` [h * w, hidden] (the resampled positions
    plus the patch embedding's bias, summed in fp32 and rounded once to the weights' dtype) and the rotary cos,
    sin [h * w, head_dim / 2] fp32."""

    pos_bias: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pos_bias, self.cos, self.sin))


class FrameTableCache:
    """FrameTables by frame size (h, w), least recently used dropped past ``max_bytes``: images of one size
    (and every frame of a video) share one computation."""

    def __init__(self, *, pos_table: torch.Tensor, patch_bias: torch.Tensor, side: int, merge: int, head_dim: int,
                 theta: float, max_bytes: int) -> None:
        self._pos, self._bias = pos_table, patch_bias
        self._side, self._merge, self._head_dim, self._theta = side, merge, head_dim, theta
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, int], FrameTables] = OrderedDict()
        self._bytes = 0

    def frame(self, h: int, w: int) -> FrameTables:
        key = (h, w)
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit
        device = self._pos.device
        angles = frame_rope_angles(h, w, self._merge, self._head_dim, self._theta, device)
        pos = frame_pos_embed(self._pos, h, w, self._side, self._merge) + self._bias.float()
        tables = FrameTables(pos_bias=pos.to(self._pos.dtype), cos=angles.cos(), sin=angles.sin())
        if tables.nbytes <= self.max_bytes:
            self._entries[key] = tables
            self._bytes += tables.nbytes
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
        return tables

    def batch(self, grids: Sequence[Grid]) -> FrameTables:
        """The tables of every frame of ``grids`` in order (a video's frames repeat their size's)."""
        frames = [(self.frame(h, w), t) for t, h, w in grids]
        if len(frames) == 1 and frames[0][1] == 1:
            return frames[0][0]

        def cat(field: str) -> torch.Tensor:
            return torch.cat([getattr(f, field).repeat(t, 1) for f, t in frames])

        return FrameTables(pos_bias=cat("pos_bias"), cos=cat("cos"), sin=cat("sin"))

    def __len__(self) -> int:
        return len(self._entries)
