"""Chunk crc32s computed in any order, on any thread, join into the object's crc32."""

from __future__ import annotations

import random
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from ninfer.artifact.checksum import ChunkChecksums, crc32_combine
from ninfer.artifact.format import ChecksumError, PhysicalObject, checksum_text


def test_crc32_combine_equals_the_crc_of_the_concatenation():
    rng = random.Random(0)
    for _ in range(200):
        a = rng.randbytes(rng.randrange(0, 5000))
        b = rng.randbytes(rng.randrange(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = rng.randbytes(3 << 20)
    assert crc32_combine(zlib.crc32(b"x"), zlib.crc32(big), len(big)) == zlib.crc32(b"x" + big)


def _object(data: bytes, checksum: str | None = None) -> PhysicalObject:
    return PhysicalObject(id="w", feature="text", format="bytes", dtype="u8", shape=(len(data),), offset=0,
                          nbytes=len(data), checksum=checksum or checksum_text(zlib.crc32(data)))


def _chunks(data: bytes, size: int) -> list[tuple[int, bytes]]:
    return [(pos, data[pos:pos + size]) for pos in range(0, len(data), size)]


def test_chunks_recorded_out_of_order_on_many_threads():
    rng = random.Random(1)
    data = rng.randbytes(1_000_003)
    obj = _object(data)
    chunks = _chunks(data, 4096)
    rng.shuffle(chunks)
    sums = ChunkChecksums("model.ninfer")
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda c: sums.add(obj, c[0], c[1]), chunks))
    sums.check([obj])


def test_a_mismatch_or_a_gap_names_the_object_and_the_file():
    data = bytes(range(256)) * 64
    wrong = _object(data, checksum="crc32:00000000")
    sums = ChunkChecksums("model.ninfer")
    for pos, chunk in _chunks(data, 1000):
        sums.add(wrong, pos, chunk)
    with pytest.raises(ChecksumError, match=r"model.ninfer: .*'w' is corrupted"):
        sums.check([wrong])
    gap = ChunkChecksums("model.ninfer")
    obj = _object(data)
    for pos, chunk in _chunks(data, 1000)[1:]:
        gap.add(obj, pos, chunk)
    with pytest.raises(ChecksumError, match="not read contiguously"):
        gap.check([obj])


def test_an_empty_object_verifies():
    ChunkChecksums("model.ninfer").check([_object(b"")])
