"""Response schema: engine events -> OpenAI chat / text completion objects, chunks and SSE frames."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Protocol

from ninfer.contract.events import FinishReason, GenerationResult, OutputDelta, TokenLogprob, ToolCall
from ninfer.contract.request import GenerationRequest
from ninfer.contract.values import JSON, JSONObject
from ninfer_serve.translate import ResponseOptions

DONE = "data: [DONE]\n\n"

# OpenAI has no "deadline" or "cancelled": a deadline cut is a length limit; "abort" is vLLM's word. "grammar":
# the request's constraint allowed no further token (no OpenAI word either; the output is a valid prefix).
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.TOOL_CALLS: "tool_calls",
           FinishReason.DEADLINE: "length", FinishReason.CANCELLED: "abort", FinishReason.ERROR: "error",
           FinishReason.GRAMMAR: "grammar"}


class ResponseBuilding(Protocol):
    """What the gateway asks of a response builder (chat, text completion, ``/v1/responses``): SSE frames per
    event of choice ``index``, the frames after every choice ended, or the whole answer."""

    def start(self, prompt_tokens: int, index: int = 0, *, cached_tokens: int = 0) -> list[str]: ...

    def delta(self, d: OutputDelta, index: int = 0) -> list[str]: ...

    def finish(self, result: GenerationResult, index: int = 0) -> list[str]: ...

    def end(self) -> list[str]: ...

    def whole(self, results: list[GenerationResult]) -> JSONObject: ...


# A parsed body -> its engine request and response options; what builds the answer (id, model, options).
Translate = Callable[..., tuple[GenerationRequest, ResponseOptions]]
BuilderFactory = Callable[[str, str, ResponseOptions], ResponseBuilding]


def sse(obj: JSONObject) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def finish_reason(reason: FinishReason) -> str:
    return _FINISH[reason]


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf


def _token_entry(token: str, logprob: float) -> JSONObject:
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(items: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> JSONObject:
    """``logprobs.content``: the content tokens only (not reasoning, think markers or tool-call markup),
    each with the text it added to the content, so their texts joined are the content."""
    content = []
    for t in items:
        if t.channel != "content":
            continue
        entry = _token_entry(t.token, t.logprob)
        entry["top_logprobs"] = [_token_entry(tok, lp) for _, tok, lp in t.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(items: list[TokenLogprob], offset: int) -> JSONObject:
    """Legacy completions logprobs; ``offset`` is the text length already sent (for text_offset). A token
    whose text spans reasoning and content (``part``) is one entry with its whole text."""
    tokens, lps, tops, offsets = [], [], [], []
    for t in items:
        if t.part and tokens:
            tokens[-1] += t.token
            offset += len(t.token)
            continue
        tokens.append(t.token)
        lps.append(_lp(t.logprob))
        tops.append({tok: _lp(lp) for _, tok, lp in t.top} if t.top else None)
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> JSONObject:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens restored from the context cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ToolCallIndexer:
    """Accumulates streamed tool-call fragments (``ToolCall.index`` names the call: the first fragment
    brings id and name, later ones argument text to append) into OpenAI ``tool_calls``."""

    def __init__(self) -> None:
        self._slot: dict[int, int] = {}
        self.calls: list[JSONObject] = []

    def add(self, call: ToolCall) -> JSONObject:
        if call.index in self._slot:
            i = self._slot[call.index]
            fn = self.calls[i]["function"]
            fn["arguments"] += call.arguments
            out: JSONObject = {"index": i, "function": {"arguments": call.arguments}}
            if call.name and not fn["name"]:
                fn["name"] = out["function"]["name"] = call.name
            if call.id and not self.calls[i]["id"]:
                self.calls[i]["id"] = out["id"] = call.id
            return out
        i = self._slot[call.index] = len(self.calls)
        self.calls.append({"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}})
        return {"index": i, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}


class _Choice:
    """What one choice has produced so far."""

    def __init__(self) -> None:
        self.completion_tokens = 0
        self.cached_tokens: int | None = None  # known from its GenerationStart or its result
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.tools = ToolCallIndexer()
        self.sent = 0  # characters of text so far (legacy text_offset)

    def add(self, d: OutputDelta) -> list[JSONObject]:
        self.completion_tokens += len(d.token_ids)
        self.content.append(d.content)
        self.reasoning.append(d.reasoning)
        self.logprobs.extend(d.logprobs)
        return [self.tools.add(c) for c in d.tool_calls]

    def settle(self, result: GenerationResult) -> None:
        self.completion_tokens = max(self.completion_tokens, result.usage.completion_tokens)
        self.cached_tokens = result.usage.cached_tokens


class _Response:
    """Shared bookkeeping of a response with ``options.n`` choices (one engine request each)."""

    def __init__(self, id: str, model: str, options: ResponseOptions) -> None:
        self.id = id
        self.model = model
        self.options = options
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.choices = [_Choice() for _ in range(options.n)]

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Of the prompt (counted once), the tokens restored from the context cache: the fewest any choice
        restored, so the figure never claims a restore that some choice's prompt did not have."""
        return min((c.cached_tokens for c in self.choices if c.cached_tokens is not None), default=0)

    def usage(self) -> JSONObject:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def _obj(self, kind: str, choices: list[JSONObject], **extra: JSON) -> JSONObject:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
               "system_fingerprint": None, "choices": choices}
        if self.options.stream and self.options.continuous_usage and choices:
            out["usage"] = self.usage()
        out.update(extra)
        return out

    def _settle(self, result: GenerationResult, index: int) -> None:
        self.choices[index].settle(result)
        self.prompt_tokens = result.usage.prompt_tokens or self.prompt_tokens

    def _started(self, prompt_tokens: int, index: int, cached_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.choices[index].cached_tokens = cached_tokens

    def end(self) -> list[str]:
        """After every choice finished: the usage chunk when asked for (``choices: []``)."""
        if not self.options.include_usage:
            return []
        return [sse(self._obj(self.chunk_kind, [], usage=self.usage()))]


class ChatResponse(_Response):
    """Builds one chat completion, streamed as chunks or whole, from the handles' events."""

    chunk_kind = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, options: ResponseOptions) -> None:
        super().__init__(f"chatcmpl-{request_id}", model, options)

    def start(self, prompt_tokens: int, index: int = 0, *, cached_tokens: int = 0) -> list[str]:
        """Choice ``index`` was admitted (its ``GenerationStart``): the prompt's size and its cached part."""
        self._started(prompt_tokens, index, cached_tokens)
        if not self.options.stream:
            return []
        return [sse(self._obj(self.chunk_kind, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]))]

    def delta(self, d: OutputDelta, index: int = 0) -> list[str]:
        calls = self.choices[index].add(d)
        if not self.options.stream:
            return []
        delta: JSONObject = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
            delta["reasoning"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if calls:
            delta["tool_calls"] = calls
        if not delta and not (self.options.logprobs and any(t.channel == "content" for t in d.logprobs)):
            return []
        lp = chat_logprobs(d.logprobs) if self.options.logprobs else None
        return [sse(self._obj(self.chunk_kind, [{"index": index, "delta": delta, "logprobs": lp,
                                                 "finish_reason": None}]))]

    def finish(self, result: GenerationResult, index: int = 0) -> list[str]:
        self._settle(result, index)
        return [sse(self._obj(self.chunk_kind, [{"index": index, "delta": {}, "logprobs": None,
                                                 "finish_reason": self._finish_reason(result, index)}]))]

    def _finish_reason(self, result: GenerationResult, index: int) -> str:
        if self.choices[index].tools.calls and result.finish_reason in (FinishReason.STOP, FinishReason.TOOL_CALLS):
            return "tool_calls"
        return finish_reason(result.finish_reason)

    def whole(self, results: list[GenerationResult]) -> JSONObject:
        out = []
        for i, (choice, result) in enumerate(zip(self.choices, results, strict=True)):
            self._settle(result, i)
            content, reasoning = "".join(choice.content), "".join(choice.reasoning)
            message = {"role": "assistant", "content": content or (None if choice.tools.calls else ""),
                       "reasoning_content": reasoning or None, "reasoning": reasoning or None}
            if choice.tools.calls:  # absent when there are none, as in OpenAI's responses
                message["tool_calls"] = choice.tools.calls
            out.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(choice.logprobs) if self.options.logprobs else None,
                        "finish_reason": self._finish_reason(result, i)})
        return self._obj("chat.completion", out, usage=self.usage())


