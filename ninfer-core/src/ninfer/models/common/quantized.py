"""Quantized weights at Startup: which executable path each one takes on this device, or a refusal.

A plugin declares each linear's activation permit (``ninfer.contract.quant``: A16Only, AllowA8, AllowA4; a fused
call the intersection of its parts'); Startup asks ``executable`` per weight. FP8 and NVFP4 need the FP8 conversion
instructions of compute capability 8.9+ (Ada, Hopper) on CUDA; the CPU runs the references. W8A8 (A8) is chosen for
block-scaled FP8 weights whose permit allows it when the device has FP8 tensor cores and the W8A8 kernel is
selected; NVFP4 runs weight-only (A4 would need FP4 tensor cores, which Hopper lacks).
"""

from __future__ import annotations

import torch

from ninfer.contract.quant import A8, A16, FP8_BLOCK
from ninfer.ops.dispatch import triton_selected
from ninfer.ops.quant import QuantizedWeight

FP8_CAPABILITY = (8, 9)


class QuantizedFormatUnsupported(ValueError):
    """This device cannot execute a quantized weight's format (the message names object, format and device)."""


def executable(name: str, weight: QuantizedWeight, permit: frozenset[str], device: torch.device) -> QuantizedWeight:
    """``weight`` with the activation path it runs on ``device`` (the meta device of a profile: weight-only)."""
    if device.type != "cuda":
        return weight.with_activation(A16)
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise QuantizedFormatUnsupported(
            f"{name}: format {weight.format} needs a CUDA device of compute capability "
            f"{'.'.join(map(str, FP8_CAPABILITY))} or newer; {torch.cuda.get_device_name(device)} has "
            f"{'.'.join(map(str, capability))} (convert the checkpoint without --quantize, or from its bf16 release)")
    a8 = A8 in permit and weight.format == FP8_BLOCK and weight.block == (128, 128) \
        and triton_selected("linear_quant", "linear_fp8_w8a8")
    return weight.with_activation(A8 if a8 else A16)
