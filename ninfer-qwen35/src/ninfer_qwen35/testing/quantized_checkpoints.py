"""Tiny Qwen3.5 checkpoints in the published quantized formats, for the converter's tests: a tiny checkpoint
(``checkpoints.make_tiny_checkpoint``) rewritten in place with its linear weights quantized and named as the
published releases name them.

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", moe=True)
    quantize_tiny_checkpoint(ckpt, "modelopt_nvfp4")

Schemes: ``fp8`` (Qwen fine-grained FP8: ``weight`` + ``weight_scale_inv`` per 128x128 block, in
config.json ``quantization_config``), ``ct_fp8_block`` / ``ct_fp8_channel`` / ``ct_fp8_tensor`` (compressed-tensors
``float-quantized``: ``weight`` + ``weight_scale``), ``ct_nvfp4`` (compressed-tensors ``nvfp4-pack-quantized``:
``weight_packed``, ``weight_scale``, ``weight_global_scale`` a divisor, ``input_global_scale``) and
``modelopt_nvfp4`` (``hf_quant_config.json``: ``weight`` u8, ``weight_scale``, ``weight_scale_2`` a multiplier,
``input_scale``). Expert banks are written per expert (``experts.{e}.gate_proj.weight`` ...) or, with
``fused_experts`` (fp8 only), as the quantized banks themselves with ``<bank>_scale_inv``.

The quantizers here are written from the formats' published definitions, apart from ninfer's own.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

SCHEMES = ("fp8", "ct_fp8_block", "ct_fp8_channel", "ct_fp8_tensor", "ct_nvfp4", "modelopt_nvfp4")
# Modules left in bf16, as the published releases leave them (module-name tails).
NOT_QUANTIZED = ("embed_tokens", "lm_head", "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a",
                 "linear_attn.in_proj_b", "linear_attn.out_proj", "mtp.fc")
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_BANK = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def kept_in_bf16(module: str) -> bool:
    """Whether the published quantized releases leave ``module`` (a linear's name without ``.weight``) in bf16."""
    return "visual." in module or any(module == m or module.endswith("." + m) for m in NOT_QUANTIZED)


def fp8_block(w, block=(128, 128)):
    """(f8 data, f32 scale grid): scale = block amax / 448, a multiplier."""
    import torch

    n, k = w.shape
    b0, b1 = block
    w = w.float()
    scale = torch.ones(math.ceil(n / b0), math.ceil(k / b1))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            amax = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].abs().max()
            scale[i, j] = amax / 448 if amax > 0 else 1.0
    full = scale.repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :k]
    return (w / full).to(torch.float8_e4m3fn), scale


