"""Qwen4Exp plugin. The architecture is not implemented yet, so it registers nothing (see README)."""
