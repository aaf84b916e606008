"""Sparse artifacts: a published shape converted by the real converter with every weight left as a hole of zeros
(no weight is made, read or written to disk), so a full-size model can be planned and started on a small disk.
Used by ``moe`` (the planner's expert cache at full depth) and ``start`` (a server started on a published shape).
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import zlib
from pathlib import Path

import attrs

from benchmarks.harness import GIB, plugin_host, write_source_files
from ninfer.artifact.format import (
    DEFAULT_ALIGNMENT,
    PREFIX_SIZE,
    RESOURCE_FEATURE,
    ArtifactHeader,
    Binding,
    PhysicalObject,
    Plane,
    Use,
    align_up,
    checksum_text,
    header_to_json,
    pack_prefix,
)
from ninfer.artifact.writer import ArtifactWriter, tensor_bytes

_POLY = 0xEDB88320  # CRC-32 (zlib's), bit-reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, both bit-reflected (zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial
for _ in range(63):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def zero_crc(n: int) -> int:
    """crc32 of n zero bytes in closed form: n zero bytes multiply the CRC register (which starts and ends
    inverted) by x^(8n), so a 100 GB hole costs microseconds, not a pass over 100 GB of zeros."""
    if n == 0:
        return 0
    p, k = 1 << 31, 3  # x^0; bit k of n stands for x^(2^k) = x^(8 * 2^(k-3))
    while n:
        if n & 1:
            p = _multmodp(_X2N[k], p)
        n >>= 1
        k += 1
    return _multmodp(p, 0xFFFFFFFF) ^ 0xFFFFFFFF


def zero_crcs(sizes) -> dict[int, int]:
    """crc32 of n zero bytes for every n in ``sizes``."""
    return {n: zero_crc(n) for n in set(sizes)}


class SparseArtifactWriter(ArtifactWriter):
    """The converter's writer with every weight object left as a hole of zeros; frontend resources are written.
    Same layout, header and atomic rename as ``ArtifactWriter.write``; no weight source is ever read. It keeps
    its own record of what the converter adds (through the writer's public methods); the reader validates the
    header when the artifact is opened."""

    def __init__(self, alignment: int = DEFAULT_ALIGNMENT) -> None:
        super().__init__(alignment)
        self.pending: list[tuple[PhysicalObject, object]] = []  # (object, its chunk source), in file order
        self.bindings: list[Binding] = []
        self.uses: list[Use] = []

    def add_object(self, id: str, *, feature: str, dtype: str, shape: tuple[int, ...], nbytes: int, source,
                   format: str = "dense", planes: tuple[Plane, ...] = (), block: tuple[int, ...] | None = None
                   ) -> PhysicalObject:
        obj = super().add_object(id, feature=feature, dtype=dtype, shape=shape, nbytes=nbytes, source=source,
                                 format=format, planes=planes, block=block)
        self.pending.append((obj, source))
        return obj

    def add_binding(self, binding: Binding) -> None:
        super().add_binding(binding)
        self.bindings.append(binding)

    def add_use(self, use: Use) -> None:
        super().add_use(use)
        self.uses.append(use)

    def write(self, path, *, metadata, config, features, frontend=None, progress=None, digest=None):
        path = Path(path)
        def header(objects, meta=metadata) -> ArtifactHeader:
            return ArtifactHeader(metadata=meta, config=config, features=features, alignment=self.alignment,
                                  data_size=self.data_size, objects=objects, bindings=tuple(self.bindings),
                                  uses=tuple(self.uses), frontend=frontend)

        draft = header(tuple(obj for obj, _ in self.pending))
        header_len = len(header_to_json(draft))
        data_start = align_up(PREFIX_SIZE + header_len, self.alignment)
        zeros = zero_crcs(obj.nbytes for obj, _ in self.pending if obj.feature != RESOURCE_FEATURE)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                final = []
                for obj, source in self.pending:
                    crc = zeros.get(obj.nbytes, 0)
                    if obj.feature == RESOURCE_FEATURE:
                        data = b"".join(bytes(c if isinstance(c, bytes | bytearray | memoryview) else tensor_bytes(c))
                                        for c in source())
                        f.seek(data_start + obj.offset)
                        f.write(data)
                        crc = zlib.crc32(data)
                    final.append(attrs.evolve(obj, checksum=checksum_text(crc)))
                f.truncate(data_start + self.data_size)  # the rest is a hole: zeros on read, no disk
                meta = metadata if digest is None else attrs.evolve(metadata, source_digest=digest(tuple(final)))
                raw = header_to_json(header(tuple(final), meta))
                if len(raw) != header_len:
                    raise RuntimeError(f"header length changed from {header_len} to {len(raw)}")
                f.seek(0)
                f.write(pack_prefix(header_len, zlib.crc32(raw)))
                f.write(raw)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return header(tuple(final), meta)


def sparse_shapes() -> dict[str, dict]:
    """Every shape a sparse artifact can be written for: the dense, MoE and Qwen4Exp published shapes."""
    from benchmarks.shapes import MOE_SHAPES, QWEN4EXP_SHAPES, SHAPES

    return {**SHAPES, **MOE_SHAPES, **QWEN4EXP_SHAPES}


def shape_config(shape: str) -> dict:
    shapes = sparse_shapes()
    if shape not in shapes:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(sorted(shapes))}")
    # an MTP head: --speculative mtp plans
    return dict(shapes[shape], dtype="bfloat16", mtp_num_hidden_layers=1)


def write_sparse_source(directory: Path, config: dict, shard_bytes: int = 4 * GIB, *, fp8: bool = False) -> int:
    """A checkpoint in published naming (flat text + ``mtp.*``) whose tensor data is a hole: config.json, tokenizer
    files, safetensors shards with real headers (and their index). Shards as published: one mapping of 54 GB
    is refused where memory overcommit is heuristic. The tensors are the architecture plugin's (dispatched by
    the config's ``architectures``: ``benchmarks.architectures.source_tensors``). With ``fp8`` the checkpoint is
    in Qwen's fine-grained FP8 (``fp8_tensors``). Returns the tensor bytes it declares."""
    from benchmarks.architectures import source_tensors

    write_source_files(directory, config)
    tensors = {n: (list(shape), "F32" if size == 4 else "BF16", size)
               for n, (shape, size) in source_tensors(config, ("text", "mtp")).items()}
    if fp8:
        tensors, kept = fp8_tensors(tensors)
        from ninfer_qwen35.testing.quantized_checkpoints import write_quant_config

        write_quant_config(directory, "fp8", kept)
    shards: list[dict] = [{}]
    sizes = [0]
    for name, (shape, dtype, size) in tensors.items():
        nbytes = math.prod(shape) * size
        if sizes[-1] and sizes[-1] + nbytes > shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = {"dtype": dtype, "shape": shape, "data_offsets": [sizes[-1], sizes[-1] + nbytes]}
        sizes[-1] += nbytes
    weight_map = {}
    for i, (entries, size) in enumerate(zip(shards, sizes, strict=True)):
        file = directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        raw = json.dumps({"__metadata__": {"format": "pt"}, **entries}).encode()
        raw += b" " * (-len(raw) % 8)
        with open(file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
        os.truncate(file, 8 + len(raw) + size)
        weight_map.update(dict.fromkeys(entries, file.name))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}))
    return sum(sizes)


