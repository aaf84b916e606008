"""``/v1/responses``: create (whole or streamed), retrieve and delete, over the gateway's generation flow.

A create is translated into the chat request it means (ninfer_serve.responses_api), checked, prepared and
generated exactly as a chat completion is; only the response object and its events differ
(ninfer_serve.responses_stream). A finished response (completed or incomplete) is stored unless ``store`` is
false, for ``previous_response_id`` and ``GET`` (ninfer_serve.responses_store).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ninfer.contract.values import JSON, JSONObject
from ninfer_serve.access import key_scope
from ninfer_serve.drain import refused_while_stopping
from ninfer_serve.errors import APIError
from ninfer_serve.json_body import parse_json
from ninfer_serve.offload import ClientGone, unless_ended
from ninfer_serve.responses import DONE
from ninfer_serve.responses_api import (
    ResponsesRequest,
    chat_completion,
    input_messages,
    renamed,
    stored_size,
)
from ninfer_serve.responses_store import ResponseStore, StoredResponse
from ninfer_serve.responses_stream import ResponseBuilder
from ninfer_serve.schemas import ChatMessage, MessageToolCall, ToolCallFunction, structure
from ninfer_serve.translate import ResponseOptions, chat_request

if TYPE_CHECKING:  # the Gateway builds these endpoints on itself
    from ninfer_serve.app import Gateway

ENDPOINT = "responses"  # the metrics' endpoint label


async def _without_done(frames: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """The gateway's stream less its closing ``data: [DONE]``: a Responses stream ends with its last typed
    event, and strict clients parse every ``data:`` as an event."""
    try:
        async for frame in frames:
            if frame != DONE:
                yield frame
    finally:
        await frames.aclose()  # the gateway's generator: closes the handles


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"No response with id '{response_id[:120]}' is stored (never stored, deleted, or evicted "
                         "from the server's bounded response store)", type="invalid_request_error", param=param,
                    code="response_not_found")


def output_message(body: JSONObject) -> ChatMessage | None:
    """A response's output as the assistant message the next turn's template sees."""
    text, reasoning, calls = [], [], []
    for item in body["output"]:
        if item["type"] == "message":
            text += [part["text"] for part in item["content"]]
        elif item["type"] == "reasoning":
            reasoning += [part["text"] for part in item["content"]]
        else:
            calls.append(MessageToolCall(id=item["call_id"], function=ToolCallFunction(
                name=item["name"], arguments=item["arguments"] or "{}")))
    if not (text or calls):
        return None
    return ChatMessage(role="assistant", content="".join(text) if text else None, tool_calls=calls or None,
                       reasoning_content="".join(reasoning) or None)


def _skeleton(req: ResponsesRequest, model: str) -> JSONObject:
    """The request-side fields of the response object, as OpenAI echoes them."""
    fmt: JSONObject = {"type": "text"}
    if req.text is not None and req.text.format is not None:
        fmt = {k: v for k, v in attrs.asdict(req.text.format).items() if v is not None}
    tc = req.tool_choice
    choice: JSON = tc if isinstance(tc, str) else "auto" if tc is None else {"type": "function", "name": tc.name}
    effort = req.reasoning.effort if req.reasoning is not None else None
    return {"model": model, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "metadata": dict(req.metadata or {}),
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": effort, "summary": None},
            "store": req.store is not False, "temperature": req.temperature, "text": {"format": fmt},
            "tool_choice": choice, "tools": [attrs.asdict(t) for t in req.tools or []], "top_p": req.top_p,
            "truncation": "disabled", "user": req.user, "background": False, "service_tier": "default"}


class ResponsesEndpoints:
    """The three routes, bound to a ``Gateway`` (ninfer_serve.app) and a ``ResponseStore``."""

    def __init__(self, gateway: Gateway, store: ResponseStore) -> None:
        self.gw = gateway
        self.store = store

    async def create(self, request: Request) -> Response:
        gw = self.gw
        if gw.drain.stopping:
            raise refused_while_stopping(gw.retry_after_s)
        from ninfer_serve.app import _require_json  # the app's rule for bodies, shared, not copied

        _require_json(request)
        req = structure(parse_json(await gw._read_body(request)), ResponsesRequest)
        gw._check_model(req.model)
        rid = request.state.request_id
        scope = key_scope(request.scope)
        response_id = f"resp_{rid}"
        prior: tuple[ChatMessage, ...] = ()
        session_key = req.prompt_cache_key or response_id
        if req.previous_response_id is not None:
            held = self.store.get(scope, req.previous_response_id)
            if held is None:
                raise _not_found(req.previous_response_id, "previous_response_id")
            prior, session_key = held.messages, held.session_key
        new = input_messages(req.input)
        try:
            chat = chat_completion(req, list(prior), new, session_key)
            gen, options = chat_request(chat, queue_timeout_s=gw.queue_timeout_s, request_id=rid, key_scope=scope)
            gw._check_budget(gen)
        except APIError as exc:
            raise renamed(exc) from None

        def on_done(body: JSONObject) -> None:
            if req.store is False or body["status"] not in ("completed", "incomplete"):
                return
            out = output_message(body)
            messages = (*prior, *new, *([out] if out is not None else []))
            self.store.put(scope, response_id, StoredResponse(messages=messages, session_key=session_key, body=body,
                                                              size=stored_size(list(messages), body)))

        def builder(_rid: str, model: str, _options: ResponseOptions) -> ResponseBuilder:
            return ResponseBuilder(response_id, _skeleton(req, model), stream=req.stream, on_done=on_done)

        try:
            gen = await unless_ended(gw.drain, gw.media.attach(request, chat, gen, gw.engine.vision_enabled),
                                     retry_after_s=gw.retry_after_s)
        except ClientGone:
            gw.metrics.disconnects.labels(ENDPOINT).inc()
            return Response(status_code=499)
        except APIError as exc:  # a refused image names its place in the chat request
            raise renamed(exc) from None
        try:
            response = await gw._generate(request, ENDPOINT, gen, options, builder, rid)
        except APIError as exc:
            raise renamed(exc) from None
        if isinstance(response, StreamingResponse):
            response.body_iterator = _without_done(response.body_iterator)
        return response

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        held = self.store.get(key_scope(request.scope), response_id)
        if held is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(held.body)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(key_scope(request.scope), response_id):
            raise _not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
