"""Startup's choice per quantized weight (ninfer.models.common.quantized.executable): the CPU runs the references
weight-only; a CUDA device older than compute capability 8.9 is refused in one line naming the weight, its format
and the device; on a capable one A8 is chosen only where the permit allows it, the format and block are the W8A8
GEMM's and that kernel is selected. The CUDA queries are stood in for, so this runs on the CPU."""

from __future__ import annotations

import pytest
import torch

from ninfer.contract.quant import A8, A16, A16_ONLY, ALLOW_A4, ALLOW_A8
from ninfer.models.common import quantized
from ninfer.models.common.quantized import QuantizedFormatUnsupported, executable
from ninfer.ops.quant import quantize_fp8_block, quantize_nvfp4

FP8 = quantize_fp8_block(torch.randn(256, 256))
NVFP4 = quantize_nvfp4(torch.randn(256, 256))
CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """A stand-in CUDA device: its compute capability and name, and whether the W8A8 GEMM is selected."""
    state = {"capability": (9, 0), "w8a8": True}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["capability"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(quantized, "triton_selected", lambda module, name: state["w8a8"])
    return state


def test_the_cpu_runs_every_format_weight_only():
    for w in (FP8, NVFP4, FP8.with_activation(A8)):
        assert executable("w", w, ALLOW_A4, torch.device("cpu")).activation == A16
    assert executable("w", FP8, ALLOW_A8, torch.device("meta")).activation == A16


def test_a_device_without_fp8_support_is_refused_in_one_line(gpu):
    gpu["capability"] = (8, 0)
    with pytest.raises(QuantizedFormatUnsupported) as err:
        executable("model.layers.0.mlp.down_proj.weight", NVFP4, ALLOW_A4, CUDA)
    message = str(err.value)
    assert "\n" not in message
    for part in ("model.layers.0.mlp.down_proj.weight", "nvfp4", "8.9", "NVIDIA A100-SXM4-80GB", "8.0"):
        assert part in message, message


def test_a8_where_the_permit_format_and_kernel_allow_it(gpu):
    assert executable("w", FP8, ALLOW_A8, CUDA).activation == A8
    assert executable("w", FP8, A16_ONLY, CUDA).activation == A16  # the permit
    assert executable("w", NVFP4, ALLOW_A4, CUDA).activation == A16  # no FP4 tensor cores: weight-only
    channel = quantize_fp8_block(torch.randn(256, 256), (1, 256))
    assert executable("w", channel, ALLOW_A8, CUDA).activation == A16  # not the GEMM's 128x128 blocks
    gpu["w8a8"] = False
    assert executable("w", FP8, ALLOW_A8, CUDA).activation == A16  # the kernel is not selected
