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


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Per-request sampling. ``None`` fields take the model's generation defaults (from the artifact).

    temperature 0 means greedy. ``seed`` makes sampling reproducible per request,
    independent of batch neighbours and of preemption.
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
