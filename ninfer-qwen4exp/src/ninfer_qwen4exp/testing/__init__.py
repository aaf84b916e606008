"""Qwen4Exp test helpers (test-only dependencies: transformers, safetensors, ninfer-convert).

- ``checkpoints``: tiny real Qwen4Exp checkpoints written by ``transformers`` (``make_tiny_checkpoint``,
  ``convert_tiny``, the named tiny configs ``VARIANTS`` and ``tiny_text_config``).

Importing this package is cheap (no torch): each name loads its submodule on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "make_tiny_checkpoint": "checkpoints", "convert_tiny": "checkpoints", "tiny_text_config": "checkpoints",
    "VARIANTS": "checkpoints", "TINY_TEXT": "checkpoints",
}


def __getattr__(name: str) -> Any:
    submodule = _LAZY.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{submodule}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
