"""Instance construction: artifact -> architecture plugin -> native Startup -> ModelInstance.

The engine dispatches on the artifact's architecture once, here; the worker then calls the native
Program directly. The plugin's Startup receives typed ``StartupOptions`` (every option, always).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ninfer.contract.config import StartupOptions
from ninfer.contract.model import ModelInstance, Startup
from ninfer.plugins import PluginHost, default_host

if TYPE_CHECKING:
    from ninfer.artifact import Artifact


def build_instance(model: str | os.PathLike, options: StartupOptions, *, host: PluginHost | None = None,
                   verify: bool = True) -> tuple[ModelInstance, str, Artifact]:
    """Open ``model`` (a .ninfer artifact), find its plugin and build the ModelInstance.

    ``verify``: check the checksum of every object the load reads (weights and Frontend resources).

    Returns the instance, its public name (``metadata.name``) and the opened artifact (the engine keeps
    it alive: loaded weights may borrow its mapping)."""
    from ninfer.artifact import open_artifact  # lazy: keeps ``import ninfer`` light

    if not isinstance(options, StartupOptions):
        raise TypeError(f"options must be StartupOptions, got {type(options).__name__}")
    path = os.fspath(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model artifact {path!r} does not exist")
    artifact = open_artifact(path, verify=verify)
    arch = artifact.metadata.architecture
    build: Startup = (host or default_host()).architecture(arch).spec.load("startup")
    instance = build(artifact, options)
    if not isinstance(instance, ModelInstance):
        raise TypeError(f"the {arch!r} Startup returned {type(instance).__name__}, not a ModelInstance")
    if instance.program is None:
        raise ValueError(f"architecture {arch!r} built no Program; generation needs one")
    return instance, artifact.metadata.name, artifact