class CompletionResponse(_Response):
    """Builds one legacy text completion (``text_completion`` objects) from the handles' events."""

    chunk_kind = "text_completion"

    def __init__(self, request_id: str, model: str, options: ResponseOptions) -> None:
        super().__init__(f"cmpl-{request_id}", model, options)

    def start(self, prompt_tokens: int, index: int = 0, *, cached_tokens: int = 0) -> list[str]:
        self._started(prompt_tokens, index, cached_tokens)
        return []

    def delta(self, d: OutputDelta, index: int = 0) -> list[str]:
        choice = self.choices[index]
        text = d.reasoning + d.content
        lp = completion_logprobs(list(d.logprobs), choice.sent) if self.options.logprobs else None
        choice.add(d)
        choice.sent += len(text)
        if not self.options.stream or not (text or lp and lp["tokens"]):
            return []
        return [sse(self._obj(self.chunk_kind, [{"index": index, "text": text, "logprobs": lp,
                                                 "finish_reason": None}]))]

    def finish(self, result: GenerationResult, index: int = 0) -> list[str]:
        self._settle(result, index)
        return [sse(self._obj(self.chunk_kind, [{"index": index, "text": "", "logprobs": None,
                                                 "finish_reason": finish_reason(result.finish_reason)}]))]

    def whole(self, results: list[GenerationResult]) -> JSONObject:
        out = []
        for i, (choice, result) in enumerate(zip(self.choices, results, strict=True)):
            self._settle(result, i)
            text = "".join(r + c for r, c in zip(choice.reasoning, choice.content, strict=True))
            lp = completion_logprobs(choice.logprobs, 0) if self.options.logprobs else None
            out.append({"index": i, "text": text, "logprobs": lp,
                        "finish_reason": finish_reason(result.finish_reason)})
        return self._obj("text_completion", out, usage=self.usage())
