"""Quantized weight formats and activation permits: the names the artifact, the converter, the ops and a plugin's
Startup share.

Formats (what the artifact stores, each a set of planes; ``docs/quantization.md``):

- ``fp8_e4m3_block``: data float8_e4m3fn ``[N, K]``, scale float32 ``[ceil(N / b0), ceil(K / b1)]`` with
  ``W = data * scale`` over each ``b0 x b1`` block (Qwen's fine-grained FP8 is ``(128, 128)``; a per-channel
  scale is ``(1, K)``).
- ``nvfp4``: data uint8 ``[N, K / 2]`` (e2m1 pairs, the even element in the low nibble), scale float8_e4m3fn
  ``[N, K / 16]``, global_scale float32 ``[N]`` (one per output row, so fused shards keep their own global scale)
  with ``W = e2m1 * scale * global_scale``.

Activation permits (the design's A16Only = {A16}, AllowA8 = {A16, A8}, AllowA4 = {A16, A8, A4}): what a linear
tolerates as its input's precision. A fused call takes the intersection of its parts' permits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

FP8_BLOCK = "fp8_e4m3_block"
NVFP4 = "nvfp4"
QUANTIZED_FORMATS = (FP8_BLOCK, NVFP4)
NVFP4_GROUP = 16
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
E2M1_MAX = 6.0

A16, A8, A4 = "a16", "a8", "a4"
A16_ONLY: frozenset[str] = frozenset({A16})
ALLOW_A8: frozenset[str] = frozenset({A16, A8})
ALLOW_A4: frozenset[str] = frozenset({A16, A8, A4})


def intersect(permits: Iterable[frozenset[str]]) -> frozenset[str]:
    """The permit of a fused call over parts with these permits (A16 is always allowed)."""
    out = ALLOW_A4
    for p in permits:
        out = out & p
    return out | A16_ONLY


def blocks_fit(piece_rows: Sequence[int], block_rows: int, matrix_rows: int | None = None) -> bool:
    """Whether pieces of these row counts, stacked, start every piece but the first on a ``block_rows`` scale-block
    boundary of its matrix (``matrix_rows``: the rows of each matrix of a stacked bank; default the whole stack), so
    that an FP8 weight stacked from them keeps every piece's own scales (a piece may end its matrix partway
    through a block)."""
    matrix_rows = matrix_rows or sum(piece_rows)
    pos = 0
    for rows in piece_rows[:-1]:
        pos += rows
        if pos % matrix_rows % block_rows:
            return False
    return True
