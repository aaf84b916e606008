"""Prometheus ``/metrics``: a per-app registry whose engine metrics are read from ``engine.metrics()``.

Names follow vLLM's (``ninfer:num_requests_running``, ``ninfer:time_to_first_token_seconds``, ...).
The engine keeps the counts; this collector only translates one consistent snapshot per scrape. What the
start took (``engine.memory``) reads as the ``ninfer:memory_*`` gauges (``ninfer.engine.memory_report``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from ninfer.contract.model import ResourceUsage
from ninfer.contract.serving import ServingEngine
from ninfer.core.task_pool import TaskPool
from ninfer.engine.memory_report import memory_gauges
from ninfer.engine.metrics import EngineMetrics, HistogramSnapshot

Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily
One = Callable[[str, str, float], Family]  # one family of one sample: (name, doc, value)


def _histogram(name: str, doc: str, snap: HistogramSnapshot, model_name: str) -> HistogramMetricFamily:
    cumulative = snap.cumulative()  # one more entry than bounds: the last is +Inf
    buckets = [(repr(float(b)), c) for b, c in zip(snap.bounds, cumulative, strict=False)]
    buckets.append(("+Inf", cumulative[-1] if cumulative else 0))
    h = HistogramMetricFamily(name, doc, labels=["model_name"])
    h.add_metric([model_name], buckets, sum_value=snap.total)
    return h


def _context_cache(m: EngineMetrics, model_name: str, gauge: One, counter: One) -> Iterator[Family]:
    """The context cache's families: prefix-cache queries and hits in prompt tokens (vLLM's names), the
    checkpoints held and their bytes by place, evictions by where the checkpoint went."""
    yield counter("ninfer:prefix_cache_queries", "Prompt tokens of requests that looked up the context cache "
                  "(as vLLM's prefix_cache_queries).", m.prefix_cache_queries)
    yield counter("ninfer:prefix_cache_hits", "Of those, prompt tokens restored from the context cache "
                  "(as vLLM's prefix_cache_hits).", m.prefix_cache_hits)
    yield gauge("ninfer:checkpoints", "Context-cache checkpoints held.", m.checkpoints)
    places = GaugeMetricFamily("ninfer:checkpoint_bytes", "Bytes the context-cache checkpoints hold, by place.",
                               labels=["model_name", "place"])
    places.add_metric([model_name, "device"], m.checkpoint_device_bytes)
    places.add_metric([model_name, "host"], m.checkpoint_host_bytes)
    yield places
    evictions = CounterMetricFamily("ninfer:cache_evictions", "Context-cache checkpoint evictions by where "
                                    "they went (host: demoted to a host replica; dropped: freed).",
                                    labels=["model_name", "to"])
    for to in ("host", "dropped"):
        evictions.add_metric([model_name, to], m.cache_evictions.get(to, 0))
    yield evictions


def _speculative(m: EngineMetrics, model_name: str, gauge: One, counter: One) -> Iterator[Family]:
    """Speculative decoding's families, under vLLM's spec_decode_* names: verify steps (drafts), draft tokens
    verified, drafts accepted (in all and per draft position), and the mean acceptance length."""
    s = m.speculative
    yield counter("ninfer:spec_decode_num_drafts", "Verify steps of rows that carried drafts "
                  "(as vLLM's spec_decode_num_drafts).", s.drafts)
    yield counter("ninfer:spec_decode_num_draft_tokens", "Draft tokens verified "
                  "(as vLLM's spec_decode_num_draft_tokens).", s.draft_tokens)
    yield counter("ninfer:spec_decode_num_accepted_tokens", "Draft tokens verification accepted "
                  "(as vLLM's spec_decode_num_accepted_tokens).", s.accepted_tokens)
    per_position = CounterMetricFamily("ninfer:spec_decode_num_accepted_tokens_per_pos", "Verify steps that "
                                       "accepted the draft at this position (0: the first; as vLLM's "
                                       "spec_decode_num_accepted_tokens_per_pos).",
                                       labels=["model_name", "position"])
    for position, n in enumerate(s.accepted_per_position):
        per_position.add_metric([model_name, str(position)], n)
    yield per_position
    yield gauge("ninfer:spec_decode_mean_acceptance_length", "Tokens per verify step since start, 1 + accepted "
                "/ drafts (0 before the first verify step).", s.mean_acceptance_length or 0.0)


class EngineCollector(Collector):
    def __init__(self, engine: ServingEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def describe(self):  # no up-front description: collect() reads the engine lazily
        return []

    def _usage(self) -> ResourceUsage | None:
        try:
            return self.engine.usage()
        except Exception:  # a failed or closed engine still answers the rest of /metrics
            return None

    def collect(self) -> Iterator[Family]:
        m = self.engine.metrics()
        label = ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=label)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=label)
            c.add_metric(value, v)
            return c

        yield gauge("ninfer:num_requests_running", "Requests resident on the device.", m.running)
        yield gauge("ninfer:num_requests_waiting", "Requests waiting for admission.", m.queue_depth)
        yield gauge("ninfer:num_requests_paused", "Requests paused by preemption.", m.paused)
        yield gauge("ninfer:num_requests_outstanding", "Requests holding outstanding capacity.", m.outstanding)
        yield gauge("ninfer:kv_cache_pages_used", "KV pages requests hold.", m.kv_pages_used)
        yield gauge("ninfer:kv_cache_pages_cached", "KV pages only the context cache holds (reclaimed on demand).",
                    m.kv_pages_cached)
        yield gauge("ninfer:kv_cache_pages_total", "KV pages in the pool.", m.kv_pages_total)
        yield gauge("ninfer:kv_cache_usage_perc", "Fraction of KV pages in use.",
                    m.kv_pages_used / m.kv_pages_total if m.kv_pages_total else 0.0)
        usage = self._usage()
        if usage is not None:  # the Program's own ledger: what tests check to prove everything was released
            yield gauge("ninfer:state_slots_used", "StateImage slots bound to sequences.", usage.state_slots_used)
            yield gauge("ninfer:state_slots_total", "StateImage slots.", usage.state_slots_total)
            yield gauge("ninfer:kv_cache_pages_reserved", "KV pages reserved for the next units.",
                        usage.reserved_pages)
            yield gauge("ninfer:host_bytes_used", "Host memory holding paused requests.", usage.host_bytes_used)
            yield gauge("ninfer:host_bytes_total", "Host budget for paused Snapshots.", usage.host_bytes_total)
        yield gauge("ninfer:engine_failed", "1 when the engine has failed and accepts no work.", float(m.failed))
        yield counter("ninfer:num_preemptions", "Preemptions (pauses) of running requests.", m.preemptions)
        yield counter("ninfer:num_snapshots_revoked", "Paused Snapshots demoted to Replay under host pressure.",
                      m.snapshots_revoked)
        yield counter("ninfer:prompt_tokens", "Prompt tokens admitted.", m.prompt_tokens)
        yield counter("ninfer:generation_tokens", "Tokens generated.", m.generated_tokens)
        yield from _context_cache(m, self.model_name, gauge, counter)
        yield from _speculative(m, self.model_name, gauge, counter)
        if self.engine.memory is not None:  # what the start took: fixed once the engine is up
            for g in memory_gauges(self.engine.memory):
                yield gauge(g.name, g.help, g.value)
        success = CounterMetricFamily("ninfer:request_success", "Finished requests by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, n in sorted(m.requests_finished.items()):
            success.add_metric([self.model_name, reason], n)
        yield success
        rejected = CounterMetricFamily("ninfer:request_rejected", "Rejected requests by kind.",
                                       labels=["model_name", "kind"])
        for kind, n in sorted(m.requests_rejected.items()):
            rejected.add_metric([self.model_name, kind], n)
        yield rejected
        yield _histogram("ninfer:time_to_first_token_seconds", "Time to first token.", m.ttft, self.model_name)
        yield _histogram("ninfer:inter_token_latency_seconds", "Time between output tokens.", m.inter_token, self.model_name)
        yield _histogram("ninfer:request_queue_time_seconds", "Time waiting for admission.", m.queue_time, self.model_name)
        yield _histogram("ninfer:e2e_request_latency_seconds", "End-to-end request latency.", m.end_to_end, self.model_name)


class GatewayMetrics:
    """The app's registry: the engine collector plus HTTP-level metrics the gateway itself owns."""

    def __init__(self, engine: ServingEngine, model_name: str, pool: TaskPool, media_pool: TaskPool,
                 heavy_pool: TaskPool) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        self.http_requests = Counter("ninfer:http_requests", "HTTP requests by endpoint and status.",
                                     ["endpoint", "status"], registry=self.registry)
        self.disconnects = Counter("ninfer:client_disconnects", "Requests cancelled because the client left.",
                                   ["endpoint"], registry=self.registry)
        self.in_flight = Gauge("ninfer:http_requests_in_flight", "/v1 requests being read, prepared or answered.",
                               registry=self.registry)
        queued = Gauge("ninfer:http_prepare_queued", "Plain requests waiting for a thread to prepare them "
                       "(template and tokenization).", registry=self.registry)
        queued.set_function(lambda: pool.queued)
        running = Gauge("ninfer:http_prepare_running", "Plain requests being prepared now.", registry=self.registry)
        running.set_function(lambda: pool.running)
        media_queued = Gauge("ninfer:http_media_queued", "Requests waiting for a thread to fetch their images and "
                             "videos.", registry=self.registry)
        media_queued.set_function(lambda: media_pool.queued)
        media_running = Gauge("ninfer:http_media_running", "Requests whose media is being fetched now.",
                              registry=self.registry)
        media_running.set_function(lambda: media_pool.running)
        heavy_queued = Gauge("ninfer:http_heavy_prepare_queued", "Requests with a constraint or media waiting "
                             "for a thread to prepare them (grammar compilation, media decoding).",
                             registry=self.registry)
        heavy_queued.set_function(lambda: heavy_pool.queued)
        heavy_running = Gauge("ninfer:http_heavy_prepare_running", "Requests with a constraint or media being "
                              "prepared now.", registry=self.registry)
        heavy_running.set_function(lambda: heavy_pool.running)


class InFlight:
    """Counts ``/v1`` requests from arrival until the response, streamed ones included, is over."""

    def __init__(self, app: ASGIApp, gauge: Gauge) -> None:
        self.app = app
        self.gauge = gauge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        self.gauge.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.gauge.dec()
