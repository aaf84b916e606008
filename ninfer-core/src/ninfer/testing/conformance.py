"""Checks every architecture plugin must pass; each raises ConformanceError naming what failed."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from typing import Any

from ninfer.contract import Startup
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
        _check_source_mapping(name, spec, sample_config)
    _check_protocol_classes(spec)


def _check_source_mapping(name: str, spec, sample_config: dict[str, Any]) -> None:
    """The source mapping made from ``sample_config`` (a config.json) has every member the converter and the
    loader call, and describes the text feature."""
    from ninfer.artifact.mapping import missing_members

    if spec.source_mapping is None:
        raise ConformanceError(f"architecture {name!r} provides no source_mapping to read a config with")
    mapping = spec.load("source_mapping")(sample_config)
    missing = missing_members(mapping)
    if missing:
        raise ConformanceError(f"{name}.source_mapping returned {type(mapping).__name__}, which lacks {missing}")
    if "text" not in mapping.configured_features():
        raise ConformanceError(f"{name}.source_mapping configures {mapping.configured_features()}, not text")


def _check_protocol_classes(spec) -> None:
    """The startup slot names a class of the ``Startup`` shape, made with no arguments (a bare function is the
    old one-step contract), defining every method of the Protocol."""
    if spec.startup is None:
        return
    obj = spec.load("startup")
    _check_startup_class(spec.name, spec.startup, obj)
    missing = [m for m in _protocol_methods(Startup) if not callable(getattr(obj, m, None))]
    if missing:
        raise ConformanceError(f"{spec.name}.startup {obj.__name__} lacks {missing} of {Startup.__name__}")


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
