"""The context cache's HTTP surface: OpenAI ``prompt_cache_key`` becomes the engine's ``session_key``,
every usage object carries ``prompt_tokens_details.cached_tokens``, /metrics exports the cache's counters
and gauges, and the serve warmup stays out of the cache.

The exact pass-through of engine values runs against the scripted engine (conftest.py); the shapes are
checked again through the real engine on the embedded model, in process."""

from __future__ import annotations

import json

import attrs
import pytest

import ninfer
from ninfer.contract.events import (
    FinishReason,
    GenerationResult,
    GenerationStart,
    OutputDelta,
    Timings,
    Usage,
)
from ninfer.contract.model import ResourceUsage
from ninfer_serve.testing import parse_metrics
from ninfer_serve.translate import MAX_PROMPT_CACHE_KEY_CHARS
from ninfer_serve.warmup import warmup

CHAT = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny-test", "prompt": "hi"}
ENDPOINTS = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]


def sse_events(text):
    frames = [f for f in text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[6:]) for f in frames[:-1]]


def cached_events(request_id, prompt_tokens, cached_tokens, pieces=("a", "b")):
    """A request whose prompt was partly restored from the context cache, as the engine reports it."""
    return [GenerationStart(request_id=request_id, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens),
            *(OutputDelta(content=p, token_ids=(i + 10,)) for i, p in enumerate(pieces)),
            GenerationResult(request_id=request_id, finish_reason=FinishReason.STOP, timings=Timings(),
                             usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(pieces),
                                         cached_tokens=cached_tokens), content="".join(pieces))]


# -- prompt_cache_key ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", ENDPOINTS)
@pytest.mark.parametrize("key,words", [
    (5, "expected a string or null, got an integer"), (["a"], "got an array"), ({"k": "v"}, "got an object"),
    (True, "got a boolean"), ("", "must not be empty"),
    ("k" * (MAX_PROMPT_CACHE_KEY_CHARS + 1), f"at most {MAX_PROMPT_CACHE_KEY_CHARS} characters"),
])
def test_a_bad_prompt_cache_key_is_400_naming_it(engine, client, path, body, key, words):
    r = client(engine).post(path, json={**body, "prompt_cache_key": key})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_cache_key" and error["type"] == "invalid_request_error"
    assert words in error["message"] and "prompt_cache_key" in error["message"]
    assert engine.submitted == []


@pytest.mark.parametrize("path,body", ENDPOINTS)
def test_prompt_cache_key_reaches_the_engine_as_session_key(engine, script, client, path, body):
    engine.next = lambda r: script.Handle(r.request_id, script.text(r.request_id, 2, ["x"]))
    c = client(engine)
    longest = "k" * MAX_PROMPT_CACHE_KEY_CHARS
    for sent in ("conversation-7", longest):
        assert c.post(path, json={**body, "prompt_cache_key": sent}).status_code == 200
    assert c.post(path, json=body).status_code == 200
    assert c.post(path, json={**body, "prompt_cache_key": "both", "n": 2, "seed": 3, "temperature": 0.5}) \
        .status_code == 200
    assert [r.session_key for r in engine.submitted] == ["conversation-7", longest, None, "both", "both"]
    assert all(r.context_cache for r in engine.submitted)  # a client cannot opt a request out of the cache


# -- usage.prompt_tokens_details.cached_tokens ----------------------------------------------------------
@pytest.mark.parametrize("path,body", ENDPOINTS)
def test_cached_tokens_in_whole_and_streamed_usage(engine, script, client, path, body):
    engine.next = lambda r: script.Handle("r", cached_events("r", 9, 6))
    c = client(engine)
    expected = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
                "prompt_tokens_details": {"cached_tokens": 6}}
    assert c.post(path, json=body).json()["usage"] == expected
    with c.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = sse_events(r.read().decode())
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == expected
    assert all("usage" not in ch for ch in chunks[:-1])
    options = {"include_usage": True, "continuous_usage_stats": True}
    with c.stream("POST", path, json={**body, "stream": True, "stream_options": options}) as r:
        chunks = sse_events(r.read().decode())
    # from the GenerationStart on, every chunk's running usage already knows the cached part of the prompt
    assert all(ch["usage"]["prompt_tokens_details"] == {"cached_tokens": 6} for ch in chunks)


@pytest.mark.parametrize("path,body", ENDPOINTS)
def test_n_choices_count_the_prompt_once_and_its_cached_tokens_once(engine, script, client, path, body):
    """The choices share one prompt: usage counts it once, and its cached part as the fewest tokens any
    choice restored (here choice 0 computed the prompt, choice 1 restored 7 of its 8 tokens)."""
    cached = iter([0, 7, 0, 7])
    engine.next = lambda r: script.Handle(r.request_id, cached_events(r.request_id, 8, next(cached)))
    c = client(engine)
    expected = {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12,
                "prompt_tokens_details": {"cached_tokens": 0}}
    assert c.post(path, json={**body, "n": 2}).json()["usage"] == expected
    with c.stream("POST", path, json={**body, "n": 2, "stream": True,
                                      "stream_options": {"include_usage": True}}) as r:
        assert sse_events(r.read().decode())[-1]["usage"] == expected


def test_usage_is_zero_cached_without_a_cache_hit(engine, script, client):
    engine.next = lambda r: script.Handle("r", script.text("r", 3, ["x"]))  # GenerationStart without cached
    assert client(engine).post("/v1/chat/completions", json=CHAT).json()["usage"]["prompt_tokens_details"] == \
        {"cached_tokens": 0}


