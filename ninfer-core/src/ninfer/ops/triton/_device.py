"""What launch heuristics read about the device a kernel runs on."""

from __future__ import annotations

import functools

import torch

H200_SMS = 132  # stands in for the device on the CPU (Triton's interpreter), so CPU tests pick the GPU's shapes


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(t: torch.Tensor) -> int:
    """Streaming multiprocessors of the CUDA device holding ``t``; an H200's for a CPU tensor."""
    if not t.is_cuda:
        return H200_SMS
    return _multiprocessors(t.device.index if t.device.index is not None else torch.cuda.current_device())
