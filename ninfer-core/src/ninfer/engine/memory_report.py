"""What a start took (``MemorySummary``), shown to people and to monitoring: the short block ``ninfer generate``
and ``ninfer serve`` print at startup (``summary_lines``), and the gauges ``/metrics`` exports
(``memory_gauges``). Sizes read as ``ninfer.core.sizes.format_bytes`` writes them.

Light at import (the memory contract only), so ``ninfer --help`` loads no torch.
"""

from __future__ import annotations

import attrs

from ninfer.contract.memory import MemorySummary
from ninfer.core.sizes import GIB, KIB, MIB, format_bytes


def summary_lines(m: MemorySummary) -> list[str]:
    """The startup block, 2-4 lines: weights, KV and context; the Program's reservation and workspace (on CUDA
    also what the start kept and the headroom); the CUDA graphs' figures (only on CUDA); the budget, what the
    allocator holds and the host budgets."""
    kv = f"KV {m.kv_pages:,} pages ({m.kv_tokens:,} tokens{'' if m.kv_automatic else ', num_pages'})"
    cuda = m.device.startswith("cuda")
    lines = [f"memory: {m.device} · weights {format_bytes(m.weights_bytes)} ({m.placement}) · {kv} · "
             f"context {m.max_model_len:,}",
             f"runtime reservation {format_bytes(m.runtime_reservation_bytes)} (StateImages, KV, checkpoints, "
             f"verify records) · workspace {format_bytes(m.workspace_bytes)}"
             + (f" · startup retained {format_bytes(m.startup_retained_bytes)} · headroom "
                f"{format_bytes(m.headroom_bytes)}" if cuda else "")]  # the CPU measures neither
    if m.staging_bytes or m.expert_cache_slots:
        lines[0] += (f" · expert cache {m.expert_cache_slots:,} experts ({format_bytes(m.expert_cache_bytes)}), "
                     f"staging {format_bytes(m.staging_bytes)}")
    if cuda:
        g = m.cuda_graph
        lines.append(f"CUDA graphs: calibration growth {format_bytes(g.calibration_growth)} · retained after "
                     f"release {format_bytes(g.retained_after_release)} · rebuild est. "
                     f"{format_bytes(g.rebuild_estimate)} · formal growth {format_bytes(g.formal_growth)}"
                     + (f" · calibrated in {m.calibration_seconds:.1f} s" if m.calibration_seconds else ""))
    last = []
    if m.budget_bytes is not None:
        of = f" of {format_bytes(m.device_total_bytes)}" if m.device_total_bytes is not None else ""
        last.append(f"budget {format_bytes(m.budget_bytes)}{of}")
    if m.reserved_bytes:
        last.append(f"reserved {format_bytes(m.reserved_bytes)}")
    if m.corrections:
        last.append(f"{m.corrections} correction rebuild{'s' if m.corrections > 1 else ''}")
    h = m.host
    host = f"host: Snapshots {format_bytes(h.snapshot_budget_bytes)}, cache replicas {format_bytes(h.cache_budget_bytes)}"
    last.append(host + (f", weights {format_bytes(h.weights_bytes)}" if h.weights_bytes else ""))
    lines.append(" · ".join(last))
    return lines


def summary_text(m: MemorySummary, prefix: str = "") -> str:
    """``summary_lines`` as one block: ``prefix`` before the first line, the others indented under it."""
    lines = summary_lines(m)
    pad = " " * (len(prefix) + len("memory: "))
    return "\n".join([prefix + lines[0], *(pad + line for line in lines[1:])])


@attrs.frozen(kw_only=True)
class MemoryGauge:
    """One exported figure: its metric name, help text and value."""

    name: str
    help: str
    value: float


def memory_gauges(m: MemorySummary) -> list[MemoryGauge]:
    """The ``ninfer:memory_*`` gauges of a start (fixed once it is done). The budget and the host's available
    memory appear only when known; the CUDA graph figures read 0 on the CPU."""
    g, h = m.cuda_graph, m.host
    rows = [
        ("weights_bytes", "Device bytes of the resident weights.", m.weights_bytes),
        ("runtime_reservation_bytes", "The Program's explicit backing: StateImages, KV pages, checkpoint slots, "
         "verify records.", m.runtime_reservation_bytes),
        ("startup_retained_bytes", "Device growth before the formal Program, less the weights (CUDA context, "
         "kernels, calibration leftovers).", m.startup_retained_bytes),
        ("workspace_bytes", "The planned transient peak of one unit.", m.workspace_bytes),
        ("cuda_graph_calibration_growth_bytes", "Device growth preparing the calibration Program and its graphs.",
         g.calibration_growth),
        ("cuda_graph_retained_after_release_bytes", "What stayed after the calibration graphs were destroyed, "
         "beyond their Program's backing.", g.retained_after_release),
        ("cuda_graph_rebuild_estimate_bytes", "What the graphs took, charged to the formal plan.",
         g.rebuild_estimate),
        ("cuda_graph_formal_growth_bytes", "Device growth preparing the formal Program.", g.formal_growth),
        ("kv_pages", "KV pages the start granted.", m.kv_pages),
        ("kv_tokens", "KV positions the start granted (pages x page size).", m.kv_tokens),
        ("max_model_len", "The longest history a request may reach.", m.max_model_len),
        ("headroom_bytes", "Device bytes the plan left for what is not counted exactly.", m.headroom_bytes),
        ("reserved_bytes", "What the caching allocator held once the start was done.", m.reserved_bytes),
        ("corrections", "Capacity rebuilds after a formal allocation fell short (0 or 1).", m.corrections),
        ("expert_cache_bytes", "Device bytes of the host experts' cache.", m.expert_cache_bytes),
        ("expert_staging_bytes", "Device bytes the host experts' whole layers stream through.", m.staging_bytes),
        ("host_weights_bytes", "Host bytes of resident host weights.", h.weights_bytes),
        ("host_snapshot_budget_bytes", "Host bytes paused requests' Snapshots may hold.", h.snapshot_budget_bytes),
        ("host_cache_budget_bytes", "Pinned host bytes the context cache's replicas may hold.",
         h.cache_budget_bytes),
    ]
    if m.budget_bytes is not None:
        rows.append(("budget_bytes", "The device budget the start planned against.", m.budget_bytes))
    if m.device_total_bytes is not None:
        rows.append(("device_total_bytes", "The device's memory.", m.device_total_bytes))
    if h.available_bytes is not None:
        rows.append(("host_available_bytes", "Host memory available when the start planned.", h.available_bytes))
    return [MemoryGauge(name=f"ninfer:memory_{name}", help=doc, value=float(value)) for name, doc, value in rows]


__all__ = ["GIB", "KIB", "MIB", "MemoryGauge", "format_bytes", "memory_gauges", "summary_lines", "summary_text"]
