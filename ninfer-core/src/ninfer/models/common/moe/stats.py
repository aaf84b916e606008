"""What the host experts' runtime counts (``HostExperts.stats``): how routed (token, expert) pairs were served."""

from __future__ import annotations

import attrs


@attrs.frozen
class ExpertStats:
    """Counters since the Program started. A *pair* is one token routed to one expert.

    ``cache_hits`` / ``cache_misses``: pairs of few-token calls whose expert was / was not in the device cache
    (misses run on the CPU team). ``streamed_pairs``: pairs of many-token calls, served from a whole layer
    streamed to the device. ``streamed_layers``: layer banks uploaded whole. ``admitted``: experts copied into
    the cache on a miss or from a streamed layer; ``prefetched``: experts uploaded ahead because the previous
    layer's input predicted them. ``mixed_calls`` / ``streamed_calls``: MoE layer calls by mode.

    Host seconds of the mixed calls, by phase (where a slow step goes): ``wait_s`` for the device to hand over
    the routing (the previous work of the stream included), ``team_s`` in the CPU team's collective and the sum
    of its rows, ``upload_s`` issuing cache admissions and prefetches, ``mixed_s`` the calls in all."""

    cache_hits: int = 0
    cache_misses: int = 0
    streamed_pairs: int = 0
    streamed_layers: int = 0
    admitted: int = 0
    prefetched: int = 0
    mixed_calls: int = 0
    streamed_calls: int = 0
    wait_s: float = 0.0
    team_s: float = 0.0
    upload_s: float = 0.0
    mixed_s: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        """Cache hits over few-token pairs (None before any)."""
        total = self.cache_hits + self.cache_misses
        return None if total == 0 else self.cache_hits / total
