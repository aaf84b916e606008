"""A scripted stand-in for ``ninfer.Engine``, used ONLY by the pure schema / framing / error-mapping unit
tests in this folder. It replays fixed events; the acceptance tests (tests/test_serve_*.py) drive the real
engine with a real tiny model instead."""

from __future__ import annotations

import asyncio

import pytest

from ninfer.contract.events import (
    FinishReason,
    GenerationResult,
    GenerationStart,
    OutputDelta,
    Timings,
    Usage,
)
from ninfer.contract.model import ResourceUsage
from ninfer.engine.metrics import MetricsRecorder


class ScriptedHandle:
    def __init__(self, request_id, events, error=None, delay_s=0.0):
        self.request_id = request_id
        self.events = list(events)
        self.error = error
        self.delay_s = delay_s
        self.closed = False
        self.cancelled = False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for ev in self.events:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            yield ev

    def exception(self):
        return self.error

    def cancel(self):
        self.cancelled = True

    def close(self):
        self.closed = True
        if not self.events or not isinstance(self.events[-1], GenerationResult):
            self.cancelled = True


def text_events(request_id, prompt_tokens, pieces, reason=FinishReason.STOP, **delta_kw):
    evs = [GenerationStart(request_id=request_id, prompt_tokens=prompt_tokens)]
    for i, p in enumerate(pieces):
        evs.append(OutputDelta(content=p, token_ids=(i + 10,), **delta_kw))
    evs.append(GenerationResult(request_id=request_id, finish_reason=reason, timings=Timings(),
                                usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(pieces)),
                                content="".join(pieces)))
    return evs


class ScriptedEngine:
    model_name = "tiny-test"
    max_model_len = 128
    memory = None  # no start took memory (a test sets a MemorySummary to see its gauges)
    vision_enabled = False  # a test that sends media sets it

    def __init__(self):
        self.submitted = []
        self.next = None  # callable(request) -> ScriptedHandle, or an exception to raise
        self.handles = []
        self.cancels = []  # the ``cancel`` event each submit was given
        self.recorder = MetricsRecorder()

    def submit(self, request, cancel=None):
        self.submitted.append(request)
        self.cancels.append(cancel)
        if isinstance(self.next, BaseException):
            raise self.next
        h = self.next(request)
        self.handles.append(h)
        return h

    def metrics(self):
        return self.recorder.snapshot(queue_depth=0, running=0, paused=0, outstanding=0, kv_pages_used=0,
                                      kv_pages_total=32, failed=False)

    def usage(self):
        return ResourceUsage(state_slots_total=4, state_slots_used=0, kv_pages_total=32, kv_pages_used=0)



@pytest.fixture
def engine():
    return ScriptedEngine()


@pytest.fixture
def script():
    """Helpers to script events: ``script.text(...)`` and the handle class."""
    class _S:
        text = staticmethod(text_events)
        Handle = ScriptedHandle
    return _S


@pytest.fixture
def client():
    """``client(engine, base_url=..., **create_app_options)``: a started TestClient (lifespan run), closed
    after the test, which shuts the app's TaskPool down."""
    from starlette.testclient import TestClient

    from ninfer_serve.app import create_app

    opened = []

    def make(engine, base_url="http://testserver", **kw):
        c = TestClient(create_app(engine, **kw), base_url=base_url)
        c.__enter__()
        opened.append(c)
        return c
    yield make
    for c in opened:
        c.__exit__(None, None, None)
