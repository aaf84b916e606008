"""OpenAI request bodies as frozen attrs classes, structured strictly with cattrs.

Types are checked exactly (no ``int("3")``, no ``bool("false")``); unknown keys are refused as OpenAI does,
except inside messages (clients send replies back with vendor fields: ninfer_serve.message_fields); range
checks run after structuring and name the parameter. Fields OpenAI clients commonly send that ninfer cannot
honour are accepted only at their neutral value (``best_of: 1``): nothing is silently ignored.
"""

from __future__ import annotations

import json
import math
import types
import typing
from typing import Any, Literal, TypeVar, Union

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from ninfer.contract.values import JSON
from ninfer_serve.errors import APIError, bad_request
from ninfer_serve.message_fields import ignore_unknown_keys

T = TypeVar("T")
TypeHint = object  # a type as typing spells it: a class, Literal[...], a union, list[...], Any


# ---------------------------------------------------------------- shared pieces


@attrs.frozen(kw_only=True)
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


@attrs.frozen(kw_only=True)
class FunctionDef:
    name: str
    description: str | None = None
    parameters: dict[str, JSON] | None = None
    strict: bool | None = None


@attrs.frozen(kw_only=True)
class Tool:
    type: Literal["function"]
    function: FunctionDef


@attrs.frozen(kw_only=True)
class ToolCallFunction:
    name: str
    arguments: str | dict[str, JSON] = "{}"


@attrs.frozen(kw_only=True)
class MessageToolCall:
    type: Literal["function"] = "function"
    id: str | None = None
    function: ToolCallFunction


@attrs.frozen(kw_only=True)
class NamedFunction:
    name: str


@attrs.frozen(kw_only=True)
class NamedToolChoice:
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"]
    function: NamedFunction


@attrs.frozen(kw_only=True)
class JsonSchemaFormat:
    """OpenAI ``response_format.json_schema`` (``name`` is optional here: llama.cpp clients omit it)."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, JSON] | None = None
    strict: bool | None = None


@attrs.frozen(kw_only=True)
class ResponseFormat:
    """OpenAI ``response_format``; ``schema`` with ``json_object`` is llama.cpp's extension. ``structural_tag``
    (vLLM, with its ``format``/``structures``/``triggers``) is recognised only to be refused by name."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    schema: dict[str, JSON] | None = None
    format: JSON = None
    structures: JSON = None
    triggers: JSON = None


