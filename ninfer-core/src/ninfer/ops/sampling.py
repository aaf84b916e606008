"""Next-token sampling and logprobs.

Each row draws with its own generator, so a row's token depends only on its logits, its settings and
its own seed/step, never on its batch neighbours. The draw is an exponential race
(argmax p / E, E ~ Exp(1)), which samples exactly from p and needs one noise vector per row.
"""

from __future__ import annotations

import torch

from ninfer.ops.dispatch import triton_kernel


def _filter_sorted(sorted_x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits sorted descending per row, with the tokens removed by top-k, top-p and
    min-p (in that order) at -inf. ``sorted_x`` may hold only each row's leading candidates (``topk``)."""
    V = sorted_x.shape[-1]
    rank = torch.arange(V, device=sorted_x.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.iinfo(torch.int64).max).to(sorted_x.device)
    sorted_x = sorted_x.masked_fill(rank >= k[:, None], float("-inf"))
    probs = sorted_x.softmax(-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop = ((probs.cumsum(-1) - probs) >= top_p.float()[:, None]) & (top_p < 1.0)[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    probs = sorted_x.softmax(-1)
    drop = probs < min_p.float()[:, None] * probs[:, :1]
    return sorted_x.masked_fill(drop, float("-inf"))


def _filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits with the tokens removed by top-k, top-p and min-p (in that order) at -inf."""
    x = logits.float() / temperature.float().clamp_min(1e-6)[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True)
    return torch.full_like(x, float("-inf")).scatter(1, order, _filter_sorted(sorted_x, top_k, top_p, min_p))


def _noise(shape: tuple[int, int], device: torch.device, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise over the whole vocabulary, one row per generator (the draw's only randomness)."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    for row, gen in enumerate(generators):
        noise[row].exponential_(generator=gen)
    return noise


def greedy_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """tokens[B] int64 from logits[B, V]: each row's argmax, as torch's (the first index of the maximum; NaN
    counts as the maximum, so the first NaN wins). On the GPU one kernel splits each row over many programs."""
    if logits.dim() != 2 or logits.shape[-1] == 0:
        raise ValueError(f"greedy: logits {tuple(logits.shape)} is not [B, V] with V > 0")
    kernel = triton_kernel("sampling", "greedy", logits)
    if kernel is not None:
        return kernel(logits)
    return greedy_ref(logits)


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, generators: list[torch.Generator | None], *,
               max_top_k: int | None = None) -> torch.Tensor:
    # Greedy rows are selected at the end rather than by an early return on all(temperature <= 0), which
    # would sync the host with the device every step; callers with an all-greedy batch call greedy() directly.
    best = greedy(logits)
    B, V = logits.shape
    noise = _noise((B, V), logits.device, generators)
    if max_top_k is not None and max_top_k < V:
        # Every sampled row keeps at most max_top_k tokens: filter those candidates, not a sort of the whole
        # vocabulary. Same noise, same race: the draw is the full path's up to float rounding of the softmax.
        vals, ids = logits.float().topk(max_top_k, dim=-1)
        x = vals / temperature.float().clamp_min(1e-6)[:, None]
        probs = _filter_sorted(x, top_k, top_p, min_p).softmax(-1)
        drawn = ids.gather(1, (probs / noise.gather(1, ids)).argmax(-1, keepdim=True))[:, 0]
    else:
        probs = _filtered_logits(logits, temperature, top_k, top_p, min_p).softmax(-1)
        drawn = (probs / noise).argmax(-1)
    return torch.where(temperature.to(logits.device) <= 0, best, drawn)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, generators: list[torch.Generator | None], *,
           max_top_k: int | None = None) -> torch.Tensor:
    """tokens[B] int64 from logits[B, V] fp32: temperature 0 is greedy argmax; otherwise temperature,
    top-k (0 = off), top-p, min-p filtering, then a draw with that row's generator (None: global RNG).

    ``max_top_k``: the caller knows every sampled row has 1 <= top_k <= max_top_k (greedy rows may have
    any); the filter then runs over those candidates instead of sorting the vocabulary."""
    B = logits.shape[0]
    if logits.dim() != 2 or any(t.shape != (B,) for t in (temperature, top_k, top_p, min_p)) \
            or len(generators) != B:
        raise ValueError(f"sample: logits {tuple(logits.shape)} needs temperature/top_k/top_p/min_p of shape "
                         f"[{B}] and {B} generators")
    if max_top_k is not None and max_top_k < 1:
        raise ValueError(f"sample: max_top_k must be >= 1, got {max_top_k}")
    return sample_ref(logits, temperature, top_k, top_p, min_p, generators, max_top_k=max_top_k)


def apply_token_mask_ref(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    B, V = logits.shape
    allowed = ((mask.to(logits.device)[:, :, None] >> bits) & 1).bool().reshape(B, -1)[:, :V]
    return logits.masked_fill_(~allowed, float("-inf"))


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """In place: logits[b, t] = -inf where bit ``t % 32`` of ``mask[b, t // 32]`` is 0 (the constraint refuses
    token t); returns ``logits``. ``mask``: int32 [B, ceil(V / 32)] on the logits' device."""
    if logits.dim() != 2 or mask.dtype != torch.int32 or mask.shape != (logits.shape[0], (logits.shape[1] + 31) // 32):
        raise ValueError(f"apply_token_mask: mask {tuple(mask.shape)} {mask.dtype} does not fit logits "
                         f"{tuple(logits.shape)} (int32 [B, ceil(V / 32)] expected)")
    kernel = triton_kernel("sampling", "apply_token_mask", logits)
    if kernel is not None:
        return kernel(logits, mask)
    return apply_token_mask_ref(logits, mask)


def logprobs(logits: torch.Tensor, tokens: torch.Tensor,
             top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of tokens[B], top_n ids [B, top_n], their logprobs) under the raw model distribution
    (no temperature or filtering), as OpenAI and vLLM report them."""
    if top_n < 0 or top_n > logits.shape[-1]:
        raise ValueError(f"logprobs: top_n must be in 0..{logits.shape[-1]}, got {top_n}")
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, tokens.long()[:, None])[:, 0]
    top_lp, top_ids = lp.topk(top_n, dim=-1)
    return chosen, top_ids, top_lp