# -- /metrics ---------------------------------------------------------------------------------------------
def test_metrics_export_the_context_cache(engine, client, monkeypatch):
    snapshot = engine.metrics

    def with_cache():
        return attrs.evolve(snapshot(), prefix_cache_queries=120, prefix_cache_hits=96, checkpoints=5,
                            checkpoint_device_bytes=4096, checkpoint_host_bytes=1024,
                            cache_evictions={"host": 3, "dropped": 1})
    monkeypatch.setattr(engine, "metrics", with_cache)
    text = client(engine).get("/metrics").text
    for line in ('ninfer:prefix_cache_queries_total{model_name="tiny-test"} 120.0',
                 'ninfer:prefix_cache_hits_total{model_name="tiny-test"} 96.0',
                 'ninfer:checkpoints{model_name="tiny-test"} 5.0',
                 'ninfer:checkpoint_bytes{model_name="tiny-test",place="device"} 4096.0',
                 'ninfer:checkpoint_bytes{model_name="tiny-test",place="host"} 1024.0',
                 'ninfer:cache_evictions_total{model_name="tiny-test",to="host"} 3.0',
                 'ninfer:cache_evictions_total{model_name="tiny-test",to="dropped"} 1.0'):
        assert line in text.splitlines(), line
    assert "# TYPE ninfer:prefix_cache_hits_total counter" in text and "vLLM's prefix_cache_hits" in text
    assert "# TYPE ninfer:checkpoint_bytes gauge" in text and "# TYPE ninfer:cache_evictions_total counter" in text


def test_metrics_of_an_unused_cache_read_zero(engine, client):
    m = parse_metrics(client(engine).get("/metrics").text)
    for name in ("ninfer:prefix_cache_queries_total", "ninfer:prefix_cache_hits_total", "ninfer:checkpoints",
                 "ninfer:checkpoint_bytes", "ninfer:cache_evictions_total"):
        assert m[name] == 0, name


# -- warmup -------------------------------------------------------------------------------------------------
class _Done:
    def __init__(self, request_id):
        self.request_id = request_id

    def result(self, timeout=None):
        return GenerationResult(request_id=self.request_id, finish_reason=FinishReason.LENGTH, timings=Timings(),
                                usage=Usage(prompt_tokens=1, completion_tokens=4))


class _IdleEngine:
    """Answers every request at once and is always empty: what warmup needs to finish."""

    def __init__(self, inner, vision_enabled: bool = False):
        self.inner = inner
        self.submitted = []
        self.vision_enabled = vision_enabled

    def submit(self, request, cancel=None):
        self.submitted.append(request)
        return _Done(request.request_id)

    def metrics(self):
        return self.inner.metrics()

    def usage(self):
        return ResourceUsage(state_slots_total=4, state_slots_used=0, kv_pages_total=32, kv_pages_used=0)


def test_warmup_requests_stay_out_of_the_context_cache(engine):
    idle = _IdleEngine(engine)
    warmup(idle, concurrency=3)
    assert len(idle.submitted) == 3
    assert [r.context_cache for r in idle.submitted] == [False] * 3
    assert all(r.session_key is None for r in idle.submitted)
    with_vision = _IdleEngine(engine, vision_enabled=True)
    warmup(with_vision, concurrency=3)  # one more request: a chat with a picture, outside the cache too
    assert len(with_vision.submitted) == 4 and with_vision.submitted[-1].input.media
    assert [r.context_cache for r in with_vision.submitted] == [False] * 4


# -- the real engine on the embedded model, in process -------------------------------------------------------
@pytest.fixture(scope="module")
def real_engine(embedded_model, one_cpu_thread):
    with ninfer.Engine(embedded_model, ninfer.EngineConfig(device="cpu", max_concurrency=2,
                                                           max_model_len=256)) as engine:
        warmup(engine, concurrency=2)
        engine.after_warmup = engine.metrics()
        submitted = []
        submit = engine.submit

        def recording(request, cancel=None):
            submitted.append(request)
            return submit(request, cancel=cancel)
        engine.submit = recording
        engine.submitted = submitted
        yield engine


def test_real_engine_warmup_left_nothing_to_hit(real_engine):
    m = real_engine.after_warmup
    assert m.prefix_cache_queries == 0 and m.prefix_cache_hits == 0 and m.checkpoints == 0


@pytest.mark.parametrize("path,body", ENDPOINTS)
def test_real_engine_session_key_and_cached_tokens(real_engine, client, path, body):
    body = {**body, "model": real_engine.model_name, "max_tokens": 3, "temperature": 0,
            "prompt_cache_key": f"session-{path}"}
    c = client(real_engine)
    real_engine.submitted.clear()
    whole = c.post(path, json=body)
    assert whole.status_code == 200, whole.text
    details = whole.json()["usage"]["prompt_tokens_details"]
    assert isinstance(details["cached_tokens"], int)
    assert 0 <= details["cached_tokens"] <= whole.json()["usage"]["prompt_tokens"]
    with c.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        usage = sse_events(r.read().decode())[-1]["usage"]
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
    assert usage["prompt_tokens"] == whole.json()["usage"]["prompt_tokens"]
    assert [r.session_key for r in real_engine.submitted] == [f"session-{path}"] * 2
    text = c.get("/metrics").text
    for name in ("ninfer:prefix_cache_queries_total", "ninfer:prefix_cache_hits_total", "ninfer:checkpoints",
                 "ninfer:checkpoint_bytes", "ninfer:cache_evictions_total"):
        assert name in parse_metrics(text), name


def test_openapi_lists_prompt_cache_key(engine, client):
    schemas = client(engine).get("/openapi.json").json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        assert schemas[name]["properties"]["prompt_cache_key"] == \
            {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
