"""Next-token sampling and logprobs.

Each row draws with its own generator, so a row's token depends only on its logits, its settings and
its own seed/step, never on its batch neighbours. The draw is an exponential race
(argmax p / E, E ~ Exp(1)), which samples exactly from p and needs one noise vector per row.
"""

from __future__ import annotations

import torch

from ninfer.ops._dispatch import triton_kernel


def _filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits with the tokens removed by top-k, top-p and min-p (in that order) at -inf."""
    B, V = logits.shape
    x = logits.float() / temperature.float().clamp_min(1e-6)[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V).to(x.device)
    drop = rank >= k[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    probs = sorted_x.softmax(-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop = ((probs.cumsum(-1) - probs) >= top_p.float()[:, None]) & (top_p < 1.0)[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    probs = sorted_x.softmax(-1)
    drop = probs < min_p.float()[:, None] * probs[:, :1]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    # Greedy rows are selected at the end rather than by an early return on all(temperature <= 0), which
    # would sync the host with the device every step; callers with an all-greedy batch take argmax directly.
    greedy = logits.argmax(-1)
    probs = _filtered_logits(logits, temperature, top_k, top_p, min_p).softmax(-1)
    noise = torch.empty_like(probs)
    for row, gen in enumerate(generators):
        noise[row].exponential_(generator=gen)
    drawn = (probs / noise).argmax(-1)
    return torch.where(temperature.to(logits.device) <= 0, greedy, drawn)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """tokens[B] int64 from logits[B, V] fp32: temperature 0 is greedy argmax; otherwise temperature,
    top-k (0 = off), top-p, min-p filtering, then a draw with that row's generator (None: global RNG)."""
    B = logits.shape[0]
    if logits.dim() != 2 or any(t.shape != (B,) for t in (temperature, top_k, top_p, min_p)) \
            or len(generators) != B:
        raise ValueError(f"sample: logits {tuple(logits.shape)} needs temperature/top_k/top_p/min_p of shape "
                         f"[{B}] and {B} generators")
    kernel = triton_kernel("sampling", "sample", logits)
    if kernel is not None:
        return kernel(logits, temperature, top_k, top_p, min_p, generators)
    return sample_ref(logits, temperature, top_k, top_p, min_p, generators)


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
