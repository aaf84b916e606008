"""The public ``ninfer.Engine``: one resident model, purpose and max_concurrency fixed at startup.

``submit`` prepares the prompt and opens the OutputSession in the caller's thread (template
rendering, grammar compilation), then hands the request to the worker. Request-level rejections
raise a ``RequestRejected`` subclass from ``submit``; a queue timeout ends the handle with an error.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import attrs

from ninfer.contract.errors import PromptTooLong
from ninfer.contract.model import ModelInstance, ResourceUsage, StartupFeatures
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.core import EngineCore, PauseChoice
from ninfer.engine.errors import InputTooLong, RequestRejected, Unrepresentable
from ninfer.engine.handle import GenerationHandle, ResponseChannel
from ninfer.engine.metrics import EngineMetrics
from ninfer.engine.request import RequestRecord

PURPOSES = ("generation",)


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_prefill_chunk(device: str) -> int:
    """Prompt tokens per prefill unit. On a GPU, 2048: a 9B chunk then runs the matmuls near their peak
    rate (512 reached 21 % of it on the H200, 4096 75 %) while a decode row waits at most one chunk
    (about 55 ms at 9B); on the CPU, 512 keeps other rows' inter-token gaps short."""
    return 2048 if str(device).startswith("cuda") else 512


def merge_sampling(defaults: SamplingParams, request: SamplingParams) -> SamplingParams:
    """Request fields left ``None`` take the model's defaults; everything else is the request's."""
    changes = {f.name: getattr(defaults, f.name) for f in attrs.fields(SamplingParams)
               if getattr(request, f.name) is None and getattr(defaults, f.name) is not None}
    return attrs.evolve(request, **changes)


