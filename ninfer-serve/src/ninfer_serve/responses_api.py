"""The OpenAI Responses API's request (``POST /v1/responses``) -> the chat completion request it means.

A Responses request is a chat in other clothes: ``instructions`` is the system message, ``input`` items are
messages, the client's own tool loop (``function_call`` / ``function_call_output`` items) is the assistant's
tool calls and the tool messages, ``text.format`` is ``response_format`` and ``reasoning.effort`` the template's
thinking switch. Translating into a ``ChatCompletionRequest`` keeps one set of rules (sampling ranges,
constraints, media) for both endpoints. ``previous_response_id`` puts the stored conversation
(ninfer_serve.responses_store) in front of the new input.
"""

from __future__ import annotations

import json
from typing import Literal, TypeVar

import attrs

from ninfer.contract.values import JSON, JSONObject
from ninfer_serve.errors import APIError, bad_request
from ninfer_serve.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionDef,
    JsonSchemaFormat,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCallFunction,
    structure,
)

# The values OpenAI documents for ``include``: accepted; none of them changes what ninfer answers.
KNOWN_INCLUDES = frozenset({
    "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
    "web_search_call.action.sources", "web_search_call.results"})
# Efforts that turn thinking off; every other one keeps it on (budgets are not implemented).
THINKING_OFF = ("none", "minimal")

T = TypeVar("T")


