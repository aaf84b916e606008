"""Request and sampling parameters (public owning input to ``Engine.submit``)."""

from __future__ import annotations

import attrs
from attrs import validators as v

from ninfer.contract._validate import finite, token_ids
from ninfer.contract.constraint import CONSTRAINT_TYPES, Constraint
from ninfer.contract.prompt import ChatInput, PreparedPrompt, TextInput

# Longest stop string, in characters. Stop strings are markers ("</answer>", "\n\nUser:"); 1024 is far above
# any real one, and it bounds what a request makes the output session hold back (at most this - 1 characters)
# and the matcher it builds (linear in the total length of the stop strings).
MAX_STOP_CHARS = 1024
# Longest cache salt, in characters: room for a client's salt (a gateway takes up to 1024) and the scope a
# gateway puts in front of it (its API key's identity).
MAX_CACHE_SALT_CHARS = 2048
# Most logit_bias entries per request (OpenAI's limit): the sampler adds them per row and step.
MAX_LOGIT_BIAS = 300


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """A mapping or pairs of token id -> bias as (id, bias) pairs (hashable)."""
    items = value.items() if isinstance(value, dict) else value
    return tuple((k, v) for k, v in items)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Per-request sampling. ``None`` fields take the model's generation defaults (from the artifact).

    temperature 0 means greedy. ``seed`` makes sampling reproducible per request,
    independent of batch neighbours and of preemption.

    Penalties and biases change the logits before temperature and filtering (``docs/engine.md``, Sampling):
    ``presence_penalty`` / ``frequency_penalty`` (OpenAI) subtract from the logit of every token already generated,
    once / per occurrence; ``repetition_penalty`` (HF, vLLM) divides the positive logits (multiplies the negative
    ones) of every token of the prompt or the output; ``logit_bias`` adds to a token's logit (-100 bans it, +100
    all but forces it); ``min_tokens``: the tokens that end generation (``stop_token_ids``, and EOS unless
    ``ignore_eos``) are refused until that many tokens are generated.
    """

    max_tokens: int | None = attrs.field(default=None, validator=v.optional(v.ge(1)))
    temperature: float | None = attrs.field(default=None, validator=v.optional([finite, v.ge(0.0), v.le(100.0)]))
    top_p: float | None = attrs.field(default=None, validator=v.optional([finite, v.gt(0.0), v.le(1.0)]))
    top_k: int | None = attrs.field(default=None, validator=v.optional(v.ge(0)))
    min_p: float | None = attrs.field(default=None, validator=v.optional([finite, v.ge(0.0), v.le(1.0)]))
    seed: int | None = attrs.field(default=None, validator=v.optional([v.ge(0), v.lt(2**63)]))
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple, validator=token_ids)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = attrs.field(default=0, validator=[v.ge(0), v.le(20)])
    presence_penalty: float | None = attrs.field(default=None, validator=v.optional([finite, v.ge(-2.0), v.le(2.0)]))
    frequency_penalty: float | None = attrs.field(default=None,
                                                  validator=v.optional([finite, v.ge(-2.0), v.le(2.0)]))
    repetition_penalty: float | None = attrs.field(default=None, validator=v.optional([finite, v.gt(0.0)]))
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    min_tokens: int = attrs.field(default=0, validator=v.ge(0))

    @logit_bias.validator
    def _check_logit_bias(self, attribute, value):
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
        for token, bias in value:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative integer token ids, got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
        if len({t for t, _ in value}) != len(value):
            raise ValueError("logit_bias names a token id twice")

    @min_tokens.validator
    def _check_min_tokens(self, attribute, value):
        if self.max_tokens is not None and value > self.max_tokens:
            raise ValueError(f"min_tokens ({value}) must not exceed max_tokens ({self.max_tokens})")

    @stop.validator
    def _check_stop(self, attribute, value):
        for s in value:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string may hold at most {MAX_STOP_CHARS} characters, got one of {len(s)}")


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """One generation request. ``input`` is raw text/token ids, a chat, or an already PreparedPrompt.

    ``deadline_s`` is a wall-clock budget from submission; ``queue_timeout_s`` bounds
    time spent waiting for admission. ``constraint``: what the output must be (JSON, a schema, a regex, a
    choice, a grammar or tool calls; ``ninfer.contract.constraint``). ``session_key`` (OpenAI ``prompt_cache_key``) names the conversation:
    the context cache looks up its latest continuation first. ``cache_salt`` (vLLM's ``cache_salt``) is the
    request's context-cache scope: what a request saves is restored only for requests with the same salt
    (sessions included); requests without one share among themselves. ``context_cache=False``: the request
    neither restores from nor saves into the context cache (serve warmup).
    """

    input: TextInput | ChatInput | PreparedPrompt
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    deadline_s: float | None = attrs.field(default=None, validator=v.optional([finite, v.gt(0.0)]))
    queue_timeout_s: float | None = attrs.field(default=None, validator=v.optional([finite, v.gt(0.0)]))
    constraint: Constraint | None = attrs.field(default=None, validator=v.optional(v.instance_of(CONSTRAINT_TYPES)))
    request_id: str | None = None
    session_key: str | None = None
    cache_salt: str | None = attrs.field(default=None)
    context_cache: bool = True

    @cache_salt.validator
    def _check_cache_salt(self, attribute, value):
        if value is None:
            return
        if not isinstance(value, str) or not value:
            raise ValueError(f"cache_salt must be a non-empty string or None, got {value!r:.40}")
        if len(value) > MAX_CACHE_SALT_CHARS:
            raise ValueError(f"cache_salt may hold at most {MAX_CACHE_SALT_CHARS} characters, got {len(value)}")
