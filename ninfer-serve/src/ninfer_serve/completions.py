"""``POST /v1/completions``: batched prompts, and the prompt scored for ``echo`` and vLLM's ``prompt_logprobs``.

A batch (``prompt`` as a list of strings or of token-id lists) is one engine request per prompt and choice,
submitted together; choice ``i * n + j`` is prompt ``i``'s choice ``j``. With ``echo`` or ``prompt_logprobs``
each prompt is tokenized and scored first by ``Engine.score`` (``ninfer score``'s CausalScoring of the prompt
tokens, so the logprobs are the same), then generated as usual; ``max_tokens: 0`` scores only (what
evaluation harnesses send for loglikelihood). The first prompt token has no context: its logprob is null.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING

import attrs
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ninfer.contract.errors import RequestCancelled
from ninfer.contract.events import GenerationResult
from ninfer.contract.prompt import TextInput
from ninfer.contract.serving import ServingEngine
from ninfer.contract.values import JSONObject
from ninfer.engine.scoring import ScoreResult
from ninfer_serve.access import key_scope
from ninfer_serve.errors import APIError, from_engine_error
from ninfer_serve.offload import ClientGone
from ninfer_serve.responses import DONE, CompletionResponse, _lp, sse
from ninfer_serve.schemas import CompletionRequest
from ninfer_serve.translate import ResponseOptions, completion_requests

if TYPE_CHECKING:  # the Gateway calls this endpoint with itself
    from ninfer_serve.app import Gateway


@attrs.frozen(kw_only=True)
class ScoredPrompt:
    """One prompt as echoed: its text, tokens (each token's own text) and scores (None: a one-token prompt)."""

    text: str
    token_ids: tuple[int, ...]
    token_texts: tuple[str, ...]
    score: ScoreResult | None
    alternatives: dict[int, str]  # token id -> its text, for every id among the top alternatives

    def legacy_logprobs(self, top: int) -> JSONObject:
        """OpenAI's legacy ``logprobs`` of the prompt tokens (null for the first)."""
        lps: list[float | None] = [None]
        tops: list[dict[str, float] | None] = [None]
        if self.score is not None:
            lps += [_lp(x) for x in self.score.logprobs]
            for row in self.score.top:
                tops.append({self.alternatives[t]: _lp(lp) for t, lp in row[:top]} if top else None)
        offsets, at = [], 0
        for text in self.token_texts:
            offsets.append(at)
            at += len(text)
        return {"tokens": list(self.token_texts), "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def vllm_prompt_logprobs(self, top: int) -> list[JSONObject | None]:
        """vLLM's ``prompt_logprobs``: per position the token's entry then its ``top`` alternatives, keyed by id."""
        out: list[JSONObject | None] = [None]
        if self.score is None:
            return out
        for j, (lp, rank) in enumerate(zip(self.score.logprobs, self.score.ranks, strict=True)):
            token = self.token_ids[j + 1]
            entry = {str(token): {"logprob": _lp(lp), "rank": rank, "decoded_token": self.token_texts[j + 1]}}
            for k, (t, alt) in enumerate(self.score.top[j][:top]):
                entry.setdefault(str(t), {"logprob": _lp(alt), "rank": k + 1, "decoded_token": self.alternatives[t]})
            out.append(entry)
        return out


class BatchCompletionResponse(CompletionResponse):
    """A text completion over one or more prompts (``n_each`` choices each), echoing and scoring prompts as
    asked (``prompts``: one ScoredPrompt each, or None when nothing is echoed or scored)."""

    def __init__(self, request_id: str, model: str, options: ResponseOptions, *, n_each: int,
                 prompts: list[ScoredPrompt] | None = None, top: int = 0) -> None:
        super().__init__(request_id, model, options)
        self.n_each = n_each
        self.prompts = prompts
        self.top = top
        self.prompt_sizes: dict[int, int] = {}  # prompt index -> its tokens (usage counts each prompt once)

    def _prompt(self, index: int) -> ScoredPrompt | None:
        return None if self.prompts is None else self.prompts[index // self.n_each]

    def usage(self) -> JSONObject:
        self.prompt_tokens = sum(self.prompt_sizes.values())
        return super().usage()

    def _started(self, prompt_tokens: int, index: int, cached_tokens: int) -> None:
        super()._started(prompt_tokens, index, cached_tokens)
        self.prompt_sizes[index // self.n_each] = prompt_tokens

    def _settle(self, result: GenerationResult, index: int) -> None:
        super()._settle(result, index)
        if result.usage.prompt_tokens:
            self.prompt_sizes[index // self.n_each] = result.usage.prompt_tokens

    def _prompt_part(self, index: int) -> JSONObject:
        """What choice ``index`` carries of its prompt: the echoed text and logprobs, vLLM's prompt_logprobs."""
        prompt = self._prompt(index)
        if prompt is None:
            return {}
        part: JSONObject = {}
        if self.options.echo:
            part["text"] = prompt.text
            part["logprobs"] = prompt.legacy_logprobs(self.top) if self.options.logprobs else None
        if self.options.prompt_logprobs is not None:
            part["prompt_logprobs"] = prompt.vllm_prompt_logprobs(self.options.prompt_logprobs)
        return part

    def start(self, prompt_tokens: int, index: int = 0, *, cached_tokens: int = 0) -> list[str]:
        frames = super().start(prompt_tokens, index, cached_tokens=cached_tokens)
        part = self._prompt_part(index)
        if not part:
            return frames
        self.choices[index].sent = len(part.get("text", ""))  # generated text_offset goes on after the prompt
        if not self.options.stream:
            return frames
        chunk = {"index": index, "text": part.get("text", ""), "logprobs": part.get("logprobs"),
                 "finish_reason": None, **{k: v for k, v in part.items() if k == "prompt_logprobs"}}
        return [*frames, sse(self._obj(self.chunk_kind, [chunk]))]

    def whole(self, results: list[GenerationResult]) -> JSONObject:
        out = super().whole(results)
        for choice in out["choices"]:
            part = self._prompt_part(choice["index"])
            if "text" in part:
                choice["text"] = part["text"] + choice["text"]
                choice["logprobs"] = _joined(part["logprobs"], choice["logprobs"], len(part["text"]))
            if "prompt_logprobs" in part:
                choice["prompt_logprobs"] = part["prompt_logprobs"]
        return out

    def prompt_only(self) -> list[JSONObject]:
        """The choices of a request that generates nothing (``max_tokens: 0``): the prompt part alone."""
        for i in range(len(self.choices)):
            self.prompt_sizes[i // self.n_each] = len(self._prompt(i).token_ids)
        return [{"index": i, "text": "", "logprobs": None, "finish_reason": "length", **self._prompt_part(i)}
                for i in range(len(self.choices))]


def _joined(prompt: JSONObject | None, generated: JSONObject | None, shift: int) -> JSONObject | None:
    """The prompt's legacy logprobs followed by the completion's (whose text_offset start after the prompt)."""
    if prompt is None or generated is None:
        return prompt or generated
    return {"tokens": prompt["tokens"] + generated["tokens"],
            "token_logprobs": prompt["token_logprobs"] + generated["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + generated["top_logprobs"],
            "text_offset": prompt["text_offset"] + [o + shift for o in generated["text_offset"]]}


def _score_prompts(engine: ServingEngine, inputs: list[TextInput], top: int, cancel: threading.Event) -> list[ScoredPrompt]:
    """Tokenize and score each prompt (on the worker thread it blocks on, one after another)."""
    frontend = engine.frontend
    out = []
    for text in inputs:
        if cancel.is_set():
            raise RequestCancelled("the client left")
        ids = tuple(engine.prepare(text).token_ids)
        score = engine.score(ids, top=top) if len(ids) > 1 else None
        alternatives = {t: frontend.token_text(t) for row in (score.top if score else ()) for t, _ in row}
        out.append(ScoredPrompt(text=text.text if text.text is not None else frontend.decode(ids), token_ids=ids,
                                token_texts=tuple(frontend.token_text(t) for t in ids), score=score,
                                alternatives=alternatives))
    return out


async def completions(gw: Gateway, request: Request) -> Response:
    """The endpoint, on the Gateway ``gw`` (ninfer_serve.app)."""
    req = await gw.parsed(request, CompletionRequest)
    rid = request.state.request_id
    gens, options = completion_requests(req, queue_timeout_s=gw.queue_timeout_s, request_id=rid,
                                        key_scope=key_scope(request.scope))
    for gen in gens:
        gw._check_budget(gen, options.budget_param)
    n_each = options.n // len(gens)
    if not options.echo and options.prompt_logprobs is None:
        return await gw._generate(request, "completions", gens, options,
                                  partial(BatchCompletionResponse, n_each=n_each), rid)
    top = max(gens[0].sampling.top_logprobs if options.echo else 0, options.prompt_logprobs or 0)
    cancel = threading.Event()
    try:
        prompts = await gw._watched(request, run_in_threadpool(_score_prompts, gw.engine,
                                                               [g.input for g in gens], top, cancel))
    except ClientGone:
        cancel.set()
        gw.metrics.disconnects.labels("completions").inc()
        return Response(status_code=499)
    except APIError:
        cancel.set()
        raise
    except Exception as exc:  # RequestRejected (a prompt too long, ...), Overloaded, EngineClosed
        raise from_engine_error(exc, request_id=rid, retry_after_s=gw.retry_after_s) from None
    builder = partial(BatchCompletionResponse, n_each=n_each, prompts=prompts, top=gens[0].sampling.top_logprobs)
    if not options.prompt_only:
        return await gw._generate(request, "completions", gens, options, builder, rid)
    return _prompt_only(builder(rid, gw.model_id, options), rid)


def _prompt_only(response: BatchCompletionResponse, rid: str) -> Response:
    choices = response.prompt_only()
    headers = {"X-Request-Id": rid}
    if not response.options.stream:
        return JSONResponse(response._obj("text_completion", choices, usage=response.usage()), headers=headers)

    async def frames() -> AsyncIterator[str]:
        for choice in choices:
            yield sse(response._obj(response.chunk_kind, [choice]))
        for frame in response.end():
            yield frame
        yield DONE

    return StreamingResponse(frames(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"} | headers)
