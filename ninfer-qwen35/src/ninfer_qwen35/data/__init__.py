"""Package data: the embedded default model (default.ninfer, a tiny Qwen3.5; docs/embedded-model.md), which the
plugin names to core through ``ninfer_default_model``."""
