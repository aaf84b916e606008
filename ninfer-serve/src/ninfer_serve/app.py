"""The Starlette application: routes, request flow and connection lifecycle around one ``ninfer.Engine``.

Flow of a generation request: read the JSON body within the body timeout (408 otherwise), parse and
validate it (400 on anything wrong) -> acquire a chat's images and videos as a task of the gateway's media
TaskPool (ninfer_serve.media) -> ``engine.submit`` as a task of one of the gateway's preparation TaskPools
(ninfer_serve.preparation: plain requests and those with a grammar or media to prepare apart; a full queue or
a client over its share answers 429, engine rejections 429 / 400 / 503) -> wait for the first output while
watching the connection (a queue timeout still answers 503, a client that leaves cancels) -> answer whole
or as SSE. Whatever way the exchange ends, the handles are closed, which cancels unfinished work.

Shutdown (ninfer_serve.drain): after SIGTERM new generation requests answer 503; once the graceful timeout
has passed, every request still waiting answers 503 ``closed`` and every stream ends with an error event and
``[DONE]``, written by the gateway; then the lifespan shuts the pools down, joining their threads within a
bound (a preparation that is stuck ends when the caller closes the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ninfer.contract.errors import InvalidConstraint
from ninfer.contract.events import Event, FinishReason, GenerationResult, GenerationStart, OutputDelta
from ninfer.contract.request import GenerationRequest
from ninfer.contract.serving import RequestHandle, ServingEngine
from ninfer.contract.values import JSONObject
from ninfer.core.task_pool import Task
from ninfer_serve.access import access_middleware, key_scope
from ninfer_serve.completions import completions
from ninfer_serve.drain import Drain, ended_by_shutdown, refused_while_stopping
from ninfer_serve.errors import APIError, from_engine_error, from_error_result, internal_error, new_request_id
from ninfer_serve.json_body import parse_json
from ninfer_serve.media import MediaAcquirer, MediaPolicy
from ninfer_serve.metrics import GatewayMetrics, InFlight
from ninfer_serve.offload import (
    ClientGone,
    client_gone,
    client_of,
    submit_or_refuse,
    unless_disconnected,
    unless_ended,
)
from ninfer_serve.openapi import openapi_document
from ninfer_serve.preparation import HEAVY_THREADS, Preparation, close_all, submit_each
from ninfer_serve.responses import DONE, BuilderFactory, ChatResponse, ResponseBuilding, Translate
from ninfer_serve.responses_endpoint import ResponsesEndpoints
from ninfer_serve.responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES, ResponseStore
from ninfer_serve.schemas import ChatCompletionRequest, structure
from ninfer_serve.tokenizer_routes import tokenizer_routes
from ninfer_serve.translate import ResponseOptions, chat_request, choices

log = logging.getLogger("ninfer_serve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
POOL_JOIN_S = 2.0  # at shutdown, how long the preparation and media threads may take to finish, in all
_ENDED = object()  # a stream's queue item: the Drain ended it
T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]


def _error_of(handle: RequestHandle, result: GenerationResult, request_id: str) -> APIError:
    exc = handle.exception()
    if exc is not None:
        return from_engine_error(exc, request_id=request_id)
    return from_error_result(result.error, result.extra.get("error_kind"), request_id=request_id)


def _require_json(request: Request) -> None:
    """Bodies must be declared JSON: a browser's cross-site "simple" request (text/plain, a form, or no
    type at all) then fails here instead of reaching the engine."""
    declared = request.headers.get("content-type")
    if (declared or "").split(";", 1)[0].strip().lower() != "application/json":
        got = f"{declared!r}" if declared else "none"
        raise APIError(415, f"request bodies must be JSON sent with 'Content-Type: application/json' (got {got})",
                       code="unsupported_media_type")


class Gateway:
    """Request handling bound to one engine; ``create_app`` wires it into Starlette routes."""

    def __init__(self, engine: ServingEngine, *, model_id: str | None, queue_timeout_s: float | None,
                 retry_after_s: int, body_timeout_s: float, preparation: Preparation, media: MediaAcquirer,
                 drain: Drain) -> None:
        self.engine = engine
        self.model_id = model_id or engine.model_name
        self.aliases = {self.model_id, engine.model_name}
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.body_timeout_s = body_timeout_s
        self.preparation = preparation
        self.pool = preparation.plain
        self.heavy_pool = preparation.heavy
        self.media = media
        self.drain = drain
        self.metrics = GatewayMetrics(engine, self.model_id, preparation.plain, media.pool, preparation.heavy)
        self.created = int(time.time())

    # -- plain endpoints -------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        failed = (await run_in_threadpool(self.engine.metrics)).failed
        if failed:
            return JSONResponse({"status": "failed"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def _model_card(self) -> JSONObject:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "ninfer",
                "root": self.engine.model_name, "max_model_len": self.engine.max_model_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def prometheus(self, request: Request) -> Response:
        body = await run_in_threadpool(generate_latest, self.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.aliases:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    # -- generation ------------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._endpoint(request, "chat", ChatCompletionRequest, chat_request, ChatResponse)

    async def completions(self, request: Request) -> Response:
        return await completions(self, request)

    async def parsed(self, request: Request, schema: type[T]) -> T:
        """The body checked against ``schema`` (its model one this server serves)."""
        if self.drain.stopping:
            raise refused_while_stopping(self.retry_after_s)
        _require_json(request)
        req = structure(parse_json(await self._read_body(request)), schema)
        self._check_model(req.model)
        return req

    async def _endpoint(self, request: Request, endpoint: str, schema: type[ChatCompletionRequest],
                        translate: Translate, builder_cls: BuilderFactory) -> Response:
        """Parse and check the body against ``schema``, translate it into engine requests and generate."""
        req = await self.parsed(request, schema)
        rid = request.state.request_id
        gen, options = translate(req, queue_timeout_s=self.queue_timeout_s, request_id=rid,
                                 key_scope=key_scope(request.scope))
        self._check_budget(gen, options.budget_param)
        if isinstance(req, ChatCompletionRequest):
            try:
                gen = await unless_ended(self.drain, self.media.attach(request, req, gen, self.engine.vision_enabled),
                                         retry_after_s=self.retry_after_s)
            except ClientGone:
                self.metrics.disconnects.labels(endpoint).inc()
                return Response(status_code=499)
        return await self._generate(request, endpoint, gen, options, builder_cls, rid)

    async def _read_body(self, request: Request) -> bytes:
        """The whole body within ``body_timeout_s`` of the headers: a client that stalls gets 408 and the
        connection is closed, so a stalled body cannot hold a connection open."""
        try:
            return await unless_ended(self.drain, asyncio.wait_for(request.body(), self.body_timeout_s),
                                      retry_after_s=self.retry_after_s)
        except TimeoutError:
            raise APIError(408, f"the request body was not received within {self.body_timeout_s:g} s",
                           code="body_timeout", headers={"Connection": "close"}) from None

    def _check_budget(self, gen: GenerationRequest, param: str = "max_tokens") -> None:
        """A generation budget that cannot fit the context even after a one-token prompt is out of range."""
        limit = self.engine.max_model_len
        wanted = gen.sampling.max_tokens
        if wanted is not None and wanted > limit - 1:
            raise APIError(400, f"{param} {wanted} does not fit this model's context limit of {limit} tokens "
                           f"(at most {limit - 1} with a one-token prompt)", param=param)

    async def _submit_all(self, request: Request, gens: list[GenerationRequest], rid: str) -> list[RequestHandle]:
        """Submit every choice through a preparation TaskPool (the heavy one for a grammar or media); a full
        queue, or a client holding its share of the heavy pool, answers 429. A client that leaves meanwhile
        abandons the task: it never runs, or its handles are closed."""
        cancel = threading.Event()
        task: Task[list[RequestHandle]] = Task(lambda: submit_each(self.engine, gens, cancel), on_abandon=close_all)
        submit_or_refuse(self.preparation.pool_for(gens), task, retry_after_s=self.retry_after_s,
                         waiting_for="to be prepared", owner=client_of(request))
        try:
            return await self._watched(request, task.wait())
        except (APIError, ClientGone):
            cancel.set()  # nobody waits for this preparation any more: a compile only it needs is killed
            raise
        except Exception as exc:  # RequestRejected, EngineFailed, EngineClosed, anything else
            raise from_engine_error(exc, request_id=rid, retry_after_s=self.retry_after_s) from None

    async def _generate(self, request: Request, endpoint: str, gen: GenerationRequest | list[GenerationRequest],
                        options: ResponseOptions, builder_cls: BuilderFactory, rid: str) -> Response:
        try:
            handles = await self._submit_all(request, choices(gen, options.n), rid)
        except ClientGone:
            self.metrics.disconnects.labels(endpoint).inc()
            return Response(status_code=499)
        except APIError as exc:
            if exc.code == InvalidConstraint.kind:  # the engine names the problem, the gateway knows the field
                exc.param = options.constraint_param
            raise
        streams = [h.__aiter__() for h in handles]
        builder = builder_cls(handles[0].request_id, self.model_id, options)
        streaming = False
        try:
            # Answer only once every choice is admitted (GenerationStart) or has ended, so a queue timeout
            # still gets its status; a client leaving while queued cancels the request.
            try:
                firsts = await self._watched(request, asyncio.gather(*(anext(s) for s in streams)))
            except ClientGone:
                self.metrics.disconnects.labels(endpoint).inc()
                return Response(status_code=499)
            for h, ev in zip(handles, firsts, strict=True):
                if isinstance(ev, GenerationResult) and ev.finish_reason is FinishReason.ERROR:
                    raise _error_of(h, ev, rid)
            headers = {"X-Request-Id": handles[0].request_id}
            if client_gone(request):  # it left as the first events came: no stream would notice
                self.metrics.disconnects.labels(endpoint).inc()
                return Response(status_code=499)
            if options.stream:
                streaming = True
                return StreamingResponse(self._stream(endpoint, handles, streams, builder, firsts, rid),
                                         media_type="text/event-stream", headers=SSE_HEADERS | headers)
            rest = asyncio.gather(*(self._rest(streams[i], builder, firsts[i], i) for i in range(len(streams))))
            try:
                results = await self._watched(request, rest)
            except ClientGone:
                self.metrics.disconnects.labels(endpoint).inc()
                return Response(status_code=499)
            for h, result in zip(handles, results, strict=True):
                if result.finish_reason is FinishReason.ERROR:
                    raise _error_of(h, result, rid)
            return JSONResponse(builder.whole(results), headers=headers)
        finally:
            if not streaming:
                for h in handles:
                    h.close()

    async def _watched(self, request: Request, coro: Awaitable[T]) -> T:
        """``coro``'s result; ClientGone when the client leaves first, 503 when the server's Drain ends first."""
        return await unless_disconnected(request, coro, drain=self.drain, retry_after_s=self.retry_after_s)

    @staticmethod
    async def _rest(events: AsyncIterator[Event], builder: ResponseBuilding, first: Event, index: int
                    ) -> GenerationResult:
        ev = first
        while not isinstance(ev, GenerationResult):
            if isinstance(ev, GenerationStart):
                builder.start(ev.prompt_tokens, index, cached_tokens=ev.cached_tokens)
            else:
                builder.delta(ev, index)
            ev = await anext(events)
        return ev

    async def _stream(self, endpoint: str, handles: list[RequestHandle], streams: list[AsyncIterator[Event]],
                      builder: ResponseBuilding, firsts: list[Event], rid: str) -> AsyncIterator[str]:
        """SSE over every choice's events as they come (one pump task per choice feeding one queue)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            ev = firsts[i]
            try:
                while True:
                    await queue.put((i, ev))
                    if isinstance(ev, GenerationResult):
                        return
                    ev = await anext(streams[i])
            except Exception as exc:  # surfaces in the consumer below instead of stalling it
                await queue.put((i, exc))

        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(handles))]
        unsubscribe = self.drain.subscribe(lambda: queue.put_nowait((-1, _ENDED)))
        open_choices, finished, left, sent = len(handles), False, False, 0
        try:
            while open_choices:
                i, ev = await queue.get()
                if isinstance(ev, Exception):
                    raise ev
                if ev is _ENDED:  # the graceful timeout has passed: the stream ends here, cleanly
                    frames, open_choices = [ended_by_shutdown(self.retry_after_s).sse()], 0
                elif isinstance(ev, GenerationStart):
                    frames = builder.start(ev.prompt_tokens, i, cached_tokens=ev.cached_tokens)
                elif isinstance(ev, OutputDelta):
                    frames = builder.delta(ev, i)
                elif ev.finish_reason is FinishReason.ERROR:
                    frames, open_choices = [_error_of(handles[i], ev, rid).sse()], 0
                else:
                    frames = builder.finish(ev, i)
                    open_choices -= 1
                    if not open_choices:
                        frames += builder.end()
                for frame in frames:
                    yield frame
                    sent += 1
            finished = True
            yield DONE
        except (asyncio.CancelledError, GeneratorExit):  # the client left: Starlette cancels or closes the body
            left = not finished
            raise
        finally:
            unsubscribe()
            for p in pumps:
                p.cancel()
            if not finished:  # the client left (Starlette cancels the body) or the server is stopping
                self.metrics.disconnects.labels(endpoint).inc()
            if left:  # one line, no traceback: leaving a stream is an ordinary end of it
                log.info("request %s: the client left the %s stream after %d chunks", rid, endpoint, sent)
            for h in handles:
                h.close()


