"""Routed experts whose banks live in pinned host memory (placement "host-experts"): one Program's runtime.

Every MoE layer call picks its mode by its token count (prefill chunks, Replay, decode, control and
verification alike):

* **mixed** (fewer than ``stream_min_tokens`` tokens): the pairs whose expert is in the device cache
  (``ExpertCache``) run on the device through the routed-experts op over the cache's slots; the rest run on the
  CPU team from the host banks (``cpu_experts``: whole experts per rank), overlapping the device work; the CPU contribution is copied
  up and added. Missed experts that now score above the coldest resident one are then uploaded into the cache
  (at most ``admit_per_call`` per call, on the transfer stream), so the next steps find them. With the next
  layer's router (``next_routers``), the call also predicts the next layer's experts from its own input (the
  residual stream changes little from one layer to the next) and starts uploading the missing ones (at most
  ``prefetch_per_call``), so they are there when that layer runs: the upload overlaps this layer's CPU work
  and the next layer's mixer.
* **streamed** (many tokens): the layer's whole banks are uploaded into one of two device staging buffers and
  the op runs over them; the upload of the next layer (after the last, the first) starts at once into the other
  buffer, so uploads overlap the layers' compute. The hottest experts of the call are copied from the staged
  banks into the cache on the way (device to device).

A mixed call reads the routing on the host (one device sync per MoE layer), so host experts run outside CUDA
graphs. Weight copies belong to this runtime, never to a request's StateImage: pausing, resuming or rolling
back a request leaves them as they are.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from ninfer import env
from ninfer.core.cpu_executor import CpuExecutor, default_threads, single_threaded_caller
from ninfer.models.common.moe.cpu_experts import ExpertRows, cpu_experts
from ninfer.models.common.moe.expert_cache import ExpertCache
from ninfer.models.common.moe.stats import ExpertStats
from ninfer.models.common.moe.transfers import Transfers
from ninfer.ops.moe import moe_experts

TEAM_THREADS = 8  # more Python workers contend for the GIL between their matrix products (measured: docs/moe.md)
STREAM_MIN_TOKENS = 256  # from here a layer's whole banks go up: the CPU share would take longer than PCIe
ADMIT_PER_CALL = 2  # cache uploads a mixed call may start (each is one expert's bytes over PCIe)
PREFETCH_PER_CALL = 8  # uploads of predicted next-layer experts a mixed call may start (a token's k at top-8)


def default_team() -> CpuExecutor:
    """The CPU team's default (the allowed CPUs less the control thread's), at most ``TEAM_THREADS`` workers."""
    return CpuExecutor(min(TEAM_THREADS, default_threads()))


def staging_bytes(gate_up: torch.Tensor, down: torch.Tensor) -> int:
    """Device bytes of the two staging buffers for layers with banks shaped like these."""
    return 2 * (gate_up.numel() * gate_up.element_size() + down.numel() * down.element_size())


def expert_bytes(gate_up, down) -> int:
    """Device bytes of one expert of a layer with these banks (a quantized bank's planes of one expert)."""
    planes = [*_planes(gate_up), *_planes(down)]
    return sum(p[0].numel() * p.element_size() for p in planes)


def _planes(bank) -> tuple[torch.Tensor, ...]:
    return (bank,) if isinstance(bank, torch.Tensor) else bank.planes()


class HostExperts:
    """The routed experts of every MoE layer, banks on the host (``banks``: (gate_up [E, 2I, H], down [E, H, I])
    per layer, in call order), served on ``device`` with ``cache_slots`` cached experts and ``team``."""

    def __init__(self, banks: Sequence[tuple[torch.Tensor, torch.Tensor]], *, device: torch.device,
                 cache_slots: int, team: CpuExecutor, top_k: int, next_routers: Sequence[torch.Tensor | None] = (),
                 stream_min_tokens: int | None = None, admit_per_call: int = ADMIT_PER_CALL,
                 prefetch_per_call: int = PREFETCH_PER_CALL) -> None:
        """``top_k``: experts per token. ``next_routers``: per layer, the routing weight [E, H] (on the device) of
        the layer its output feeds in the same forward, or None (the last layer of a stack); empty: no
        prefetch. ``stream_min_tokens``: None takes ``NINFER_MOE_STREAM_TOKENS``, else ``STREAM_MIN_TOKENS``."""
        if not banks:
            raise ValueError("HostExperts needs the banks of at least one MoE layer")
        gate_up, down = banks[0]
        if any(g.shape != gate_up.shape or d.shape != down.shape for g, d in banks):
            raise ValueError("HostExperts: every MoE layer's banks must have one shape")
        if next_routers and len(next_routers) != len(banks):
            raise ValueError(f"HostExperts: {len(next_routers)} next-layer routers for {len(banks)} layers")
        self.banks = list(banks)
        self.next_routers = list(next_routers) or [None] * len(banks)
        self.top_k, self.prefetch_per_call = top_k, prefetch_per_call
        self.layer_of = {g.data_ptr(): i for i, (g, _) in enumerate(banks)}
        self.device, self.team = device, team
        if stream_min_tokens is None:
            stream_min_tokens = env.get("NINFER_MOE_STREAM_TOKENS") or STREAM_MIN_TOKENS
        self.stream_min_tokens, self.admit_per_call = stream_min_tokens, admit_per_call
        self.transfers = Transfers(device)
        self.cache = ExpertCache(layers=len(banks), experts=gate_up.shape[0], slots=cache_slots,
                                 gate_up_shape=tuple(gate_up.shape[1:]), down_shape=tuple(down.shape[1:]),
                                 dtype=gate_up.dtype, device=device, transfers=self.transfers)
        self.staging = [(torch.empty_like(gate_up, device=device), torch.empty_like(down, device=device))
                        for _ in range(2)]
        self.staged: list[tuple[int, torch.cuda.Event | None] | None] = [None, None]  # (layer, upload) per buffer
        self.computing = 1  # the staging buffer the last streamed call read (the other one takes the next upload)
        pin = device.type == "cuda"
        self.x_host = torch.empty((stream_min_tokens, gate_up.shape[2]), dtype=gate_up.dtype, pin_memory=pin)
        self.out_host = torch.empty_like(self.x_host, pin_memory=pin)
        self._counts = dict.fromkeys(attrs.fields_dict(ExpertStats), 0)
        self._close = weakref.finalize(self, team.close)

    @property
    def stats(self) -> ExpertStats:
        return ExpertStats(**self._counts)

    def close(self) -> None:
        """Stop the CPU team (also done when this runtime is collected)."""
        self._close()

    def replace_team(self, team: CpuExecutor) -> None:
        """Compute the misses on ``team`` from now on; the previous team is stopped."""
        self._close()
        self.team = team
        self._close = weakref.finalize(self, team.close)

    def routed(self, gate_up: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts of the layer whose host bank is ``gate_up``: x [N, H] and the routing ``ids`` /
        ``weights`` [N, k] on the device -> [N, H] on the device."""
        layer = self.layer_of.get(gate_up.data_ptr())
        if layer is None:
            raise ValueError("HostExperts.routed: this bank is not one of the host experts' layers")
        if x.shape[0] >= self.stream_min_tokens:
            return self._streamed(layer, x, ids, weights)
        with single_threaded_caller():  # no OpenMP threads of this thread spin on the team's cores
            return self._mixed(layer, x, ids, weights)

    # -- few tokens: cache hits on the device, misses on the CPU team ------------------------------------------
    def _mixed(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        N = x.shape[0]
        x_host = self.x_host[:N]
        x_host.copy_(x, non_blocking=True)
        ids_host, w_host = ids.to("cpu", non_blocking=True), weights.to("cpu", non_blocking=True)
        router = self.next_routers[layer]
        predicted = None
        if router is not None and self.cache.slots:
            predicted = torch.topk(x @ router.T, self.top_k, dim=-1).indices.to("cpu", non_blocking=True)
        t_wait = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the routing and x are on the host now
        t_wait = time.perf_counter() - t_wait
        ids_np = ids_host.numpy()
        self.cache.observe(layer, ids_np)
        slots = self.cache.lookup(layer, ids_np)
        hit = slots >= 0
        out = None
        if hit.any():  # issued first: the device computes its share while the team computes the misses
            slot_ids = torch.from_numpy(np.where(hit, slots, 0)).to(self.device, non_blocking=True)
            w_hits = torch.where(torch.from_numpy(hit), w_host, 0).to(self.device, non_blocking=True)
            out = moe_experts(x, self.cache.gate_up, self.cache.down, slot_ids, w_hits)
        misses = int((~hit).sum())
        t_team = t_upload = 0.0
        if misses:
            out_host = self.out_host[:N]
            out_host.zero_()
            gate_up, down = self.banks[layer]
            t_team = time.perf_counter()
            cpu_experts(self.team, self._work(ids_np, w_host, ~hit, x_host), gate_up, down, out_host)
            t_team = time.perf_counter() - t_team
            cpu = out_host.to(self.device, non_blocking=True)
            out = cpu if out is None else out + cpu
            missed = np.unique(ids_np[~hit])
            t_upload = time.perf_counter()
            self._add(admitted=self.cache.admit(layer, self.cache.by_score(layer, missed), gate_up, down,
                                                self.admit_per_call))
            t_upload = time.perf_counter() - t_upload
        if predicted is not None:
            t = time.perf_counter()
            self._prefetch(layer + 1, predicted.numpy())
            t_upload += time.perf_counter() - t
        self._add(cache_hits=int(hit.sum()), cache_misses=misses, mixed_calls=1, wait_s=t_wait, team_s=t_team,
                  upload_s=t_upload, mixed_s=time.perf_counter() - t0)
        return out

    def _prefetch(self, layer: int, predicted: np.ndarray) -> None:
        """Start uploading the predicted experts of ``layer`` that are not cached (those predicted for more tokens
        first), evicting the lowest-scored residents whatever their score: they are needed next."""
        experts, counts = np.unique(predicted, return_counts=True)
        wanted = experts[np.argsort(-counts, kind="stable")]
        wanted = wanted[self.cache.slot_of[layer][wanted] < 0][:self.prefetch_per_call]
        gate_up, down = self.banks[layer]
        self._add(prefetched=self.cache.admit(layer, wanted, gate_up, down, len(wanted), force=True))

    def _work(self, ids: np.ndarray, weights: torch.Tensor, missed: np.ndarray, x: torch.Tensor) -> list[ExpertRows]:
        """The missed pairs grouped by expert, with their gathered inputs and activation scratch."""
        tokens, slots = np.nonzero(missed)
        experts = ids[tokens, slots]
        order = np.argsort(experts, kind="stable")
        work = []
        for expert in np.unique(experts):
            sel = order[experts[order] == expert]
            rows = torch.from_numpy(tokens[sel])
            w = weights[rows, torch.from_numpy(slots[sel])].unsqueeze(1)
            work.append(ExpertRows(expert=int(expert), rows=rows, x=x[rows], weights=w,
                                   y=torch.empty((len(sel), x.shape[1]), dtype=x.dtype)))
        return work

    # -- many tokens: whole layers streamed through the staging buffers ------------------------------------------
    def _streamed(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        buffer = self.computing = self._stage(layer)
        _, upload = self.staged[buffer]
        self.transfers.wait(upload)
        gate_up, down = self.staging[buffer]
        out = moe_experts(x, gate_up, down, ids, weights)
        self._stage((layer + 1) % len(self.banks))  # the next layer goes up while this one computes
        routed = ids.reshape(-1).cpu().numpy()
        self.cache.observe(layer, routed)
        hot = np.unique(routed)
        warm = max(1, self.cache.slots // len(self.banks))
        admitted = self.cache.admit(layer, self.cache.by_score(layer, hot), gate_up, down, warm)
        self._add(streamed_pairs=ids.numel(), streamed_calls=1, admitted=admitted)
        return out

    def _stage(self, layer: int) -> int:
        """The staging buffer holding ``layer``; else it is uploaded into the buffer the last call did not read."""
        for i, held in enumerate(self.staged):
            if held is not None and held[0] == layer:
                return i
        i = 1 - self.computing
        gate_up, down = self.banks[layer]
        staged_gate_up, staged_down = self.staging[i]
        self.staged[i] = (layer, self.transfers.copy_in([(staged_gate_up, gate_up), (staged_down, down)]))
        self._add(streamed_layers=1)
        return i

    def _add(self, **counts: float) -> None:
        for name, n in counts.items():
            self._counts[name] += n
