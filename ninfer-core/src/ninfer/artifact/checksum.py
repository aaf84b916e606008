"""Object checksums verified while a load reads: crc32 per chunk, on any thread, combined in file order.

A load reads an object in chunks, in parallel and out of order. Each chunk's crc32 is computed right
after it is read (``zlib.crc32`` releases the GIL on large buffers, so this overlaps the other reads);
``check`` then joins the chunk crcs of each object in order (``crc32_combine``) and compares the result
with the header's ``crc32:<hex>``. Joining costs a few hundred integer operations per chunk, so the
whole-object crc never needs the bytes again.
"""

from __future__ import annotations

import threading
import zlib
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from ninfer.artifact.format import ChecksumError, PhysicalObject, checksum_text

_POLY = 0xEDB88320  # the reflected crc32 polynomial zlib uses


def _apply(matrix: list[int], vector: int) -> int:
    """Multiply a 32x32 GF(2) matrix (one int per column) by a 32-bit vector."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: list[int]) -> list[int]:
    return [_apply(matrix, column) for column in matrix]


def _zero_byte_operators() -> list[list[int]]:
    """``ops[k]`` advances a crc32 register over 2**k zero bytes (k = 0..63)."""
    one_bit = [_POLY] + [1 << n for n in range(31)]  # one zero bit shifted through the register
    op = _square(_square(_square(one_bit)))          # 8 bits: one zero byte
    ops = [op]
    for _ in range(63):
        op = _square(op)
        ops.append(op)
    return ops


_OPS: list[list[int]] | None = None
_OPS_LOCK = threading.Lock()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(a + b) from crc32(a), crc32(b) and len(b), without the bytes."""
    global _OPS
    if _OPS is None:
        with _OPS_LOCK:
            if _OPS is None:
                _OPS = _zero_byte_operators()
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _apply(_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def mismatch(path: str | Path, obj: PhysicalObject, got: str) -> ChecksumError:
    """The error for an object whose bytes do not match the header (names the object and the artifact)."""
    what = "Frontend resource" if obj.format == "bytes" else f"{obj.feature} weight object"
    return ChecksumError(f"{path}: {what} {obj.id!r} is corrupted: checksum {got} != recorded {obj.checksum} "
                         f"(re-convert or re-copy the artifact; verify=False / --no-verify loads it anyway)")


def check_bytes(path: str | Path, obj: PhysicalObject, data) -> None:
    """Verify one object read whole (a Frontend resource)."""
    got = checksum_text(zlib.crc32(data))
    if got != obj.checksum:
        raise mismatch(path, obj, got)


class ChunkChecksums:
    """The crc32 of every chunk a load read, by object; thread-safe."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self._chunks: dict[str, dict[int, tuple[int, int]]] = defaultdict(dict)
        self._lock = threading.Lock()

    def add(self, obj: PhysicalObject, pos: int, data) -> None:
        """Record bytes [pos, pos + len(data)) of ``obj`` as read (computes their crc32)."""
        crc = zlib.crc32(data)
        with self._lock:
            self._chunks[obj.id][pos] = (len(data), crc)

    def check(self, objects: Iterable[PhysicalObject]) -> None:
        """Every object read whole and matching its checksum; raises ChecksumError naming the first bad one."""
        for obj in objects:
            with self._lock:
                chunks = sorted(self._chunks.get(obj.id, {}).items())
            crc, end = 0, 0
            for pos, (n, part) in chunks:
                if pos != end:
                    raise ChecksumError(f"{self.path}: object {obj.id!r} was not read contiguously "
                                        f"(chunk at {pos}, expected {end})")
                crc = crc32_combine(crc, part, n)
                end += n
            if end != obj.nbytes:
                raise ChecksumError(f"{self.path}: object {obj.id!r} was read up to byte {end} of {obj.nbytes}")
            got = checksum_text(crc)
            if got != obj.checksum:
                raise mismatch(self.path, obj, got)
