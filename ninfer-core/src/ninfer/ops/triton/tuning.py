"""Launch choices of the Triton kernels as data: one table per kernel family, read once.

A table is a JSON file ``tables/<family>.json`` beside this module (or in ``NINFER_TUNING_DIR``, which replaces
the packaged folder: how a benchmark varies tiles without patching the library). It holds

- ``devices``: entries measured on one GPU, keyed by its name (``torch.cuda.get_device_properties().name``),
  each with the ``sms`` it was measured with. A device matches an entry only when both its name and its SM
  count are the entry's. ``{"same_as": NAME}`` repeats another entry: the ``"cpu"`` entry, the stand-in for
  the device when tests run kernels in Triton's interpreter, mirrors the H200 so they exercise its shapes.
- ``generic``: the rule for every other device (an H100, an A100, ...), written per streaming multiprocessor
  where a choice depends on how many there are, and without the per-shape entries measured on another GPU.

In any entry a key ``<name>_per_sm`` resolves to ``<name>`` = round(value x SM count) (at least 1), so a rule
written for the SMs of one GPU scales to another. ``choices(family, device)`` is that resolved entry.
``python -m ninfer.ops.triton.tune`` measures and writes an entry for the device it runs on (docs/kernels.md).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs
import torch

from ninfer import env

PACKAGED = Path(__file__).parent / "tables"
FAMILIES = ("attention", "gdn", "linear", "linear_quant", "moe", "sampling", "vision_attention")
CPU_ENTRY = "cpu"


class TuningError(ValueError):
    """A tuning table is missing, malformed, or has no entry a device can use."""


@attrs.frozen
class DeviceKey:
    """What a table is keyed by: the device's name and streaming multiprocessors (0 for the CPU)."""

    name: str
    sms: int


CPU = DeviceKey(CPU_ENTRY, 0)


@functools.cache
def _cuda_key(index: int) -> DeviceKey:
    props = torch.cuda.get_device_properties(index)
    return DeviceKey(props.name, props.multi_processor_count)


def device_key(t: torch.Tensor | torch.device) -> DeviceKey:
    """The key of the device holding ``t`` (a tensor or a device); ``CPU`` for anything not on CUDA."""
    device = t if isinstance(t, torch.device) else t.device
    if device.type != "cuda":
        return CPU
    return _cuda_key(device.index if device.index is not None else torch.cuda.current_device())


def tables_dir() -> Path:
    """The folder tables are read from: ``NINFER_TUNING_DIR`` when set, else the packaged one."""
    override = env.get("NINFER_TUNING_DIR")
    return Path(override) if override else PACKAGED


def choices(family: str, device: DeviceKey) -> Mapping[str, Any]:
    """The resolved launch choices of ``family``'s kernels on ``device`` (read-only; cached per folder)."""
    return _resolved(tables_dir(), family, device)


def table(family: str, directory: Path | None = None) -> Mapping[str, Any]:
    """The raw table of ``family`` (``tables_dir()`` unless ``directory``)."""
    return _read(directory or tables_dir(), family)


def known_entry(family: str, device: DeviceKey, directory: Path | None = None) -> str | None:
    """The name of the measured entry ``device`` uses in ``family``'s table, or None (the generic rule)."""
    devices = table(family, directory)["devices"]
    if device == CPU:
        return CPU_ENTRY if CPU_ENTRY in devices else None
    entry = devices.get(device.name)
    if entry is None:
        return None
    return device.name if _follow(devices, device.name)["sms"] == device.sms else None


@functools.cache
def _read(directory: Path, family: str) -> Mapping[str, Any]:
    if family not in FAMILIES:
        raise TuningError(f"no tuning family {family!r} (known: {', '.join(FAMILIES)})")
    path = directory / f"{family}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TuningError(f"tuning table {path} does not exist (NINFER_TUNING_DIR names a folder of "
                          f"<family>.json files)") from None
    except json.JSONDecodeError as exc:
        raise TuningError(f"tuning table {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("generic"), dict) or \
            not isinstance(data.get("devices"), dict):
        raise TuningError(f"tuning table {path} needs a 'generic' entry and a 'devices' object")
    return _frozen(data)


def _follow(devices: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    entry, seen = devices[name], {name}
    while "same_as" in entry:
        target = entry["same_as"]
        if target in seen or target not in devices:
            raise TuningError(f"tuning entry {name!r}: same_as {target!r} names no entry (or a circle)")
        seen.add(target)
        entry = devices[target]
    return entry


@functools.cache
def _resolved(directory: Path, family: str, device: DeviceKey) -> Mapping[str, Any]:
    data = _read(directory, family)
    name = known_entry(family, device, directory)
    if name is not None:
        entry = _follow(data["devices"], name)
        sms = entry["sms"]
    elif device == CPU:
        raise TuningError(f"tuning table {directory / family}.json has no {CPU_ENTRY!r} entry for the interpreter")
    else:
        entry, sms = data["generic"], device.sms
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if key.endswith("_per_sm"):
            out[key.removesuffix("_per_sm")] = max(1, round(value * sms))
        elif key != "same_as":
            out[key] = value
    missing = set(_resolved_keys(data["generic"])) - set(out)
    if missing:
        raise TuningError(f"tuning table {directory / family}.json: entry {name!r} lacks {sorted(missing)}")
    return MappingProxyType(out)


def _resolved_keys(entry: Mapping[str, Any]) -> list[str]:
    return [k.removesuffix("_per_sm") for k in entry if k not in ("same_as", "shapes", "sms")]


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value
