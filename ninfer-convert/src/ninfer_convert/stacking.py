"""Stacked sources: logical parameters a checkpoint stores split into several tensors (per-expert MoE weights).

The source mapping declares the groups (``SourceMapping.stacked_sources``); here each group is checked against
the checkpoint and becomes one PlannedTensor whose bytes are its parts read in order. Its parts are consumed:
the per-name mapping never sees them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ninfer.artifact.mapping import StackedSource
from ninfer_convert.source import ConversionError, PlannedTensor, SourceTensor


def _preview(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def plan_stacked(tensors: Mapping[str, SourceTensor], groups: Sequence[StackedSource]) -> dict[str, PlannedTensor]:
    """Logical name -> PlannedTensor for every declared group; raises ConversionError naming a group that lacks
    parts, a part of the wrong shape or dtype, or a tensor claimed twice."""
    planned: dict[str, PlannedTensor] = {}
    owner: dict[str, str] = {}
    for g in groups:
        if not isinstance(g, StackedSource):
            raise ConversionError(f"the source mapping declared {g!r}, not a StackedSource")
        if g.name in planned:
            raise ConversionError(f"the source mapping declares two stacked groups named {g.name!r}")
        for part in g.parts:
            if part in owner:
                where = "twice" if owner[part] == g.name else f"of both {owner[part]!r} and {g.name!r}"
                raise ConversionError(f"tensor {part!r} is declared a part {where}")
            owner[part] = g.name
        missing = [p for p in g.parts if p not in tensors]
        if missing:
            raise ConversionError(f"{g.name!r} is stacked from {len(g.parts)} tensors but the checkpoint lacks "
                                  f"{len(missing)} of them: {_preview(missing)}")
        parts = tuple(tensors[p] for p in g.parts)
        for k, t in enumerate(parts):
            if t.shape != g.shape_of(k):
                raise ConversionError(f"tensor {t.name!r} has shape {list(t.shape)} but {g.name!r} stacks parts of "
                                      f"{list(g.shape_of(k))}: the config disagrees with the weights")
        first_of: dict[str, str] = {}
        for t in parts:
            first_of.setdefault(t.dtype, t.name)
        if len(first_of) > 1:
            raise ConversionError(f"the parts of {g.name!r} differ in dtype: "
                                  + ", ".join(f"{n!r} is {d}" for d, n in first_of.items()))
        kinds = {(t.quant.format, t.quant.block) if t.quant else None for t in parts}
        if len(kinds) > 1:
            raise ConversionError(f"the parts of {g.name!r} are stored in different quantized formats or blocks: "
                                  f"{sorted(map(str, kinds))}")
        label = f"{g.name!r} (stacked from {len(parts)} tensors {parts[0].name!r} .. {parts[-1].name!r})"
        planned[g.name] = PlannedTensor(g.feature, parts[0].dtype, g.shape, parts, label)
    return planned
