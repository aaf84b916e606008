"""The device cache of host experts: a fixed pool of slots, each holding one routed expert's weights (its rows of
the layer's ``gate_up`` bank and of its ``down`` bank), shared by every MoE layer.

Which experts stay is decided on the host from how often each (layer, expert) was routed to, with older use
decaying (``DECAY`` per call of that layer): a missing expert is admitted when its score beats the lowest-scored
resident one, so the pool follows the experts the traffic keeps using, in whichever layers they are.

Uploads run on the transfer stream (``Transfers``) and never stall the compute stream: a slot being filled is
not looked up as a hit until its copy has finished (its pair meanwhile runs where it would on a miss), and the
copy into an evicted slot starts only after the compute work already issued (which may still read the old
expert) is done. The slot tables live on the host, so a lookup costs no device read.
"""

from __future__ import annotations

import numpy as np
import torch

from ninfer.models.common.moe.transfers import Transfers

DECAY = 0.98  # per call of a layer: an expert's score halves over ~35 calls without use


class ExpertCache:
    """``slots`` device slots of experts with banks shaped ``gate_up`` [E, 2I, H] / ``down`` [E, H, I] over
    ``layers`` MoE layers. ``lookup`` says which pairs hit; ``admit`` fills slots (on ``transfers``)."""

    def __init__(self, *, layers: int, experts: int, slots: int, gate_up_shape: tuple[int, int],
                 down_shape: tuple[int, int], dtype: torch.dtype, device: torch.device, transfers: Transfers) -> None:
        if slots < 0:
            raise ValueError(f"ExpertCache: slots must be >= 0, got {slots}")
        self.slots = min(slots, layers * experts)
        self.gate_up = torch.empty((self.slots, *gate_up_shape), dtype=dtype, device=device)
        self.down = torch.empty((self.slots, *down_shape), dtype=dtype, device=device)
        self.transfers = transfers
        self.slot_of = np.full((layers, experts), -1, dtype=np.int64)  # resident or loading: the slot, else -1
        self.owner = np.full((self.slots,), -1, dtype=np.int64)  # layer * experts + expert, -1 free
        self.score = np.zeros((layers, experts), dtype=np.float64)
        self.loading: dict[int, object] = {}  # slot -> completion of its upload (not looked up as a hit before)
        self.experts = experts

    def observe(self, layer: int, ids: np.ndarray) -> None:
        """Decay the layer's scores and count this call's routed pairs (``ids``: expert numbers)."""
        row = self.score[layer]
        row *= DECAY
        np.add.at(row, ids.reshape(-1), 1.0)

    def lookup(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """The slot of every pair of ``ids`` ([N, k] expert numbers) whose expert is resident, else -1 (a slot
        still loading counts as a miss)."""
        for slot in [s for s, done in self.loading.items() if self.transfers.finished(done)]:
            del self.loading[slot]
        slots = self.slot_of[layer][ids]
        if self.loading:
            slots = np.where(np.isin(slots, list(self.loading)), -1, slots)
        return slots

    def admit(self, layer: int, candidates: np.ndarray, source_gate_up: torch.Tensor, source_down: torch.Tensor,
              limit: int, *, force: bool = False) -> int:
        """Copy up to ``limit`` of ``candidates`` (distinct expert numbers of ``layer`` that are not resident, best
        first) from the source banks (the layer's host banks, or a staged copy on the device) into slots, evicting
        lower-scored experts (``force``: the lowest-scored ones, whatever the candidate's score). Returns how many
        were admitted."""
        if self.slots == 0 or limit <= 0:
            return 0
        admitted = 0
        for expert in candidates[:limit]:
            expert = int(expert)
            slot = self._victim(np.inf if force else self.score[layer, expert])
            if slot is None:
                break
            self._evict(slot)
            done = self.transfers.copy_in([(self.gate_up[slot], source_gate_up[expert]),
                                           (self.down[slot], source_down[expert])])
            self.slot_of[layer, expert] = slot
            self.owner[slot] = layer * self.experts + expert
            if done is not None:
                self.loading[slot] = done
            admitted += 1
        return admitted

    def by_score(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """``experts`` (distinct numbers) of ``layer`` that are not resident, highest score first."""
        missing = experts[self.slot_of[layer][experts] < 0]
        return missing[np.argsort(-self.score[layer][missing], kind="stable")]

    def _victim(self, score: float) -> int | None:
        """A free slot, else the resident (not loading) slot of the lowest score below ``score``, else None."""
        free = np.flatnonzero(self.owner < 0)
        if free.size:
            return int(free[0])
        scores = self.score.reshape(-1)[self.owner]  # a copy (fancy indexing)
        if self.loading:
            scores[list(self.loading)] = np.inf
        slot = int(np.argmin(scores))
        return slot if scores[slot] < score else None

    def _evict(self, slot: int) -> None:
        owner = int(self.owner[slot])
        if owner >= 0:
            self.slot_of[owner // self.experts, owner % self.experts] = -1
            self.owner[slot] = -1
