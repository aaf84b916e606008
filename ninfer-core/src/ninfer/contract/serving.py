"""What a gateway calls on an engine and on the handles it returns.

``ninfer.Engine`` and its ``GenerationHandle`` have these shapes; so does a test's scripted stand-in. The HTTP
gateway (``ninfer_serve``) holds a ``ServingEngine``: every call it makes on the engine is declared here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol

from ninfer.contract.events import Event
from ninfer.contract.memory import MemorySummary
from ninfer.contract.model import Frontend, ResourceUsage
from ninfer.contract.prompt import ChatInput, PreparedPrompt, TextInput
from ninfer.contract.request import GenerationRequest

if TYPE_CHECKING:  # the engine's snapshot types: read by a gateway, never built by it
    import threading

    from ninfer.engine.metrics import EngineMetrics
    from ninfer.engine.scoring import ScoreResult


class RequestHandle(Protocol):
    """One submitted request: its events (GenerationStart, OutputDelta*, one GenerationResult), its end."""

    @property
    def request_id(self) -> str: ...

    def __aiter__(self) -> AsyncIterator[Event]: ...

    def exception(self) -> BaseException | None:
        """The error that ended the request, once it ended with one (QueueTimeout, EngineFailed, ...); else None."""

    def cancel(self) -> None: ...

    def close(self) -> None:
        """Abandon the handle: cancel the request if it still runs and release the consumer side."""


class ServingEngine(Protocol):
    """One resident model as a gateway uses it (``ninfer.Engine`` documents each call)."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def frontend(self) -> Frontend: ...

    @property
    def vision_enabled(self) -> bool: ...

    @property
    def memory(self) -> MemorySummary | None: ...

    def submit(self, request: GenerationRequest, *, cancel: threading.Event | None = None) -> RequestHandle: ...

    def prepare(self, input: TextInput | ChatInput | PreparedPrompt) -> PreparedPrompt: ...

    def score(self, token_ids: Sequence[int], *, top: int | None = None) -> ScoreResult: ...

    def metrics(self) -> EngineMetrics: ...

    def usage(self) -> ResourceUsage: ...
