"""Bound weights: logical parameters as views onto resident physical parents.

The artifact stores physical objects; a logical parameter is a Binding onto one (the whole
object, or a row range of a fused parent). A parent shared by several logical parameters is
resident once per device. A quantized parent is a ``ninfer.ops.quant.QuantizedWeight`` (its planes views into
one allocation) and so are the parameters bound to it: its row ranges are ``QuantizedWeight.rows``. Model code asks for a logical parameter by name, or for a run of
logical parameters that a single matmul can serve (``LinearSplit``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch


@attrs.frozen(kw_only=True)
class FusedParent:
    """A physical parent that stores several logical parameters concatenated along dim 0."""

    name: str
    members: tuple[str, ...] = attrs.field(converter=tuple)
    feature: str = "text"


def row_range(parent, lo: int, hi: int):
    """Rows ``lo:hi`` of a parent: a tensor slice, or ``QuantizedWeight.rows`` (which keeps the scale rows)."""
    import torch

    return parent[lo:hi] if isinstance(parent, torch.Tensor) else parent.rows(lo, hi)


@attrs.frozen(kw_only=True, eq=False)
class BoundParameter:
    """One logical parameter: a view of ``parent`` (rows ``rows`` of dim 0, or all of it); a QuantizedWeight when
    the parent is quantized."""

    name: str
    parent: str
    tensor: torch.Tensor = attrs.field(repr=False)
    rows: tuple[int, int] | None = None


class WeightSet(Mapping[str, "torch.Tensor"]):
    """Logical name -> tensor view (or QuantizedWeight), plus the resident parents behind them."""

    def __init__(self, parents: Mapping[str, torch.Tensor], params: Iterable[BoundParameter]) -> None:
        self.parents = dict(parents)
        self.params = {p.name: p for p in params}

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.params[name].tensor
        except KeyError:
            raise KeyError(f"no bound parameter {name!r}") from None

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def fused(self, names: Sequence[str]) -> torch.Tensor | None:
        """The single parent slice holding ``names`` back to back in this order (a QuantizedWeight row range when
        the parent is quantized), or None."""
        first = self.params[names[0]]
        parent = self.parents[first.parent]
        start = first.rows[0] if first.rows else 0
        pos = start
        for n in names:
            p = self.params[n]
            if p.parent != first.parent:
                return None
            lo, hi = p.rows if p.rows else (0, parent.shape[0])
            if lo != pos:
                return None
            pos = hi
        return row_range(parent, start, pos)

    def resident_bytes(self) -> int:
        from ninfer.core.device_plan import resident_bytes

        return resident_bytes(self.parents.values())

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], fused: Iterable[FusedParent] = ()) -> WeightSet:
        """Build from logical tensors (tests, in-memory models): fused groups are concatenated once."""
        import torch

        parents: dict[str, torch.Tensor] = {}
        params: list[BoundParameter] = []
        grouped: set[str] = set()
        for group in fused:
            if not all(m in tensors for m in group.members):
                continue
            parts = [tensors[m] for m in group.members]
            dense = [isinstance(t, torch.Tensor) for t in parts]
            if all(dense):
                parent = torch.cat(parts, dim=0)
            elif any(dense):
                continue  # quantized and dense members stay apart (LinearSplit joins each format's run once)
            else:  # quantized members: their planes stacked by rows, each keeping its scales
                from ninfer.ops.quant import QuantizedWeight

                parent = QuantizedWeight.cat(parts)
            parents[group.name] = parent
            pos = 0
            for m in group.members:
                n = tensors[m].shape[0]
                params.append(BoundParameter(name=m, parent=group.name, tensor=row_range(parent, pos, pos + n),
                                             rows=(pos, pos + n)))
                pos += n
                grouped.add(m)
        for name, t in tensors.items():
            if name not in grouped:
                parents[name] = t
                params.append(BoundParameter(name=name, parent=name, tensor=t))
        return cls(parents, params)
