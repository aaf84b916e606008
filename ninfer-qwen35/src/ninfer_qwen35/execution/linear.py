"""LinearSplit: several logical projections of the same input served by one matmul.

The logical weights are rows of one physical parent when the artifact stores them back to back
(``WeightSet.fused``); otherwise they are concatenated once, at preparation, never per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ninfer.artifact.weights import WeightSet
from ninfer.ops import linear


@attrs.frozen(kw_only=True, eq=False)
class LinearSplit:
    """y = x @ weight.T, split along the last dim into the logical outputs ``names`` (``sizes`` wide)."""

    names: tuple[str, ...] = attrs.field(converter=tuple)
    sizes: tuple[int, ...] = attrs.field(converter=tuple)
    weight: torch.Tensor = attrs.field(repr=False)
    shares_parent: bool = False  # True: ``weight`` is the artifact's parent itself (no copy was made)

    @classmethod
    def from_weights(cls, weights: WeightSet, names: Sequence[str], dtype: torch.dtype,
                     device: torch.device | None = None) -> LinearSplit:
        parts = [weights[n] for n in names]
        if any(p.dim() != 2 or p.shape[1] != parts[0].shape[1] for p in parts):
            raise ValueError(f"LinearSplit over {list(names)}: parts must be 2-D with one input width, got "
                             f"{[tuple(p.shape) for p in parts]}")
        device = device if device is not None else parts[0].device
        fused = weights.fused(list(names))
        if fused is not None:
            weight = fused.to(device=device, dtype=dtype)
            shares = weight.data_ptr() == fused.data_ptr()
        else:
            weight = torch.cat([p.to(device=device, dtype=dtype) for p in parts])
            shares = False
        return cls(names=names, sizes=[p.shape[0] for p in parts], weight=weight, shares_parent=shares)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The unsplit output [..., sum(sizes)] (e.g. [gate | up] for silu_and_mul)."""
        return linear(x, self.weight)

    def parts(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The logical outputs of an unsplit output ``y`` [..., sum(sizes)] (computed here or by a fused op)."""
        return y.split(self.sizes, dim=-1)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.parts(self.matmul(x))
