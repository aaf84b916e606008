"""Protocol input -> public owning input: OpenAI request bodies become ``GenerationRequest``s.

Every range check names its parameter; whatever passes here is representable for the engine
(which still rejects over-long prompts, since only it knows the tokenized length).
"""

from __future__ import annotations

import json

import attrs

from ninfer.contract import ChatInput, GenerationRequest, SamplingParams, TextInput
from ninfer.contract.request import MAX_LOGIT_BIAS, MAX_STOP_CHARS
from ninfer.contract.values import JSON, JSONObject
from ninfer_serve.constraints import request_constraint
from ninfer_serve.errors import bad_request
from ninfer_serve.media_parts import check_part_fields, media_kind
from ninfer_serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationBody

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_N = 16
MAX_BATCH_COMPLETIONS = 64  # prompts x n of one text completion request (batched prompts)
MAX_REPETITION_PENALTY = 10.0  # far past any useful value (1.0 - 1.3 in practice); vLLM bounds it only below
MAX_PROMPT_CACHE_KEY_CHARS = 1024
# A client's cache_salt; the engine's bound (its MAX_CACHE_SALT_CHARS) leaves room for a key scope in front.
MAX_CLIENT_CACHE_SALT_CHARS = 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's, for an absent or null max_tokens on text completions


@attrs.frozen(kw_only=True)
class ResponseOptions:
    """What shapes the response, beside the engine's output."""

    stream: bool = False
    n: int = 1
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False
    tools_enabled: bool = False
    constraint_param: str | None = None  # the field the engine's refusal of the request's constraint is about
    echo: bool = False  # text completions: the prompt (and its logprobs) before the completion
    prompt_logprobs: int | None = None  # text completions: vLLM's per-choice prompt_logprobs, with this many top
    prompt_only: bool = False  # max_tokens 0 with echo or prompt_logprobs: score the prompt, generate nothing
    budget_param: str = "max_tokens"  # the field the generation budget came from


def _check_range(name: str, value: float | None, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if value is None:
        return
    if value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise bad_request(f"'{name}' must be in {bracket}{lo}, {hi}], got {value}", param=name)


def _adjustments(req: GenerationBody) -> JSONObject:
    """Penalties, logit_bias and min_tokens (OpenAI and vLLM spellings) as SamplingParams fields."""
    _check_range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    _check_range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    if req.repetition_penalty is not None and not 0.0 < req.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise bad_request(f"'repetition_penalty' must be in (0, {MAX_REPETITION_PENALTY}], got "
                          f"{req.repetition_penalty}", param="repetition_penalty")
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or len(key) > 9:  # token ids as OpenAI writes them: decimal strings
            raise bad_request(f"'logit_bias' keys must be token ids (decimal strings), got {key!r:.40}",
                              param="logit_bias")
        _check_range("logit_bias", value, -100.0, 100.0)
        bias[int(key)] = value
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' holds at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", param="logit_bias")
    if req.min_tokens < 0:
        raise bad_request(f"'min_tokens' must be >= 0, got {req.min_tokens}", param="min_tokens")
    return {"presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty, "logit_bias": bias, "min_tokens": req.min_tokens}


def _sampling(req: GenerationBody, *, max_tokens: int | None, logprobs: bool, top_logprobs: int,
              budget_param: str = "max_tokens") -> SamplingParams:
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"'n' must be in [1, {MAX_N}], got {req.n}", param="n")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"'{budget_param}' must be >= 1, got {max_tokens}", param=budget_param)
    _check_range("temperature", req.temperature, 0.0, 2.0)
    _check_range("top_p", req.top_p, 0.0, 1.0, lo_open=True)
    _check_range("min_p", req.min_p, 0.0, 1.0)
    top_k = req.top_k
    if top_k is not None:
        if top_k < -1:
            raise bad_request(f"'top_k' must be -1 (disabled) or >= 0, got {top_k}", param="top_k")
        top_k = max(top_k, 0)  # -1 and 0 both mean "no top-k"
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise bad_request(f"'seed' must be in [0, 2**63), got {req.seed}", param="seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' holds at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    if any(not s for s in stop):
        raise bad_request("'stop' strings must not be empty", param="stop")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise bad_request(f"'stop' strings may hold at most {MAX_STOP_CHARS} characters each, got one of {longest}",
                          param="stop")
    stop_ids = list(req.stop_token_ids or [])
    if any(t < 0 for t in stop_ids):
        raise bad_request("'stop_token_ids' must be non-negative token ids", param="stop_token_ids")
    adjust = _adjustments(req)
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({req.min_tokens}) must not exceed 'max_tokens' ({max_tokens})",
                          param="min_tokens")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=top_k,
                              min_p=req.min_p, seed=req.seed, stop=tuple(stop), stop_token_ids=tuple(stop_ids),
                              ignore_eos=req.ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs, **adjust)
    except (ValueError, TypeError) as exc:  # the contract's own validators, as a last line
        raise bad_request(f"invalid sampling parameters: {exc}") from None


