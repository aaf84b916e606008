"""Hugging Face transformers ``generate`` on a written Qwen3.5 checkpoint: the baseline every ninfer figure
is also divided by.

Greedy, random token-id prompts, a fixed number of new tokens (EOS suppressed with ``min_new_tokens``).
Per batch size, after a warm-up at the same shapes, one timed ``generate(N)`` whose streamer notes when
each new token reaches the host: prefill = call to first token (the prompt, the head and the first
sample), decode step = first to last token over N - 1 steps. Both come from one run: a difference of
two separately timed runs (T(N) - T(1)) can come out negative when the runs' noise exceeds the decode
time. fla kernels are used by transformers when ``fla`` is importable (reported as ``fla``).

``run`` is called by the ``bench`` and ``moe`` suites on the checkpoint they wrote.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(checkpoint: str | Path, *, device: str, prompt: int = 512, new_tokens: int = 64,
        batches: tuple[int, ...] = (1, 8), dtype: str = "bfloat16", seed: int = 0,
        clock: Callable[[], float] = time.perf_counter) -> dict:
    """Load ``checkpoint`` with ``from_pretrained`` and time greedy ``generate`` at each batch size.

    ``clock`` is any monotonic clock in seconds (tests pass a deterministic one)."""
    import torch
    import transformers

    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (the decode step spans the first to the last new token), "
                         f"got {new_tokens}")
    if prompt < 1 or not batches or min(batches) < 1:
        raise ValueError(f"prompt and batch sizes must be >= 1, got prompt {prompt}, batches {batches}")
    t0 = clock()
    # Straight onto the GPU (device_map) rather than through host memory: 18 GB for the 9B shape.
    placement = {"device_map": device} if device.startswith("cuda") else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=getattr(torch, dtype),
                                                              **placement)
    model.to(device).eval()
    _sync(device)
    load_s = clock() - t0
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    res = {"transformers": transformers.__version__, "fla": importlib.util.find_spec("fla") is not None,
           "device": device, "dtype": dtype, "prompt": prompt, "new_tokens": new_tokens, "load_s": load_s,
           "rows": []}

    def generate(model, ids: torch.Tensor, n: int) -> list[float]:
        """Greedy ``generate`` of exactly n tokens; [call time, then the time each new token reached the host]."""
        arrivals = TokenArrivals(clock)
        _sync(device)
        start = clock()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, streamer=arrivals)
        if out.shape[1] != ids.shape[1] + n:
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, expected {n}")
        if len(arrivals.times) != n + 1:  # the prompt, then one call per new token
            raise RuntimeError(f"transformers streamed {len(arrivals.times) - 1} token steps, expected {n}")
        return [start, *arrivals.times[1:]]

    with torch.inference_mode():
        for B in batches:
            ids = torch.randint(0, vocab, (B, prompt), generator=gen).to(device)
            generate(model, ids, 2)  # warm-up: kernel compilation (fla, Triton) at exactly these shapes
            start, first, *_, last = generate(model, ids, new_tokens)
            prefill_s = first - start
            step_ms = (last - first) / (new_tokens - 1) * 1e3
            res["rows"].append({"batch": B, "prefill_s": prefill_s, "total_s": last - start,
                                "decode_ms_per_step": step_ms, "decode_tokens_per_s": B / step_ms * 1e3,
                                "prefill_tokens_per_s": B * prompt / prefill_s})
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


class TokenArrivals:
    """A ``generate`` streamer (transformers calls ``put`` with the prompt, then with each new token, and
    ``end``) that notes the time of every ``put``; the tokens are handed over on the host, so on CUDA
    after the step's device work."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(self.clock())

    def end(self) -> None:
        pass

