"""Instance construction: artifact -> architecture plugin -> native Startup -> ModelInstance.

The engine dispatches on the artifact's architecture once, here; the worker then calls the native
Program directly.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from ninfer.contract.model import ModelInstance, StartupFeatures
from ninfer.plugins import PluginHost, default_host


def artifact_architecture(artifact: Any) -> str:
    """The Hugging Face architecture string an opened artifact declares."""
    for path in (("architecture",), ("metadata", "architecture"), ("config", "architectures")):
        obj = artifact
        for part in path:
            obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, (list, tuple)) and obj:
            obj = obj[0]
        if isinstance(obj, str) and obj:
            return obj
    raise ValueError(f"artifact {artifact!r} declares no architecture")


def artifact_name(artifact: Any, architecture: str) -> str:
    """metadata.name, defaulting to the architecture name (design document)."""
    meta = getattr(artifact, "metadata", None)
    name = meta.get("name") if isinstance(meta, dict) else getattr(meta, "name", None)
    return name or architecture


def build_instance(model: str | os.PathLike, *, device: str, features: StartupFeatures, max_concurrency: int,
                   device_budget_bytes: int | None, program_options: dict[str, Any],
                   max_model_len: int | None = None, host: PluginHost | None = None, verify: bool = True
                   ) -> tuple[ModelInstance, str, Any]:
    """Open ``model`` (a .ninfer artifact), find its plugin and build the ModelInstance.

    ``verify``: check the checksum of every object the load reads (weights and Frontend resources).

    Returns the instance, its public name and the opened artifact (the engine keeps it alive: loaded
    weights may borrow its mapping)."""
    from ninfer.artifact import open_artifact  # lazy: keeps ``import ninfer`` light

    path = os.fspath(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model artifact {path!r} does not exist")
    artifact = open_artifact(path, verify=verify)
    arch = artifact_architecture(artifact)
    entry = (host or default_host()).architecture(arch)
    startup = entry.spec.load("startup")
    build = getattr(startup, "build", startup)
    if max_model_len is not None and _accepts(build, "max_model_len"):
        program_options = {**program_options, "max_model_len": max_model_len}  # the capacity plan sizes for it
    instance = build(artifact, device=device, features=features, max_concurrency=max_concurrency,
                     device_budget_bytes=device_budget_bytes, **program_options)
    if instance.program is None:
        raise ValueError(f"architecture {arch!r} built no Program; generation needs one")
    return instance, artifact_name(artifact, arch), artifact


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
