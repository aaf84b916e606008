"""Example ninfer architecture plugin: dense Qwen3 (``Qwen3ForCausalLM``)."""
