"""Small attrs validators shared by the contracts."""

import math

import attrs


def finite(instance, attribute: attrs.Attribute, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be finite, got {value!r}")


def token_ids(instance, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"{attribute.name} must hold non-negative integer token ids, got {t!r}")
