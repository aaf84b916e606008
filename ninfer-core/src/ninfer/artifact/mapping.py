"""The contract an architecture plugin fills for the converter and the loader (slot ``source_mapping``).

The plugin's ``source_mapping`` target is called with the raw config.json dict and returns an object
with this shape. The converter uses it to name, validate and fuse source tensors; the loader uses
``expected_parameters`` to check what an artifact actually binds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from ninfer.artifact.format import Use
from ninfer.models.common.weights import FusedParent


@runtime_checkable
class SourceMapping(Protocol):
    # Features whose every parameter the mapping can name and shape (Qwen3.5: text, mtp, vision); tensors of
    # other features are stored as found under their canonical names.
    validated_features: tuple[str, ...]

    def canonical_name(self, source_name: str) -> tuple[str, str] | None:
        """(feature, logical name) of a checkpoint tensor, or None for tensors the model does not use."""

    def configured_features(self) -> tuple[str, ...]:
        """Features config.json describes (text always; vision, mtp when configured)."""

    def expected_parameters(self, features: tuple[str, ...]) -> Mapping[str, tuple[str, tuple[int, ...]]]:
        """Logical name -> (feature, shape) that the config implies for ``features``."""

    def fused_parents(self) -> Sequence[FusedParent]:
        """Groups stored back to back as one physical parent (one matmul serves them)."""

    def shared_uses(self, bound: set[str], features: tuple[str, ...]) -> Sequence[Use]:
        """Uses beyond each binding's own: a tied lm_head, MTP's shared embedding and head, ..."""

    def embedding_vocab(self) -> int:
        """Number of embedding rows (token ids the model accepts)."""
