"""Verification of draft tokens: which of a row's drafts the target model accepts, and the token that follows.

One rule for every speculative backend (MTP now, DFlash later). A row verifies up to R-1 drafts with R target
rows: row i is the target's distribution for the token after the committed output and drafts[:i].

- Greedy rows (temperature 0) accept the longest prefix of drafts equal to the target's argmax at each
  position, then emit the target's argmax at the first mismatch, or the bonus argmax after the last draft:
  the tokens plain greedy decoding would give.
- Sampled rows use rejection sampling (Leviathan et al. 2023; Chen et al. 2023), lossless: draft x at row i is
  accepted with probability min(1, p_i(x) / q_i(x)); at the first rejection the token is drawn from
  norm(max(0, p_i - q_i)); after the last draft the bonus is drawn from p. p is the target distribution after
  temperature, top-k, top-p and min-p (``ops.sampling``'s filters); q is the draft's distribution, or one-hot
  on the draft token when the drafter is argmax (``draft_probs`` None: acceptance probability p_i(x)).

The randomness is drawn by the caller per position (``noise`` [B, R, V] Exp(1), ``uniform`` [B, R]), from the
same counter-based generators plain sampling uses, noise first: a row with no drafts draws exactly what
``ops.sampling.sample`` draws, and a row's tokens never depend on its neighbours.
"""

from __future__ import annotations

import torch

from ninfer.ops.sampling import _filtered_logits


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """fp32 probabilities [B, R, V] of logits [B, R, V] after each row's temperature and filters (greedy rows:
    temperature clamped, their probabilities are not used)."""
    B, R, V = logits.shape
    rep = lambda t: t.to(logits.device).repeat_interleave(R)  # noqa: E731 - per-row knobs for each position
    flat = _filtered_logits(logits.reshape(B * R, V), rep(temperature), rep(top_k), rep(top_p), rep(min_p))
    return flat.softmax(-1).reshape(B, R, V)


def verify_ref(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, temperature: torch.Tensor,
               top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, noise: torch.Tensor,
               uniform: torch.Tensor, draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    B, R, V = logits.shape
    dev = logits.device
    greedy_row = (temperature.to(dev) <= 0)[:, None]
    best = logits.argmax(-1)  # [B, R]
    probs = target_probs(logits, temperature, top_k, top_p, min_p)
    pos = torch.arange(R - 1, device=dev)[None, :]
    valid = pos < num_drafts.to(dev)[:, None]  # [B, R-1]
    d = drafts.clamp_min(0)
    p_draft = probs[:, :-1].gather(-1, d[..., None])[..., 0]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.to(dev).float().gather(-1, d[..., None])[..., 0]
    sampled_ok = uniform[:, :-1].to(dev) * q_draft < p_draft  # u < p / q, without dividing by a zero q
    ok = torch.where(greedy_row, d == best[:, :-1], sampled_ok) & valid
    accepted = ok.long().cumprod(-1).sum(-1)  # [B]
    rows = torch.arange(B, device=dev)
    at = accepted  # the position whose token follows the accepted drafts
    p_at = probs[rows, at]  # [B, V]
    rejected = accepted < num_drafts.to(dev)
    if R == 1:  # no drafts: the bonus alone, drawn as plain sampling draws it
        q_at = torch.zeros_like(p_at)
    elif draft_probs is None:
        q_at = torch.zeros_like(p_at).scatter_(1, d[rows, at.clamp_max(R - 2)][:, None], 1.0)
    else:
        q_at = draft_probs.to(dev).float()[rows, at.clamp_max(R - 2)]
    residual = (p_at - q_at).clamp_min(0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p <= q everywhere (only when the draft had all p's mass)
    residual = torch.where(empty, p_at, residual)
    dist = torch.where(rejected[:, None], residual, p_at)
    drawn = (dist / noise[rows, at].to(dev)).argmax(-1)
    follow = torch.where(greedy_row[:, 0], best[rows, at], drawn)
    out = torch.full((B, R), -1, dtype=torch.long, device=dev)
    out[:, :-1] = torch.where(pos < accepted[:, None], drafts, -1)
    out[rows, at] = follow
    return out, accepted


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify`` when every row is greedy and offers all R-1 drafts: (tokens [B, R], accepted [B]) from logits
    [B, R, V] alone (no draws, no host sync: CUDA-graph capturable). Ties go as ``ops.sampling.greedy`` breaks them."""
    from ninfer.ops.sampling import greedy

    B, R, V = logits.shape
    if drafts.shape != (B, R - 1):
        raise ValueError(f"verify_greedy: drafts {tuple(drafts.shape)} must be [{B}, {R - 1}]")
    best = greedy(logits.reshape(B * R, V)).view(B, R)
    accepted = (drafts == best[:, :-1]).long().cumprod(-1).sum(-1)
    after = torch.arange(R, device=best.device)[None, :] > accepted[:, None]
    return best.masked_fill(after, -1), accepted


def verify(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, temperature: torch.Tensor,
           top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, noise: torch.Tensor, uniform: torch.Tensor,
           draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, R] int64, accepted [B] int64) for target logits [B, R, V] (fp32, masks already applied) and
    ``drafts`` [B, R-1] of which the first ``num_drafts[b]`` count. A row emits ``tokens[b, :accepted[b] + 1]``:
    its accepted drafts, then the correction or bonus token; later entries are -1. ``noise`` [B, R, V] and
    ``uniform`` [B, R] are the row's draws per position (see the module docstring); ``draft_probs`` [B, R-1, V]
    the drafter's q when it sampled its drafts."""
    B, R, V = logits.shape if logits.dim() == 3 else (None, None, None)
    if B is None or R < 1 or drafts.shape != (B, R - 1) or num_drafts.shape != (B,) \
            or noise.shape != (B, R, V) or uniform.shape != (B, R) \
            or (draft_probs is not None and draft_probs.shape != (B, R - 1, V)) \
            or any(t.shape != (B,) for t in (temperature, top_k, top_p, min_p)):
        raise ValueError(f"verify: logits {tuple(logits.shape)} needs [B, R, V] with drafts [B, R-1], num_drafts, "
                         f"temperature/top_k/top_p/min_p [B], noise [B, R, V], uniform [B, R] "
                         f"(got drafts {tuple(drafts.shape)}, noise {tuple(noise.shape)}, "
                         f"uniform {tuple(uniform.shape)})")
    if bool(((num_drafts < 0) | (num_drafts > R - 1)).any()):
        raise ValueError(f"verify: num_drafts must be in 0..{R - 1}, got {num_drafts.tolist()}")
    return verify_ref(logits, drafts, num_drafts, temperature, top_k, top_p, min_p, noise, uniform, draft_probs)
