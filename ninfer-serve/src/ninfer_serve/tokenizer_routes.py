"""vLLM's tokenizer endpoints, which lm-evaluation-harness's remote tokenizer calls: ``POST /tokenize`` (a
prompt, or chat messages rendered by the chat template), ``POST /detokenize`` and ``GET /tokenizer_info``.

They tokenize exactly as a request would (``Engine.prepare``: a text prompt of ``/v1/completions``, the messages
of ``/v1/chat/completions``), so the token ids they give can be sent back as a token prompt. They sit at the
root, as in vLLM, behind the same API key as the ``/v1`` routes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ninfer.contract.prompt import ChatInput, TextInput
from ninfer.contract.values import JSON
from ninfer_serve.errors import bad_request, from_engine_error
from ninfer_serve.schemas import ChatCompletionRequest, structure
from ninfer_serve.translate import chat_request

if TYPE_CHECKING:  # the Gateway builds these routes on itself
    from ninfer_serve.app import Gateway, Handler

TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
MAX_DETOKENIZE_TOKENS = 1 << 20  # the body limit bounds it first; this names the parameter


@attrs.frozen(kw_only=True)
class TokenizeRequest:
    """vLLM's ``/tokenize`` body: ``prompt`` or ``messages`` (with ``tools`` and ``chat_template_kwargs``)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[JSON] | None = None
    tools: list[JSON] | None = None
    chat_template_kwargs: dict[str, JSON] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True  # Qwen adds no special tokens to a text prompt either way
    return_token_strs: bool = False


@attrs.frozen(kw_only=True)
class DetokenizeRequest:
    model: str | None = None
    tokens: list[int]


def _input(req: TokenizeRequest) -> TextInput | ChatInput:
    """The engine input the body stands for (a chat is checked as ``/v1/chat/completions`` checks it)."""
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
    if req.prompt is not None:
        if not req.prompt:
            raise bad_request("'prompt' must not be empty", param="prompt")
        return TextInput(text=req.prompt)
    if req.continue_final_message:
        raise bad_request("'continue_final_message' is not supported by this server", param="continue_final_message")
    chat = {"messages": req.messages, "tools": req.tools, "chat_template_kwargs": req.chat_template_kwargs}
    gen, _ = chat_request(structure({k: v for k, v in chat.items() if v is not None}, ChatCompletionRequest))
    return attrs.evolve(gen.input, add_generation_prompt=req.add_generation_prompt)


def tokenizer_routes(gw: Gateway, counted: Callable[[str, Handler], Handler]) -> list[Route]:
    """The three routes on the Gateway ``gw`` (ninfer_serve.app), counted as ``counted`` counts."""
    engine = gw.engine

    async def tokenize(request: Request) -> Response:
        req = await gw.parsed(request, TokenizeRequest)
        text = _input(req)
        try:
            ids = list((await run_in_threadpool(engine.prepare, text)).token_ids)
        except Exception as exc:  # too long, unrepresentable, the engine closed
            raise from_engine_error(exc, request_id=request.state.request_id) from None
        strs = [engine.frontend.token_text(t) for t in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(request: Request) -> Response:
        req = await gw.parsed(request, DetokenizeRequest)
        if len(req.tokens) > MAX_DETOKENIZE_TOKENS:
            raise bad_request(f"'tokens' holds at most {MAX_DETOKENIZE_TOKENS} ids", param="tokens")
        try:
            text = await run_in_threadpool(engine.frontend.decode, req.tokens)
        except ValueError as exc:  # an id outside the vocabulary
            raise bad_request(str(exc), param="tokens") from None
        return JSONResponse({"prompt": text})

    async def tokenizer_info(request: Request) -> Response:
        frontend = engine.frontend
        eos = frontend.token_text(frontend.eos_token_ids[0]) if frontend.eos_token_ids else None
        return JSONResponse({"tokenizer_class": type(frontend).__name__, "eos_token": eos, "bos_token": None,
                             "pad_token": None, "model_max_length": engine.max_model_len,
                             "max_model_len": engine.max_model_len})

    return [Route("/tokenize", counted("tokenize", tokenize), methods=["POST"]),
            Route("/detokenize", counted("detokenize", detokenize), methods=["POST"]),
            Route("/tokenizer_info", counted("tokenizer_info", tokenizer_info), methods=["GET"])]