def _session_key(req: GenerationBody) -> str | None:
    """``prompt_cache_key``: names the conversation for the context cache (the engine's ``session_key``)."""
    key = req.prompt_cache_key
    if key is None:
        return None
    if not key:
        raise bad_request("'prompt_cache_key' must not be empty", param="prompt_cache_key")
    if len(key) > MAX_PROMPT_CACHE_KEY_CHARS:
        raise bad_request(f"'prompt_cache_key' may hold at most {MAX_PROMPT_CACHE_KEY_CHARS} characters, got "
                          f"{len(key)}", param="prompt_cache_key")
    return key


def _cache_salt(req: GenerationBody, key_scope: str | None) -> str | None:
    """The engine's ``cache_salt``: the client's (vLLM's ``cache_salt``) behind the authenticating key's scope
    when the server has several keys (``access.key_scope``), so scope = (key, salt); otherwise the client's."""
    salt = req.cache_salt
    if salt is not None:
        if not salt:
            raise bad_request("'cache_salt' must be a non-empty string if provided", param="cache_salt")
        if len(salt) > MAX_CLIENT_CACHE_SALT_CHARS:
            raise bad_request(f"'cache_salt' may hold at most {MAX_CLIENT_CACHE_SALT_CHARS} characters, got "
                              f"{len(salt)}", param="cache_salt")
    if key_scope is None:
        return salt
    return key_scope if salt is None else f"{key_scope}:{salt}"  # a key scope holds no ':'


def _stream_options(req: GenerationBody) -> tuple[bool, bool]:
    if req.stream_options is None:
        return False, False
    if not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return req.stream_options.include_usage, req.stream_options.continuous_usage_stats


# ---------------------------------------------------------------- chat


def _message_content(m: ChatMessage, i: int) -> str | list[JSONObject] | None:
    """The content as the chat template takes it: text parts joined by newlines; with media, a list in which each
    image or video is a ``{"type": "image"}`` / ``{"type": "video"}`` part (its bytes come later, as
    ``ChatInput.media``, in the same order) and each run of text parts one text part."""
    if m.content is None or isinstance(m.content, str):
        return m.content
    parts: list[JSONObject] = []
    texts: list[str] = []
    for j, part in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        check_part_fields(part, where)
        kind = media_kind(part)
        if part.type == "text":
            if part.text is None:
                raise bad_request(f"a text content part needs 'text' ({where})", param=f"{where}.text")
            texts.append(part.text)
        elif kind is not None:
            if m.role in ("system", "developer"):
                raise bad_request(f"{where}: a {m.role} message cannot carry images or videos", param=where)
            if texts:
                parts.append({"type": "text", "text": "\n".join(texts)})
                texts = []
            parts.append({"type": kind})
        else:
            raise bad_request(f"{where}: content parts of type '{part.type}' are not supported", param=where)
    if not parts:
        return "\n".join(texts)
    if texts:
        parts.append({"type": "text", "text": "\n".join(texts)})
    return parts


def _call_arguments(args: str | JSONObject, where: str) -> JSONObject:
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request(f"{where} is not valid JSON", param=where) from None
    if not isinstance(args, dict):
        raise bad_request(f"{where} must be a JSON object", param=where)
    return args