def nvfp4(w):
    """(u8 packed e2m1, e4m3 scales per 16 inputs, f32 global multiplier)."""
    import torch

    n, k = w.shape
    w = w.float()
    g = float(w.abs().max()) / (448 * 6) or 1.0
    groups = w.view(n, k // 16, 16)
    scale = (groups.abs().amax(-1) / 6 / g).to(torch.float8_e4m3fn)
    denom = (scale.float() * g)[..., None]
    x = torch.where(denom > 0, groups / denom, torch.zeros_like(groups)).view(n, k)
    mags = torch.tensor(_E2M1)
    code = (x.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude (the first on a tie)
    code = (code | ((x < 0) & (code > 0)).long() << 3).to(torch.uint8)
    return code[:, 0::2] | code[:, 1::2] << 4, scale, torch.tensor(g, dtype=torch.float32)


def _quantize(name: str, w, scheme: str, out: dict, scale_dtype=None) -> None:
    """Add the published tensors of one linear weight ``name`` (``X.weight``) to ``out``."""
    import torch

    if scheme == "fp8":
        data, scale = fp8_block(w)
        out[name], out[name + "_scale_inv"] = data, scale.to(scale_dtype or torch.float32)
    elif scheme.startswith("ct_fp8"):
        if scheme == "ct_fp8_block":
            data, scale = fp8_block(w)
        else:
            rows = w.float().abs().amax(1, keepdim=True) if scheme == "ct_fp8_channel" else w.float().abs().max()
            scale = torch.where(rows > 0, rows / 448, torch.ones_like(rows))
            data = (w.float() / scale).to(torch.float8_e4m3fn)
            scale = scale.reshape(-1, 1) if scheme == "ct_fp8_channel" else scale.reshape(1)
        out[name], out[name + "_scale"] = data, scale
        out[name[:-len("weight")] + "input_scale"] = torch.ones(1)  # calibration leftovers the converter skips
    else:
        data, scale, g = nvfp4(w)
        module = name[:-len(".weight")]
        if scheme == "ct_nvfp4":
            out[name + "_packed"], out[name + "_scale"] = data, scale
            out[name + "_global_scale"] = (1 / g.double()).float().reshape(1)  # stored as a divisor
            out[module + ".input_global_scale"] = torch.ones(1)
        else:
            out[name], out[name + "_scale"], out[name + "_scale_2"] = data, scale, g
            out[module + ".input_scale"] = torch.ones(())


def _quantize_bank(name: str, bank, scheme: str, fused: bool, out: dict, scale_dtype=None) -> None:
    import torch

    if fused:
        if scheme != "fp8":
            raise ValueError("fused quantized expert banks are written for the fp8 scheme only")
        parts = [fp8_block(bank[e]) for e in range(bank.shape[0])]
        out[name] = torch.stack([d for d, _ in parts])
        out[name + "_scale_inv"] = torch.stack([s for _, s in parts])
        return
    prefix, kind = _BANK.match(name).groups()
    for e in range(bank.shape[0]):
        if kind == "down_proj":
            _quantize(f"{prefix}.{e}.down_proj.weight", bank[e], scheme, out, scale_dtype)
        else:
            gate, up = bank[e].chunk(2)
            _quantize(f"{prefix}.{e}.gate_proj.weight", gate, scheme, out, scale_dtype)
            _quantize(f"{prefix}.{e}.up_proj.weight", up, scheme, out, scale_dtype)


def quantize_tiny_checkpoint(directory: str | Path, scheme: str, *, fused_experts: bool = False,
                             scale_dtype=None) -> Path:
    """Rewrite the checkpoint in ``directory`` (every shard, the index, config.json or hf_quant_config.json) with
    its linear weights in ``scheme`` (see the module doc); returns the directory. ``scale_dtype``: the fp8
    scheme's ``weight_scale_inv`` dtype (float32 by default; some releases store bfloat16)."""
    from safetensors.torch import load_file, save_file

    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    out_dir = Path(directory)
    index_path = out_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    kept_modules: list[str] = []
    for shard in sorted(out_dir.glob("*.safetensors")):
        written: dict = {}
        for name, t in load_file(str(shard)).items():
            module = name[:-len(".weight")] if name.endswith(".weight") else name
            if _BANK.match(name):
                _quantize_bank(name, t, scheme, fused_experts, written, scale_dtype)
            elif name.endswith(".weight") and t.dim() == 2 and not kept_in_bf16(module):
                _quantize(name, t, scheme, written, scale_dtype)
            else:
                written[name] = t
                if name.endswith(".weight") and t.dim() == 2:
                    kept_modules.append(module)
        save_file(written, str(shard), metadata={"format": "pt"})
        if index is not None:
            index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard.name}
            index["weight_map"].update({n: shard.name for n in written})
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2))
    write_quant_config(out_dir, scheme, sorted(kept_modules))
    return out_dir


def write_quant_config(out_dir: Path, scheme: str, kept: list[str]) -> None:
    """config.json's ``quantization_config`` (or ``hf_quant_config.json``) of ``scheme``, ``kept`` left in bf16."""
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    if scheme == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128], "modules_to_not_convert": kept}
    elif scheme == "modelopt_nvfp4":
        (out_dir / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.0"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                             "exclude_modules": ["lm_head", "*embed_tokens", "*mlp.gate", "*shared_expert_gate",
                                                 "*in_proj_a", "*in_proj_b", "*linear_attn.out_proj", "mtp.fc",
                                                 "*visual*"]}}, indent=2))
    else:
        nvfp4_scheme = scheme == "ct_nvfp4"
        strategy = scheme.removeprefix("ct_fp8_")
        weights = ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                    "symmetric": True, "dynamic": False} if nvfp4_scheme else
                   {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
                    "block_structure": [128, 128] if strategy == "block" else None})
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "format": "nvfp4-pack-quantized" if nvfp4_scheme else "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                "num_bits": 4 if nvfp4_scheme else 8, "type": "float", "dynamic": not nvfp4_scheme}}},
            "ignore": ["lm_head", "re:.*embed_tokens$", "re:.*mlp.gate$", "re:.*shared_expert_gate$",
                       "re:.*in_proj_[ab]$", "re:.*linear_attn.out_proj$", "mtp.fc", "re:.*visual.*"]}
    config_path.write_text(json.dumps(config, indent=2))
