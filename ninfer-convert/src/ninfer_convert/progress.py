"""A one-line progress display on stderr (no dependency): bytes done, percentage and rate."""

from __future__ import annotations

import sys
import time


class ProgressLine:
    def __init__(self, label: str, stream=None, interval: float = 0.25) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.interval = interval
        self.start = time.perf_counter()
        self._last = 0.0
        self._shown = False

    def update(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self._last < self.interval and done < total:
            return
        self._last = now
        rate = done / max(now - self.start, 1e-9) / 1e9
        pct = 100.0 * done / total if total else 100.0
        self.stream.write(f"\r{self.label}: {done / 1e9:8.3f} / {total / 1e9:.3f} GB {pct:5.1f}% {rate:6.2f} GB/s")
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
