"""LinearSplit: several logical projections of the same input served by as few matmuls as their formats allow.

The logical weights are rows of one physical parent when the artifact stores them back to back
(``WeightSet.fused``: a dense parent, an FP8 parent or an NVFP4 matrix view, in the same row order). Parts in
different formats (an FP8 checkpoint leaves GDN's ``in_proj_b`` / ``in_proj_a`` in bf16 beside a quantized
``in_proj_qkv``) are consecutive groups, one matmul each, their outputs joined in the logical order; the converter
stores each such run as a parent of its own, so a group is a view of it too. Only parts the artifact holds apart
(an in-memory WeightSet) are concatenated, once, at preparation, never per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ninfer.artifact.weights import WeightSet
from ninfer.contract.quant import FP8_BLOCK, blocks_fit
from ninfer.ops import linear
from ninfer.ops.quant import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight


@attrs.frozen(kw_only=True, eq=False)
class LinearSplit:
    """y = x @ W.T for W the logical parts ``names`` (``sizes`` rows each) stacked, split along the last dim.

    ``groups``: the matmuls, each a run of consecutive parts in one format; almost always one."""

    names: tuple[str, ...] = attrs.field(converter=tuple)
    sizes: tuple[int, ...] = attrs.field(converter=tuple)
    groups: tuple[Weight, ...] = attrs.field(converter=tuple, repr=False)
    members: tuple[tuple[str, ...], ...] = attrs.field(converter=tuple)  # the names each group serves
    shares_parent: bool = False  # True: every group is a view of the artifact's parents (no copy was made)

    @property
    def weight(self) -> Weight:
        """The one matmul's weight (a fused op such as ``swiglu`` takes it whole)."""
        if len(self.groups) != 1:
            raise ValueError(f"LinearSplit over {list(self.names)} runs as {len(self.groups)} matmuls (its parts "
                             f"differ in format), not one weight")
        return self.groups[0]

    @classmethod
    def from_weights(cls, weights: WeightSet, names: Sequence[str], dtype: torch.dtype,
                     device: torch.device | None = None) -> LinearSplit:
        parts = [weights[n] for n in names]
        if any(p.dim() != 2 or p.shape[1] != parts[0].shape[1] for p in parts):
            raise ValueError(f"LinearSplit over {list(names)}: parts must be 2-D with one input width, got "
                             f"{[tuple(p.shape) for p in parts]}")
        device = device if device is not None else parts[0].device
        runs: list[list[str]] = []  # the matmuls: consecutive parts that can share one weight
        for name, p in zip(names, parts, strict=True):
            if runs and _kind(weights[runs[-1][0]]) == _kind(p) and _stackable([weights[n] for n in runs[-1]] + [p]):
                runs[-1].append(name)
            else:
                runs.append([name])
        groups, shared = [], []
        for run in runs:
            # the artifact stores a run back to back in one parent (a group of mixed formats as fused runs):
            # its view, else the run joined once
            view = weights.fused(run)
            if view is not None:
                w = _place(view, dtype, device)
                shared.append(_storage(w) == _storage(view))
            else:
                w = _stack([_place(weights[n], dtype, device) for n in run])
                shared.append(False)
            groups.append(w)
        return cls(names=names, sizes=[p.shape[0] for p in parts], groups=groups, members=map(tuple, runs),
                   shares_parent=all(shared))

    def with_groups(self, groups: Sequence[Weight]) -> LinearSplit:
        """The same split over these weights for its groups (a quantized group given its executable path)."""
        return attrs.evolve(self, groups=groups)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The unsplit output [..., sum(sizes)] (e.g. [gate | up] for silu_and_mul)."""
        if len(self.groups) == 1:
            return linear(x, self.groups[0])
        return torch.cat([linear(x, w) for w in self.groups], dim=-1)

    def parts(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The logical outputs of an unsplit output ``y`` [..., sum(sizes)] (computed here or by a fused op)."""
        return y.split(self.sizes, dim=-1)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.parts(self.matmul(x))


def _kind(w: Weight) -> tuple:
    return (w.format, w.block) if isinstance(w, QuantizedWeight) else ("dense",)


def _stackable(run: list[Weight]) -> bool:
    """Whether quantized parts can share one matmul: FP8 blocks must not straddle a part boundary."""
    first = run[0]
    if not isinstance(first, QuantizedWeight) or first.format != FP8_BLOCK:
        return True
    return blocks_fit([p.shape[0] for p in run], first.block[0])


def _place(w: Weight, dtype: torch.dtype, device: torch.device) -> Weight:
    """On ``device``; a dense weight in the model's ``dtype`` (a quantized one keeps its stored planes)."""
    return w.to(device) if isinstance(w, QuantizedWeight) else w.to(device=device, dtype=dtype)


def _stack(run: list[Weight]) -> Weight:
    if len(run) == 1:
        return run[0]
    return QuantizedWeight.cat(run) if isinstance(run[0], QuantizedWeight) else torch.cat(run)


def _storage(w: Weight) -> int:
    return (w.data if isinstance(w, QuantizedWeight) else w).data_ptr()
