"""Open a .ninfer file: mmap it, validate framing, bounds, overlaps and references; never unpickle.

Every access to object bytes goes through ``Artifact.object_buffer`` or ``read_into`` so that
``bytes_read`` counts exactly what a load touched, per feature. With ``verify`` (the default) every
object a load reads is checked against its checksum: weights by the Materializer as it reads them,
Frontend resources here, when they are read.
"""

from __future__ import annotations

import mmap
import os
import threading
import zlib
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ninfer.artifact.checksum import check_bytes, mismatch
from ninfer.artifact.format import (
    FEATURES,
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    PREFIX_SIZE,
    RESOURCE_FEATURE,
    VERSION,
    ArtifactError,
    ArtifactHeader,
    ChecksumError,
    PhysicalObject,
    align_up,
    checksum_text,
    dense_nbytes,
    header_from_json,
    quantized_object_problem,
)

if TYPE_CHECKING:
    from ninfer.contract.resources import FrontendResources

_CRC_CHUNK = 64 << 20


class Artifact:
    """An open, validated .ninfer file. Use as a context manager or call ``close()``.

    ``verify``: check the checksum of every object a load reads (``load_weights``, ``frontend``).
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True) -> None:
        self.path = Path(path)
        self.verify_on_load = verify
        self._file = None
        self._mm: mmap.mmap | None = None
        self.bytes_read: dict[str, int] = defaultdict(int)
        self._count_lock = threading.Lock()
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115 - owned until close()
        except OSError as exc:
            raise ArtifactError(f"cannot open artifact {self.path}: {exc.strerror}") from None
        try:
            self.file_size = os.fstat(self._file.fileno()).st_size
            self.header, self.data_start = self._read_header()
            _validate(self.header, self.path)
            expected = self.data_start + self.header.data_size
            if self.file_size < expected:
                raise ArtifactError(f"{self.path} is truncated: {self.file_size} bytes, the header describes "
                                    f"{expected}")
            if self.file_size > expected:
                raise ArtifactError(f"{self.path} has {self.file_size - expected} trailing bytes after the data "
                                    f"region ({expected} expected)")
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self.file_size else None
        except BaseException:
            self.close()
            raise
        self.objects = self.header.object_map()
        self.bindings = self.header.binding_map()

    # -- framing -------------------------------------------------------------------------------------
    def _read_header(self) -> tuple[ArtifactHeader, int]:
        prefix = self._file.read(PREFIX_SIZE)
        if len(prefix) < PREFIX_SIZE:
            if prefix and not MAGIC.startswith(prefix[:len(MAGIC)]):
                raise ArtifactError(f"{self.path} is not a .ninfer artifact (wrong magic {prefix[:8]!r})")
            raise ArtifactError(f"{self.path} is truncated: {len(prefix)} bytes, shorter than the "
                                f"{PREFIX_SIZE}-byte prefix")
        magic, version, flags, header_len, header_crc, reserved = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise ArtifactError(f"{self.path} is not a .ninfer artifact (wrong magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise ArtifactError(f"{self.path} is .ninfer version {version}; this reader understands version "
                                f"{VERSION} (re-convert the checkpoint)")
        if flags or reserved:
            raise ArtifactError(f"{self.path}: unknown prefix flags {flags:#x} / reserved {reserved:#x}")
        if header_len == 0 or header_len > MAX_HEADER_BYTES or PREFIX_SIZE + header_len > self.file_size:
            raise ArtifactError(f"{self.path}: header length {header_len} does not fit the {self.file_size}-byte "
                                f"file (truncated or corrupted)")
        raw = self._file.read(header_len)
        if zlib.crc32(raw) != header_crc:
            raise ChecksumError(f"{self.path}: header checksum mismatch (corrupted header)")
        header = header_from_json(raw)
        a = header.alignment
        if a < 64 or a & (a - 1):
            raise ArtifactError(f"{self.path}: header.alignment {a} is not a power of two >= 64")
        return header, align_up(PREFIX_SIZE + header_len, a)

    # -- access --------------------------------------------------------------------------------------
    @property
    def metadata(self):
        return self.header.metadata

    @property
    def config(self) -> dict:
        return self.header.config

    @property
    def features(self) -> tuple[str, ...]:
        return self.header.features

    @property
    def uses(self):
        return self.header.uses

    def object_buffer(self, obj: PhysicalObject | str) -> memoryview:
        """A zero-copy read-only view of one object's bytes; counted in ``bytes_read`` by feature."""
        if isinstance(obj, str):
            obj = self.objects[obj]
        if self._mm is None:
            if obj.nbytes == 0 and self._file is not None:
                return memoryview(b"")
            raise ArtifactError(f"artifact {self.path} is closed")
        start = self.data_start + obj.offset
        with self._count_lock:
            self.bytes_read[obj.feature] += obj.nbytes
        return memoryview(self._mm)[start:start + obj.nbytes]

    def read_into(self, obj: PhysicalObject, pos: int, out: memoryview) -> None:
        """Copy bytes [pos, pos + len(out)) of ``obj`` into ``out`` with pread (no page faults on the mapping;
        thread-safe, releases the GIL). Counted in ``bytes_read``."""
        n = len(out)
        if pos < 0 or pos + n > obj.nbytes:
            raise ArtifactError(f"read of [{pos}, {pos + n}) is outside object {obj.id!r} ({obj.nbytes} bytes)")
        if self._file is None:
            raise ArtifactError(f"artifact {self.path} is closed")
        fd, where, done = self._file.fileno(), self.data_start + obj.offset + pos, 0
        while done < n:
            got = os.preadv(fd, [out[done:]], where + done)
            if got <= 0:
                raise ArtifactError(f"{self.path} ended while reading object {obj.id!r} (file truncated?)")
            done += got
        with self._count_lock:
            self.bytes_read[obj.feature] += n

    def resource_text(self, object_id: str) -> str:
        obj = self.objects[object_id]
        with self.object_buffer(obj) as buf:
            if self.verify_on_load:
                check_bytes(self.path, obj, buf)
            try:
                return bytes(buf).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ArtifactError(f"resource {object_id!r} is not UTF-8: {exc}") from None

    @property
    def frontend(self) -> FrontendResources:
        from ninfer.contract.resources import FrontendResources

        fe = self.header.frontend
        if fe is None:
            raise ArtifactError(f"{self.path} carries no Frontend resources")
        return FrontendResources(
            tokenizer_json=self.resource_text(fe.tokenizer),
            chat_template=self.resource_text(fe.chat_template) if fe.chat_template else None,
            generation_config=dict(fe.generation_config), special_tokens=dict(fe.special_tokens),
            eos_token_ids=fe.eos_token_ids, embedding_vocab=fe.embedding_vocab,
            media=dict(fe.media) if fe.media is not None else None)

    def verify(self, objects: Iterable[PhysicalObject] | None = None, *, threads: int = 4) -> None:
        """Check object checksums (all by default); raises ChecksumError naming the first bad object."""
        todo = list(self.header.objects if objects is None else objects)

        def crc(obj: PhysicalObject) -> tuple[PhysicalObject, str]:
            value = 0
            with self.object_buffer(obj) as buf:
                for pos in range(0, obj.nbytes, _CRC_CHUNK):  # zlib releases the GIL on large buffers
                    value = zlib.crc32(buf[pos:pos + _CRC_CHUNK], value)
            return obj, checksum_text(value)

        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for obj, got in pool.map(crc, todo):
                if got != obj.checksum:
                    raise mismatch(self.path, obj, got)

    def bytes_by_feature(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for o in self.header.objects:
            out[o.feature] += o.nbytes
        return dict(out)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError as exc:
                raise ArtifactError(f"cannot close {self.path}: views of its bytes are still alive") from exc
            self._mm = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Artifact({str(self.path)!r}, name={self.metadata.name!r}, "
                f"architecture={self.metadata.architecture!r}, features={self.features})")


def open_artifact(path: str | os.PathLike[str], *, verify: bool = True) -> Artifact:
    """Open and validate a .ninfer v3 file (framing, bounds, overlaps, references, the header's crc32).

    Object checksums: with ``verify`` (default) each object is checked when a load reads it;
    ``Artifact.verify()`` checks them all now."""
    return Artifact(path, verify=verify)


def _validate(h: ArtifactHeader, path: Path) -> None:
    """Structural checks of a parsed header; each error names the object, binding or use."""
    where = str(path)
    if "text" not in h.features:
        raise ArtifactError(f"{where}: header.features {list(h.features)} lacks the required 'text'")
    unknown = [f for f in h.features if f not in FEATURES]
    if unknown or len(set(h.features)) != len(h.features):
        raise ArtifactError(f"{where}: header.features {list(h.features)} has unknown or repeated entries")
    allowed = set(h.features) | {RESOURCE_FEATURE}
    seen: set[str] = set()
    spans = []
    for o in h.objects:
        if o.id in seen:
            raise ArtifactError(f"{where}: object {o.id!r} appears twice")
        seen.add(o.id)
        if o.feature not in allowed:
            raise ArtifactError(f"{where}: object {o.id!r} has feature {o.feature!r}, not in {sorted(allowed)}")
        if o.offset % h.alignment:
            raise ArtifactError(f"{where}: object {o.id!r} offset {o.offset} is not {h.alignment}-aligned")
        if o.offset + o.nbytes > h.data_size:
            raise ArtifactError(f"{where}: object {o.id!r} bytes [{o.offset}, {o.offset + o.nbytes}) run past the "
                                f"data region ({h.data_size} bytes)")
        _check_object_size(o, where)
        if o.nbytes:
            spans.append((o.offset, o.offset + o.nbytes, o.id))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ArtifactError(f"{where}: objects {a!r} and {b!r} overlap")
    objects = h.object_map()
    names: set[str] = set()
    for b in h.bindings:
        if b.name in names:
            raise ArtifactError(f"{where}: binding {b.name!r} appears twice")
        names.add(b.name)
        o = objects.get(b.object)
        if o is None:
            raise ArtifactError(f"{where}: binding {b.name!r} refers to missing object {b.object!r}")
        if b.feature not in h.features:
            raise ArtifactError(f"{where}: binding {b.name!r} has feature {b.feature!r} not in header.features")
        _check_view(b, o, where)
    for u in h.uses:
        if u.binding not in names:
            raise ArtifactError(f"{where}: use {u.site!r} refers to missing binding {u.binding!r}")
        if u.feature not in h.features:
            raise ArtifactError(f"{where}: use {u.site!r} has feature {u.feature!r} not in header.features")
    fe = h.frontend
    if fe is not None:
        for field, oid in (("tokenizer", fe.tokenizer), ("chat_template", fe.chat_template)):
            if oid is not None and (oid not in objects or objects[oid].format != "bytes"):
                raise ArtifactError(f"{where}: frontend.{field} refers to {oid!r}, which is not a bytes object")


def _check_object_size(o: PhysicalObject, where: str) -> None:
    if o.format == "dense":
        want = dense_nbytes(o.dtype, o.shape)
        if o.nbytes != want or o.planes:
            raise ArtifactError(f"{where}: object {o.id!r} is {o.nbytes} bytes but {o.dtype}{list(o.shape)} "
                                f"needs {want}")
    elif o.format == "bytes":
        if o.dtype != "u8" or o.shape != (o.nbytes,):
            raise ArtifactError(f"{where}: bytes object {o.id!r} must be u8 of shape [{o.nbytes}]")
    else:
        problem = quantized_object_problem(o)
        if problem:
            raise ArtifactError(f"{where}: {o.format} object {o.id!r} {problem}")


def _check_view(b, o: PhysicalObject, where: str) -> None:
    if b.plane is not None:
        plane = {p.name: p for p in o.planes}.get(b.plane)
        if plane is None:
            raise ArtifactError(f"{where}: binding {b.name!r} names plane {b.plane!r} that {o.id!r} lacks")
        base = plane.shape
    else:
        base = o.shape
    if b.rows is None:
        want = base
    else:
        lo, hi = b.rows
        if not base or not 0 <= lo < hi <= base[0]:
            raise ArtifactError(f"{where}: binding {b.name!r} rows {list(b.rows)} are outside object {o.id!r} "
                                f"shape {list(base)}")
        want = (hi - lo, *base[1:])
    if tuple(b.shape) != tuple(want):
        raise ArtifactError(f"{where}: binding {b.name!r} shape {list(b.shape)} does not match its view "
                            f"{list(want)} of object {o.id!r}")
