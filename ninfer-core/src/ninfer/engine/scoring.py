"""CausalScoring: per-token logprobs, total NLL and perplexity of a long text.

CausalScoreCore walks the token sequence in windows of ``window`` tokens moving by ``stride``
(the Hugging Face perplexity recipe): each window is a fresh causal context run by serial Program
calls on a temporary State slot and Main KV, outside the generation scheduler and caches, and
scores only the tokens that no earlier window scored. When one window covers the whole text this
is exactly one full forward. The first token has no context and is never scored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

# Tokens of context per window unless the caller says (``ninfer score``, ``Engine.score``), bounded by the
# model's max length.
DEFAULT_WINDOW = 4096


@runtime_checkable
class ScoringProgram(Protocol):
    """What scoring needs from a Program: one fresh causal window, logprobs of tokens from ``score_from``."""

    max_model_len: int

    def score_window(self, token_ids: Sequence[int], score_from: int = 1, *, top: int | None = None): ...


@attrs.frozen(kw_only=True)
class ScoreResult:
    """``logprobs[i]`` is log p(token_ids[i + 1] | context); NLL in nats; perplexity = exp(NLL / scored).
    Scored with ``top``: ``ranks[i]`` is 1 + how many vocabulary entries were more likely than token i + 1,
    ``top[i]`` the ``top`` most likely (token id, logprob) pairs, best first; both empty otherwise."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    total_nll: float
    windows: int
    ranks: tuple[int, ...] = ()
    top: tuple[tuple[tuple[int, float], ...], ...] = ()

    @property
    def num_scored(self) -> int:
        return len(self.logprobs)

    @property
    def mean_nll(self) -> float:
        return self.total_nll / self.num_scored if self.logprobs else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll) if self.logprobs else float("nan")


class CausalScoreCore:
    """Scores token sequences with ``window``/``stride`` windows through a Program's ``score_window``."""

    def __init__(self, program: ScoringProgram, *, window: int | None = None, stride: int | None = None) -> None:
        if not isinstance(program, ScoringProgram):
            raise TypeError(f"{type(program).__name__} does not provide score_window; it cannot score")
        self.program = program
        self.window = window if window is not None else program.max_model_len
        if not 2 <= self.window <= program.max_model_len:
            raise ValueError(f"window must be in 2..{program.max_model_len} (the Program's max_model_len), "
                             f"got {self.window}")
        # stride < window, so every window after the first starts inside scored text: each token but
        # the first is scored exactly once, with at least one token of context.
        self.stride = stride if stride is not None else max(1, self.window // 2)
        if not 1 <= self.stride < self.window:
            raise ValueError(f"stride must be in 1..{self.window - 1} (less than the window), got {self.stride}")

    def windows(self, n: int) -> list[tuple[int, int, int]]:
        """(begin, end, first scored position) of each window over ``n`` tokens."""
        out, scored_to = [], 1
        begin = 0
        while scored_to < n:
            end = min(begin + self.window, n)
            if end > scored_to:
                out.append((begin, end, max(scored_to, begin + 1)))
                scored_to = end
            begin += self.stride
        return out

    def score(self, token_ids: Sequence[int], *, top: int | None = None) -> ScoreResult:
        """Scores of ``token_ids``; with ``top`` (0 or more) also each token's rank and the ``top`` most
        likely alternatives (the logprobs are the same either way)."""
        ids = tuple(int(t) for t in token_ids)
        if len(ids) < 2:
            raise ValueError(f"scoring needs at least 2 tokens (the first has no context), got {len(ids)}")
        logprobs: list[float] = []
        ranks: list[int] = []
        alternatives: list[tuple[tuple[int, float], ...]] = []
        spans = self.windows(len(ids))
        for begin, end, first in spans:
            if top is None:
                lp = self.program.score_window(ids[begin:end], first - begin)
                logprobs.extend(lp.double().cpu().tolist())
                continue
            scores = self.program.score_window(ids[begin:end], first - begin, top=top)
            logprobs.extend(scores.logprobs.double().cpu().tolist())
            ranks.extend(scores.ranks.cpu().tolist())
            for row_ids, row_lps in zip(scores.top_ids.cpu().tolist(), scores.top_logprobs.double().cpu().tolist(),
                                        strict=True):
                alternatives.append(tuple(zip(row_ids, row_lps, strict=True)))
        return ScoreResult(token_ids=ids, logprobs=tuple(logprobs), total_nll=-math.fsum(logprobs),
                           windows=len(spans), ranks=tuple(ranks), top=tuple(alternatives))
