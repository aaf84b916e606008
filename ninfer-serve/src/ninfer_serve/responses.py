"""Response schema: engine events -> OpenAI chat / text completion objects, chunks and SSE frames."""

from __future__ import annotations

import json
import math
import time
from typing import Any

from ninfer.contract.events import FinishReason, GenerationResult, OutputDelta, TokenLogprob, ToolCall
from ninfer_serve.translate import ResponseOptions

DONE = "data: [DONE]\n\n"

# OpenAI has no "deadline" or "cancelled": a deadline cut is a length limit; "abort" is vLLM's word.
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.TOOL_CALLS: "tool_calls",
           FinishReason.DEADLINE: "length", FinishReason.CANCELLED: "abort", FinishReason.ERROR: "error"}


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def finish_reason(reason: FinishReason) -> str:
    return _FINISH[reason]


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(items: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict[str, Any]:
    content = []
    for t in items:
        entry = _token_entry(t.token, t.logprob)
        entry["top_logprobs"] = [_token_entry(tok, lp) for _, tok, lp in t.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """Legacy completions logprobs; ``offset`` is the text length already sent (for text_offset)."""
    tokens, lps, tops, offsets = [], [], [], []
    for t in items:
        tokens.append(t.token)
        lps.append(_lp(t.logprob))
        tops.append({tok: _lp(lp) for _, tok, lp in t.top} if t.top else None)
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ToolCallIndexer:
    """Accumulates streamed tool-call fragments (``ToolCall.index`` names the call: the first fragment
    brings id and name, later ones argument text to append) into OpenAI ``tool_calls``."""

    def __init__(self) -> None:
        self._slot: dict[int, int] = {}
        self.calls: list[dict[str, Any]] = []

    def add(self, call: ToolCall) -> dict[str, Any]:
        if call.index in self._slot:
            i = self._slot[call.index]
            fn = self.calls[i]["function"]
            fn["arguments"] += call.arguments
            out: dict[str, Any] = {"index": i, "function": {"arguments": call.arguments}}
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


class ChatResponse:
    """Builds one chat completion, streamed as chunks or whole, from the handle's events."""

    object_chunk = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, options: ResponseOptions) -> None:
        self.id = f"chatcmpl-{request_id}"
        self.model = model
        self.options = options
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.tools = ToolCallIndexer()

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {"id": self.id, "object": self.object_chunk, "created": self.created, "model": self.model,
               "system_fingerprint": None, "choices": choices}
        if self.options.continuous_usage and choices:
            out["usage"] = usage(self.prompt_tokens, self.completion_tokens)
        out.update(extra)
        return out

    def start(self, prompt_tokens: int) -> list[str]:
        self.prompt_tokens = prompt_tokens
        if not self.options.stream:
            return []
        return [sse(self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]))]

    def delta(self, d: OutputDelta) -> list[str]:
        self.completion_tokens += len(d.token_ids)
        self.content.append(d.content)
        self.reasoning.append(d.reasoning)
        self.logprobs.extend(d.logprobs)
        calls = [self.tools.add(c) for c in d.tool_calls]
        if not self.options.stream:
            return []
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
            delta["reasoning"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if calls:
            delta["tool_calls"] = calls
        if not delta and not (self.options.logprobs and d.logprobs):
            return []
        lp = chat_logprobs(d.logprobs) if self.options.logprobs else None
        return [sse(self._chunk([{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": None}]))]

    def finish(self, result: GenerationResult) -> list[str]:
        self.completion_tokens = max(self.completion_tokens, result.usage.completion_tokens)
        self.prompt_tokens = result.usage.prompt_tokens or self.prompt_tokens
        out = [sse(self._chunk([{"index": 0, "delta": {}, "logprobs": None,
                                 "finish_reason": self._finish_reason(result)}]))]
        if self.options.include_usage:
            out.append(sse(self._chunk([], usage=usage(self.prompt_tokens, self.completion_tokens))))
        return out

    def _finish_reason(self, result: GenerationResult) -> str:
        if self.tools.calls and result.finish_reason in (FinishReason.STOP, FinishReason.TOOL_CALLS):
            return "tool_calls"
        return finish_reason(result.finish_reason)

    def whole(self, result: GenerationResult) -> dict[str, Any]:
        self.completion_tokens = max(self.completion_tokens, result.usage.completion_tokens)
        self.prompt_tokens = result.usage.prompt_tokens or self.prompt_tokens
        content = "".join(self.content)
        reasoning = "".join(self.reasoning)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if self.tools.calls else ""),
                                   "reasoning_content": reasoning or None, "reasoning": reasoning or None,
                                   "tool_calls": self.tools.calls}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "message": message,
                             "logprobs": chat_logprobs(self.logprobs) if self.options.logprobs else None,
                             "finish_reason": self._finish_reason(result)}],
                "usage": usage(self.prompt_tokens, self.completion_tokens)}


class CompletionResponse:
    """Builds one legacy text completion (``text_completion`` objects) from the handle's events."""

    def __init__(self, request_id: str, model: str, options: ResponseOptions) -> None:
        self.id = f"cmpl-{request_id}"
        self.model = model
        self.options = options
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.text: list[str] = []
        self.sent = 0  # characters of text so far, for text_offset
        self.logprobs: list[TokenLogprob] = []

    def _obj(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
               "system_fingerprint": None, "choices": choices}
        if self.options.stream and self.options.continuous_usage and choices:
            out["usage"] = usage(self.prompt_tokens, self.completion_tokens)
        out.update(extra)
        return out

    def start(self, prompt_tokens: int) -> list[str]:
        self.prompt_tokens = prompt_tokens
        return []

    def delta(self, d: OutputDelta) -> list[str]:
        self.completion_tokens += len(d.token_ids)
        text = d.reasoning + d.content
        lp = completion_logprobs(list(d.logprobs), self.sent) if self.options.logprobs else None
        self.text.append(text)
        self.sent += len(text)
        self.logprobs.extend(d.logprobs)
        if not self.options.stream or not (text or lp and lp["tokens"]):
            return []
        return [sse(self._obj([{"index": 0, "text": text, "logprobs": lp, "finish_reason": None}]))]

    def finish(self, result: GenerationResult) -> list[str]:
        self.completion_tokens = max(self.completion_tokens, result.usage.completion_tokens)
        self.prompt_tokens = result.usage.prompt_tokens or self.prompt_tokens
        out = [sse(self._obj([{"index": 0, "text": "", "logprobs": None,
                               "finish_reason": finish_reason(result.finish_reason)}]))]
        if self.options.include_usage:
            out.append(sse(self._obj([], usage=usage(self.prompt_tokens, self.completion_tokens))))
        return out

    def whole(self, result: GenerationResult) -> dict[str, Any]:
        self.completion_tokens = max(self.completion_tokens, result.usage.completion_tokens)
        self.prompt_tokens = result.usage.prompt_tokens or self.prompt_tokens
        lp = completion_logprobs(self.logprobs, 0) if self.options.logprobs else None
        return self._obj([{"index": 0, "text": "".join(self.text), "logprobs": lp,
                           "finish_reason": finish_reason(result.finish_reason)}],
                         usage=usage(self.prompt_tokens, self.completion_tokens))