@attrs.frozen(kw_only=True)
class StructuredOutputs:
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, as an object or JSON text), ``regex``,
    ``choice``, ``grammar`` (GBNF, or Lark with a ``start`` rule) and ``json_object``; or, as vLLM allows beside
    ``response_format``, only ``disable_any_whitespace`` (None: the server's default)."""

    json: dict[str, JSON] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: JSON = None
    disable_any_whitespace: bool | None = None


@attrs.frozen(kw_only=True)
class ImageURL:
    """OpenAI's ``image_url`` object; ``detail`` is accepted at its neutral value ("auto") only."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


@attrs.frozen(kw_only=True)
class VideoURL:
    """``video_url``: a video as its sampled frames (``url``: the frames' URLs in time order), taken at ``fps``."""

    url: str | list[str]
    fps: float | None = None


@attrs.frozen(kw_only=True)
class ContentPart:
    """One part of a message's content. Media (ninfer_serve.media): ``image_url`` (OpenAI; also in
    ``input_image``), ``image`` (Qwen's form: the URL), ``video_url`` and ``video`` (Qwen's form: the frames'
    URLs, with ``fps``)."""

    type: Literal["text", "image_url", "input_image", "image", "video_url", "video", "input_audio", "file"]
    text: str | None = None
    image_url: str | ImageURL | None = None
    image: str | None = None
    video_url: VideoURL | None = None
    video: str | list[str] | None = None
    fps: float | None = None
    input_audio: dict[str, JSON] | None = None
    file: dict[str, JSON] | None = None


@attrs.frozen(kw_only=True)
class ChatMessage:
    """OpenAI's message schema in full (what ``message.model_dump()`` sends back). Unknown keys inside a message
    (vendor fields such as LiteLLM's ``provider_specific_fields``) are ignored: ninfer_serve.message_fields.
    How each field is used: translate.py and docs/serving.md, "Messages"."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    function_call: ToolCallFunction | None = None  # the deprecated form of one tool call
    audio: dict[str, JSON] | None = None  # a reference to an earlier audio reply: ignored
    annotations: list[JSON] | None = None  # citations on an earlier reply: ignored


@attrs.frozen(kw_only=True)
class _SamplingFields:
    """Fields shared by chat and text completions (OpenAI plus the common vLLM extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_cache_key: str | None = None  # OpenAI's session hint -> GenerationRequest.session_key
    cache_salt: str | None = None  # vLLM's cache isolation -> GenerationRequest.cache_salt
    # Constrained decoding (ninfer_serve.constraints): OpenAI, vLLM and llama.cpp spellings.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    grammar: str | None = None  # llama.cpp: GBNF
    json_schema: dict[str, JSON] | None = None  # llama.cpp: a JSON Schema, {} for any JSON
    # Logit adjustments (OpenAI, vLLM): ninfer.contract.SamplingParams documents each.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    user: str | None = None


@attrs.frozen(kw_only=True)
class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    reasoning_effort: str | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, JSON] | None = None
    metadata: dict[str, JSON] | None = None
    store: bool | None = None
    service_tier: str | None = None


@attrs.frozen(kw_only=True)
class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for text completions (null means the same: translate.py)
    max_completion_tokens: int | None = None  # chat's spelling, which some clients send here too
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM: each prompt token's logprob with this many alternatives
    suffix: str | None = None
    best_of: int | None = None


GenerationBody = ChatCompletionRequest | CompletionRequest  # a body the sampling translation reads
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | None


# Inside messages unknown keys are ignored (ninfer_serve.message_fields); leaves first.
MESSAGE_CLASSES = (ToolCallFunction, MessageToolCall, ContentPart, ChatMessage)


# ---------------------------------------------------------------- strict converter


def _type_name(t: TypeHint) -> str:
    origin = typing.get_origin(t)
    if t is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in typing.get_args(t))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(t))
    if origin is list:
        (item,) = typing.get_args(t) or (Any,)
        return "an array" if item is Any else f"an array of {_plural(_type_name(item))}"
    if origin is dict or t is dict:
        return "an object"
    if attrs.has(t):
        return "an object"
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}.get(t, str(t))


def _plural(name: str) -> str:
    for article in ("an ", "a "):
        if name.startswith(article) and " " not in name[len(article):]:
            return name[len(article):] + "s"
    return f"({name})"


def _matches(value: JSON, t: TypeHint) -> bool:
    """Whether a JSON value has the shape of one union member (decides which member to structure)."""
    origin = typing.get_origin(t)
    if t is Any:
        return True
    if t is type(None):
        return value is None
    if origin is Literal:
        return isinstance(value, str) and value in typing.get_args(t)
    if t is bool:
        return isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if t is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if t is str:
        return isinstance(value, str)
    if origin is list:
        if not isinstance(value, list):
            return False
        (item,) = typing.get_args(t)
        return all(_matches(x, item) for x in value[:1])  # first item decides; the rest are then checked
    if origin is dict or attrs.has(t):
        return isinstance(value, dict)
    return False


def _strict_primitive(t: type):
    def hook(value: JSON, _t: TypeHint) -> object:
        if not _matches(value, t):
            raise TypeError(f"expected {_type_name(t)}, got {_describe(value)}")
        if t is float:
            if not math.isfinite(value):
                raise ValueError(f"expected a finite number, got {value!r}")
            return float(value)
        return value
    return hook


