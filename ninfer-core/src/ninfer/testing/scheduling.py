"""Engine test helpers that take thread scheduling out of a test's outcome."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ninfer.contract.request import GenerationRequest
    from ninfer.engine.engine import Engine
    from ninfer.engine.handle import GenerationHandle


def submit_together(engine: Engine, requests: Sequence[GenerationRequest]) -> list[GenerationHandle]:
    """Submit ``requests`` from the engine's worker, between two of its cycles, and return their handles.

    Submitted one by one from the test's thread, the first requests may run (even finish) before the last
    arrive, depending on how promptly that thread is scheduled. Submitted together, the scheduler sees all
    of them at its next cycle, so what it does (batching, pauses, Snapshot revocations) is a function of
    the workload alone.
    """
    return engine._core.on_worker(lambda: [engine.submit(r) for r in requests])
