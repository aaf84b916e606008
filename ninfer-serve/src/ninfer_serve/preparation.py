"""Where ``engine.submit`` runs: the gateway's two preparation TaskPools.

``engine.submit`` renders the template and tokenizes, which is quick; a request with a constraint also has its
grammar compiled there, and a chat with images or videos has them decoded there, which can take seconds or
more. Those heavy requests go to their own pool, so a plain request never waits behind them: the plain pool
(``--http-threads`` / ``--http-queue``) and the heavy pool (``--heavy-threads`` / ``--heavy-queue``) each have
their own threads and queue. In the heavy pool one client address holds at most ``--heavy-per-client``
places (queued and running; 429 past it), and a free thread takes the oldest task of the clients running
fewest, so no client can hold the whole pool or keep the others' work from starting.
"""

from __future__ import annotations

import os
import time
from typing import Any

import attrs

from ninfer.contract import GenerationRequest
from ninfer.contract.prompt import ChatInput
from ninfer.core.task_pool import TaskPool


def default_heavy_threads() -> int:
    """Half the CPU cores this process may run on, 1 to 4: a compile or a decode keeps a core busy (a grammar
    compile two), and more of them at once than the cores take slow the plain requests' decoding too."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 2
    return max(1, min(4, cores // 2))


def is_heavy(gen: GenerationRequest) -> bool:
    """Preparation that may take long: a grammar to compile, or images and videos to decode."""
    return gen.constraint is not None or (isinstance(gen.input, ChatInput) and bool(gen.input.media))


class Preparation:
    """The plain and the heavy TaskPool (sizes as ``ninfer serve``'s ``--http-*`` and ``--heavy-*`` options;
    ``heavy_threads`` None: ``default_heavy_threads()``), and which one a request's choices are submitted on."""

    def __init__(self, *, threads: int = 4, queue: int = 64, heavy_threads: int | None = None, heavy_queue: int = 64,
                 heavy_per_client: int | None = 16) -> None:
        self.plain = TaskPool("ninfer-http", threads=threads, max_queued=queue)
        heavy_threads = default_heavy_threads() if heavy_threads is None else heavy_threads
        try:
            self.heavy = TaskPool("ninfer-heavy", threads=heavy_threads, max_queued=heavy_queue,
                                  max_per_owner=heavy_per_client)
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


def submit_each(engine: Any, gens: list[GenerationRequest]) -> list[Any]:
    """Submit every choice (in a pool thread); all or none. The choices of a chat with media share one
    prepared prompt: its images and videos are decoded once, not once per choice."""
    handles: list[Any] = []
    if len(gens) > 1 and isinstance(gens[0].input, ChatInput) and gens[0].input.media:
        prompt = engine.prepare(gens[0].input)
        gens = [attrs.evolve(gen, input=prompt) for gen in gens]
    try:
        for gen in gens:
            handles.append(engine.submit(gen))
    except BaseException:
        close_all(handles)
        raise
    return handles


def close_all(handles: list[Any]) -> None:
    for h in handles:
        h.close()
