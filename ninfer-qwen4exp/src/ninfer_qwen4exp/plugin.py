"""Qwen4Exp plugin: registers the architecture's contract slots as lazy targets (no torch import here)."""

from ninfer import ArchitectureSpec, hookimpl


@hookimpl
def ninfer_register_architectures(register):
    register(ArchitectureSpec(
        name="qwen4exp", handles=("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"),
        description="Qwen4Exp: Qwen3.5 MoE's mixers under 4-stream hyper-connections, QSA sparse attention, "
                    "PLE n-gram embeddings, no final norm",
        startup="ninfer_qwen4exp.startup:Qwen4ExpStartup",
        source_mapping="ninfer_qwen4exp.source_mapping:source_mapping",
        tiny_checkpoint="ninfer_qwen4exp.testing.checkpoints:tiny_checkpoint"))
