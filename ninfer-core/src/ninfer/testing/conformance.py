"""Checks every architecture plugin must pass; each raises ConformanceError naming what failed."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from typing import Any

from ninfer.contract import Frontend, Program, Startup, StateImageLayout
from ninfer.plugins import CONTRACT_SLOTS, PluginHost, make_plugin_host

_HEAVY = ("torch", "triton")


class ConformanceError(AssertionError):
    pass


def check_plugin_module(module: str) -> None:
    """Importing the plugin module in a fresh interpreter must not import torch or triton."""
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            f"print(__import__('json').dumps([m for m in {_HEAVY!r} if m in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise ConformanceError(f"importing plugin module {module!r} failed:\n{proc.stderr}")
    heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    if heavy:
        raise ConformanceError(f"plugin module {module!r} imports {heavy} at import time; import lazily")


def check_architecture(name: str, *, sample_config: dict[str, Any] | None = None,
                       host: PluginHost | None = None) -> None:
    """The architecture is registered once, every provided slot resolves, and the objects fit their roles."""
    host = host or make_plugin_host()
    entry = host.architecture(name)
    spec = entry.spec
    if not spec.handles:
        raise ConformanceError(f"architecture {name!r} handles no Hugging Face architecture names")
    for slot in CONTRACT_SLOTS:
        if getattr(spec, slot) is None:
            continue
        try:
            obj = spec.load(slot)
        except Exception as exc:
            raise ConformanceError(f"{name}.{slot} target {getattr(spec, slot)!r} does not load: {exc!r}") from exc
        if not callable(obj):
            raise ConformanceError(f"{name}.{slot} target {getattr(spec, slot)!r} is not callable")
    if sample_config is not None:
        if spec.config is None:
            raise ConformanceError(f"architecture {name!r} provides no config parser")
        config = spec.load("config")(sample_config)
        if spec.state_layout is not None:
            _check_state_layout(name, spec.load("state_layout")(config))
    _check_protocol_classes(spec)


def _check_state_layout(name: str, layout: Any) -> None:
    """A StateImageLayout whose every field holds bytes. No fields is valid: an attention-only model keeps no
    recurrent state, its slots are sequence identities with zero-byte images (docs/program.md, "Stores")."""
    if not isinstance(layout, StateImageLayout):
        raise ConformanceError(f"{name}.state_layout returned {layout!r}, not a StateImageLayout")
    empty = [f.name for f in layout.fields if f.nbytes_per_layer == 0]
    if empty:
        raise ConformanceError(f"{name}.state_layout fields {empty} hold no bytes (a shape with a zero extent)")


def _check_protocol_classes(spec) -> None:
    """Classes named by startup/program/frontend must define every method of their Protocol; the startup slot
    must name such a class, made with no arguments (a bare function is the old one-step contract)."""
    for slot, proto in (("startup", Startup), ("program", Program), ("frontend", Frontend)):
        if getattr(spec, slot) is None:
            continue
        obj = spec.load(slot)
        if slot == "startup":
            _check_startup_class(spec.name, getattr(spec, slot), obj)
        if isinstance(obj, type):
            missing = [m for m in _protocol_methods(proto) if not callable(getattr(obj, m, None))]
            if missing:
                raise ConformanceError(f"{spec.name}.{slot} {obj.__name__} lacks {missing} of {proto.__name__}")


def _check_startup_class(name: str, target: str, obj: Any) -> None:
    if not isinstance(obj, type):
        raise ConformanceError(
            f"{name}.startup target {target!r} is a {type(obj).__name__}, not a class: the slot names a class of "
            f"the ninfer.contract.Startup shape ({', '.join(_protocol_methods(Startup))}), made with no arguments")
    try:
        signature = inspect.signature(obj)
    except ValueError:  # no signature to read (a class built in C): the runtime's own call will tell
        return
    try:
        signature.bind()
    except TypeError as exc:
        raise ConformanceError(f"{name}.startup {obj.__name__} cannot be made with no arguments: {exc}") from None


def _protocol_methods(proto: type) -> list[str]:
    return sorted(n for n, val in vars(proto).items() if callable(val) and not n.startswith("_"))


__all__ = ["CONTRACT_SLOTS", "ConformanceError", "check_architecture", "check_plugin_module"]
