"""The one device->host copy of a unit's results: sampled tokens, plus logprobs when rows want them.

Launching packs everything into one tensor (fp64 holds token ids and fp32 logprobs exactly) and
queues its copy into pinned host memory, on its owner's copy stream (``CopyStream``: one per Program, made at
its first CUDA readback and dropped with it), followed by an event; waiting blocks on that event only.
A pipelined decode launches the next step before it waits for this one.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch


class CopyStream:
    """The stream one owner's readback copies run on (a Program's, through its Sampler): made on first use on a
    CUDA device, released with the owner, so nothing process-wide outlives a Program."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None

    def on(self, dev: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
            self._stream = torch.cuda.Stream(dev)
        return self._stream


RowLogprobs = tuple[float, tuple[Sequence[float], Sequence[float]]]  # chosen, (top ids, top logprobs)


def upload(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small host tensor on ``dev`` without waiting for the device: pinned, then an async copy (a copy
    from pageable memory may synchronize with the stream, which would stall a pipelined launch)."""
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


@attrs.frozen(kw_only=True)
class Readback:
    """A unit's sampled tokens (and logprobs) on their way to the host: one copy, one event."""

    tokens: torch.Tensor            # device [B] int64: the next step's inputs when it is chained
    host: torch.Tensor              # the host copy (pinned on CUDA) of tokens, or of the fp64 pack with logprobs
    event: torch.cuda.Event | None  # recorded after the copy (CUDA)
    want: tuple[int, ...]           # rows that report logprobs
    top_n: int
    # The device tensor being copied, held until the copy is waited for: the copy runs on another stream, and the
    # compute stream must not reuse that memory before it has been read.
    source: torch.Tensor | None = None

    @classmethod
    def launch(cls, tokens: torch.Tensor, want: tuple[int, ...] = (), top_n: int = 0,
               logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, *,
               copies: CopyStream) -> Readback:
        """Queue the copy of ``tokens`` [B] and, for rows ``want``, ``logprobs`` = (chosen [W], top ids
        [W, top_n], top logprobs [W, top_n]), on ``copies`` (the owner's stream; unused off CUDA)."""
        if want:
            chosen, top_ids, top_lp = logprobs
            pack = torch.cat([tokens.double(), chosen.double(), top_ids.double().flatten(), top_lp.double().flatten()])
        else:
            pack = tokens
        event = None
        if pack.device.type == "cuda":
            # On a stream of its own: the next step's work on the compute stream does not queue behind the copy.
            stream = copies.on(pack.device)
            stream.wait_stream(torch.cuda.current_stream(pack.device))
            with torch.cuda.stream(stream):
                host = torch.empty(pack.shape, dtype=pack.dtype, pin_memory=True)
                host.copy_(pack, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
        else:
            host = pack
        return cls(tokens=tokens, host=host, event=event, want=want, top_n=top_n, source=pack)

    def wait(self) -> tuple[list[int], dict[int, RowLogprobs]]:
        """Every row's token, and (chosen logprob, (top ids, top logprobs)) of the rows in ``want``."""
        if self.event is not None:
            self.event.synchronize()
        flat = self.host.tolist()
        B = self.tokens.shape[0]
        if not self.want:
            return flat, {}
        W, top_n = len(self.want), self.top_n
        chosen_l, ids_l, lps_l = flat[B:B + W], flat[B + W:B + W + W * top_n], flat[B + W + W * top_n:]
        lp = {}
        for j, i in enumerate(self.want):
            a = j * top_n
            lp[i] = (chosen_l[j], (ids_l[a:a + top_n], lps_l[a:a + top_n]))
        return [int(t) for t in flat[:B]], lp
