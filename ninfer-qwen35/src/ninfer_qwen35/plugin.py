"""Qwen3.5 plugin: registers the implemented contract slots as lazy targets, the makers of ``ninfer
tiny-checkpoint`` and the embedded default model (a tiny Qwen3.5 shipped as this package's data); no torch
import here."""

from pathlib import Path

from ninfer import ArchitectureSpec, hookimpl

# Dense and MoE share every native part: the MoE block is a config choice of the same model code.
_SLOTS = dict(startup="ninfer_qwen35.startup:Qwen35Startup",
              source_mapping="ninfer_qwen35.source_mapping:source_mapping")


@hookimpl
def ninfer_register_architectures(register):
    register(ArchitectureSpec(
        name="qwen35", handles=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
        description="Qwen3.5 dense: Gated DeltaNet + gated attention (3:1), text part of VL checkpoints",
        tiny_checkpoint="ninfer_qwen35.testing.checkpoints:tiny_checkpoint", **_SLOTS))
    register(ArchitectureSpec(
        name="qwen35_moe", handles=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        description="Qwen3.5 MoE: the same mixers, every MLP a sparse block (routed experts + a shared expert)",
        tiny_checkpoint="ninfer_qwen35.testing.checkpoints:tiny_moe_checkpoint", **_SLOTS))


@hookimpl
def ninfer_default_model() -> str | None:
    path = Path(__file__).parent / "data" / "default.ninfer"
    return str(path) if path.is_file() else None
