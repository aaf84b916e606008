"""What a GenerationHandle yields: one GenerationStart, output deltas, one final result."""

from __future__ import annotations

import enum

import attrs

from ninfer.contract.values import JSONObject


class FinishReason(enum.Enum):
    STOP = "stop"              # stop string, stop token or end of sequence
    LENGTH = "length"          # max_tokens or the context limit
    TOOL_CALLS = "tool_calls"  # the model finished with a structured tool call
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"
    GRAMMAR = "grammar"        # the request's constraint allowed no further token (the output is a valid prefix)


@attrs.frozen(kw_only=True)
class TokenLogprob:
    """One generated token's logprob. With a session that attributes tokens (``OutputDelta.token_spans``),
    ``token`` is the text the token added to ``channel`` ("content", "reasoning", or "none" with empty text for a
    token that added no visible text: a stop token, a think marker); ``part``: the entry
    continues the previous one's token, whose text spans both channels."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()
    channel: str = "content"
    part: bool = False


@attrs.frozen(kw_only=True)
class TokenSpan:
    """Generated token ``index`` (0-based in the request's output) added ``text`` to ``channel``; ``part``:
    the token's text began in another channel (its earlier span)."""

    index: int
    channel: str
    text: str
    part: bool = False


@attrs.frozen(kw_only=True)
class ToolCall:
    """A tool call, or in an OutputDelta one streamed fragment of it (OpenAI ``tool_calls[i]`` chunks).

    ``index`` orders the calls of one output. In deltas the first fragment of a call carries ``id`` and
    ``name`` (arguments ""), later fragments have empty ``id``/``name`` and carry ``arguments`` text to append;
    ``merge_tool_call_fragments`` turns fragments into complete calls (GenerationResult holds complete ones).
    """

    id: str
    name: str
    arguments: str  # JSON text, typed by the tool's schema
    index: int = 0


def merge_tool_call_fragments(fragments) -> tuple[ToolCall, ...]:
    """Complete calls from streamed fragments: grouped by index, id/name from the first, arguments joined."""
    calls: dict[int, list[str]] = {}
    for f in fragments:
        entry = calls.setdefault(f.index, [f.id, f.name, ""])
        entry[0] = entry[0] or f.id
        entry[1] = entry[1] or f.name
        entry[2] += f.arguments
    return tuple(ToolCall(index=i, id=e[0], name=e[1], arguments=e[2]) for i, e in sorted(calls.items()))


@attrs.frozen(kw_only=True)
class GenerationStart:
    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens restored from the context cache instead of computed


@attrs.frozen(kw_only=True)
class OutputDelta:
    """Newly committed output: text per channel, tool-call progress and the accepted token ids."""

    content: str = ""
    reasoning: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    # The tokens whose text this delta releases, when the session attributes text to tokens (None: it does
    # not, and every accepted token's logprob goes with the delta that accepts it).
    token_spans: tuple[TokenSpan, ...] | None = None


@attrs.frozen(kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, restored from the context cache (OpenAI prompt_tokens_details)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen(kw_only=True)
class Timings:
    queued_s: float = 0.0
    time_to_first_token_s: float | None = None
    end_to_end_s: float = 0.0
    preemptions: int = 0


@attrs.frozen(kw_only=True)
class GenerationResult:
    request_id: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    content: str = ""
    reasoning: str = ""
    token_ids: tuple[int, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    error: str | None = None
    extra: JSONObject = attrs.field(factory=dict)


Event = GenerationStart | OutputDelta | GenerationResult  # what a handle yields, in that order
