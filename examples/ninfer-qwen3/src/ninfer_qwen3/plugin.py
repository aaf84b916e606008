"""Registers the ``qwen3`` architecture; slots are lazy ``module:attr`` targets, so no torch is imported here."""

from ninfer import ArchitectureSpec, hookimpl


@hookimpl
def ninfer_register_architectures(register):
    register(ArchitectureSpec(
        name="qwen3",
        handles=("Qwen3ForCausalLM",),
        description="Qwen3 dense: attention-only, per-head q/k RMSNorm, RoPE, SwiGLU (example plugin)",
        startup="ninfer_qwen3.startup:Qwen3Startup",
        source_mapping="ninfer_qwen3.source_mapping:source_mapping",
    ))
