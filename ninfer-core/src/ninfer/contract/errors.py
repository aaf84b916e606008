"""Errors a contract implementation raises for the engine to map onto its request rejections."""

from __future__ import annotations


class PromptTooLong(ValueError):
    """The prompt has more than the ``max_tokens`` the engine passed to ``Frontend.prepare``.

    ``tokens`` is the prompt's length, or a lower bound on it when ``exact`` is False (the Frontend rejected
    the prompt without tokenizing all of it); ``limit`` is the ``max_tokens`` it exceeds.
    """

    def __init__(self, *, tokens: int, limit: int, exact: bool, detail: str = "") -> None:
        self.tokens, self.limit, self.exact, self.detail = tokens, limit, exact, detail
        amount = f"{tokens}" if exact else f"at least {tokens}"
        super().__init__(f"the prompt has {amount} tokens{detail}; at most {limit} fit")


class NoRoomToScore(RuntimeError):
    """A scoring window found no free state slot or too few free KV pages (generation holds them for now)."""