class Engine:
    """Generation engine over one ``.ninfer`` artifact (see docs/engine.md)."""

    def __init__(self, model: str | os.PathLike, *, purpose: str = "generation", max_concurrency: int = 4,
                 features: StartupFeatures = StartupFeatures(), device: str | None = None,
                 device_budget_bytes: int | None = None, max_queue: int = 64, max_model_len: int | None = None,
                 chat_template: str | None = None, prefill_chunk: int | None = None, bypass_limit: int | None = None,
                 pause_mode: PauseChoice = "auto", verify: bool = True, special_tokens_in_content: bool = False,
                 **program_options: Any) -> None:
        """``prefill_chunk``: prompt tokens per prefill unit (default ``default_prefill_chunk(device)``).
        ``verify``: check every object's checksum as the artifact is read (``False`` skips it).
        ``special_tokens_in_content``: special-token strings inside chat messages (``"<|im_end|>"``) are read
        as control tokens; by default they are plain text, so a message cannot end its turn or open another
        (raw text prompts always read them as tokens)."""
        from ninfer.engine.startup import build_instance

        _check_purpose(purpose)
        if not 1 <= max_concurrency <= 8:
            raise ValueError(f"max_concurrency must be in 1..8, got {max_concurrency}")
        device = device or _default_device()
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(device)
        if chat_template is not None:
            program_options["chat_template"] = chat_template
        if special_tokens_in_content:  # only when asked: the default needs no support from the plugin
            program_options["special_tokens_in_content"] = True
        instance, name, self.artifact = build_instance(
            model, device=device, features=features, max_concurrency=max_concurrency,
            device_budget_bytes=device_budget_bytes, program_options=program_options, max_model_len=max_model_len,
            verify=verify)
        self._start(instance, name=name, max_concurrency=max_concurrency, max_queue=max_queue,
                    max_model_len=max_model_len, device=device, prefill_chunk=prefill_chunk,
                    bypass_limit=bypass_limit, pause_mode=pause_mode)

    @classmethod
    def from_instance(cls, instance: ModelInstance, *, name: str | None = None, max_concurrency: int = 4,
                      max_queue: int = 64, max_model_len: int | None = None, device: str | None = None,
                      prefill_chunk: int = 512, bypass_limit: int | None = None,
                      pause_mode: PauseChoice = "auto") -> Engine:
        """An engine over an already built ModelInstance (its Program sized for ``max_concurrency``)."""
        self = cls.__new__(cls)
        self.artifact = None
        self._start(instance, name=name or instance.architecture, max_concurrency=max_concurrency,
                    max_queue=max_queue, max_model_len=max_model_len, device=device, prefill_chunk=prefill_chunk,
                    bypass_limit=bypass_limit, pause_mode=pause_mode)
        return self

    def _start(self, instance: ModelInstance, *, name: str, max_concurrency: int, max_queue: int,
               max_model_len: int | None, device: str | None, prefill_chunk: int, bypass_limit: int | None,
               pause_mode: PauseChoice) -> None:
        if instance.program is None:
            raise ValueError("the ModelInstance has no Program; generation needs one")
        slots = getattr(instance.program, "max_concurrency", None)
        if slots is not None and slots < max_concurrency:
            raise ValueError(f"the Program was built for {slots} concurrent sequences; the engine asks for "
                             f"max_concurrency={max_concurrency}")
        self.instance = instance
        self.model_name = name
        self.frontend = instance.frontend
        self.max_concurrency = max_concurrency
        limit = getattr(instance.program, "max_model_len", None) or getattr(instance.config, "max_model_len", None) \
            or getattr(instance.config, "max_position_embeddings", None)
        if max_model_len is None:
            if limit is None:
                raise ValueError("max_model_len is unknown: pass it, or let the Program declare max_model_len")
            max_model_len = int(limit)
        elif limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit {limit}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.max_model_len = max_model_len
        self._defaults = self.frontend.sampling_defaults()
        self._core = EngineCore(instance.program, self.frontend, max_concurrency=max_concurrency,
                                max_queue=max_queue, max_model_len=max_model_len, prefill_chunk=prefill_chunk,
                                bypass_limit=bypass_limit, pause_mode=pause_mode, device=device)

    # -- requests ------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> GenerationHandle:
        """Prepare and enqueue one request; raises RequestRejected (or EngineFailed / EngineClosed)."""
        core = self._core
        core.check_open()
        try:
            if not isinstance(request, GenerationRequest):
                raise Unrepresentable(f"submit() takes a GenerationRequest, got {type(request).__name__}")
            prompt = self._prepare(request)
            sampling = merge_sampling(self._defaults, request.sampling)
            try:
                session = self.frontend.open_session(prompt, sampling)
            except Exception as exc:
                raise Unrepresentable(f"request cannot be represented: {exc}") from exc
        except RequestRejected as exc:
            core.metrics.rejected_request(exc.kind)
            raise
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        submitted = time.monotonic()

        def make_record(ticket: int) -> RequestRecord:
            channel = ResponseChannel(request_id, on_cancel=core.notify, on_release=core.release_outstanding)
            return RequestRecord(
                ticket=ticket, request=request, prompt=prompt, sampling=sampling, channel=channel, session=session,
                submitted_at=submitted,
                deadline_at=None if request.deadline_s is None else submitted + request.deadline_s,
                queue_deadline_at=None if request.queue_timeout_s is None else submitted + request.queue_timeout_s)

        return GenerationHandle(core.enqueue(make_record).channel)

    def _prepare(self, request: GenerationRequest) -> PreparedPrompt:
        try:
            prompt = self.frontend.prepare(request.input, max_tokens=self.max_model_len - 1)
        except RequestRejected:
            raise
        except PromptTooLong as exc:  # found by the Frontend, possibly before tokenizing all of it
            amount = exc.tokens if exc.exact else f"at least {exc.tokens}"
            raise InputTooLong(f"prompt has {amount} tokens{exc.detail}; the context limit is {self.max_model_len} "
                               f"(at least one token must remain for generation)") from exc
        except Exception as exc:  # template, tokenizer, media or token-range errors name the problem
            raise Unrepresentable(f"request cannot be represented: {exc}") from exc
        if len(prompt) >= self.max_model_len:
            raise InputTooLong(f"prompt has {len(prompt)} tokens; the context limit is {self.max_model_len} "
                               f"(at least one token must remain for generation)")
        return prompt

    def generate(self, request: GenerationRequest, timeout: float | None = None):
        """Submit and block for the final GenerationResult."""
        return self.submit(request).result(timeout)

    # -- observation ---------------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        return self._core.snapshot_metrics()

    def usage(self) -> ResourceUsage:
        """The Program's own resource ledger, read on the worker between cycles."""
        return self._core.on_worker(self._core.program.usage)

    @property
    def failed(self) -> bool:
        return self._core.failed is not None

    # -- lifetime ------------------------------------------------------------------------------------
    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop accepting work; end in-flight requests (or finish them with ``drain=True``); wait for the worker."""
        core = getattr(self, "_core", None)
        if core is not None:
            core.close(drain=drain, timeout=timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_purpose(purpose: str) -> None:
    if purpose not in PURPOSES:
        raise ValueError(f"Engine purpose {purpose!r} is not a generation purpose; offline causal scoring "
                         f"runs through ninfer.engine.scoring, not the Generation scheduler")
