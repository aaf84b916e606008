"""The bound-weight classes at the path plugins first used; they live in ``ninfer.artifact.weights`` (the artifact
reader builds them, and it imports no model part)."""

from ninfer.artifact.weights import BoundParameter, FusedParent, WeightSet

__all__ = ["BoundParameter", "FusedParent", "WeightSet"]
