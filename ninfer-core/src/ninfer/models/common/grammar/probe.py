"""The compile worker's probe: a few seeded walks through a freshly compiled grammar, measuring what its matcher
costs before any request runs one.

Some grammars compile fine and then make their matcher grow by gigabytes or take seconds per token (a JSON
object of thousands of optional properties grows quadratically at its first value). Each walk starts a new
matcher and takes up to ``STEPS`` tokens the grammar allows, preferring tokens that spell something (not only
whitespace) and, half the time, ones that close strings and structures (``"``, ``}``, ``]``), so walks leave
free text and reach values. Every step's CPU time (``time.thread_time``: the worker runs at a low priority, so
wall time would measure the machine's load) and the worker's resident growth are checked against the limits;
the worker's address-space limit is lowered to the matcher limit meanwhile, so a runaway allocation fails
at once (MemoryError) instead of growing further.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from ninfer.contract.constraint import ConstraintLimitExceeded, ConstraintLimits
from ninfer.models.common.grammar.build import mib

WALKS = 4
STEPS = 32
CLOSE_BIAS = 0.5
_CLOSERS = frozenset(b'"}]')
_WHITESPACE = frozenset(b" \t\r\n")


@attrs.frozen
class TokenClasses:
    """Per token id: whether its text has a byte other than whitespace; whether it only closes (``"}]``)."""

    spelling: np.ndarray
    closing: np.ndarray

    @classmethod
    def of(cls, vocabulary: Sequence[bytes], vocab_size: int) -> TokenClasses:
        spelling = np.zeros(vocab_size, dtype=bool)
        closing = np.zeros(vocab_size, dtype=bool)
        for i, text in enumerate(vocabulary[:vocab_size]):
            if text and not _WHITESPACE.issuperset(text):
                spelling[i] = True
                closing[i] = _CLOSERS.issuperset(text)
        return cls(spelling, closing)


@attrs.frozen
class ProbeResult:
    growth_bytes: int  # the largest resident growth of one walk's matcher
    step_s: float  # the slowest step (a mask or an acceptance), CPU seconds
    tokens: int  # tokens taken over all walks


def probe(compiled, classes: TokenClasses, limits: ConstraintLimits, *, rss: Callable[[], int],
          what: str) -> ProbeResult:
    """Walk ``compiled`` (an xgrammar CompiledGrammar); ConstraintLimitExceeded names the limit a step passed."""
    import xgrammar as xgr

    vocab_size = classes.spelling.shape[0]
    mask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
    base = rss()
    growth = tokens = 0
    slowest = 0.0

    def step(fn, *args):
        nonlocal slowest, growth
        t0 = time.thread_time()
        out = fn(*args)
        spent = time.thread_time() - t0
        slowest = max(slowest, spent)
        growth = max(growth, rss() - base)
        if spent > limits.token_time_s:
            raise ConstraintLimitExceeded("token_time_s", f"{what}: one matcher step took {spent:.3f} CPU seconds; "
                                                          f"at most {limits.token_time_s}")
        if growth > limits.matcher_memory_bytes:
            raise ConstraintLimitExceeded("matcher_memory_bytes", matcher_growth(what, growth, limits))
        return out

    for walk in range(WALKS):
        rng = random.Random(walk)
        matcher = step(xgr.GrammarMatcher, compiled)
        for _ in range(STEPS):
            step(matcher.fill_next_token_bitmask, mask)
            token = _pick(mask, classes, rng)
            if token is None or not step(matcher.accept_token, token):
                break
            tokens += 1
            if matcher.is_terminated():
                break
        del matcher
    return ProbeResult(growth_bytes=growth, step_s=slowest, tokens=tokens)


def matcher_growth(what: str, growth: int, limits: ConstraintLimits) -> str:
    return (f"{what}: its matcher grew by {mib(growth)} within a few tokens; at most "
            f"{mib(limits.matcher_memory_bytes)} per request")


def _pick(mask: np.ndarray, classes: TokenClasses, rng: random.Random) -> int | None:
    """A token the mask allows: one that spells something (a closing one half the time, when allowed), else
    any allowed one (whitespace, or the end of the grammar: the walk then stops)."""
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:classes.spelling.shape[0]].astype(bool)
    spelling = allowed & classes.spelling
    if spelling.any():
        closing = spelling & classes.closing
        pool = closing if closing.any() and rng.random() < CLOSE_BIAS else spelling
    else:
        pool = allowed
    ids = np.flatnonzero(pool)
    if not len(ids):
        return None
    return int(ids[rng.randrange(len(ids))])
