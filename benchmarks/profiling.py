"""Decode steps under torch.profiler, summed up per step: the device's busy time, its launches and the top kernels
(CUDA), or the host ops (CPU). ``bench --profile`` profiles the Engine's steady decode, ``moe --profile`` a
Program's decode steps."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import sync


def kernel_profile(prof, steps: int, cuda: bool, path: Path | None, title: str) -> dict:
    """What a finished torch.profiler saw over ``steps`` decode steps, per step: the device's kernels and copies
    (CUDA; a CPU op's device time repeats its kernels') or the host ops (CPU): busy time, launches, the top 20
    entries; the whole table goes to ``path`` under ``title``."""
    events = prof.key_averages()
    if cuda:
        kernels, key = [e for e in events if e.device_type.name == "CUDA"], "self_device_time_total"
    else:
        kernels, key = list(events), "self_cpu_time_total"
    kernels.sort(key=lambda e: getattr(e, key), reverse=True)
    busy_us = sum(getattr(e, key) for e in kernels) if cuda and kernels else None  # None: no kernel seen
    if path is not None:
        path.write_text(f"# {title}; per-step figures divide by {steps}\n" + events.table(sort_by=key, row_limit=60))
    return {"forwards": steps, "device_busy_ms_per_step": None if busy_us is None else busy_us / steps / 1e3,
            "launches_per_step": sum(e.count for e in kernels) / steps if cuda else None,
            "top": [{"name": e.key[:120], "ms_per_step": getattr(e, key) / steps / 1e3,
                     "calls_per_step": e.count / steps} for e in kernels[:20]]}


def profile_steps(step, device: str, steps: int, path: Path) -> dict:
    """``steps`` calls of ``step`` under torch.profiler, summed up by ``kernel_profile`` (its table to ``path``)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        sync(device)
    return kernel_profile(prof, steps, cuda, path, f"{path.stem}: {steps} decode steps")
