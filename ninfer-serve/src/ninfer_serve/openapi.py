"""``/openapi.json``: an OpenAPI 3.1 document generated from the attrs request schemas (schemas.py), so
clients and fuzzers see exactly the bodies the strict converter accepts."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union

import attrs

from ninfer.contract.values import JSONObject
from ninfer_serve.json_body import MAX_JSON_DEPTH
from ninfer_serve.responses_api import ResponsesRequest
from ninfer_serve.schemas import MESSAGE_CLASSES, ChatCompletionRequest, CompletionRequest, TypeHint
from ninfer_serve.tokenizer_routes import DetokenizeRequest, TokenizeRequest

_PRIMITIVES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def json_schema(t: TypeHint, components: JSONObject) -> JSONObject:
    """The JSON Schema of a type annotation; attrs classes go to ``components`` and are referenced."""
    origin = typing.get_origin(t)
    if t is Any:
        return {}
    if t in _PRIMITIVES:
        return {"type": _PRIMITIVES[t]}
    if origin is Literal:
        return {"type": "string", "enum": list(typing.get_args(t))}
    if origin in (Union, types.UnionType):
        return {"anyOf": [json_schema(a, components) for a in typing.get_args(t)]}
    if origin is list:
        (item,) = typing.get_args(t)
        return {"type": "array", "items": json_schema(item, components)}
    if origin is dict:
        _, value = typing.get_args(t)
        return {"type": "object", "additionalProperties": json_schema(value, components)}
    if attrs.has(t):
        name = t.__name__
        if name not in components:
            components[name] = {}  # placeholder: a recursive reference resolves to the same name
            components[name] = _object_schema(t, components)
        return {"$ref": f"#/components/schemas/{name}"}
    raise TypeError(f"no JSON Schema for {t!r}")


def _object_schema(cls: type, components: JSONObject) -> JSONObject:
    hints = typing.get_type_hints(cls)
    properties: JSONObject = {}
    required = []
    for field in attrs.fields(cls):
        schema = json_schema(hints[field.name], components)
        if field.default is attrs.NOTHING:
            required.append(field.name)
        elif not isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            schema = {**schema, "default": field.default}
        properties[field.name] = schema
    # inside messages unknown keys are ignored, everywhere else refused
    out: JSONObject = {"type": "object", "properties": properties,
                           "additionalProperties": cls in MESSAGE_CLASSES}
    if required:
        out["required"] = required
    if cls.__doc__:
        out["description"] = " ".join(cls.__doc__.split())
    return out


_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}

_ERRORS = {status: {"description": text, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/Error"}}}}
    for status, text in (("400", "invalid request (the parameter is named in `param`)"),
                         ("401", "missing or wrong API key"), ("404", "unknown model"),
                         ("408", "the body did not arrive within the body timeout"),
                         ("413", "the body is too large"), ("415", "the body is not application/json"),
                         ("429", "overloaded; retry after Retry-After seconds"),
                         ("500", "internal error (with a request id)"),
                         ("503", "queue timeout, shutting down or closed; retry after Retry-After seconds"))}


def _generation(summary: str, schema: JSONObject) -> JSONObject:
    return {"post": {
        "summary": summary, "security": [{"bearer": []}, {}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": {"description": "the completion as JSON, or as `text/event-stream` when `stream` "
                                             "is true (`data: {chunk}` events, then `data: [DONE]`)",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                      **_ERRORS}}}


def _tokenizer_post(summary: str, schema: JSONObject) -> JSONObject:
    return {"post": {"summary": summary, "security": [{"bearer": []}, {}],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                     "responses": {"200": {"description": summary, "content": {"application/json": {
                         "schema": {"type": "object"}}}}, **{k: _ERRORS[k] for k in ("400", "401", "415")}}}}


def _get(summary: str, *, secured: bool, content_type: str = "application/json") -> JSONObject:
    op: JSONObject = {"summary": summary, "responses": {"200": {
        "description": summary, "content": {content_type: {"schema": {"type": "object" if content_type ==
                                                                       "application/json" else "string"}}}}}}
    if secured:
        op["security"] = [{"bearer": []}, {}]
        op["responses"]["401"] = _ERRORS["401"]
    return {"get": op}


def _responses(schema: JSONObject) -> JSONObject:
    """``POST /v1/responses``: ``input`` items are checked by their ``type`` when translated (their shapes
    are OpenAI's), so the schema lists them as objects."""
    op = _generation("a Responses API response", schema)
    op["post"]["responses"]["200"]["description"] = ("the response object as JSON, or as `text/event-stream` when "
                                                     "`stream` is true (typed `event:` / `data:` events)")
    op["post"]["responses"]["404"] = {**_ERRORS["404"], "description": "unknown model, or `previous_response_id` "
                                                                       "not stored (never, deleted or evicted)"}
    return op


def _stored_response() -> JSONObject:
    param = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    not_found = {**_ERRORS["404"], "description": "no such stored response (never stored, deleted or evicted)"}
    ops = {"get": _get("a stored response", secured=True)["get"],
           "delete": _get("delete a stored response", secured=True)["get"]}
    for op in ops.values():
        op["parameters"] = param
        op["responses"]["404"] = not_found
    return ops


def openapi_document(*, title: str, version: str) -> JSONObject:
    """The document served at ``/openapi.json``; ``security`` lists the bearer key as optional because
    it is required only when the server runs with --api-key."""
    components: JSONObject = {}
    chat = json_schema(ChatCompletionRequest, components)
    completion = json_schema(CompletionRequest, components)
    responses = json_schema(ResponsesRequest, components)
    tokenize = json_schema(TokenizeRequest, components)
    detokenize = json_schema(DetokenizeRequest, components)
    components["Error"] = _ERROR
    model_get = _get("one model", secured=True)
    model_get["get"]["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    model_get["get"]["responses"]["404"] = _ERRORS["404"]
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible chat and text completions. Request bodies are checked exactly: "
                                "unknown keys (except inside messages, where they are ignored), wrong types, text "
                                f"that is not Unicode and JSON nested more than {MAX_JSON_DEPTH} levels answer 400."},
        "paths": {
            "/v1/chat/completions": _generation("chat completion", chat),
            "/v1/completions": _generation("text completion", completion),
            "/v1/responses": _responses(responses),
            "/v1/responses/{response_id}": _stored_response(),
            "/v1/models": _get("the served model", secured=True),
            "/v1/models/{model}": model_get,
            "/tokenize": _tokenizer_post("token ids of a prompt or of chat messages (vLLM's shape)", tokenize),
            "/detokenize": _tokenizer_post("the text of token ids (vLLM's shape)", detokenize),
            "/tokenizer_info": _get("the tokenizer's special tokens and context length", secured=True),
            "/health": _get("health: 200 while the engine serves, 503 once it has failed", secured=False),
            "/metrics": _get("Prometheus metrics", secured=False, content_type="text/plain"),
        },
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