def _describe(value: JSON) -> str:
    return {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    for t in (str, int, float, bool):
        conv.register_structure_hook(t, _strict_primitive(t))
    conv.register_structure_hook(Any, lambda v, _t: v)

    def is_literal(t: TypeHint) -> bool:
        return typing.get_origin(t) is Literal

    def structure_literal(value: JSON, t: TypeHint) -> object:
        if not _matches(value, t):
            raise ValueError(f"expected {_type_name(t)}, got {json.dumps(value)[:40]}")
        return value

    conv.register_structure_hook_func(is_literal, structure_literal)

    def is_union(t: TypeHint) -> bool:
        return typing.get_origin(t) in (Union, types.UnionType)

    def structure_union(value: JSON, t: TypeHint) -> object:
        for member in typing.get_args(t):
            if _matches(value, member):
                return None if member is type(None) else conv.structure(value, member)
        raise TypeError(f"expected {_type_name(t)}, got {_describe(value)}")

    conv.register_structure_hook_func(is_union, structure_union)

    def is_dict(t: TypeHint) -> bool:
        return typing.get_origin(t) is dict

    def structure_dict(value: JSON, t: TypeHint) -> object:
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {_describe(value)}")
        _, vt = typing.get_args(t)
        return {k: conv.structure(v, vt) for k, v in value.items()}

    conv.register_structure_hook_func(is_dict, structure_dict)

    def is_list(t: TypeHint) -> bool:
        return typing.get_origin(t) is list

    def structure_list(value: JSON, t: TypeHint) -> object:
        if not isinstance(value, list):
            raise TypeError(f"expected {_type_name(t)}, got {_describe(value)}")
        (item,) = typing.get_args(t)
        out = []
        for i, x in enumerate(value):
            try:
                out.append(conv.structure(x, item))
            except Exception as exc:
                raise _AtPath(f"[{i}]", exc) from exc
        return out

    conv.register_structure_hook_func(is_list, structure_list)
    ignore_unknown_keys(conv, MESSAGE_CLASSES)
    return conv


class _AtPath(Exception):
    """Carries the list index of a nested failure up to the error formatter."""

    def __init__(self, step: str, exc: BaseException) -> None:
        super().__init__(step)
        self.step = step
        self.exc = exc


_CONVERTER = make_converter()


def _first_error(exc: BaseException, path: str) -> tuple[str, str]:
    """The first leaf error of a cattrs exception tree as (param path, message)."""
    if isinstance(exc, _AtPath):
        return _first_error(exc.exc, path + exc.step)
    if isinstance(exc, ForbiddenExtraKeysError):
        extra = sorted(exc.extra_fields)
        where = f" in {path.lstrip('.')}" if path else ""
        name = ", ".join(extra)
        return (f"{path}.{extra[0]}" if path else extra[0],
                f"Unrecognized request argument supplied{where}: {name}")
    if isinstance(exc, ClassValidationError | IterableValidationError):
        for sub in exc.exceptions:
            notes = getattr(sub, "__notes__", [])
            step = ""
            for note in notes:
                # cattrs notes read "Structuring class X @ attribute name" / "... @ index 3"
                if "@ attribute " in note:
                    step = "." + note.rsplit("@ attribute ", 1)[1]
                elif "@ index " in note:
                    step = f"[{note.rsplit('@ index ', 1)[1]}]"
            return _first_error(sub, (path + step) if step else path)
    if isinstance(exc, KeyError) and not isinstance(exc, ForbiddenExtraKeysError):
        # cattrs has already put the missing attribute's name on the path
        return path, f"missing required parameter: {path.lstrip('.')}"
    message = str(exc) if str(exc) else type(exc).__name__
    return path.lstrip("."), message


def structure(body: JSON, cls: type[T]) -> T:
    """Structure a decoded JSON body into ``cls`` or raise a 400 APIError naming the parameter."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_describe(body)}")
    try:
        return _CONVERTER.structure(body, cls)
    except APIError:
        raise
    except Exception as exc:  # cattrs raises exception groups; report the first leaf
        param, message = _first_error(exc, "")
        param = param.lstrip(".") or None
        if param and not message.startswith(("Unrecognized", "missing")):
            message = f"invalid value for '{param}': {message}"
        raise bad_request(message, param=param) from None
