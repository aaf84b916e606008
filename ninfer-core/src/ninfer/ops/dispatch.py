"""Choosing an op's implementation: the pure-torch reference, or a validated Triton kernel on CUDA.

Every op module ``ninfer.ops.<module>`` has a reference ``<name>_ref`` that runs anywhere. A Triton
kernel with the same signature lives in ``ninfer.ops.triton.<module>`` (or the module ``_HOMES`` names); it is
used for CUDA tensors only once its name is listed in ``TRITON_OPS`` (added after it passes the GPU tests), so
enabling a kernel is a one-line edit here. The Triton module is imported lazily, on first use, so importing
``ninfer.ops`` never imports triton. Public: plugins ask ``triton_selected`` what their startup plans for.

``NINFER_OPS=torch`` forces the references everywhere (debugging, kernel comparisons);
``NINFER_OPS=triton`` uses every Triton kernel that exists, listed or not (to try kernels end to end
before listing them). ``NINFER_OPS_OFF=module.name,...`` leaves the named kernels out (a fused kernel against
the composition it replaces, in one process).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from ninfer import env

if TYPE_CHECKING:
    import torch

# "module.name" of every Triton kernel that passed the GPU tests (ninfer-core/tests/gpu) at Qwen3.5 shapes; how
# each was validated and measured is in docs/kernels.md.
TRITON_OPS: frozenset[str] = frozenset({
    "norm.rms_norm", "norm.embed_rms_norm", "norm.rms_norm_gated", "norm.add_rms_norm", "norm.add_rms_norm_linear",
    "activation.silu_and_mul", "rope.apply_rope",
    "gdn.gdn_gates", "gdn.gdn_decode", "gdn.gdn_decode_fused", "gdn.gdn_prefill", "gdn.gdn_verify",
    "gdn.gdn_verify_commit",
    "conv1d.causal_conv1d_decode", "conv1d.causal_conv1d_prefill",
    "attention.write_kv", "attention.paged_attention", "attention.paged_attention_gated",
    "attention.norm_rope_write_kv", "linear.linear", "linear.swiglu", "sampling.greedy",
    "sampling.apply_token_mask", "moe.moe_experts", "moe_route.moe_route", "moe.moe_block",
    "attention.norm_rope_write_kv_mrope", "moe_one_token.moe_one_token", "penalties.apply_penalties",
    "linear_quant.linear_fp8", "linear_quant.linear_nvfp4", "linear_quant.linear_dequant",
    "moe_quant.moe_experts_quant", "norm.rms_norm_gated_sigmoid", "hyper_connection.grouped_rms_norm",
    "hyper_connection.stream_mix", "hyper_connection.hyper_connection_inject", "qsa.qsa_block_scores",
    "qsa.qsa_attention_static",
})


def _mode() -> str:
    return env.get("NINFER_OPS")


# Kernels kept in a module of their own, under their op module's name.
_HOMES: dict[str, str] = {"gdn.gdn_verify": "gdn_verify", "gdn.gdn_verify_commit": "gdn_verify"}


@functools.cache
def _load(module: str, name: str) -> Callable:
    home = _HOMES.get(f"{module}.{name}", module)
    return getattr(importlib.import_module(f"ninfer.ops.triton.{home}"), name)


def triton_selected(module: str, name: str) -> bool:
    """Whether ``module.name`` runs its Triton kernel on CUDA under the current ``NINFER_OPS`` (listed, or every
    kernel with ``triton``)."""
    mode, op = _mode(), f"{module}.{name}"
    return mode != "torch" and (op in TRITON_OPS or mode == "triton") and op not in env.get("NINFER_OPS_OFF")


def triton_kernel(module: str, name: str, tensor: torch.Tensor) -> Callable | None:
    """The validated Triton kernel for ``module.name`` when ``tensor`` is on CUDA, else None."""
    if tensor.device.type != "cuda":
        return None
    mode = _mode()
    if mode == "torch" or f"{module}.{name}" in env.get("NINFER_OPS_OFF"):
        return None
    if f"{module}.{name}" in TRITON_OPS:
        return _load(module, name)
    if mode == "triton":
        try:
            return _load(module, name)
        except (ImportError, AttributeError):  # no kernel written for this op
            return None
    return None
