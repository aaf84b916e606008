"""Engine observation: counters, gauges and latency histograms, read as one consistent snapshot.

The worker records; any thread may call ``snapshot``. Histogram buckets follow the Prometheus
convention (cumulative counts per upper bound) so a gateway can export them unchanged.
"""

from __future__ import annotations

import bisect
import threading

import attrs

from ninfer.contract.config import MAX_DRAFT_TOKENS

# Seconds; wide enough for CPU test runs and fine enough for GPU inter-token gaps.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12,
                   10.24, 20.48, 40.96, 81.92)


@attrs.frozen(kw_only=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket (not cumulative); the last entry is the +Inf bucket
    total: float
    count: int

    def cumulative(self) -> tuple[int, ...]:
        out, acc = [], 0
        for c in self.counts:
            acc += c
            out.append(acc)
        return tuple(out)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


class Histogram:
    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(bounds=self.bounds, counts=tuple(self.counts), total=self.total, count=self.count)


@attrs.frozen(kw_only=True)
class SpeculativeStats:
    """Speculative decoding's counters (vLLM's spec_decode_* names), from the committed rows that verified
    drafts: the verify rows (``drafts``), the draft tokens they verified, the drafts verification accepted,
    and per draft position how many rows accepted at least that far (position 0: the first draft)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = (0,) * MAX_DRAFT_TOKENS

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify step (the accepted drafts plus the token verification adds); None before one."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens over the draft tokens verified; None before one."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


@attrs.frozen(kw_only=True)
class EngineMetrics:
    """A point-in-time view of the engine for the server's /metrics and for tests."""

    queue_depth: int
    running: int
    paused: int
    outstanding: int
    preemptions: int
    preemptions_snapshot: int
    preemptions_replay: int
    snapshots_revoked: int = 0  # paused Snapshots demoted to Replay under host pressure
    prompt_tokens: int
    generated_tokens: int
    requests_finished: dict[str, int]
    requests_rejected: dict[str, int]
    kv_pages_used: int  # held by requests; pages only the context cache holds are kv_pages_cached
    kv_pages_total: int
    kv_pages_cached: int = 0
    # Context cache (vLLM's prefix_cache_queries / _hits count tokens): prompt tokens of requests that looked
    # up the cache, and of those the tokens restored; checkpoints held now, and evictions by where they went.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    checkpoints: int = 0
    checkpoint_device_bytes: int = 0
    checkpoint_host_bytes: int = 0
    cache_evictions: dict[str, int] = attrs.field(factory=dict)  # "host" (demoted) / "dropped"
    speculative: SpeculativeStats = SpeculativeStats()
    ttft: HistogramSnapshot
    inter_token: HistogramSnapshot
    queue_time: HistogramSnapshot
    end_to_end: HistogramSnapshot
    failed: bool


class MetricsRecorder:
    """Mutable counters behind ``EngineMetrics``; guarded by one lock (worker writes, readers snapshot)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.preemptions = {"snapshot": 0, "replay": 0}
        self.revoked = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.finished: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.ttft = Histogram()
        self.inter_token = Histogram()
        self.queue_time = Histogram()
        self.end_to_end = Histogram()
        self.cache_queries = 0
        self.cache_hits = 0
        self.cache = None  # the ResourceManager's stats (gauges) as of the worker's last observation
        self.evictions: dict[str, int] = {}  # counters, recorded as evictions happen
        self.drafts = 0  # speculative decoding: verify rows, draft tokens, accepted drafts (in all; by position)
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_position = [0] * MAX_DRAFT_TOKENS

    def preempted(self, mode: str) -> None:
        with self.lock:
            self.preemptions[mode] += 1

    def snapshot_revoked(self) -> None:
        with self.lock:
            self.revoked += 1

    def rejected_request(self, kind: str) -> None:
        with self.lock:
            self.rejected[kind] = self.rejected.get(kind, 0) + 1

    def admitted(self, prompt_tokens: int, queued_s: float) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.queue_time.observe(queued_s)

    def tokens(self, n: int, *, first_token_s: float | None, gap_s: float | None) -> None:
        """``n`` tokens committed at once: a first token records TTFT, later ones the gap per token."""
        with self.lock:
            self.generated_tokens += n
            if first_token_s is not None:
                self.ttft.observe(first_token_s)
            if gap_s is not None:
                for _ in range(n):
                    self.inter_token.observe(gap_s / n)

    def drafts_verified(self, drafted: int, accepted: int) -> None:
        """A committed row verified ``drafted`` draft tokens and verification accepted the first ``accepted``."""
        with self.lock:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            for position in range(min(accepted, len(self.accepted_per_position))):  # a longer drafter: the first
                self.accepted_per_position[position] += 1

    def prefix_cache_lookup(self, queried: int, hit: int) -> None:
        """A request looked up ``queried`` prompt tokens in the context cache and restored ``hit`` of them."""
        with self.lock:
            self.cache_queries += queried
            self.cache_hits += hit

    def cache_evictions(self, counts: dict[str, int]) -> None:
        """The context cache's eviction counters (by outcome), right after evicting."""
        with self.lock:
            self.evictions = dict(counts)

    def cache_state(self, stats) -> None:
        """The context cache's holdings (``context_cache.CacheStats``), set by the worker after each cycle."""
        with self.lock:
            self.cache = stats

    def finished_request(self, reason: str, end_to_end_s: float) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.end_to_end.observe(end_to_end_s)

    def snapshot(self, *, queue_depth: int, running: int, paused: int, outstanding: int, kv_pages_used: int,
                 kv_pages_total: int, failed: bool, kv_pages_cached: int = 0) -> EngineMetrics:
        with self.lock:
            cache = self.cache
            return EngineMetrics(
                queue_depth=queue_depth, running=running, paused=paused, outstanding=outstanding,
                preemptions=sum(self.preemptions.values()), preemptions_snapshot=self.preemptions["snapshot"],
                preemptions_replay=self.preemptions["replay"], snapshots_revoked=self.revoked,
                prompt_tokens=self.prompt_tokens,
                generated_tokens=self.generated_tokens, requests_finished=dict(self.finished),
                requests_rejected=dict(self.rejected), kv_pages_used=kv_pages_used, kv_pages_total=kv_pages_total,
                kv_pages_cached=kv_pages_cached,
                ttft=self.ttft.snapshot(), inter_token=self.inter_token.snapshot(),
                queue_time=self.queue_time.snapshot(), end_to_end=self.end_to_end.snapshot(), failed=failed,
                prefix_cache_queries=self.cache_queries, prefix_cache_hits=self.cache_hits,
                checkpoints=cache.checkpoints if cache else 0, checkpoint_device_bytes=cache.device_bytes if cache else 0,
                checkpoint_host_bytes=cache.host_bytes if cache else 0,
                cache_evictions=dict(self.evictions),
                speculative=SpeculativeStats(drafts=self.drafts, draft_tokens=self.draft_tokens,
                                             accepted_tokens=self.accepted_tokens,
                                             accepted_per_position=tuple(self.accepted_per_position)))
