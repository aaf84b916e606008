"""``ninfer convert --quantize fp8|nvfp4``: quantize a bf16 / fp32 checkpoint's linear weights while converting
(``ninfer.ops.quant.quantize_fp8_block`` with Qwen's 128x128 blocks, ``quantize_nvfp4`` with one global scale
per fused shard), leaving unquantized what Qwen's own FP8 release leaves (``KEEP_DENSE``) and any weight whose
dimensions the format's blocks do not divide."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ninfer.contract.quant import FP8_BLOCK, NVFP4, NVFP4_GROUP
from ninfer_convert.quantized import module_matches
from ninfer_convert.source import ConversionError, PlannedTensor

FP8_BLOCK_SIZE = (128, 128)
FORMATS = {"fp8": (FP8_BLOCK, FP8_BLOCK_SIZE), "nvfp4": (NVFP4, (1, NVFP4_GROUP))}
_FLOAT_DTYPES = ("bf16", "f16", "f32")

# Modules kept unquantized (a module-list entry as in quantized.module_matches), with why. The list follows the
# modules Qwen's FP8 checkpoints leave in bf16 (kernels_quant.md section 4.1) and the MTP head that vLLM and
# SGLang keep unquantized (qwen35_arch.md); norms, GDN A_log / dt_bias / conv1d are not linear weights at all.
KEEP_DENSE: tuple[tuple[str, str], ...] = (
    ("embed_tokens", "an embedding is a row lookup, not a matmul"),
    ("ngram_embedding", "the PLE n-gram table is a row lookup, not a matmul"),
    ("lm_head", "the output head sets every logit; Qwen's FP8 release keeps it bf16"),
    ("mlp.gate", "the MoE router: small, and its errors change which experts run"),
    ("mlp.shared_expert_gate", "the shared expert's gate: one output row"),
    ("linear_attn.in_proj_a", "GDN decay input: one row per value head, too few for scale blocks"),
    ("linear_attn.in_proj_b", "GDN beta input: one row per value head, too few for scale blocks"),
    ("linear_attn.out_proj", "Qwen's FP8 release keeps the GDN output projection bf16"),
    ("visual", "the vision tower: Qwen's FP8 release keeps it bf16"),
    ("mtp.fc", "the MTP head's input projection: vLLM and SGLang keep it bf16"),
)
_BANKS = (".experts.gate_up_proj", ".experts.down_proj")


def _linear(name: str, shape: tuple[int, ...]) -> bool:
    return (name.endswith(".weight") and len(shape) == 2) or (name.endswith(_BANKS) and len(shape) == 3)


def plan_quantize(logical: Mapping[str, PlannedTensor], option: str
                  ) -> tuple[dict[str, tuple[str, tuple[int, int]]], dict[str, str]]:
    """(logical name -> (format, block) to quantize, linear weight left unquantized -> why)."""
    if option not in FORMATS:
        raise ConversionError(f"--quantize {option!r}: choose {' or '.join(FORMATS)}")
    kind = FORMATS[option]
    targets: dict[str, tuple[str, tuple[int, int]]] = {}
    dense: dict[str, str] = {}
    for name, t in logical.items():
        if not _linear(name, t.shape):
            continue
        module = name[:-len(".weight")] if name.endswith(".weight") else name
        reason = next((why for pattern, why in KEEP_DENSE if module_matches(pattern, module)), None)
        n, k = t.shape[-2:]
        if reason is None and t.dtype not in _FLOAT_DTYPES:
            reason = f"stored as {t.dtype}"
        elif reason is None and option == "fp8" and (n % FP8_BLOCK_SIZE[0] or k % FP8_BLOCK_SIZE[1]):
            reason = f"dimensions not multiples of the {FP8_BLOCK_SIZE[0]}x{FP8_BLOCK_SIZE[1]} FP8 blocks"
        elif reason is None and option == "nvfp4" and k % NVFP4_GROUP:
            reason = f"input width not a multiple of the NVFP4 group of {NVFP4_GROUP}"
        if reason is None:
            targets[name] = kind
        else:
            dense[name] = reason
    return targets, dense


def quantize_members(read: Callable, members: list[PlannedTensor], format: str):
    """One QuantizedWeight for a parent stored as ``members`` back to back: each member quantized alone (its own
    FP8 blocks, its own NVFP4 global scale), an expert bank expert by expert (NVFP4: a global scale per stacked
    part, e.g. gate and up), then stacked by rows."""
    import torch

    from ninfer.ops.quant import QuantizedWeight

    parts = []
    for m in members:
        w = torch.cat([read(p.name).reshape(-1) for p in m.parts]).view(m.shape)
        if w.dim() == 2:
            parts.append(_quantize(w, format, None))
            continue
        per_expert = len(m.parts) // w.shape[0] if m.stacked else 1
        shards = tuple(p.shape[0] for p in m.parts[:per_expert]) if m.stacked else None
        experts = [_quantize(w[e], format, shards) for e in range(w.shape[0])]
        g = None if format == FP8_BLOCK else torch.stack([q.global_scale for q in experts])
        parts.append(QuantizedWeight(format=format, block=experts[0].block, global_scale=g,
                                     data=torch.stack([q.data for q in experts]),
                                     scale=torch.stack([q.scale for q in experts])))
    return parts[0] if len(parts) == 1 else QuantizedWeight.cat(parts)


def _quantize(w, format: str, shards: tuple[int, ...] | None):
    """Quantized on a CUDA device when there is one (the same IEEE operations give the same bits as on the CPU,
    ``ninfer-core/tests/gpu/test_linear_quant.py``; a 9B model's NVFP4 planes take minutes on CPU cores)."""
    import torch

    from ninfer.ops.quant import quantize_fp8_block, quantize_nvfp4

    device = w.device
    if torch.cuda.is_available():
        w = w.to("cuda")
    q = quantize_fp8_block(w, FP8_BLOCK_SIZE) if format == FP8_BLOCK else quantize_nvfp4(w, shards)
    return q.to(device) if device != w.device else q
