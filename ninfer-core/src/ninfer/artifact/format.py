"""The .ninfer v3 container: framing constants, header records (attrs) and their JSON form (cattrs).

Layout (docs/artifact-v3.md is the specification):

    prefix (32 bytes)  magic | version u32 | flags u32 | header_len u64 | header crc32 u32 | reserved u32
    header             UTF-8 JSON of ArtifactHeader, header_len bytes (may end in spaces)
    padding            zeros up to data_start = align_up(32 + header_len, header.alignment)
    data               raw object bytes; object offsets are relative to data_start and aligned

Nothing here imports torch: inspecting a file needs only the header.
"""

from __future__ import annotations

import json
import math
import re
import struct
from typing import Any

import attrs
import cattrs
from attrs import validators as v

MAGIC = b"\x89NINFER\n"
VERSION = 3
PREFIX = struct.Struct("<8sIIQII")
PREFIX_SIZE = PREFIX.size  # 32
DEFAULT_ALIGNMENT = 4096
MAX_HEADER_BYTES = 1 << 30

# Model features an artifact may hold; "text" is required. Frontend resources use the "frontend" feature.
FEATURES = ("text", "vision", "mtp", "dflash")
RESOURCE_FEATURE = "frontend"

# Storage dtypes: name -> bytes per element (sub-byte formats are described by planes).
DTYPE_SIZES = {"bool": 1, "u8": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "f16": 2, "bf16": 2, "f32": 4,
               "f64": 8, "f8_e4m3": 1, "f8_e5m2": 1}

# Object formats. dense: one plane, dtype x shape. bytes: an opaque resource (UTF-8 text, ...).
# fp8_e4m3_block: data f8_e4m3 [out, in] + scale f32 [ceil(out/b0), ceil(in/b1)], W = data * scale per block.
# nvfp4: data u8 [out, in/2] (e2m1 pairs, first element in the low nibble) + scale f8_e4m3 [out, in/16]
#        + global_scale f32 [1], W = e2m1 * scale * global_scale.
FORMATS = ("dense", "bytes", "fp8_e4m3_block", "nvfp4")
QUANTIZED_PLANES = {"fp8_e4m3_block": ("data", "scale"), "nvfp4": ("data", "scale", "global_scale")}

_CHECKSUM = re.compile(r"^crc32:[0-9a-f]{8}$")


class ArtifactError(ValueError):
    """The file is not a valid .ninfer v3 artifact, or a request does not fit it (message names what)."""


class ChecksumError(ArtifactError):
    """An object's bytes do not match its recorded checksum."""


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value)