def create_app(engine: ServingEngine, *, model_id: str | None = None, queue_timeout_s: float | None = 60.0,
               retry_after_s: int = 1, max_body_bytes: int = 32 << 20, body_timeout_s: float = 30.0,
               http_threads: int = 4, http_queue: int = 64, heavy_threads: int = HEAVY_THREADS, heavy_queue: int = 64,
               heavy_per_client: int | None = 16, heavy_running_per_client: int | None = 1,
               media_per_client: int | None = 16,
               api_key: str | Sequence[str] | None = None,
               allowed_hosts: Sequence[str] | None = None, allowed_origins: Sequence[str] | None = None,
               media: MediaPolicy | None = None, drain: Drain | None = None,
               responses_max: int = DEFAULT_MAX_RESPONSES, responses_max_bytes: int = DEFAULT_MAX_BYTES) -> Starlette:
    """An ASGI app serving ``engine``; the caller owns the engine (and closes it after serving).

    The app owns two TaskPools for ``engine.submit`` (ninfer_serve.preparation): plain requests
    (``http_threads`` threads, ``http_queue`` waiting) and those with a constraint or media (``heavy_threads``,
    ``heavy_queue``; at most ``heavy_per_client`` places per client address, ``heavy_running_per_client`` of
    them running), and one for media acquisition as ``media`` says (default ``MediaPolicy()``: data URLs only; at
    most ``media_per_client`` places per client address); its lifespan shuts them down when the server stops,
    joining their threads within ``POOL_JOIN_S``.
    ``drain`` is the server's shutdown state (ninfer_serve.drain; the server sets it); ``None``: one of its
    own. ``allowed_hosts=None`` accepts any Host header; ``api_key`` (one key or several: each then scopes its
    requests' context-cache entries) guards every ``/v1`` route;
    ``allowed_origins`` turns CORS on for those origins (off by default). ``/v1/responses`` keeps at most
    ``responses_max`` finished responses, ``responses_max_bytes`` in all (ninfer_serve.responses_store).
    """
    preparation = Preparation(threads=http_threads, queue=http_queue, heavy_threads=heavy_threads,
                              heavy_queue=heavy_queue, heavy_per_client=heavy_per_client,
                              heavy_running_per_client=heavy_running_per_client)
    acquirer = MediaAcquirer(media or MediaPolicy(), retry_after_s=retry_after_s, per_client=media_per_client)
    gw = Gateway(engine, model_id=model_id, queue_timeout_s=queue_timeout_s, retry_after_s=retry_after_s,
                 body_timeout_s=body_timeout_s, preparation=preparation, media=acquirer, drain=drain or Drain())
    responses = ResponsesEndpoints(gw, ResponseStore(responses_max, responses_max_bytes))
    openapi = openapi_document(title="ninfer", version=_version())

    def counted(endpoint: str, handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            rid = request.state.request_id = new_request_id()
            try:
                response = await handler(request)
            except APIError as exc:
                response = exc.response()
            except HTTPException as exc:
                response = _http_error(exc).response()
            except ClientDisconnect:  # left while sending the body: nobody to answer
                gw.metrics.disconnects.labels(endpoint).inc()
                response = Response(status_code=499)
            except Exception:  # details to the log under the request id; the client gets the id only
                log.exception("request %s: unhandled error in %s %s", rid, request.method, request.url.path)
                response = internal_error(rid).response()
            gw.metrics.http_requests.labels(endpoint, str(response.status_code)).inc()
            return response
        return wrapped

    def _http_error(exc: HTTPException) -> APIError:
        etype = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=etype, headers=dict(exc.headers or {}))

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return _http_error(exc).response()

    async def unhandled(request: Request, exc: Exception) -> Response:
        rid = new_request_id()
        log.error("request %s: unhandled error in %s %s", rid, request.method, request.url.path, exc_info=exc)
        return internal_error(rid).response()

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(openapi)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:  # after the server's graceful wait: new work is refused and the threads are joined, within a
            # bound: a preparation stuck in a compile must not hold the process (closing the engine ends it)
            await run_in_threadpool(_shut_down, preparation, acquirer, POOL_JOIN_S)

    routes = [
        Route("/health", counted("health", gw.health), methods=["GET"]),
        Route("/metrics", gw.prometheus, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/v1/models", counted("models", gw.models), methods=["GET"]),
        Route("/v1/models/{model:path}", counted("models", gw.model), methods=["GET"]),
        Route("/v1/chat/completions", counted("chat", gw.chat_completions), methods=["POST"]),
        Route("/v1/completions", counted("completions", gw.completions), methods=["POST"]),
        Route("/v1/responses", counted("responses", responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", counted("responses", responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{response_id}", counted("responses", responses.delete), methods=["DELETE"]),
        *tokenizer_routes(gw, counted),
    ]
    middleware = [Middleware(InFlight, gauge=gw.metrics.in_flight),
                  *access_middleware(allowed_hosts=allowed_hosts, api_key=api_key, allowed_origins=allowed_origins)]
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: unhandled},
                    max_body_size=max_body_bytes)
    app.state.gateway = gw
    app.state.drain = gw.drain
    return app


def _shut_down(preparation: Preparation, acquirer: MediaAcquirer, timeout: float) -> None:
    end = time.monotonic() + timeout
    acquirer.pool.shutdown(timeout=timeout)
    preparation.shutdown(max(0.0, end - time.monotonic()))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ninfer-serve")
    except PackageNotFoundError:
        return "0"
