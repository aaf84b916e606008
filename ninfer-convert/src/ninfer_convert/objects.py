"""The physical object of one parent (a logical parameter, or a fused group of them): dense bytes as stored,
a published quantized weight's planes as stored, or a float weight quantized on the way (``--quantize``).

A parent's ``kind`` is None (dense) or (format, block). Fused members must share one kind; an FP8 member that
ends inside a scale block (its rows not a multiple of the block's) cannot share the parent's scale rows with the
next. A group whose members cannot all share one parent is never re-scaled: each maximal run of consecutive
members that can is stored as one parent of its own (``fuse_runs``), so the loader still serves a run with one
matmul over the stored bytes instead of joining a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ninfer.artifact.format import dense_nbytes
from ninfer.artifact.writer import ArtifactWriter
from ninfer.contract.quant import FP8_BLOCK, blocks_fit
from ninfer_convert.quantize import quantize_members
from ninfer_convert.quantized import read_plane
from ninfer_convert.source import ConversionError, PlannedTensor

Kind = tuple[str, tuple[int, int]] | None
_PLANES = {"fp8_e4m3_block": ("data", "scale"), "nvfp4": ("data", "scale", "global_scale")}


def fuse_problem(tensors: Sequence[PlannedTensor], kinds: Sequence[Kind]) -> str | None:
    """Why these members cannot share one parent, or None."""
    if len(set(kinds)) > 1:
        return "members are stored in different formats (" + ", ".join(
            sorted({"dense" if k is None else f"{k[0]} {list(k[1])}" for k in kinds})) + ")"
    if len({t.dtype for t in tensors}) > 1 or len({t.shape[1:] for t in tensors}) > 1:
        return "members differ in dtype or trailing shape"
    kind = kinds[0]
    rows = [t.shape[0] for t in tensors]
    if kind is not None and kind[0] == FP8_BLOCK and not blocks_fit(rows, kind[1][0]):
        return f"member rows {rows} do not all end on the {kind[1][0]}-row FP8 scale blocks"
    return None


def fuse_runs(tensors: Sequence[PlannedTensor], kinds: Sequence[Kind]) -> list[tuple[int, int]]:
    """The member index ranges ``(lo, hi)`` of a group that cannot be one parent: consecutive members, each run
    as long as it can share one parent, taken greedily from the first (the order LinearSplit forms its matmuls
    in, so its runs are these parents)."""
    runs: list[tuple[int, int]] = []
    lo = 0
    for hi in range(1, len(tensors) + 1):
        if hi == len(tensors) or fuse_problem(tensors[lo:hi + 1], kinds[lo:hi + 1]) is not None:
            runs.append((lo, hi))
            lo = hi
    return runs


def run_name(group: str, lo: int, hi: int) -> str:
    """The object id of members ``lo:hi`` of fused group ``group`` stored as a parent of their own."""
    return f"{group}[{lo}:{hi}]"


def add_parent(writer: ArtifactWriter, read: Callable, oid: str, *, feature: str, shape: tuple[int, ...],
               tensors: Sequence[PlannedTensor], kind: Kind, quantize: bool) -> None:
    """Add the object of one parent: ``tensors`` (its members' planned sources) back to back."""
    pieces = [p for t in tensors for p in t.parts]
    if kind is None:
        dtype = tensors[0].dtype
        writer.add_object(oid, feature=feature, dtype=dtype, shape=shape, nbytes=dense_nbytes(dtype, shape),
                          source=lambda: (read(p.name) for p in pieces))
        return
    format, block = kind
    if quantize:
        def planes():
            q = quantize_members(read, list(tensors), format)
            return ([t] for t in q.planes())
    else:
        for t in tensors:  # a bank stacked from quantized parts: each part must fill its own scale rows
            if format == FP8_BLOCK and t.stacked and not blocks_fit([p.shape[0] for p in t.parts], block[0],
                                                                     t.shape[-2]):
                raise ConversionError(
                    f"{t.label}: its FP8 parts of {t.parts[0].shape[0]} rows do not fill the {block[0]}-row scale "
                    f"blocks of the stacked [{t.shape[-2]}, {t.shape[-1]}] matrices; they cannot share scale rows")

        def planes():
            return ((read_plane(read, p, name) for p in pieces) for name in _PLANES[format])
    writer.add_quantized_object(oid, feature=feature, format=format, shape=shape, block=block, planes=planes)
