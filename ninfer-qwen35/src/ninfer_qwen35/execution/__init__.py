"""Native Parameters and the fixed model calls of Qwen3.5."""
