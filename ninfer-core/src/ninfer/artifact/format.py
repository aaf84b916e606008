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

from ninfer.contract.quant import FP8_BLOCK, NVFP4, NVFP4_GROUP

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

# Object formats. dense: one plane, dtype x shape. bytes: an opaque resource (UTF-8 text, ...). The quantized
# formats (ninfer.contract.quant defines them) are planes back to back in one object; shape is the logical
# [N, K] (or [E, N, K] for a bank of experts, every plane then with a leading E):
# fp8_e4m3_block: data f8_e4m3 [N, K] + scale f32 [ceil(N/b0), ceil(K/b1)], W = data * scale per block.
# nvfp4: data u8 [N, K/2] (e2m1 pairs, the even element in the low nibble) + scale f8_e4m3 [N, K/16]
#        + global_scale f32 [N] (one per row: fused shards keep their own), W = e2m1 * scale * global_scale.
FORMATS = ("dense", "bytes", FP8_BLOCK, NVFP4)
QUANTIZED_PLANES = {FP8_BLOCK: ("data", "scale"), NVFP4: ("data", "scale", "global_scale")}
# Where a writer starts each plane inside its object: wide enough for any load on any device.
PLANE_ALIGNMENT = 256

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
    # How the weights were quantized, when they were: {"method": ..., "formats": {format: weights}, "dense": {name:
    # why it stayed unquantized}, "notes": [...]} (the objects' own formats are the authority).
    quantization: dict[str, Any] | None = None


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


def quantized_layout(format: str, shape: tuple[int, ...], block: tuple[int, ...] | None,
                     alignment: int = PLANE_ALIGNMENT) -> tuple[Plane, ...]:
    """The planes a ``format`` object of logical ``shape`` holds, each starting ``alignment``-aligned after the
    previous one. Raises ArtifactError when the shape or block does not fit the format."""
    problem = _layout_problem(format, shape, block)
    if problem:
        raise ArtifactError(problem)
    *lead, n, k = shape
    lead = tuple(lead)
    if format == FP8_BLOCK:
        b0, b1 = block
        specs = [("data", "f8_e4m3", (*lead, n, k)), ("scale", "f32", (*lead, -(-n // b0), -(-k // b1)))]
    else:
        specs = [("data", "u8", (*lead, n, k // 2)), ("scale", "f8_e4m3", (*lead, n, k // NVFP4_GROUP)),
                 ("global_scale", "f32", (*lead, n))]
    planes, pos = [], 0
    for name, dtype, dims in specs:
        pos = align_up(pos, alignment)
        planes.append(Plane(name=name, dtype=dtype, shape=dims, offset=pos, nbytes=dense_nbytes(dtype, dims)))
        pos += planes[-1].nbytes
    return tuple(planes)


def _layout_problem(format: str, shape: tuple[int, ...], block: tuple[int, ...] | None) -> str | None:
    if format not in QUANTIZED_PLANES:
        return f"{format!r} is not a quantized format ({', '.join(QUANTIZED_PLANES)})"
    if len(shape) not in (2, 3):
        return f"a {format} weight is [N, K] or a bank [E, N, K], not {list(shape)}"
    if block is None or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        return f"a {format} weight needs a block of two positive sizes, got {block!r}"
    if format == NVFP4 and (tuple(block) != (1, NVFP4_GROUP) or shape[-1] % NVFP4_GROUP):
        return (f"an nvfp4 weight has block [1, {NVFP4_GROUP}] and an input width that is a multiple of "
                f"{NVFP4_GROUP}, got block {list(block)} and shape {list(shape)}")
    return None


def quantized_object_problem(o: PhysicalObject) -> str | None:
    """What is wrong with a quantized object's planes, or None: plane names, dtypes and shapes follow from the
    format, logical shape and block; offsets are in order, aligned for their dtype and inside the object."""
    problem = _layout_problem(o.format, o.shape, o.block)
    if problem:
        return problem
    want = quantized_layout(o.format, o.shape, o.block)
    if o.dtype != want[0].dtype:
        return f"dtype {o.dtype!r} is not its data plane's {want[0].dtype!r}"
    got = [(p.name, p.dtype, p.shape) for p in o.planes]
    if got != [(p.name, p.dtype, p.shape) for p in want]:
        expected = ", ".join(f"{p.name} {p.dtype}{list(p.shape)}" for p in want)
        return (f"has planes {', '.join(f'{n} {d}{list(s)}' for n, d, s in got) or 'none'}; shape "
                f"{list(o.shape)} with block {list(o.block)} needs {expected}")
    end = 0
    for p in o.planes:
        if p.nbytes != dense_nbytes(p.dtype, p.shape) or p.offset < end or p.offset + p.nbytes > o.nbytes:
            return f"plane {p.name!r} at [{p.offset}, {p.offset + p.nbytes}) overlaps another or runs past the " \
                   f"object ({o.nbytes} bytes)"
        if p.offset % DTYPE_SIZES[p.dtype]:
            return f"plane {p.name!r} at offset {p.offset} is misaligned for {p.dtype}"
        end = p.offset + p.nbytes
    return None
