"""Where a decode step's device time goes when kernels overlap (PDL): each kernel's advance of the chain's end.

Under programmatic dependent launch a kernel starts before its predecessor ends and waits inside, so the
profiler's per-kernel durations overlap and add up to more than the step. What a kernel costs the step is how far
it moves the end of everything before it: advance = its end - the latest end of the events that started before
it (0 when it ends inside that span). The advances of one step add up to the step's device span, gaps between
graph replays included (they fall to the first kernel after the gap), so summed per kernel name they say where
the step goes, kernels outside the graph (sampling, copies) among them.

``trace`` wraps any code in a device-only profiler and returns the events; ``advances`` and ``table`` do the rest.
The test runs them on made-up events; ``benchmarks.moe_full_depth --chain-profile`` on the engine's steady steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def trace() -> Iterator[list]:
    """Profile the block's CUDA activity; the list fills with (name, start_us, end_us) once the block ends."""
    from torch.profiler import ProfilerActivity, profile

    events: list = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield events
    events.extend((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type.name == "CUDA")


def advances(events: Iterable[tuple[str, float, float]]) -> dict[str, dict]:
    """Per name: the summed chain advance (us), the summed duration (us) and the count, over events sorted by
    start. The first event only opens the span (its advance is not counted)."""
    out: dict[str, dict] = {}
    end = None
    for name, start, stop in sorted(events, key=lambda e: (e[1], e[2])):
        row = out.setdefault(name, {"advance_us": 0.0, "busy_us": 0.0, "count": 0})
        row["busy_us"] += stop - start
        row["count"] += 1
        if end is not None:
            row["advance_us"] += max(0.0, stop - end)
        end = stop if end is None else max(end, stop)
    return out


def table(per_name: dict[str, dict], steps: int, top: int = 30) -> list[dict]:
    """The ``top`` names by advance, per step: advance, busy time, calls; and a last row with the whole span."""
    rows = sorted(per_name.items(), key=lambda kv: kv[1]["advance_us"], reverse=True)
    out = [{"name": name[:90], "advance_us": r["advance_us"] / steps, "busy_us": r["busy_us"] / steps,
            "calls": r["count"] / steps} for name, r in rows[:top]]
    out.append({"name": "(all)", "advance_us": sum(r["advance_us"] for r in per_name.values()) / steps,
                "busy_us": sum(r["busy_us"] for r in per_name.values()) / steps,
                "calls": sum(r["count"] for r in per_name.values()) / steps})
    return out


def print_table(title: str, rows: list[dict]) -> None:
    print(f"# chain {title}: us per step (advance of the chain's end, device busy, calls)", flush=True)
    for r in rows:
        print(f"#   chain {r['advance_us']:8.2f} {r['busy_us']:8.2f} {r['calls']:6.1f}x  {r['name']}", flush=True)
