"""The .ninfer v3 artifact: container format, reader, writer, Binder -> LoadPlan -> resolve_load -> Materializer.

    with open_artifact("model.ninfer") as art:
        weights, report = load_weights(art, features=("text",), device="cuda")
"""

from ninfer.artifact.binder import LoadPlan, bind, normalize_features
from ninfer.artifact.format import (
    FEATURES,
    ArtifactError,
    ArtifactHeader,
    Binding,
    ChecksumError,
    FrontendSection,
    Metadata,
    PhysicalObject,
    Plane,
    Use,
)
from ninfer.artifact.materializer import LoadReport, Materializer, load_weights, meta_weights, plan_load
from ninfer.artifact.placement import Placement, ResolvedLoad, resolve_load
from ninfer.artifact.reader import Artifact, open_artifact
from ninfer.artifact.writer import ArtifactWriter

__all__ = [
    "FEATURES", "Artifact", "ArtifactError", "ArtifactHeader", "ArtifactWriter", "Binding", "ChecksumError",
    "FrontendSection", "LoadPlan", "LoadReport", "Materializer", "Metadata", "PhysicalObject", "Placement",
    "Plane", "ResolvedLoad", "Use", "bind", "load_weights", "normalize_features", "meta_weights", "open_artifact",
    "plan_load", "resolve_load",
]
