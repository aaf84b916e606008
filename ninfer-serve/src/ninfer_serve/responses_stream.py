"""Engine events -> a Responses API ``response`` object, whole or as its typed SSE event stream.

The output is a list of items opened and closed in order: a ``reasoning`` item (the thinking text, as
``reasoning_text`` content), a ``message`` with one ``output_text`` part, and a ``function_call`` item per
tool call. Streaming announces each item (``response.output_item.added``, its content part), sends its deltas
and closes it (``...done`` events) before the next one opens; every event carries a ``sequence_number``. The
builder has the chat builders' interface (start / delta / finish / end / whole), so the gateway's
generation flow serves both.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

from ninfer.contract.events import FinishReason, GenerationResult, OutputDelta, ToolCall
from ninfer.contract.values import JSON, JSONObject

# How a result that is not a plain stop reads (OpenAI's reasons; a deadline cut is a length limit).
_INCOMPLETE = {FinishReason.LENGTH: "max_output_tokens", FinishReason.DEADLINE: "max_output_tokens"}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def event_frame(event: JSONObject) -> str:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


class _Item:
    """One output item being built: ``kind`` is reasoning, message or function_call."""

    def __init__(self, kind: str, index: int, call: ToolCall | None = None) -> None:
        self.kind = kind
        self.index = index
        self.text: list[str] = []
        self.id = _item_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.call_id = (call.id if call is not None and call.id else _item_id("call"))
        self.name = call.name if call is not None else ""

    def body(self, status: str) -> JSONObject:
        text = "".join(self.text)
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": status}
        if self.kind == "message":
            content = [_output_text(text)] if status == "completed" else []
            return {"id": self.id, "type": "message", "role": "assistant", "status": status, "content": content}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": text if status == "completed" else "", "status": status}


def _output_text(text: str) -> JSONObject:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseBuilder:
    """Builds one ``response`` from one engine request's events. ``skeleton``: the response's request-side
    fields (model, instructions, tools, ...); ``on_done(body)`` is called once with the finished response."""

    def __init__(self, response_id: str, skeleton: JSONObject, *, stream: bool,
                 on_done: Callable[[JSONObject], None]) -> None:
        self.id = response_id
        self.skeleton = skeleton
        self.stream = stream
        self.on_done = on_done
        self.created_at = int(time.time())
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # engine tool-call index -> its item
        self.pending = ""  # content held back while it is only whitespace (between tool calls, after thinking)
        self.seq = 0
        self.prompt_tokens = self.cached_tokens = self.output_tokens = self.reasoning_tokens = 0
        self.status = "in_progress"
        self.incomplete: JSONObject | None = None

    # -- the response object ------------------------------------------------------------------------------
    def body(self) -> JSONObject:
        output = [item.body("completed") for item in self.items]
        usage = None
        if self.status != "in_progress":
            usage = {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                     "output_tokens": self.output_tokens,
                     "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                     "total_tokens": self.prompt_tokens + self.output_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
                "error": None, "incomplete_details": self.incomplete, **self.skeleton, "output": output,
                "usage": usage}

    def _event(self, kind: str, **fields: JSON) -> str:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event_frame(event)

    # -- items ---------------------------------------------------------------------------------------------
    def _open(self, kind: str, call: ToolCall | None = None) -> list[str]:
        frames = self._close()
        item = _Item(kind, len(self.items), call)
        self.items.append(item)
        self.open = item
        if not self.stream:
            return frames
        frames.append(self._event("response.output_item.added", output_index=item.index,
                                  item=item.body("in_progress")))
        if kind == "reasoning":
            frames.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                      content_index=0, part={"type": "reasoning_text", "text": ""}))
        elif kind == "message":
            frames.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                      content_index=0, part=_output_text("")))
        return frames

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None or not self.stream:
            return []
        text, where = "".join(item.text), {"item_id": item.id, "output_index": item.index}
        frames = []
        if item.kind == "reasoning":
            frames.append(self._event("response.reasoning_text.done", **where, content_index=0, text=text))
            frames.append(self._event("response.content_part.done", **where, content_index=0,
                                      part={"type": "reasoning_text", "text": text}))
        elif item.kind == "message":
            frames.append(self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            frames.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=_output_text(text)))
        else:
            frames.append(self._event("response.function_call_arguments.done", **where,
                                      arguments=text))
        frames.append(self._event("response.output_item.done", output_index=item.index, item=item.body("completed")))
        return frames

    def _text(self, kind: str, text: str) -> list[str]:
        frames = [] if self.open is not None and self.open.kind == kind else self._open(kind)
        item = self.open
        assert item is not None
        item.text.append(text)
        if self.stream:
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            frames.append(self._event(name, item_id=item.id, output_index=item.index, content_index=0, delta=text,
                                      **extra))
        return frames

    def _call(self, call: ToolCall) -> list[str]:
        item = self.calls.get(call.index)
        frames: list[str] = []
        if item is None:
            frames = self._open("function_call", call)
            item = self.calls[call.index] = self.open
            assert item is not None
        if call.name and not item.name:
            item.name = call.name
        if call.arguments:
            item.text.append(call.arguments)
            if self.stream and item is self.open:  # a call's fragments come together: its item is still open
                frames.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                          output_index=item.index, delta=call.arguments))
        return frames

    # -- the gateway's builder interface ---------------------------------------------------------------------
    def start(self, prompt_tokens: int, index: int = 0, *, cached_tokens: int = 0) -> list[str]:
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        if not self.stream:
            return []
        body = self.body()
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def delta(self, d: OutputDelta, index: int = 0) -> list[str]:
        self.output_tokens += len(d.token_ids)
        if d.reasoning and not d.content:
            self.reasoning_tokens += len(d.token_ids)
        frames = []
        if d.reasoning:
            frames += self._text("reasoning", d.reasoning)
        if d.content:
            if self.open is not None and self.open.kind == "message":
                frames += self._text("message", d.content)
            else:
                self.pending += d.content
                if self.pending.strip():
                    text, self.pending = self.pending, ""
                    frames += self._text("message", text)
        for call in d.tool_calls:
            frames += self._call(call)
        return frames

    def finish(self, result: GenerationResult, index: int = 0) -> list[str]:
        self.output_tokens = max(self.output_tokens, result.usage.completion_tokens)
        self.prompt_tokens = result.usage.prompt_tokens or self.prompt_tokens
        self.cached_tokens = result.usage.cached_tokens
        frames = self._close()
        reason = _INCOMPLETE.get(result.finish_reason)
        if result.finish_reason is FinishReason.CANCELLED:
            self.status = "cancelled"
        elif reason is not None:
            self.status, self.incomplete = "incomplete", {"reason": reason}
        else:
            self.status = "completed"
        body = self.body()
        self.on_done(body)
        if self.stream:
            kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
            frames.append(self._event(kind, response=body))
        return frames

    def end(self) -> list[str]:
        return []

    def whole(self, results: list[GenerationResult]) -> JSONObject:
        (result,) = results
        self.finish(result)
        return self.body()