def _dims(instance: Any, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise ValueError(f"{attribute.name} must be non-negative integers, got {value!r}")


@attrs.frozen(kw_only=True)
class Metadata:
    """Who made the artifact and from what. ``name`` is the public instance name (serve can alias it)."""

    name: str = attrs.field(validator=v.min_len(1))
    architecture: str = attrs.field(validator=v.min_len(1))  # Hugging Face string, e.g. "Qwen3_5ForCausalLM"
    converter: str = "ninfer-convert"
    converter_version: str = "0"
    source_digest: str = ""  # "blake2b:<hex>" over config.json and every source tensor (name, dtype, shape, crc)
    source: str | None = None  # free text, e.g. the checkpoint directory name


@attrs.frozen(kw_only=True)
class Plane:
    """One component of a quantized object (data, block scales, global scale), at ``offset`` in the object."""

    name: str
    dtype: str = attrs.field(validator=v.in_(DTYPE_SIZES))
    shape: tuple[int, ...] = attrs.field(converter=_shape, validator=_dims)
    offset: int = attrs.field(validator=v.ge(0))
    nbytes: int = attrs.field(validator=v.ge(0))


@attrs.frozen(kw_only=True)
class PhysicalObject:
    """A run of raw bytes in the data region: one stored tensor (maybe a fused parent) or a resource."""

    id: str = attrs.field(validator=v.min_len(1))
    feature: str
    format: str = attrs.field(validator=v.in_(FORMATS))
    dtype: str = attrs.field(validator=v.in_(DTYPE_SIZES))  # element dtype (of the data plane if quantized)
    shape: tuple[int, ...] = attrs.field(converter=_shape, validator=_dims)  # logical shape
    offset: int = attrs.field(validator=v.ge(0))  # from data_start
    nbytes: int = attrs.field(validator=v.ge(0))
    checksum: str = attrs.field(validator=v.matches_re(_CHECKSUM))
    planes: tuple[Plane, ...] = attrs.field(default=(), converter=tuple)
    block: tuple[int, ...] | None = None  # scale block of block-scaled formats, e.g. (128, 128) or (1, 16)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@attrs.frozen(kw_only=True)
class Binding:
    """A logical parameter: the whole of ``object`` or rows ``rows`` (dim 0) of it; ``plane`` for raw planes."""

    name: str = attrs.field(validator=v.min_len(1))
    feature: str
    object: str
    shape: tuple[int, ...] = attrs.field(converter=_shape, validator=_dims)
    rows: tuple[int, int] | None = None
    plane: str | None = None


@attrs.frozen(kw_only=True)
class Use:
    """One use site of a binding. A tied lm_head is a second Use of the embedding, not a second copy."""

    site: str
    feature: str
    binding: str


@attrs.frozen(kw_only=True)
class FrontendSection:
    """Frontend resources: large texts are ``bytes`` objects (by id); small facts live in the header."""

    tokenizer: str  # object id of tokenizer.json
    chat_template: str | None = None  # object id of the Jinja chat template
    generation_config: dict[str, Any] = attrs.field(factory=dict)
    special_tokens: dict[str, int] = attrs.field(factory=dict)
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    embedding_vocab: int | None = None
    media: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class ArtifactHeader:
    format: str = attrs.field(default="ninfer", validator=v.in_(("ninfer",)))
    version: int = VERSION
    metadata: Metadata
    config: dict[str, Any]
    features: tuple[str, ...] = attrs.field(converter=tuple)
    alignment: int = DEFAULT_ALIGNMENT
    data_size: int = attrs.field(validator=v.ge(0))
    objects: tuple[PhysicalObject, ...] = attrs.field(converter=tuple)
    bindings: tuple[Binding, ...] = attrs.field(converter=tuple)
    uses: tuple[Use, ...] = attrs.field(converter=tuple)
    frontend: FrontendSection | None = None

    def object_map(self) -> dict[str, PhysicalObject]:
        return {o.id: o for o in self.objects}

    def binding_map(self) -> dict[str, Binding]:
        return {b.name: b for b in self.bindings}


_converter = cattrs.Converter(forbid_extra_keys=True)


def header_to_json(header: ArtifactHeader) -> bytes:
    return json.dumps(_converter.unstructure(header), separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def header_from_json(raw: bytes) -> ArtifactHeader:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ArtifactError("header JSON is not an object")
    if data.get("version") != VERSION:
        raise ArtifactError(f"header says version {data.get('version')!r}; this reader understands {VERSION}")
    try:
        return _converter.structure(data, ArtifactHeader)
    except Exception as exc:  # cattrs raises exception groups; name every failing field
        detail = "; ".join(cattrs.transform_error(exc, path="header", format_exception=_describe)) if isinstance(
            exc, cattrs.BaseValidationError) else str(exc)
        raise ArtifactError(f"invalid header: {detail}") from None


def _describe(exc: BaseException, type_: Any) -> str:
    from cattrs.v import format_exception

    return str(exc) if isinstance(exc, ValueError) and str(exc) else format_exception(exc, type_)


def pack_prefix(header_len: int, header_crc: int) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, 0, header_len, header_crc, 0)


def checksum_text(crc: int) -> str:
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


def dense_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return DTYPE_SIZES[dtype] * math.prod(shape)
