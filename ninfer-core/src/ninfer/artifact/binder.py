"""Binder: from the selected startup features to a LoadPlan (what to read), with no placement yet.

Startup selects Text (required), Vision (optional) and none or one speculative backend. The Binder
keeps the Uses of those features, the Bindings they consume (shared ones such as the embedding used by
MTP come along through their Uses) and the physical objects behind them, each once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

import attrs

from ninfer.artifact.format import ArtifactError, ArtifactHeader, Binding, PhysicalObject, Use

SPEC_BACKENDS = ("mtp", "dflash")
OPTIONAL_FEATURES = ("vision", *SPEC_BACKENDS)


@attrs.frozen(kw_only=True)
class LoadPlan:
    """What a load needs: selected Uses, the Bindings they consume and the objects behind them (file order)."""

    features: tuple[str, ...]
    uses: tuple[Use, ...]
    bindings: tuple[Binding, ...]
    objects: tuple[PhysicalObject, ...]

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.objects)

    def bytes_by_feature(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for o in self.objects:
            out[o.feature] += o.nbytes
        return dict(out)


def normalize_features(features: Iterable[str]) -> tuple[str, ...]:
    """Validate a startup selection: text required, known optional features, at most one spec backend."""
    selected = tuple(dict.fromkeys(features))
    if "text" not in selected:
        raise ArtifactError(f"feature selection {list(selected)} must include 'text'")
    unknown = [f for f in selected if f != "text" and f not in OPTIONAL_FEATURES]
    if unknown:
        raise ArtifactError(f"unknown features {unknown}; choose from text, {', '.join(OPTIONAL_FEATURES)}")
    spec = [f for f in selected if f in SPEC_BACKENDS]
    if len(spec) > 1:
        raise ArtifactError(f"select none or one speculative backend, not {spec}")
    return selected


def bind(header: ArtifactHeader, features: Iterable[str] = ("text",), *,
         expected: Mapping[str, tuple[int, ...]] | None = None) -> LoadPlan:
    """Resolve the logical needs of ``features``. ``expected`` (logical name -> shape, from the architecture's
    source mapping) is checked against what is actually bound."""
    selected = normalize_features(features)
    missing = [f for f in selected if f not in header.features]
    if missing:
        raise ArtifactError(f"artifact {header.metadata.name!r} has no {', '.join(missing)} "
                            f"(present: {', '.join(header.features)})")
    bindings = header.binding_map()
    objects = header.object_map()
    uses = tuple(u for u in header.uses if u.feature in selected)
    needed: dict[str, Binding] = {}
    for u in uses:
        needed.setdefault(u.binding, bindings[u.binding])
    for b in header.bindings:  # a binding of a selected feature is needed even if no Use names it
        if b.feature in selected:
            needed.setdefault(b.name, b)
    if expected is not None:
        for name, shape in expected.items():
            b = needed.get(name)
            if b is None:
                raise ArtifactError(f"artifact {header.metadata.name!r} does not bind {name!r}, which "
                                    f"{header.metadata.architecture} needs for {', '.join(selected)}")
            if tuple(b.shape) != tuple(shape):
                raise ArtifactError(f"binding {name!r} has shape {list(b.shape)} but the config implies "
                                    f"{list(shape)}")
    object_ids = {b.object for b in needed.values()}
    ordered = tuple(sorted((objects[i] for i in object_ids), key=lambda o: o.offset))
    return LoadPlan(features=selected, uses=uses, bindings=tuple(needed.values()), objects=ordered)
