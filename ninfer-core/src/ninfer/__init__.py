"""ninfer: fast single-GPU inference for the Qwen3.5 family.

The public API is ``ninfer.Engine`` and the contracts in :mod:`ninfer.contract`.
Model internals are not public API. ``Engine`` and its handle/error types load lazily,
so ``import ninfer`` stays light and imports no torch.
"""

__version__ = "0.1.0"

from ninfer._markers import hookimpl  # noqa: E402
from ninfer.plugins import ArchitectureSpec  # noqa: E402

_LAZY = {
    "Engine": "ninfer.engine.engine",
    "EngineConfig": "ninfer.contract.config",
    "GenerationHandle": "ninfer.engine.handle",
    "EngineMetrics": "ninfer.engine.metrics",
    "RequestRejected": "ninfer.engine.errors",
    "Overloaded": "ninfer.engine.errors",
    "QueueTimeout": "ninfer.engine.errors",
    "InputTooLong": "ninfer.engine.errors",
    "Unrepresentable": "ninfer.engine.errors",
    "EngineFailed": "ninfer.engine.errors",
    "EngineClosed": "ninfer.engine.errors",
}


def default_model_path() -> str | None:
    """The embedded default model (a tiny Qwen3.5 trained on Shakespeare) shipped as package data, if present."""
    from pathlib import Path

    path = Path(__file__).parent / "data" / "default.ninfer"
    return str(path) if path.is_file() else None


DEFAULT_MODEL_NAME = "default"


def resolve_model_path(arg: str | None) -> str:
    """The artifact a command's model argument names: no argument or ``"default"`` is the embedded model
    (a file of that name in the working directory wins); anything else must be an existing file.
    Raises ValueError with a message fit for the user."""
    import os

    if arg is None or (arg == DEFAULT_MODEL_NAME and not os.path.exists(arg)):
        path = default_model_path()
        if path is None:
            raise ValueError("no model given and no embedded default model is available in this installation; "
                             "pass the path of a .ninfer artifact")
        return path
    if not os.path.exists(arg):
        raise ValueError(f"model file not found: {arg}")
    return arg


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ninfer' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_LAZY})


__all__ = ["DEFAULT_MODEL_NAME", "ArchitectureSpec", "__version__", "default_model_path", "hookimpl",
           "resolve_model_path", *_LAZY]
