"""One request's token gaps while the Frontend decodes another request's large pictures, with the media threads
at the process's priority against ``MEDIA_NICE`` steps below it (issue 42, item 3), on the CPU.

A tiny Qwen3.5 VL artifact whose decoding bound is raised (``media_max_pixels``) so that ``--side`` x ``--side``
PNGs are legal: each is decoded whole and resized down to the tiny preprocessor's size, so the encoder costs
little and decoding is the load. Request A, a text chat, streams tokens (``ignore_eos``; resubmitted while the
window lasts); meanwhile a second thread runs ``engine.prepare`` on a chat with ``--images`` such pictures, what
the gateway's HTTP pool does before ``submit``. Reported per mode: A's worst gap between two tokens of one
request inside the preparation window, the median gap there, and the preparation's wall time; first A's worst
gap with nothing else running. Modes alternate, ``--repeats`` rounds; min / median over rounds.

    ninfer tiny-checkpoint --layout vl --no-mtp /tmp/tiny && ninfer convert /tmp/tiny /tmp/tiny.ninfer
    python -m benchmarks.media_priority /tmp/tiny.ninfer --repeats 5
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import threading
import time

import numpy as np
from PIL import Image

clock = time.perf_counter


def picture(side: int) -> bytes:
    """A PNG of a gradient with a little noise: a photo-like decode cost, a few MB."""
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 200, side, dtype=np.float32)
    pixels = ramp[None, :, None] + ramp[:, None, None] / 4 + rng.integers(0, 24, (side, side, 3))
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB").save(out, "PNG", compress_level=1)
    return out.getvalue()


def text_request(tokens: int):
    from ninfer.contract import ChatInput, GenerationRequest, SamplingParams

    chat = ChatInput(messages=[{"role": "user", "content": "Tell me a long story."}])
    return GenerationRequest(input=chat, sampling=SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))


def stream_until(engine, stop: threading.Event, tokens: int) -> list[list[float]]:
    """A's token times, one list per request, resubmitted until ``stop`` is set."""
    runs = []
    while not stop.is_set():
        times: list[float] = []
        runs.append(times)
        for _event in engine.submit(text_request(tokens)):
            times.append(clock())
            if stop.is_set():
                break
    return runs


def gaps_within(runs: list[list[float]], start: float, end: float) -> list[float]:
    """Gaps between consecutive tokens of one request that overlap [start, end]."""
    return [b - a for times in runs for a, b in zip(times, times[1:], strict=False) if b > start and a < end]


def one_round(engine, media_chat, nice: int, tokens: int) -> dict:
    from ninfer.models.common.qwen import media_preparation

    media_preparation.MEDIA_NICE = nice
    # fresh pool threads per mode: a lowered thread never goes back up
    old = engine.frontend._media
    engine.frontend._media = media_preparation.MediaPreparer(old.config, limits=old.limits)
    old.close()
    stop = threading.Event()
    runs: list[list[float]] = []
    streamer = threading.Thread(target=lambda: runs.extend(stream_until(engine, stop, tokens)))
    streamer.start()
    time.sleep(0.5)  # A decodes steadily first
    start = clock()
    engine.prepare(media_chat)
    end = clock()
    time.sleep(0.2)
    stop.set()
    streamer.join()
    gaps = gaps_within(runs, start, end)
    return {"worst_gap_ms": 1e3 * max(gaps), "p95_gap_ms": 1e3 * _p95(gaps),
            "median_gap_ms": 1e3 * statistics.median(gaps), "prepare_s": end - start}


def _p95(values: list[float]) -> float:
    return sorted(values)[int(0.95 * (len(values) - 1))]


def idle_gaps(engine, tokens: int, seconds: float = 2.0) -> dict:
    stop = threading.Event()
    runs: list[list[float]] = []
    streamer = threading.Thread(target=lambda: runs.extend(stream_until(engine, stop, tokens)))
    streamer.start()
    time.sleep(0.5 + seconds)
    start = clock() - seconds
    stop.set()
    streamer.join()
    gaps = gaps_within(runs, start, clock())
    return {"worst_gap_ms": 1e3 * max(gaps), "p95_gap_ms": 1e3 * _p95(gaps),
            "median_gap_ms": 1e3 * statistics.median(gaps)}


def summary(values: list[float]) -> dict:
    return {"min": round(min(values), 1), "median": round(statistics.median(values), 1),
            "all": [round(v, 1) for v in values]}


def main() -> None:
    import ninfer
    from ninfer.contract import ChatInput
    from ninfer.contract.prompt import MediaItem
    from ninfer.models.common.qwen import media_preparation

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--side", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=3000, help="A's max_tokens (it is resubmitted as needed)")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    data = picture(args.side)
    parts = [{"type": "image"}] * args.images + [{"type": "text", "text": "Compare them."}]
    media_chat = ChatInput(messages=[{"role": "user", "content": parts}],
                           media=[MediaItem(kind="image", data=data)] * args.images)
    lowered = media_preparation.MEDIA_NICE
    results: dict = {"images": args.images, "side": args.side, "png_bytes": len(data), "lowered_nice": lowered,
                     "rounds": []}
    config = ninfer.EngineConfig(device="cpu", max_concurrency=2, context_cache=False,
                                 media_max_pixels=args.side * args.side)
    with ninfer.Engine(args.artifact, config=config) as engine:
        engine.prepare(media_chat)  # warm: imports, allocator, the first encode path
        idle = [idle_gaps(engine, args.tokens) for _ in range(3)]
        results["idle"] = {key: summary([r[key] for r in idle]) for key in idle[0]}
        print("A alone:", json.dumps(results["idle"]), flush=True)
        for round_ in range(args.repeats):
            for nice in ((0, lowered) if round_ % 2 == 0 else (lowered, 0)):
                figures = {"nice": nice, **one_round(engine, media_chat, nice, args.tokens)}
                results["rounds"].append(figures)
                print(json.dumps(figures), flush=True)
    for nice in (0, lowered):
        rounds = [r for r in results["rounds"] if r["nice"] == nice]
        results[f"nice_{nice}"] = {key: summary([r[key] for r in rounds])
                                   for key in ("worst_gap_ms", "p95_gap_ms", "median_gap_ms", "prepare_s")}
        print(f"media threads at nice +{nice}:", json.dumps(results[f"nice_{nice}"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
