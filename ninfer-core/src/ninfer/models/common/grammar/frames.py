"""Length-prefixed pickle frames between the engine's process and its compile workers (over their stdin/stdout).

Each frame is an 8-byte big-endian length, then that many bytes of pickle. Only the engine's own process and
the workers it started speak on these pipes, so unpickling is no trust boundary. The reader on the engine's
side never blocks past a deadline: ``FrameReader.poll`` waits at most ``timeout`` seconds for bytes.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
from typing import Any, BinaryIO

_HEADER = struct.Struct(">Q")
MAX_FRAME = 1 << 30  # far above any message; a larger length means the stream is corrupt


class WorkerGone(EOFError):
    """The other side closed its pipe (the worker exited or was killed)."""


def write_frame(stream: BinaryIO, message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def read_frame(stream: BinaryIO) -> Any:
    """The next frame (blocking): the worker's side, on an unbuffered stream (so ``select`` on it is exact)."""
    header = _read_exactly(stream, _HEADER.size)
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME:
        raise WorkerGone(f"frame of {length} bytes: the stream is corrupt")
    return pickle.loads(_read_exactly(stream, length))


def _read_exactly(stream: BinaryIO, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            raise WorkerGone("the pipe closed")
        data += chunk
    return bytes(data)


class FrameReader:
    """Frames from a pipe's file descriptor, read without blocking past a deadline (the engine's side)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = bytearray()

    def poll(self, timeout: float) -> Any | None:
        """The next whole frame, or None when none arrived within ``timeout`` seconds; WorkerGone at EOF."""
        frame = self._take()
        if frame is not None:
            return frame[0]
        readable, _, _ = select.select([self._fd], [], [], max(0.0, timeout))
        if not readable:
            return None
        while True:
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                raise WorkerGone("the worker closed its pipe")
            self._buf += chunk
            frame = self._take()
            if frame is not None:
                return frame[0]
            readable, _, _ = select.select([self._fd], [], [], 0)
            if not readable:
                return None

    def _take(self) -> tuple[Any] | None:
        if len(self._buf) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self._buf)
        if length > MAX_FRAME:
            raise WorkerGone(f"frame of {length} bytes: the stream is corrupt")
        end = _HEADER.size + length
        if len(self._buf) < end:
            return None
        body = bytes(self._buf[_HEADER.size:end])
        del self._buf[:end]
        return (pickle.loads(body),)
