"""Write a .ninfer v3 file atomically (temporary file in the target folder, then rename).

Objects are added with their size and a chunk source; the writer lays them out aligned, streams the
chunks, checks the byte count, computes each crc32 on the way and writes the header last (its
checksums are fixed-width, so its length is known before the data is written).
"""

from __future__ import annotations

import os
import tempfile
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from ninfer.artifact.format import (
    DEFAULT_ALIGNMENT,
    PREFIX_SIZE,
    ArtifactError,
    ArtifactHeader,
    Binding,
    FrontendSection,
    Metadata,
    PhysicalObject,
    Plane,
    Use,
    align_up,
    checksum_text,
    header_to_json,
    pack_prefix,
    quantized_layout,
)

Chunk = bytes | bytearray | memoryview
ChunkSource = Callable[[], Iterable[Any]]  # yields bytes-like objects or CPU torch tensors
Progress = Callable[[int, int], None]  # (bytes written so far, total bytes)

_PLACEHOLDER = checksum_text(0)


def tensor_bytes(t: Any) -> memoryview:
    """A CPU tensor's raw bytes without conversion (bf16 stays bf16)."""
    import torch

    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


@attrs.define
class _Pending:
    obj: PhysicalObject
    source: ChunkSource


class ArtifactWriter:
    """Collects objects, bindings and uses, then ``write()`` produces the file in one pass."""

    def __init__(self, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if alignment < 64 or alignment & (alignment - 1):
            raise ValueError(f"alignment {alignment} must be a power of two >= 64")
        self.alignment = alignment
        self._objects: dict[str, _Pending] = {}
        self._bindings: dict[str, Binding] = {}
        self._uses: list[Use] = []
        self._end = 0

    def add_object(self, id: str, *, feature: str, dtype: str, shape: tuple[int, ...], nbytes: int,
                   source: ChunkSource, format: str = "dense", planes: tuple[Plane, ...] = (),
                   block: tuple[int, ...] | None = None) -> PhysicalObject:
        if id in self._objects:
            raise ArtifactError(f"object {id!r} added twice")
        offset = align_up(self._end, self.alignment)
        obj = PhysicalObject(id=id, feature=feature, format=format, dtype=dtype, shape=tuple(shape),
                             offset=offset, nbytes=nbytes, checksum=_PLACEHOLDER, planes=planes, block=block)
        self._objects[id] = _Pending(obj, source)
        self._end = offset + nbytes
        return obj

    def add_quantized_object(self, id: str, *, feature: str, format: str, shape: tuple[int, ...],
                             block: tuple[int, int], planes: Callable[[], Iterable[Iterable[Any]]]) -> PhysicalObject:
        """A quantized object (``format.quantized_layout``): ``planes()`` yields, per plane in the format's order,
        that plane's chunks (bytes-like or CPU tensors); the writer pads between planes and checks each plane's
        size. One checksum covers the whole object."""
        try:
            layout = quantized_layout(format, tuple(shape), tuple(block))
        except ArtifactError as exc:
            raise ArtifactError(f"object {id!r}: {exc}") from None

        def source() -> Iterable[Any]:
            pos = 0
            per_plane = iter(planes())
            for plane in layout:
                chunks = next(per_plane, None)
                if chunks is None:
                    raise ArtifactError(f"object {id!r}: its source gave no {plane.name} plane")
                if plane.offset > pos:
                    yield bytes(plane.offset - pos)
                got = 0
                for chunk in chunks:
                    buf = chunk if isinstance(chunk, bytes | bytearray | memoryview) else tensor_bytes(chunk)
                    got += memoryview(buf).nbytes
                    if got > plane.nbytes:
                        break
                    yield buf
                if got != plane.nbytes:
                    raise ArtifactError(f"object {id!r}: plane {plane.name} {plane.dtype}{list(plane.shape)} needs "
                                        f"{plane.nbytes} bytes, its source gave {'more' if got > plane.nbytes else got}")
                pos = plane.offset + got
            if next(per_plane, None) is not None:
                raise ArtifactError(f"object {id!r}: its source gave more planes than {format} has")

        return self.add_object(id, feature=feature, dtype=layout[0].dtype, shape=shape, format=format,
                               nbytes=layout[-1].offset + layout[-1].nbytes, planes=layout, block=tuple(block),
                               source=source)

    def add_resource(self, id: str, data: bytes, *, feature: str = "frontend") -> PhysicalObject:
        return self.add_object(id, feature=feature, format="bytes", dtype="u8", shape=(len(data),),
                               nbytes=len(data), source=lambda: (data,))

    def add_binding(self, binding: Binding) -> None:
        if binding.name in self._bindings:
            raise ArtifactError(f"binding {binding.name!r} added twice")
        self._bindings[binding.name] = binding

    def add_use(self, use: Use) -> None:
        self._uses.append(use)

    @property
    def data_size(self) -> int:
        return self._end

    def write(self, path: str | os.PathLike[str], *, metadata: Metadata, config: dict[str, Any],
              features: tuple[str, ...], frontend: FrontendSection | None = None,
              progress: Progress | None = None,
              digest: Callable[[tuple[PhysicalObject, ...]], str] | None = None) -> ArtifactHeader:
        """Write everything to ``path`` atomically; on any failure no file (partial or temporary) remains.

        ``digest`` (optional) computes ``metadata.source_digest`` from the final objects (with checksums);
        it must return a string as long as the placeholder in ``metadata``.
        """
        path = Path(path)

        def header(objects, meta: Metadata = metadata) -> ArtifactHeader:
            return ArtifactHeader(metadata=meta, config=config, features=features, alignment=self.alignment,
                                  data_size=self._end, objects=objects, bindings=tuple(self._bindings.values()),
                                  uses=tuple(self._uses), frontend=frontend)

        draft = header(tuple(p.obj for p in self._objects.values()))
        from ninfer.artifact.reader import _validate

        _validate(draft, path)  # catch a bad binding or use before writing gigabytes
        header_len = len(header_to_json(draft))
        data_start = align_up(PREFIX_SIZE + header_len, self.alignment)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
        try:
            with os.fdopen(fd, "wb") as f, ThreadPoolExecutor(max_workers=1) as crc_pool:
                final = []
                done, payload = 0, sum(p.obj.nbytes for p in self._objects.values())
                for pending in self._objects.values():
                    obj = pending.obj
                    f.seek(data_start + obj.offset)
                    crc, written = 0, 0
                    for chunk in pending.source():
                        buf = chunk if isinstance(chunk, bytes | bytearray | memoryview) else tensor_bytes(chunk)
                        buf = memoryview(buf).cast("B")
                        if written + len(buf) > obj.nbytes:
                            raise ArtifactError(f"object {obj.id!r}: source gave more than {obj.nbytes} bytes")
                        pending_crc = crc_pool.submit(zlib.crc32, buf, crc)  # overlaps the write (both drop the GIL)
                        f.write(buf)
                        crc = pending_crc.result()
                        written += len(buf)
                        done += len(buf)
                        if progress is not None:
                            progress(done, payload)
                    if written != obj.nbytes:
                        raise ArtifactError(f"object {obj.id!r}: source gave {written} bytes, expected {obj.nbytes}")
                    final.append(attrs.evolve(obj, checksum=checksum_text(crc)))
                f.truncate(data_start + self._end)
                meta = metadata if digest is None else attrs.evolve(metadata, source_digest=digest(tuple(final)))
                result = header(tuple(final), meta)
                raw = header_to_json(result)
                if len(raw) != header_len:  # fixed-width checksums keep the length; guard anyway
                    raise ArtifactError(f"internal: header length changed from {header_len} to {len(raw)}")
                f.seek(0)
                f.write(pack_prefix(header_len, zlib.crc32(raw)))
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; an artifact is a shareable product file
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return result