def fp8_tensors(tensors: dict[str, tuple[list[int], str, int]]
                ) -> tuple[dict[str, tuple[list[int], str, int]], list[str]]:
    """Qwen's fine-grained FP8 release of a checkpoint's tensors ({name: (shape, safetensors dtype, element
    size)}): every linear weight and fused expert bank its releases quantize becomes e4m3 with a float32
    ``weight_scale_inv`` per 128 x 128 block (a bank's per expert); returns them and the modules kept in bf16."""
    out, kept = {}, []
    for name, (shape, dtype, size) in tensors.items():
        module = name.removesuffix(".weight")
        bank = name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) and len(shape) == 3
        linear = name.endswith(".weight") and len(shape) == 2 and not _kept_in_bf16(module)
        if not (bank or linear):
            out[name] = (shape, dtype, size)
            if name.endswith(".weight") and len(shape) == 2:
                kept.append(module)
            continue
        *lead, n, k = shape
        out[name] = (shape, "F8_E4M3", 1)
        out[f"{name}_scale_inv"] = ([*lead, -(-n // 128), -(-k // 128)], "F32", 4)
    return out, sorted(kept)


def _kept_in_bf16(module: str) -> bool:
    from ninfer_qwen35.testing.quantized_checkpoints import kept_in_bf16

    return kept_in_bf16(module)


def write_sparse_artifact(shape: str, workdir: Path, *, fp8: bool = False, **overrides) -> Path:
    """The shape's artifact through the real converter, data left as a hole (this module's docstring); with ``fp8``
    from a source in Qwen's fine-grained FP8 (imported as stored). ``overrides``: config.json fields changed from
    the shape's (e.g. ``num_hidden_layers`` for a shallower model of the same widths)."""
    import shutil

    import ninfer_convert.convert as convert

    src, out = workdir / f"{shape}-source", workdir / f"{shape}{'-fp8' if fp8 else ''}.ninfer"
    shutil.rmtree(src, ignore_errors=True)
    write_sparse_source(src, {**shape_config(shape), **overrides}, fp8=fp8)
    try:
        convert.convert_checkpoint(src, out, name=f"sparse-{shape}", host=plugin_host(), make_writer=SparseArtifactWriter)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return out

