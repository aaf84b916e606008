"""resolve_load: explicit placement of a LoadPlan's objects and the Host/Device capacity it needs.

The LoadPlan says what; this says where. Today every object goes to one device; a parent is placed
(and later resident) once per device however many Bindings and Uses share it.
"""

from __future__ import annotations

from collections import defaultdict

import attrs

from ninfer.artifact.binder import LoadPlan
from ninfer.artifact.format import ArtifactError


@attrs.frozen(kw_only=True)
class Placement:
    object: str
    device: str  # "cpu" or "cuda:N"
    nbytes: int


@attrs.frozen(kw_only=True)
class ResolvedLoad:
    plan: LoadPlan
    placements: tuple[Placement, ...]
    device_bytes: dict[str, int]  # resident bytes per device
    staging_bytes: int  # pinned host staging for uploads (0 for a CPU load)


def _device_name(device) -> str:
    import torch

    d = torch.device(device)
    if d.type == "cuda":
        return f"cuda:{d.index if d.index is not None else torch.cuda.current_device()}"
    if d.type != "cpu":
        raise ArtifactError(f"unsupported device {device!r}; use 'cpu' or 'cuda[:N]'")
    return "cpu"


def resolve_load(plan: LoadPlan, device="cpu", *, budget_bytes: int | None = None,
                 staging_bytes: int = 64 << 20, host_objects: frozenset[str] = frozenset()) -> ResolvedLoad:
    """Place every object of ``plan`` on ``device``, except ``host_objects`` (object ids), which stay in host
    memory (pinned when ``device`` is CUDA: MoE experts a host team computes with, or uploads); fail before
    reading anything if the device part cannot fit."""
    name = _device_name(device)
    unknown = sorted(host_objects - {o.id for o in plan.objects})
    if unknown:
        raise ArtifactError(f"host placement names objects the load does not read: {', '.join(unknown[:4])}")
    placements = tuple(Placement(object=o.id, device="cpu" if o.id in host_objects else name, nbytes=o.nbytes)
                       for o in plan.objects)
    per_device: dict[str, int] = defaultdict(int)
    for p in placements:
        per_device[p.device] += p.nbytes
    need = per_device.get(name, 0)
    if budget_bytes is not None and need > budget_bytes:
        raise ArtifactError(f"weights for {', '.join(plan.features)} need {need / 2**20:.1f} MiB on {name}, "
                            f"over the budget of {budget_bytes / 2**20:.1f} MiB")
    if name.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(name))
        if need > free:
            raise ArtifactError(f"weights for {', '.join(plan.features)} need {need / 2**30:.2f} GiB on {name} "
                                f"but only {free / 2**30:.2f} GiB is free")
    staging = min(staging_bytes, max((o.nbytes for o in plan.objects), default=0)) if name != "cpu" else 0
    return ResolvedLoad(plan=plan, placements=placements, device_bytes=dict(per_device), staging_bytes=staging)