@attrs.frozen(kw_only=True)
class FunctionTool:
    """A Responses function tool: flat (``name`` beside ``type``), unlike chat's ``{"function": {...}}``."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, JSON] | None = None
    strict: bool | None = None


@attrs.frozen(kw_only=True)
class ToolChoiceFunction:
    type: str
    name: str | None = None


@attrs.frozen(kw_only=True)
class TextFormat:
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema: dict[str, JSON] | None = None
    strict: bool | None = None


@attrs.frozen(kw_only=True)
class TextConfig:
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


@attrs.frozen(kw_only=True)
class ReasoningConfig:
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


@attrs.frozen(kw_only=True)
class ResponsesStreamOptions:
    include_obfuscation: bool | None = None


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    model: str | None = None
    input: str | list[dict[str, JSON]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    conversation: JSON = None
    prompt: JSON = None


# ---------------------------------------------------------------- input items


@attrs.frozen(kw_only=True)
class _Part:
    type: Literal["input_text", "output_text", "text", "input_image", "refusal", "input_file", "input_audio",
                  "summary_text", "reasoning_text"]
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    annotations: list[JSON] | None = None
    logprobs: list[JSON] | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None
    input_audio: JSON = None


@attrs.frozen(kw_only=True)
class _MessageItem:
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]
    id: str | None = None
    status: str | None = None


@attrs.frozen(kw_only=True)
class _FunctionCallItem:
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


@attrs.frozen(kw_only=True)
class _FunctionCallOutputItem:
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_Part]
    id: str | None = None
    status: str | None = None


def _structure_at(value: JSON, cls: type[T], where: str) -> T:
    """``structure`` for a nested piece, its errors naming the full path (``input[2].content``)."""
    try:
        return structure(value, cls)
    except APIError as exc:
        param = f"{where}.{exc.param}" if exc.param else where
        message = exc.message.replace(f"'{exc.param}'", f"'{param}'") if exc.param else exc.message
        raise bad_request(message if message != exc.message else f"{where}: {message}", param=param) from None


def _part(p: _Part, where: str) -> ContentPart:
    if p.type in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
        if p.text is None:
            raise bad_request(f"a '{p.type}' part needs 'text' ({where})", param=f"{where}.text")
        return ContentPart(type="text", text=p.text)
    if p.type == "refusal":
        return ContentPart(type="text", text=p.refusal or "")
    if p.type == "input_image":
        if p.image_url is None:
            raise bad_request(f"an 'input_image' part needs 'image_url' here (file ids are not supported) ({where})",
                              param=f"{where}.image_url")
        return ContentPart(type="input_image", image_url=p.image_url)
    raise bad_request(f"{where}: content parts of type '{p.type}' are not supported", param=f"{where}.type")


def _content(content: str | list[_Part], where: str) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    return [_part(p, f"{where}[{j}]") for j, p in enumerate(content)]


def _text_of(content: str | list[_Part], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = [_part(p, f"{where}[{j}]") for j, p in enumerate(content)]
    if any(p.type != "text" for p in parts):
        raise bad_request(f"{where}: a function call's output takes text parts only", param=where)
    return "\n".join(p.text or "" for p in parts)


def input_messages(items: str | list[JSONObject] | None) -> list[ChatMessage]:
    """``input`` as chat messages: consecutive ``function_call`` items (after an assistant message or not) make
    one assistant message's ``tool_calls``; ``reasoning`` items are accepted and dropped (the template keeps no
    reasoning of earlier turns)."""
    if items is None:
        return []
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue
        if kind == "message":
            m = _structure_at(item, _MessageItem, where)
            out.append(ChatMessage(role=m.role, content=_content(m.content, f"{where}.content")))
        elif kind == "function_call":
            c = _structure_at(item, _FunctionCallItem, where)
            call = MessageToolCall(id=c.call_id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = attrs.evolve(last, tool_calls=[*(last.tool_calls or []), call])
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            o = _structure_at(item, _FunctionCallOutputItem, where)
            out.append(ChatMessage(role="tool", content=_text_of(o.output, f"{where}.output"), tool_call_id=o.call_id))
        elif isinstance(kind, str):
            raise bad_request(f"{where}: input items of type '{kind[:80]}' are not supported by this server",
                              param=f"{where}.type")
        else:
            raise bad_request(f"{where}: 'type' must be a string", param=f"{where}.type")
    return out


# ---------------------------------------------------------------- the request


def _tools(req: ResponsesRequest) -> list[Tool] | None:
    if req.tools is None:
        return None
    tools = []
    for i, t in enumerate(req.tools):
        if t.type != "function":
            raise bad_request(f"tools[{i}]: tools of type '{t.type[:80]}' are not supported by this server (only "
                              "'function')", param=f"tools[{i}].type")
        if not t.name:
            raise bad_request(f"tools[{i}] needs 'name'", param=f"tools[{i}].name")
        tools.append(Tool(type="function", function=FunctionDef(name=t.name, description=t.description,
                                                                parameters=t.parameters, strict=t.strict)))
    return tools


def _tool_choice(choice: str | ToolChoiceFunction | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "none", "auto", "required"):
            raise bad_request(f"'tool_choice' must be 'none', 'auto', 'required' or a function, got {choice[:80]!r}",
                              param="tool_choice")
        return choice
    if choice.type != "function" or not choice.name:
        raise bad_request("'tool_choice' as an object names a function: {\"type\": \"function\", \"name\": ...}",
                          param="tool_choice")
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    if text is None or text.format is None:
        return None
    f = text.format
    if f.type != "json_schema":
        for name in ("name", "schema", "strict"):
            if getattr(f, name) is not None:
                raise bad_request(f"'text.format.{name}' goes with type 'json_schema'", param=f"text.format.{name}")
        return ResponseFormat(type=f.type)
    if f.schema is None:
        raise bad_request("'text.format' of type 'json_schema' needs 'schema'", param="text.format.schema")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name=f.name, description=f.description,
                                                                           schema=f.schema, strict=f.strict))


def _refuse_unsupported(req: ResponsesRequest) -> None:
    """Fields whose meaning ninfer does not implement: accepted only where they change nothing."""
    if req.background:
        raise bad_request("'background' responses are not supported by this server", param="background")
    if req.conversation is not None:
        raise bad_request("'conversation' is not supported by this server; use 'previous_response_id'",
                          param="conversation")
    if req.prompt is not None:
        raise bad_request("'prompt' (a stored prompt template) is not supported by this server", param="prompt")
    if req.truncation == "auto":
        raise bad_request("'truncation' 'auto' is not supported by this server (only 'disabled')", param="truncation")
    if req.top_logprobs:
        raise bad_request("'top_logprobs' is not supported on /v1/responses by this server", param="top_logprobs")
    if req.max_tool_calls is not None and req.max_tool_calls < 1:
        raise bad_request(f"'max_tool_calls' must be >= 1, got {req.max_tool_calls}", param="max_tool_calls")
    for i, name in enumerate(req.include or []):
        if name not in KNOWN_INCLUDES:
            raise bad_request(f"'include' value {name[:80]!r} is not one OpenAI documents", param=f"include[{i}]")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"'max_output_tokens' must be >= 1, got {req.max_output_tokens}", param="max_output_tokens")


def thinking_kwargs(reasoning: ReasoningConfig | None) -> JSONObject | None:
    """``reasoning.effort`` none / minimal turn thinking off through the template; others leave it on."""
    if reasoning is not None and reasoning.effort in THINKING_OFF:
        return {"enable_thinking": False}
    return None


def _one_system_message(messages: list[ChatMessage]) -> list[ChatMessage]:
    """``instructions`` and the system / developer messages that open ``input`` as one system message: the
    Qwen templates take one, first, and a Responses client may send both."""
    def text_only(m: ChatMessage) -> bool:
        return isinstance(m.content, str) or all(p.type == "text" for p in m.content or [])

    lead = 0
    while lead < len(messages) and messages[lead].role in ("system", "developer") and text_only(messages[lead]):
        lead += 1
    if lead < 2:
        return messages
    texts = [m.content if isinstance(m.content, str) else "\n".join(p.text or "" for p in m.content or [])
             for m in messages[:lead]]
    return [ChatMessage(role="system", content="\n\n".join(texts)), *messages[lead:]]


def chat_completion(req: ResponsesRequest, prior: list[ChatMessage], new: list[ChatMessage],
                    session_key: str) -> ChatCompletionRequest:
    """The chat request this Responses request means: ``instructions`` first, then the stored conversation
    (``prior``), then the new input; ``session_key`` names the conversation for the context cache."""
    _refuse_unsupported(req)
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
    messages = _one_system_message([*system, *prior, *new])
    if not messages:
        raise bad_request("'input' must hold at least one item", param="input")
    tools = _tools(req)
    choice = _tool_choice(req.tool_choice)
    if not tools and choice == "auto":  # clients send their default with no tools; OpenAI accepts it
        choice = None
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=tools, tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text),
        chat_template_kwargs=thinking_kwargs(req.reasoning), stream=req.stream, prompt_cache_key=session_key,
        user=req.user, metadata=req.metadata, store=req.store)


# Chat's parameter names -> the Responses ones, for errors raised while translating or compiling.
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "response_format.json_schema.schema": "text.format.schema",
           "response_format.json_schema.name": "text.format.name", "response_format.json_schema": "text.format",
           "prompt_cache_key": "prompt_cache_key", "messages": "input"}


def responses_param(param: str | None) -> str | None:
    """A chat request's parameter as the Responses request names it (``tool_choice.function.name`` ->
    ``tool_choice.name``); messages' indices shift by the instructions and the stored conversation, so a
    message is reported as ``input``."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    if param == "tool_choice.function.name":
        return "tool_choice.name"
    return _PARAMS.get(param, param)


def renamed(exc: APIError) -> APIError:
    """``exc`` with its parameter (and the message's mention of it) in the Responses request's names."""
    new = responses_param(exc.param)
    if new != exc.param and exc.param is not None:
        exc.message = exc.message.replace(f"'{exc.param}'", f"'{new}'")
        exc.param = new
    return exc


def stored_size(messages: list[ChatMessage], response: JSONObject) -> int:
    """Bytes a stored turn holds, as JSON (what the store's byte bound counts)."""
    text = json.dumps([attrs.asdict(m) for m in messages], default=str) + json.dumps(response, default=str)
    return len(text.encode("utf-8", "surrogatepass"))
