"""Retention priority: what losing one copy of a checkpoint costs a future request, per byte it frees.

Losing a copy costs the cheapest way back: a host->device transfer when the other tier still holds it,
otherwise recomputing the tokens beyond the longest other checkpoint a request would restore instead.
That loss per freed byte is weighted down by age on a logical clock (advanced by every lookup and
publication) and up for the latest continuation of a session. The lowest priority goes first.
"""

from __future__ import annotations

import attrs

from ninfer.contract.context import CheckpointInfo


def _positive(_instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"CostModel.{attribute.name} must be positive, got {value!r}")


@attrs.frozen(kw_only=True)
class CostModel:
    """Recovery cost estimates: prefill seconds per token and pinned host->device seconds per byte, as
    ``scripts/gpu cache`` calibrates them for a 9B bf16 model on one H200 (the figures are in
    docs/performance.md, "Context cache"). Only their ratio to each other and to the bytes matters, not their
    absolute scale."""

    recompute_s_per_token: float = attrs.field(default=3.1e-5, validator=_positive)
    transfer_s_per_byte: float = attrs.field(default=1.0 / 55e9, validator=_positive)
    # Uses (lookups and publications) since a checkpoint's last use at which its priority halves.
    horizon: float = attrs.field(default=64.0, validator=_positive)
    # A session's latest continuation is the likeliest next hit.
    session_weight: float = attrs.field(default=2.0, validator=_positive)


class Recency:
    """A logical clock: every lookup and publication ticks it; a use stamps a checkpoint with it."""

    def __init__(self) -> None:
        self.clock = 0
        self._last_use: dict[int, int] = {}

    def tick(self) -> None:
        self.clock += 1

    def use(self, checkpoint_id: int) -> None:
        self._last_use[checkpoint_id] = self.clock

    def age(self, checkpoint_id: int) -> int:
        return self.clock - self._last_use.get(checkpoint_id, 0)

    def forget(self, checkpoint_id: int) -> None:
        self._last_use.pop(checkpoint_id, None)

    def clear(self) -> None:
        self._last_use.clear()


def recompute_loss(info: CheckpointInfo, prefix_length: int, cost: CostModel) -> float:
    """Seconds to recompute ``info`` from the longest other checkpoint (``prefix_length`` tokens)."""
    return max(0, info.length - prefix_length) * cost.recompute_s_per_token


def transfer_loss(info: CheckpointInfo, cost: CostModel) -> float:
    """Seconds to copy the checkpoint between host and device."""
    return info.host_bytes * cost.transfer_s_per_byte


def _weigh(loss_per_byte: float, age: int, session_bound: bool, cost: CostModel) -> float:
    weight = cost.session_weight if session_bound else 1.0
    return weight * loss_per_byte / (1.0 + age / cost.horizon)


def device_priority(info: CheckpointInfo, *, prefix_length: int, age: int, session_bound: bool,
                    cost: CostModel) -> float:
    """Priority of keeping the device copy: with a host replica only a transfer is lost."""
    loss = transfer_loss(info, cost) if info.on_host else recompute_loss(info, prefix_length, cost)
    return _weigh(loss / max(1, info.device_bytes), age, session_bound, cost)


def host_priority(info: CheckpointInfo, *, prefix_length: int, age: int, session_bound: bool,
                  cost: CostModel) -> float:
    """Priority of keeping the host replica. While the device copy exists, dropping the replica loses only
    the copy that would remake it."""
    loss = transfer_loss(info, cost) if info.on_device else recompute_loss(info, prefix_length, cost)
    return _weigh(loss / max(1, info.host_bytes), age, session_bound, cost)


def worth_host_replica(info: CheckpointInfo, *, prefix_length: int, cost: CostModel) -> bool:
    """A replica pays when restoring it beats recomputing what it covers beyond the next checkpoint."""
    return recompute_loss(info, prefix_length, cost) > transfer_loss(info, cost)
