"""The contract an architecture plugin fills for the converter and the loader (slot ``source_mapping``).

The plugin's ``source_mapping`` target is called with the raw config.json dict and returns an object
with this shape. The converter uses it to name, validate, stack and fuse source tensors; the loader uses
``expected_parameters`` to check what an artifact actually binds.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from ninfer.artifact.format import Use
from ninfer.artifact.weights import FusedParent


def _shape(value) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class StackedSource:
    """One logical parameter assembled from several source tensors of one shape (``part_shape``), stored
    back to back in ``parts`` order: its bytes are the parts' bytes concatenated, viewed as ``shape``.

    A MoE layer's expert bank from a per-expert checkpoint: ``mlp.experts.gate_up_proj`` [E, 2I, H] has the
    parts ``experts.0.gate_proj.weight, experts.0.up_proj.weight, experts.1.gate_proj.weight, ...`` of [I, H],
    byte-identical to a checkpoint that stores the fused 3-D tensor itself.

    ``last_rows``: the last part's leading dimension when it is shorter than the others' (row chunks of a table
    cut as ``torch.chunk`` cuts: Qwen4Exp's sharded n-gram embedding)."""

    name: str  # the logical name
    feature: str
    parts: tuple[str, ...] = attrs.field(converter=tuple)  # every source tensor the group needs, in storage order
    part_shape: tuple[int, ...] = attrs.field(converter=_shape)
    shape: tuple[int, ...] = attrs.field(converter=_shape)  # the logical shape
    last_rows: int | None = None

    def __attrs_post_init__(self) -> None:
        tail = self.part_shape[1:]
        fits = (len(self.parts) > 0 and len(self.part_shape) >= 1 and len(self.shape) >= len(self.part_shape)
                and self.shape[len(self.shape) - len(tail):] == tail
                and math.prod(self.shape) == sum(math.prod(self.shape_of(k)) for k in range(len(self.parts)))
                and (self.last_rows is None or 0 < self.last_rows <= self.part_shape[0]))
        if not fits:
            last = f" (the last of {self.last_rows} rows)" if self.last_rows is not None else ""
            raise ValueError(f"stacked source {self.name!r}: {len(self.parts)} parts of {list(self.part_shape)}"
                             f"{last} cannot be viewed as {list(self.shape)}")

    def shape_of(self, k: int) -> tuple[int, ...]:
        """The shape part ``k`` must have."""
        if self.last_rows is not None and k == len(self.parts) - 1:
            return (self.last_rows, *self.part_shape[1:])
        return self.part_shape


@runtime_checkable
class SourceMapping(Protocol):
    # Features whose every parameter the mapping can name and shape (Qwen3.5: text, mtp, vision); tensors of
    # other features are stored as found under their canonical names.
    validated_features: tuple[str, ...]

    def canonical_name(self, source_name: str) -> tuple[str, str] | None:
        """(feature, logical name) of a checkpoint tensor, or None for tensors the model does not use."""

    def stacked_sources(self, source_names: Collection[str]) -> Sequence[StackedSource]:
        """Logical parameters this checkpoint stores split into several tensors (per-expert MoE weights), for
        the groups recognised among ``source_names``; empty when there are none. Each group lists every part
        it needs, present or not (the converter names the missing ones). Parts are consumed by their group:
        ``canonical_name`` is not asked about them."""

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


def missing_members(mapping: object) -> list[str]:
    """The SourceMapping members ``mapping`` lacks (a plugin written against an older contract)."""
    members = set(SourceMapping.__annotations__) | {n for n in vars(SourceMapping) if not n.startswith("_")}
    return sorted(n for n in members if not hasattr(mapping, n))
