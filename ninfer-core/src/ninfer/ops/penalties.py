"""Repetition, frequency and presence penalties on logits, from per-row token histories.

Semantics as vLLM's (and, for repetition, HF's ``RepetitionPenaltyLogitsProcessor``): for a token seen in the
prompt or the output, repetition divides a positive logit by ``repetition`` and multiplies a negative one; then
``frequency * count`` and ``presence * (count > 0)`` are subtracted, where ``count`` counts the token in the
output only. Each logits row reads one history row: ``counts`` int32 [H, V] (output occurrences) and ``prompt``
bool [H, V] (the token is in the prompt).
"""

from __future__ import annotations

import torch

from ninfer.ops.dispatch import triton_kernel


def penalize_ref(x: torch.Tensor, count: torch.Tensor, in_prompt: torch.Tensor, presence: torch.Tensor,
                 frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """The penalized logits of ``x`` fp32 (any shape), elementwise with broadcasting: ``count`` the token's output
    occurrences, ``in_prompt`` whether the prompt holds it, and the row's three penalties."""
    rep = torch.where(in_prompt | (count > 0), repetition, torch.ones_like(repetition))
    x = torch.where(x > 0, x / rep, x * rep)
    return x - frequency * count.float() - presence * (count > 0).float()


def apply_penalties_ref(logits: torch.Tensor, sel: torch.Tensor, hist: torch.Tensor, counts: torch.Tensor,
                        prompt: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                        repetition: torch.Tensor) -> torch.Tensor:
    rows = sel.to(logits.device)
    h = hist.to(counts.device)
    x = penalize_ref(logits[rows].float(), counts[h], prompt[h], presence.float()[:, None],
                     frequency.float()[:, None], repetition.float()[:, None])
    return logits.index_copy_(0, rows, x.to(logits.dtype))


def apply_penalties(logits: torch.Tensor, sel: torch.Tensor, hist: torch.Tensor, counts: torch.Tensor,
                    prompt: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """In place: penalize rows ``sel`` [M] (int64) of ``logits`` [N, V], row ``sel[m]`` reading history row
    ``hist[m]`` of ``counts`` int32 [H, V] and ``prompt`` bool [H, V], with ``presence`` / ``frequency`` /
    ``repetition`` [M] fp32. Returns ``logits``; other rows are untouched."""
    M = sel.shape[0]
    if logits.dim() != 2 or counts.dim() != 2 or counts.shape[1] != logits.shape[1] \
            or prompt.shape != counts.shape or counts.dtype != torch.int32 or prompt.dtype != torch.bool \
            or any(t.shape != (M,) for t in (hist, presence, frequency, repetition)):
        raise ValueError(f"apply_penalties: logits {tuple(logits.shape)}, counts {tuple(counts.shape)} "
                         f"{counts.dtype}, prompt {tuple(prompt.shape)} {prompt.dtype} and [{M}] row arguments "
                         f"do not fit (int32 / bool [H, V] histories expected)")
    if M == 0:
        return logits
    kernel = triton_kernel("penalties", "apply_penalties", logits)
    if kernel is not None:
        return kernel(logits, sel, hist, counts, prompt, presence, frequency, repetition)
    return apply_penalties_ref(logits, sel, hist, counts, prompt, presence, frequency, repetition)
