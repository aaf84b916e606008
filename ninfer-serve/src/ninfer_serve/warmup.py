"""Serve warmup through the public Engine, leaving nothing an external request could hit.

The warmup requests are ordinary greedy requests (so prefill, every decode width up to
max_concurrency and the output path run once before the port opens) that neither read nor write the
context cache; the last one is constrained, so the vocabulary's grammar tables are built and the mask path
runs before the first client's constrained request. With the vision feature one more request carries a small
picture, so the media path (preparation, the encoder, MRoPE prefill) has run and compiled its kernels before
the first client's image (a cold first image pays for kernel compilation: docs/performance.md, "Vision encoder").
Afterwards the engine must be back to empty: no resident, paused or queued request and every page, slot and
host byte free.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ninfer.contract import ChatInput, GenerationRequest, RegexConstraint, SamplingParams, TextInput
from ninfer.contract.events import FinishReason
from ninfer.contract.prompt import MediaItem

if TYPE_CHECKING:  # warmup blocks on each result: it runs on the real engine
    from ninfer import Engine

WARMUP_IMAGE_SIDE = 64  # pixels; the preprocessor's minimum area resizes it up (256 x 256 for Qwen3.5)


class WarmupFailed(RuntimeError):
    pass


def warmup_requests(concurrency: int, *, max_tokens: int = 4, prompt: str = "Hello",
                    vision: bool = False) -> list[GenerationRequest]:
    """The warmup's requests: greedy, fixed length, and outside the context cache (``context_cache=False``),
    so no checkpoint of the warmup prompt is left for a client's request to hit. The last one is constrained.
    ``vision``: one more, a chat with a small picture."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    constrained = RegexConstraint(pattern="[^<>]{1,256}")
    requests = [GenerationRequest(input=TextInput(text=prompt), sampling=sampling, request_id=f"warmup-{i}",
                                  context_cache=False, constraint=constrained if i == concurrency - 1 else None)
                for i in range(concurrency)]
    if vision:
        chat = ChatInput(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
                         media=[MediaItem(kind="image", data=warmup_image(), mime_type="image/png")])
        requests.append(GenerationRequest(input=chat, sampling=sampling, request_id=f"warmup-{concurrency}",
                                          context_cache=False))
    return requests


def warmup_image(side: int = WARMUP_IMAGE_SIDE) -> bytes:
    """A PNG of a colour gradient (not flat, so every patch differs)."""
    import io

    from PIL import Image

    image = Image.new("RGB", (side, side))
    image.putdata([(x * 255 // side, y * 255 // side, 128) for y in range(side) for x in range(side)])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def warmup(engine: Engine, *, concurrency: int, max_tokens: int = 4, prompt: str = "Hello",
           settle_timeout_s: float = 30.0) -> float:
    """Run ``concurrency`` short requests at once (and a chat with a picture when the engine has vision); returns
    the seconds it took."""
    t0 = time.monotonic()
    requests = warmup_requests(concurrency, max_tokens=max_tokens, prompt=prompt, vision=engine.vision_enabled)
    handles = [engine.submit(r) for r in requests]
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
