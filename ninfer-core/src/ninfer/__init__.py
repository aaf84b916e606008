"""ninfer: fast single-GPU inference for the Qwen3.5 family.

The public API is ``ninfer.Engine`` (arriving with the generation engine) and the
contracts in :mod:`ninfer.contract`. Model internals are not public API.
"""

__version__ = "0.1.0"

from ninfer._markers import hookimpl  # noqa: E402
from ninfer.plugins import ArchitectureSpec  # noqa: E402

__all__ = ["ArchitectureSpec", "__version__", "hookimpl"]
