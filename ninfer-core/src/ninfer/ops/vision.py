"""Non-causal attention over sequences packed back to back: the vision encoder's attention within each image or
video frame.

q, k, v [N, H, D] hold every sequence's rows in order; sequence i owns rows ``cu_seqlens[i] .. cu_seqlens[i+1]``
and attends to all of its own rows and to nothing else (no causal mask, no padding). Softmax in fp32. The
sequences are described once per encoder call by a ``PackedSequences`` (host lengths for the torch path, the
device ``cu_seqlens`` for the kernel) and reused by every layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F

from ninfer.ops.dispatch import triton_kernel


@attrs.frozen(kw_only=True)
class LengthGroup:
    """The sequences of one length: ``index`` [count * length] int64 rows on the device, or None when they are
    one contiguous run starting at row ``first`` (then the rows are a view)."""

    length: int
    count: int
    first: int
    index: torch.Tensor | None = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True, eq=False)
class PackedSequences:
    """Where each sequence of a packed batch sits: ``lengths`` (host), ``cu_seqlens`` int32 [B + 1] on the rows'
    device, and the sequences grouped by length for the torch path (one SDPA call per distinct length)."""

    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor
    groups: tuple[LengthGroup, ...]

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device | str) -> PackedSequences:
        lengths = tuple(int(n) for n in lengths)
        if not lengths or any(n <= 0 for n in lengths):
            raise ValueError(f"PackedSequences needs one or more positive lengths, got {list(lengths)}")
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        by_length: dict[int, list[int]] = {}
        for n, s in zip(lengths, starts, strict=False):
            by_length.setdefault(n, []).append(s)
        groups = []
        for n, firsts in by_length.items():
            contiguous = all(b - a == n for a, b in zip(firsts, firsts[1:], strict=False))
            index = None if contiguous else \
                (torch.tensor(firsts, dtype=torch.int64)[:, None] + torch.arange(n)).flatten().to(device)
            groups.append(LengthGroup(length=n, count=len(firsts), first=firsts[0], index=index))
        return cls(lengths=lengths, cu_seqlens=torch.tensor(starts, dtype=torch.int32, device=device),
                   groups=tuple(groups))

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def max_length(self) -> int:
        return max(self.lengths)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSequences) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape or q.shape[0] != seqs.total:
        raise ValueError(f"vision_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                         f"[N, H, D] alike with N = {seqs.total} (the packed lengths' sum)")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"vision_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != seqs.cu_seqlens.device:
        raise ValueError(f"vision_attention: q is on {q.device}, cu_seqlens on {seqs.cu_seqlens.device}")


def vision_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSequences,
                         scale: float | None = None) -> torch.Tensor:
    """torch's scaled_dot_product_attention, one call per distinct sequence length (the sequences of a length
    batched; on CUDA its flash / memory-efficient backends, on the CPU its math in the inputs' dtype)."""
    _check(q, k, v, seqs)
    out = torch.empty_like(q)
    for g in seqs.groups:
        qg, kg, vg = (_group_rows(x, g) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qg, kg, vg, scale=scale).transpose(1, 2).flatten(0, 1)
        if g.index is None:
            out[g.first:g.first + g.count * g.length] = o
        else:
            out.index_copy_(0, g.index, o)
    return out


def _group_rows(x: torch.Tensor, g: LengthGroup) -> torch.Tensor:
    """[count, H, length, D]: the rows of one length group (a view when they are one run)."""
    picked = x[g.first:g.first + g.count * g.length] if g.index is None else x.index_select(0, g.index)
    return picked.view(g.count, g.length, *x.shape[1:]).transpose(1, 2)


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSequences,
                     scale: float | None = None) -> torch.Tensor:
    """o [N, H, D]: softmax(q k^T * scale) v within each packed sequence (scale defaults to D ** -0.5). q, k and v
    may be strided views (of one fused qkv projection) with a contiguous head dim."""
    _check(q, k, v, seqs)
    kernel = triton_kernel("vision_attention", "vision_attention", q)
    if kernel is not None:
        return kernel(q, k, v, seqs, scale)
    return vision_attention_ref(q, k, v, seqs, scale)
