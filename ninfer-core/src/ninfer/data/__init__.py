"""Package data: the embedded default model (default.ninfer, see docs/embedded-model.md)."""
