"""ninfer: fast single-GPU inference for the Qwen3.5 family.

The public API is ``ninfer.Engine`` and the contracts in :mod:`ninfer.contract`.
Model internals are not public API. ``Engine`` and its handle/error types load lazily,
so ``import ninfer`` stays light and imports no torch.
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING  # noqa: E402

from ninfer._markers import hookimpl  # noqa: E402
from ninfer.plugins import ArchitectureSpec  # noqa: E402

if TYPE_CHECKING:
    from ninfer.plugins import PluginHost

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


def default_model_path(*, host: "PluginHost | None" = None) -> str | None:
    """The embedded default model, if an installed plugin ships one (ninfer-qwen35: a tiny Qwen3.5 trained on
    Shakespeare), through the ``ninfer_default_model`` hook. ``host``: the plugin host asked (default: the
    process's)."""
    from ninfer.plugins import default_host

    return (host or default_host()).pm.hook.ninfer_default_model()


DEFAULT_MODEL_NAME = "default"


def looks_like_model_id(arg: str) -> bool:
    """Whether ``arg`` has the form of a Hugging Face repository id, ``org/name`` or ``org/name@revision``
    (a relative path such as ``out/model.ninfer`` does not: ids never end in ``.ninfer``)."""
    import re

    repo, _, revision = arg.partition("@")
    return (re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", repo) is not None
            and ".." not in repo and not repo.endswith(".ninfer")
            and ("@" not in arg or re.fullmatch(r"[\w./-]+", revision) is not None))


def resolve_model_path(arg: str | None, *, host: "PluginHost | None" = None) -> str:
    """The artifact a command's model argument names: no argument or ``"default"`` is the embedded model
    (a file of that name in the working directory wins); an existing file is itself; a Hugging Face id
    (``org/name[@revision]``) is whatever a plugin's ``ninfer_resolve_model`` makes of it (ninfer-convert
    fetches and converts it once). ``host``: the plugin host asked (default: the process's).
    Raises ValueError with a message fit for the user."""
    import os

    if arg is None or (arg == DEFAULT_MODEL_NAME and not os.path.exists(arg)):
        path = default_model_path(host=host)
        if path is None:
            raise ValueError("no model given and no embedded default model is available in this installation "
                             "(ninfer-qwen35 ships it); pass the path of a .ninfer artifact")
        return path
    if os.path.exists(arg):
        return arg
    if not looks_like_model_id(arg):
        raise ValueError(f"model file not found: {arg}")
    from ninfer.plugins import default_host

    found = (host or default_host()).pm.hook.ninfer_resolve_model(name=arg)
    if found is None:
        raise ValueError(f"no file {arg} here, and using Hugging Face model ids needs ninfer-convert: "
                         f"pip install ninfer-convert (or pass the path of a .ninfer artifact)")
    return found


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
           "looks_like_model_id", "resolve_model_path", *_LAZY]