def _tool_calls(m: ChatMessage, i: int) -> list[JSONObject]:
    """The assistant's tool calls, the deprecated ``function_call`` as one more (without an id)."""
    calls = []
    for j, call in enumerate(m.tool_calls or []):
        args = _call_arguments(call.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments")
        calls.append({"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}})
    if m.function_call is not None:
        args = _call_arguments(m.function_call.arguments, f"messages[{i}].function_call.arguments")
        calls.append({"id": None, "type": "function", "function": {"name": m.function_call.name, "arguments": args}})
    return calls


def _message_dict(m: ChatMessage, i: int) -> JSONObject:
    """One OpenAI message as the chat template expects it (tool-call arguments as a mapping). A ``function``
    message (the deprecated form of a tool result) is a tool message; an assistant's ``refusal`` stands for its
    content when it has none; ``audio`` and ``annotations`` are ignored (docs/serving.md, "Messages")."""
    role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
    content = _message_content(m, i)
    if m.role == "assistant" and not content and m.refusal:
        content = m.refusal
    out: JSONObject = {"role": role, "content": content}
    if m.role != "assistant" and out["content"] is None:
        raise bad_request(f"messages[{i}] ({m.role}) needs 'content'", param=f"messages[{i}].content")
    if m.name is not None:
        out["name"] = m.name
    if m.role != "assistant" and (m.tool_calls or m.function_call is not None):
        field = "tool_calls" if m.tool_calls else "function_call"
        raise bad_request(f"only assistant messages carry '{field}' (messages[{i}])", param=f"messages[{i}].{field}")
    calls = _tool_calls(m, i)
    if calls:
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None and m.role == "assistant":
        out["reasoning_content"] = reasoning
    return out


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def template_kwargs(effort: str | None, given: JSONObject | None, *,
                    param: str = "reasoning_effort") -> JSONObject:
    """The chat template's kwargs: the client's ``chat_template_kwargs``, with ``enable_thinking: false`` when
    ``reasoning_effort`` is ``none`` or ``minimal`` (other efforts keep the template's default, thinking on). An
    explicit ``enable_thinking`` wins over the effort."""
    kwargs = dict(given or {})
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise bad_request(f"'{param}' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", param=param)
    if effort in ("none", "minimal"):
        kwargs.setdefault("enable_thinking", False)
    return kwargs


def _max_tokens(req: GenerationBody, default: int | None) -> tuple[int | None, str]:
    """The generation budget and the parameter it came from: ``max_completion_tokens`` wins when set; null is
    absent (OpenAI)."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return (default if req.max_tokens is None else req.max_tokens), "max_tokens"


def chat_request(req: ChatCompletionRequest, *, queue_timeout_s: float | None = None,
                 request_id: str | None = None, key_scope: str | None = None,
                 ) -> tuple[GenerationRequest, ResponseOptions]:
    if not req.messages:
        raise bad_request("'messages' must hold at least one message", param="messages")
    messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
    tools = [attrs.asdict(t) for t in req.tools or []]
    for t in tools:  # drop unset optional keys so the template sees what the client sent
        t["function"] = {k: v for k, v in t["function"].items() if v is not None}
    choice = req.tool_choice
    if choice is not None and not tools and choice != "none":
        raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
    if choice == "none":
        tools = []
    asked = request_constraint(req, tools, choice, req.parallel_tool_calls)
    top = req.top_logprobs or 0
    if req.top_logprobs is not None:
        _check_range("top_logprobs", req.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if req.top_logprobs > 0 and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    max_tokens, budget_param = _max_tokens(req, None)  # neither set: no limit but the context
    sampling = _sampling(req, max_tokens=max_tokens, budget_param=budget_param, logprobs=req.logprobs,
                         top_logprobs=top)
    include_usage, continuous = _stream_options(req)
    chat = ChatInput(messages=tuple(messages), tools=tuple(tools),
                     template_kwargs=template_kwargs(req.reasoning_effort, req.chat_template_kwargs))
    gen = GenerationRequest(input=chat, sampling=sampling, queue_timeout_s=queue_timeout_s, request_id=request_id,
                            session_key=_session_key(req), cache_salt=_cache_salt(req, key_scope),
                            constraint=None if asked is None else asked.constraint)
    return gen, ResponseOptions(stream=req.stream, n=req.n, include_usage=include_usage,
                                continuous_usage=continuous, logprobs=req.logprobs, tools_enabled=bool(tools),
                                constraint_param=None if asked is None else asked.compiled_from,
                                budget_param=budget_param)


# ---------------------------------------------------------------- text completions


def _prompt_input(prompt: JSON) -> TextInput:
    """The first prompt (a batch's others: ``prompt_inputs``)."""
    return prompt_inputs(prompt)[0]


def prompt_inputs(prompt: JSON) -> list[TextInput]:
    """``prompt`` as one input per prompt: a string, token ids, or a batch (a list of either)."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", param="prompt")
        return [TextInput(text=prompt)]
    if not prompt:
        raise bad_request("'prompt' must not be empty", param="prompt")
    if isinstance(prompt[0], list | str):
        if len(prompt) > MAX_BATCH_COMPLETIONS:
            raise bad_request(f"'prompt' holds at most {MAX_BATCH_COMPLETIONS} prompts, got {len(prompt)}",
                              param="prompt")
        return [one for p in prompt for one in prompt_inputs(p)]
    if any(t < 0 for t in prompt):
        raise bad_request("'prompt' token ids must be non-negative", param="prompt")
    return [TextInput(token_ids=tuple(prompt))]


def completion_request(req: CompletionRequest, *, queue_timeout_s: float | None = None,
                       request_id: str | None = None, key_scope: str | None = None,
                       ) -> tuple[GenerationRequest, ResponseOptions]:
    text = _prompt_input(req.prompt)
    if req.suffix:
        raise bad_request("'suffix' is not supported by this server", param="suffix")
    if req.best_of is not None and req.best_of != 1:
        raise bad_request("'best_of' other than 1 is not supported by this server", param="best_of")
    _check_range("logprobs", req.logprobs, 0, MAX_TOP_LOGPROBS)
    logprobs = req.logprobs is not None
    _check_range("prompt_logprobs", req.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
    max_tokens, budget_param = _max_tokens(req, COMPLETIONS_DEFAULT_MAX_TOKENS)
    prompt_only = max_tokens == 0 and (req.echo or req.prompt_logprobs is not None)  # vLLM's scoring request
    sampling = _sampling(req, max_tokens=1 if prompt_only else max_tokens, budget_param=budget_param,
                         logprobs=logprobs,
                         top_logprobs=req.logprobs or 0)
    include_usage, continuous = _stream_options(req)
    asked = request_constraint(req)
    gen = GenerationRequest(input=text, sampling=sampling, queue_timeout_s=queue_timeout_s, request_id=request_id,
                            session_key=_session_key(req), cache_salt=_cache_salt(req, key_scope),
                            constraint=None if asked is None else asked.constraint)
    return gen, ResponseOptions(stream=req.stream, n=req.n, include_usage=include_usage,
                                continuous_usage=continuous, logprobs=logprobs,
                                constraint_param=None if asked is None else asked.compiled_from,
                                echo=req.echo, prompt_logprobs=req.prompt_logprobs, prompt_only=prompt_only,
                                budget_param=budget_param)


def completion_requests(req: CompletionRequest, *, queue_timeout_s: float | None = None,
                        request_id: str | None = None, key_scope: str | None = None,
                        ) -> tuple[list[GenerationRequest], ResponseOptions]:
    """``completion_request`` for each prompt of a batch (the same keywords); the options' ``n`` counts every
    choice: ``n`` per prompt, prompt ``i``'s choice ``j`` at index ``i * n + j`` (as ``choices`` lays them out)."""
    inputs = prompt_inputs(req.prompt)
    if len(inputs) * req.n > MAX_BATCH_COMPLETIONS:
        raise bad_request(f"{len(inputs)} prompts with n={req.n} make {len(inputs) * req.n} completions; at most "
                          f"{MAX_BATCH_COMPLETIONS} fit one request", param="prompt" if req.n == 1 else "n")
    gen, options = completion_request(req, queue_timeout_s=queue_timeout_s, request_id=request_id,
                                      key_scope=key_scope)
    gens = [attrs.evolve(gen, input=text) for text in inputs]
    return gens, attrs.evolve(options, n=options.n * len(inputs))


def choices(gen: GenerationRequest | list[GenerationRequest], n: int) -> list[GenerationRequest]:
    """The ``n`` engine requests behind ``n`` choices: one each (choice i > 0 has request id ``<id>-<i>``);
    a seeded request seeds choice i with seed + i (so the choices differ yet each is reproducible);
    greedy choices are identical by definition. Every choice keeps the request's ``session_key`` and
    ``cache_salt``. A batch (one request per prompt, ``completion_requests``) gets ``n / len(gen)`` choices a
    prompt, numbered on across the batch."""
    if isinstance(gen, list):
        each, rid = n // len(gen), gen[0].request_id
        return [attrs.evolve(c, request_id=rid if k == 0 or rid is None else f"{rid}-{k}")
                for k, c in enumerate(c for g in gen for c in choices(g, each))]
    if n == 1:
        return [gen]
    seed, rid = gen.sampling.seed, gen.request_id
    return [attrs.evolve(gen, sampling=attrs.evolve(gen.sampling, seed=None if seed is None else (seed + i) % 2**63),
                         request_id=rid if i == 0 or rid is None else f"{rid}-{i}")
            for i in range(n)]
