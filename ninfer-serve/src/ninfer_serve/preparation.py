"""Where ``engine.submit`` runs: the gateway's two preparation TaskPools.

``engine.submit`` renders the template and tokenizes, which is quick; a request with a constraint also has its
grammar compiled there, and a chat with images or videos has them decoded there, which can take seconds or
more. Those heavy requests go to their own pool, so a plain request never waits behind them: the plain pool
(``--http-threads`` / ``--http-queue``) and the heavy pool (``--heavy-threads`` / ``--heavy-queue``) each have
their own threads and queue. In the heavy pool one client address holds at most ``--heavy-per-client``
places (queued and running; 429 past it) and runs at most ``--heavy-running-per-client`` of them at once (its
others wait queued while a thread is free), and a free thread takes the oldest task of the clients running
fewest, so no client can hold the whole pool or keep the others' work from starting. The heavy threads mostly
wait: a grammar compiles in the Frontend's compile worker processes and media decode on its media threads,
which bound the CPU that preparation takes (docs/constrained-decoding.md, docs/vision.md).

A client that leaves while its request is prepared sets the request's ``cancel`` event (``Engine.submit``):
a grammar compile that nobody else waits for is then killed.
"""

from __future__ import annotations

import threading
import time

import attrs

from ninfer.contract import GenerationRequest
from ninfer.contract.prompt import ChatInput
from ninfer.contract.serving import RequestHandle, ServingEngine
from ninfer.core.task_pool import TaskPool

HEAVY_THREADS = 4  # they wait for compile workers and media threads, which bound the CPU themselves


def is_heavy(gen: GenerationRequest) -> bool:
    """Preparation that may take long: a grammar to compile, or images and videos to decode."""
    return gen.constraint is not None or (isinstance(gen.input, ChatInput) and bool(gen.input.media))


class Preparation:
    """The plain and the heavy TaskPool (sizes as ``ninfer serve``'s ``--http-*`` and ``--heavy-*`` options),
    and which one a request's choices are submitted on."""

    def __init__(self, *, threads: int = 4, queue: int = 64, heavy_threads: int = HEAVY_THREADS, heavy_queue: int = 64,
                 heavy_per_client: int | None = 16, heavy_running_per_client: int | None = 1) -> None:
        self.plain = TaskPool("ninfer-http", threads=threads, max_queued=queue)
        try:
            self.heavy = TaskPool("ninfer-heavy", threads=heavy_threads, max_queued=heavy_queue,
                                  max_per_owner=heavy_per_client, max_running_per_owner=heavy_running_per_client)
        except BaseException:
            self.plain.shutdown()
            raise

    def pool_for(self, gens: list[GenerationRequest]) -> TaskPool:
        return self.heavy if any(is_heavy(g) for g in gens) else self.plain

    def shutdown(self, timeout: float) -> None:
        """Refuse new work and join both pools' threads within ``timeout`` in all; a thread still preparing
        then (a compile that is stuck) runs on as a daemon until the engine is closed."""
        end = time.monotonic() + timeout
        for pool in (self.plain, self.heavy):
            pool.shutdown(timeout=max(0.0, end - time.monotonic()))


def submit_each(engine: ServingEngine, gens: list[GenerationRequest], cancel: threading.Event | None = None
                ) -> list[RequestHandle]:
    """Submit every choice (in a pool thread); all or none. The choices of a chat with media share one
    prepared prompt: its images and videos are decoded once, not once per choice. ``cancel``: set when the
    client is gone (a compile in progress for it stops)."""
    handles: list[RequestHandle] = []
    if len(gens) > 1 and isinstance(gens[0].input, ChatInput) and gens[0].input.media:
        prompt = engine.prepare(gens[0].input)
        gens = [attrs.evolve(gen, input=prompt) for gen in gens]
    try:
        for gen in gens:
            handles.append(engine.submit(gen, cancel=cancel))
    except BaseException:
        close_all(handles)
        raise
    return handles


def close_all(handles: list[RequestHandle]) -> None:
    for h in handles:
        h.close()
