"""Every ``NINFER_*`` environment variable, in one registry: its type, default and meaning.

Library code reads the environment only through ``get`` (a test checks that no other module reads a
``NINFER_*`` name), so an unknown name is a programming error and a malformed value is a clear error
naming the variable. ``markdown_table()`` is the table in docs/configuration.md (a test keeps them equal); ``ninfer env``
prints each variable with the value it has now (a ``secret`` one only as whether it is set and its length).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import attrs

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class EnvError(ValueError):
    """A ``NINFER_*`` variable holds a value its type does not allow."""


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _names(raw: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in raw.split(",") if n.strip())


def _positive(unit: str) -> Callable[[str], int]:
    """A parser of positive whole numbers (``unit``: " of MiB" or "")."""
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"expected a whole number{unit}") from None
        if value <= 0:
            raise ValueError(f"expected a positive number{unit}" if unit else "expected a positive whole number")
        return value
    return parse


_mib = _positive(" of MiB")
_count = _positive("")


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(repr(a) for a in allowed)}")
        return value
    return parse


def _text(raw: str) -> str:
    return raw


@attrs.frozen(kw_only=True)
class EnvVar:
    """One variable: ``parse`` turns its text into the value; unset (or, unless ``keep_empty``, empty)
    means ``default``. A ``secret`` one's value never appears in messages or ``ninfer env`` output."""

    name: str
    kind: str               # what the docs table shows as its type
    default: Any
    meaning: str
    parse: Callable[[str], Any]
    scope: str = "library"  # library | cli | serve | testing
    keep_empty: bool = False
    secret: bool = False

    def shown(self, environ: Any = None) -> str:
        """The value as ``ninfer env`` prints it: a secret as ``<set, N chars>`` or ``<unset>``."""
        if not self.secret:
            return repr(self.read(environ))
        self.read(environ)  # a malformed secret still fails, naming only the variable
        raw = (os.environ if environ is None else environ).get(self.name)
        return "<unset>" if raw is None else f"<set, {len(raw)} chars>"

    def read(self, environ: Any = None) -> Any:
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or (not raw.strip() and not self.keep_empty):
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            shown = "<secret>" if self.secret else repr(raw)
            raise EnvError(f"{self.name}={shown}: {exc}") from None


REGISTRY: tuple[EnvVar, ...] = (
    EnvVar(name="NINFER_PLUGINS", kind="comma list", default=None, parse=_names, keep_empty=True,
           meaning="allowlist of plugin names to load (unset: every installed plugin; empty: none)"),
    EnvVar(name="NINFER_DISABLE_PLUGIN_AUTOLOAD", kind="flag", default=False, parse=_flag,
           meaning="load no plugin from package entry points (only NINFER_EXTRA_PLUGINS)"),
    EnvVar(name="NINFER_EXTRA_PLUGINS", kind="comma list", default=(), parse=_names,
           meaning="plugin modules to register without package metadata (a source checkout on the GPU machine)"),
    EnvVar(name="NINFER_STRICT_PLUGINS", kind="flag", default=False, parse=_flag,
           meaning="a plugin that fails to load is an error instead of a recorded failure"),
    EnvVar(name="NINFER_OPS", kind="auto, torch or triton", default="auto", parse=_choice("auto", "torch", "triton"),
           meaning="op implementations: validated Triton kernels on CUDA (auto), the torch references "
                   "everywhere, or every Triton kernel listed or not"),
    EnvVar(name="NINFER_OPS_OFF", kind="comma list", default=(), parse=_names,
           meaning="Triton kernels (module.name, e.g. moe.moe_block) left to their torch composition, to compare a "
                   "fused kernel with what it replaces"),
    EnvVar(name="NINFER_PDL", kind="flag", default=None, parse=_flag,
           meaning="programmatic dependent launch on or off for every Program (unset: each model's startup "
                   "chooses by the weight bytes a decode step reads per layer)"),
    EnvVar(name="NINFER_TUNING_DIR", kind="path", default=None, parse=_text,
           meaning="a folder of kernel tuning tables (<family>.json, docs/kernels.md) used instead of the packaged "
                   "ones, e.g. written by python -m ninfer.ops.triton.tune --out"),
    EnvVar(name="NINFER_VRAM_BUDGET_MIB", kind="MiB", default=None, parse=_mib,
           meaning="device bytes the engine may use (weights, StateImages, KV, workspace, CUDA graphs: "
                   "docs/memory.md); the free memory is the other bound"),
    EnvVar(name="NINFER_MOE_STREAM_TOKENS", kind="count", default=None, parse=_count,
           meaning="tokens from which a MoE layer call with host experts streams the layer's whole banks to the "
                   "device instead of splitting its pairs between the expert cache and the CPU (unset: 256)"),
    EnvVar(name="NINFER_HOST_BUDGET_MIB", kind="MiB", default=None, parse=_mib,
           meaning="host bytes paused requests' Snapshots may hold (unset: the model's default)"),
    EnvVar(name="NINFER_CACHE_HOST_BUDGET_MIB", kind="MiB", default=None, parse=_mib,
           meaning="pinned host bytes the context cache's checkpoint replicas may hold (unset: the model's "
                   "default)"),
    EnvVar(name="NINFER_CACHE_DIR", kind="path", default=None, parse=_text,
           meaning="where models named by Hugging Face id are converted and kept (unset: ninfer under "
                   "XDG_CACHE_HOME, else ~/.cache/ninfer); the checkpoints themselves stay in the Hugging Face "
                   "cache (HF_HOME, HF_HUB_CACHE)"),
    EnvVar(name="NINFER_API_KEY", kind="text", default=None, parse=_text, scope="serve", secret=True,
           meaning="`ninfer serve --api-key`, kept out of the process list (read only without --api-key and "
                   "--api-key-file)"),
    EnvVar(name="NINFER_COMMAND", kind="text", default="ninfer", parse=_text, scope="cli",
           meaning="how the user runs the CLI, as the commands it suggests spell it (scripts/ninfer sets it to "
                   "its own path)"),
    EnvVar(name="NINFER_SERVE_TEST_DEVICE", kind="text", default="cpu", parse=_text, scope="testing",
           meaning="device the server lifecycle tests start their servers on (cuda on the GPU machine)"),
    EnvVar(name="NINFER_TEST_CACHE", kind="path", default=None, parse=_text, scope="testing",
           meaning="where tests cache downloaded or built vocabularies (default: XDG_CACHE_HOME or ~/.cache)"),
)

_BY_NAME = {v.name: v for v in REGISTRY}


def variable(name: str) -> EnvVar:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a registered NINFER_* variable (ninfer/env.py)") from None


def get(name: str, environ: Any = None) -> Any:
    """The parsed value of a registered variable (its default when unset); raises EnvError when malformed."""
    return variable(name).read(environ)


def markdown_table() -> str:
    rows = ["| variable | type | default | scope | meaning |", "|---|---|---|---|---|"]
    for v in REGISTRY:
        default = "unset" if v.default is None else (", ".join(v.default) or "empty") \
            if isinstance(v.default, tuple) else str(v.default).lower() if isinstance(v.default, bool) \
            else str(v.default)
        rows.append(f"| `{v.name}` | {v.kind} | {default} | {v.scope} | {v.meaning} |")
    return "\n".join(rows) + "\n"

