"""Copies into device memory beside the compute stream: the host experts' cache uploads and streamed layers.

On CUDA the copies run on one transfer stream, in issue order, so an upload never waits behind compute work
issued later and compute never waits for an upload it does not read. Before a copy the transfer stream waits
for the compute work issued so far (which may still read the destination: an evicted cache slot, the staging
buffer of an earlier layer); a reader waits for the copy's completion event (``wait``). On the CPU a copy is
done when ``copy_in`` returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Transfers:
    """The transfer stream of one Program's host experts (none on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy_in(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event | None:
        """dst.copy_(src) for each pair, after the compute work issued so far; returns the completion (None: done)."""
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        issued = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(issued)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            return self.stream.record_event()

    @staticmethod
    def finished(done: torch.cuda.Event | None) -> bool:
        return done is None or done.query()

    def wait(self, done: torch.cuda.Event | None) -> None:
        """The compute stream waits (on the device, not the host) for a copy before reading its destination."""
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
