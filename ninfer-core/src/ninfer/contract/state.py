"""StateImage layout and typed KV pools that an architecture declares.

An architecture declares the fields of one request's recurrent StateImage (e.g. the
conv and recurrent state of every GDN layer); core storage keeps each slot's whole
image contiguous, and the Host copy uses the same internal layout. Growing history
(attention K/V) lives in typed paged KV pools instead.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import attrs
from attrs import validators as v

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int32": 4, "int64": 8, "uint8": 1}


def dtype_bytes(dtype: str) -> int:
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unsupported state dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}") from None


@attrs.frozen(kw_only=True)
class StateField:
    """One typed field of a StateImage: ``layers`` copies of a ``shape`` tensor of ``dtype``.

    ``per_step`` marks fields that need one copy per provisional (draft) step, so a
    speculative backend can keep every step's state until the commit boundary.
    """

    name: str
    dtype: str = attrs.field(validator=v.in_(tuple(_DTYPE_BYTES)))
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    layers: int = attrs.field(validator=v.ge(1))
    per_step: bool = False

    @property
    def nbytes_per_layer(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)


@attrs.frozen(kw_only=True)
class StateImageLayout:
    """The fields of one slot, in order; ``steps`` copies of the per-step fields (1 without drafting)."""

    fields: tuple[StateField, ...] = attrs.field(converter=tuple)
    steps: int = attrs.field(default=1, validator=v.ge(1))

    @fields.validator
    def _unique(self, attribute, value):
        names = [f.name for f in value]
        if len(names) != len(set(names)):
            raise ValueError(f"duplicate StateImage field names: {names}")

    def field(self, name: str) -> StateField:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"StateImage has no field {name!r}")

    def copies(self, f: StateField) -> int:
        return self.steps if f.per_step else 1

    def offsets(self) -> dict[str, int]:
        """Byte offset of each field inside one slot (fields 256-byte aligned for vector loads)."""
        out, pos = {}, 0
        for f in self.fields:
            out[f.name] = pos
            pos += _align(f.nbytes_per_layer * f.layers * self.copies(f), 256)
        return out

    @property
    def nbytes_per_slot(self) -> int:
        return sum(_align(f.nbytes_per_layer * f.layers * self.copies(f), 256) for f in self.fields)


def _dims(instance, attribute, value: tuple[int, ...]) -> None:
    if not all(isinstance(d, int) and d >= 1 for d in value):
        raise ValueError(f"{type(instance).__name__} {attribute.name} must be positive ints, got {value}")


@attrs.frozen(kw_only=True)
class PagedField:
    """A per-token tensor kept beside K/V in a paged pool (e.g. an indexer's raw keys): ``layers`` copies of a
    ``shape`` tensor of ``dtype`` per token position, addressed by the pool's page ids (so copy-on-write, host
    copies and restores carry it with the K/V of the same positions)."""

    name: str = attrs.field(validator=v.min_len(1))
    layers: int = attrs.field(validator=v.ge(1))
    shape: tuple[int, ...] = attrs.field(converter=tuple, validator=_dims)
    dtype: str = attrs.field(validator=v.in_(tuple(_DTYPE_BYTES)))

    @property
    def nbytes_per_token(self) -> int:
        return self.layers * math.prod(self.shape) * dtype_bytes(self.dtype)


def _unique_aux(instance, attribute, value: tuple[PagedField, ...]) -> None:
    if not all(isinstance(f, PagedField) for f in value):
        raise ValueError(f"KVPoolSpec aux must hold PagedFields, got {value}")
    names = [f.name for f in value]
    if len(names) != len(set(names)):
        raise ValueError(f"duplicate paged field names: {names}")


@attrs.frozen(kw_only=True)
class KVPoolSpec:
    """A typed paged KV pool: ``layers`` attention layers sharing page ids and one token frontier, and ``aux``
    fields paged with them."""

    name: str
    layers: int = attrs.field(validator=v.ge(1))
    kv_heads: int = attrs.field(validator=v.ge(1))
    head_dim: int = attrs.field(validator=v.ge(1))
    dtype: str = attrs.field(default="bfloat16", validator=v.in_(tuple(_DTYPE_BYTES)))
    page_size: int = attrs.field(default=16, validator=v.ge(1))
    aux: tuple[PagedField, ...] = attrs.field(default=(), converter=tuple, validator=_unique_aux)

    @property
    def nbytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes(self.dtype) + \
            sum(f.nbytes_per_token for f in self.aux)

    @property
    def nbytes_per_page(self) -> int:
        return self.nbytes_per_token * self.page_size


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@runtime_checkable
class ResumeState(Protocol):
    """What ``Program.pause`` hands the engine for a paused sequence: an owning token, opaque to the engine, that
    only the Program that made it resumes, demotes or discards (exactly once)."""

    @property
    def program_id(self) -> int:
        """The Program that made it (another Program refuses it)."""

    @property
    def host_bytes(self) -> int:
        """Host memory it holds (a Snapshot's copies; 0 for a Replay of the ledger alone)."""
