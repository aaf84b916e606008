"""Serve warmup through the public Engine, leaving nothing an external request could hit.

The warmup requests are ordinary greedy requests (so prefill, every decode width up to
max_concurrency and the output path run once before the port opens) that neither read nor write the
context cache; the last one is constrained, so the vocabulary's grammar tables are built and the mask path
runs before the first client's constrained request; afterwards the engine must be back to empty: no resident, paused or queued request
and every page, slot and host byte free.
"""

from __future__ import annotations

import time
from typing import Any

from ninfer.contract import GenerationRequest, RegexConstraint, SamplingParams, TextInput
from ninfer.contract.events import FinishReason


class WarmupFailed(RuntimeError):
    pass


def warmup_requests(concurrency: int, *, max_tokens: int = 4, prompt: str = "Hello") -> list[GenerationRequest]:
    """The warmup's requests: greedy, fixed length, and outside the context cache (``context_cache=False``),
    so no checkpoint of the warmup prompt is left for a client's request to hit. The last one is constrained."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    constrained = RegexConstraint(pattern="[^<>]{1,256}")
    return [GenerationRequest(input=TextInput(text=prompt), sampling=sampling, request_id=f"warmup-{i}",
                              context_cache=False, constraint=constrained if i == concurrency - 1 else None)
            for i in range(concurrency)]


def warmup(engine: Any, *, concurrency: int, max_tokens: int = 4, prompt: str = "Hello",
           settle_timeout_s: float = 30.0) -> float:
    """Run ``concurrency`` short requests at once; returns the seconds it took."""
    t0 = time.monotonic()
    handles = [engine.submit(r) for r in warmup_requests(concurrency, max_tokens=max_tokens, prompt=prompt)]
    for h in handles:
        result = h.result()
        if result.finish_reason is FinishReason.ERROR:
            raise WarmupFailed(f"warmup request {h.request_id} failed: {result.error}")
    # Releases are settled by the worker; wait until the engine reports itself empty again.
    end = time.monotonic() + settle_timeout_s
    while True:
        m, usage = engine.metrics(), engine.usage()
        if m.running == m.paused == m.queue_depth == m.outstanding == 0 and usage.all_free:
            return time.monotonic() - t0
        if time.monotonic() > end:
            raise WarmupFailed(f"engine not empty after warmup: running={m.running} paused={m.paused} "
                               f"queued={m.queue_depth} outstanding={m.outstanding} usage={usage}")
        time.sleep(0.01)
