"""The public ``ninfer.Engine``: one resident model, purpose and max_concurrency fixed at startup.

``submit`` prepares the prompt and opens the OutputSession in the caller's thread (template
rendering; the caller waits while its grammar compiles in a worker process, ``GrammarBook``), then hands
the request to the worker. Request-level rejections raise a ``RequestRejected`` subclass from ``submit``;
a queue timeout ends the handle with an error.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Sequence

import attrs

from ninfer.contract.config import EngineConfig
from ninfer.contract.constraint import (
    ConstraintBusy,
    ConstraintCancelled,
    ConstraintClosed,
    ConstraintError,
    JsonConstraint,
)
from ninfer.contract.errors import NoRoomToScore, PromptTooLong
from ninfer.contract.memory import MemorySummary
from ninfer.contract.model import ModelInstance, ResourceUsage
from ninfer.contract.prompt import ChatInput, PreparedPrompt, TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.errors import (
    EngineClosed,
    InputTooLong,
    InvalidConstraint,
    Overloaded,
    RequestCancelled,
    RequestRejected,
    Unrepresentable,
    VisionNotEnabled,
)
from ninfer.engine.handle import GenerationHandle, ResponseChannel
from ninfer.engine.metrics import EngineMetrics
from ninfer.engine.request import RequestRecord
from ninfer.engine.scoring import DEFAULT_WINDOW, CausalScoreCore, ScoreResult

PURPOSES = ("generation",)
SCORE_RETRY_S = 0.02  # how often Engine.score looks again for a free slot and pages


def default_device() -> str:
    """Where an engine runs when no device is given: the current CUDA device when there is one."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def merge_sampling(defaults: SamplingParams, request: SamplingParams) -> SamplingParams:
    """Request fields left ``None`` take the model's defaults; everything else is the request's."""
    changes = {f.name: getattr(defaults, f.name) for f in attrs.fields(SamplingParams)
               if getattr(request, f.name) is None and getattr(defaults, f.name) is not None}
    return attrs.evolve(request, **changes)


class Engine:
    """Generation engine over one ``.ninfer`` artifact (see docs/engine.md)."""

    def __init__(self, model: str | os.PathLike, config: EngineConfig | None = None, *,
                 purpose: str = "generation") -> None:
        """Start an engine on the artifact ``model`` with ``config`` (an ``EngineConfig``, which documents each
        option; None: the defaults). ``EngineConfig(verify=False)`` skips the artifact's checksums;
        ``special_tokens_in_content=True`` reads special-token strings inside chat messages as control tokens
        (by default they are plain text); ``context_cache=False`` turns prefix and session reuse off (outputs
        are the same either way)."""
        from ninfer.engine.startup import build_instance

        _check_purpose(purpose)
        config = _checked_config(config)
        config = config.for_device(config.device or default_device())
        instance, name, self.artifact = build_instance(model, config.startup_options(), verify=config.verify)
        try:
            self._start(instance, name=name, config=config)
        except BaseException:
            self.artifact.close()
            raise

    @classmethod
    def from_instance(cls, instance: ModelInstance, config: EngineConfig | None = None, *,
                      name: str | None = None) -> Engine:
        """An engine over an already built ModelInstance (its Program sized for ``config.max_concurrency``).
        Only the engine's own options apply: the model's startup options were the builder's to choose."""
        config = _checked_config(config)
        if config.startup_fields_set():
            raise ValueError(f"from_instance: the ModelInstance is already built; startup options "
                             f"{', '.join(config.startup_fields_set())} do not apply to it")
        self = cls.__new__(cls)
        self.artifact = None
        self._start(instance, name=name or instance.architecture,
                    config=config.for_device(config.device or default_device()))
        return self

    def _start(self, instance: ModelInstance, *, name: str, config: EngineConfig) -> None:
        program = instance.program
        if program is None:
            raise ValueError("the ModelInstance has no Program; generation needs one")
        if program.max_concurrency < config.max_concurrency:
            raise ValueError(f"the Program was built for {program.max_concurrency} concurrent sequences; the "
                             f"engine asks for max_concurrency={config.max_concurrency}")
        config = config.for_model(program.max_model_len)
        _check_vision(config.features.vision, instance.features)
        self.instance = instance
        self.model_name = name
        self.frontend = instance.frontend
        self.config = config
        self.max_concurrency = config.max_concurrency
        self.max_model_len = config.max_model_len
        self._defaults = self.frontend.sampling_defaults()
        self._core = EngineCore(program, self.frontend, config)

    # -- requests ------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, *, cancel: threading.Event | None = None) -> GenerationHandle:
        """Prepare and enqueue one request; raises RequestRejected (or EngineFailed / EngineClosed).

        ``cancel``: set it (from another thread) to abandon the preparation: while the request's constraint
        compiles, its compile is stopped and ``submit`` raises RequestCancelled. A constraint past the
        Frontend's ``ConstraintLimits`` is InvalidConstraint (the message names the limit); full compile
        workers or matcher memory are Overloaded; ``close()`` meanwhile raises EngineClosed."""
        core = self._core
        core.ingress.check_open()
        try:
            if not isinstance(request, GenerationRequest):
                raise Unrepresentable(f"submit() takes a GenerationRequest, got {type(request).__name__}")
            self._check_media(request.input)
            prompt = self._prepare(request.input)
            sampling = merge_sampling(self._defaults, request.sampling)
            if sampling.min_tokens:  # the Program refuses these until min_tokens; they end the output all the same
                sampling = attrs.evolve(sampling, stop_token_ids=self.frontend.end_token_ids(sampling))
            session = self._open_session(prompt, sampling, request.constraint, cancel)
        except RequestRejected as exc:
            core.metrics.rejected_request(exc.kind)
            raise
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        submitted = time.monotonic()

        def make_record(ticket: int) -> RequestRecord:
            channel = ResponseChannel(request_id, on_cancel=core.ingress.notify,
                                      on_release=core.ingress.release_outstanding)
            return RequestRecord(
                ticket=ticket, request=request, prompt=prompt, sampling=sampling, channel=channel, session=session,
                submitted_at=submitted,
                deadline_at=None if request.deadline_s is None else submitted + request.deadline_s,
                queue_deadline_at=None if request.queue_timeout_s is None else submitted + request.queue_timeout_s)

        return GenerationHandle(core.ingress.enqueue(make_record).channel)

    def _open_session(self, prompt: PreparedPrompt, sampling: SamplingParams, constraint, cancel):
        if isinstance(constraint, JsonConstraint) and constraint.whitespace is None:
            constraint = attrs.evolve(constraint, whitespace=self.config.json_whitespace)
        try:
            return self.frontend.open_session(prompt, sampling, constraint, cancel=cancel)
        except ConstraintError as exc:
            raise InvalidConstraint(f"invalid constraint: {exc}") from exc
        except ConstraintBusy as exc:
            raise Overloaded(str(exc)) from exc
        except ConstraintCancelled as exc:
            raise RequestCancelled(str(exc)) from exc
        except ConstraintClosed as exc:
            raise EngineClosed(f"engine is closed: {exc}") from exc
        except Exception as exc:
            raise Unrepresentable(f"request cannot be represented: {exc}") from exc

    @property
    def vision_enabled(self) -> bool:
        """Whether the model was started with the vision feature: only then does a ChatInput carry media."""
        return "vision" in self.instance.features

    def _check_media(self, input: object) -> None:
        """Media for a model without the vision feature is refused before the Frontend sees it."""
        if self.vision_enabled or not isinstance(input, ChatInput) or not _carries_media(input):
            return
        features = self.config.features
        if features.vision is not False and features.draft_tokens and self.artifact is not None \
                and "vision" in self.artifact.features:  # the startup left the encoder out for MTP
            raise VisionNotEnabled(f"image and video input together with speculative decoding "
                                   f"(speculative={features.speculative!r}) is not supported yet; start the engine "
                                   f"without speculative decoding to give this model images or videos")
        why = ("it was turned off (StartupFeatures(vision=False), --vision off)" if features.vision
               is False else "the model does not provide it (its artifact has no vision tower, or its startup "
               "cannot run one)")
        raise VisionNotEnabled(f"image and video input needs the vision feature, which this engine was started "
                               f"without: {why}")

    def prepare(self, input: TextInput | ChatInput | PreparedPrompt) -> PreparedPrompt:
        """The prompt ``submit`` would make of ``input``, raising what ``submit`` raises for it. Submitting the
        result for several requests (the choices of one HTTP request) prepares the input, media decoding
        included, once."""
        self._core.ingress.check_open()
        try:
            self._check_media(input)
            return self._prepare(input)
        except RequestRejected as exc:
            self._core.metrics.rejected_request(exc.kind)
            raise

    def _prepare(self, input: TextInput | ChatInput | PreparedPrompt) -> PreparedPrompt:
        try:
            prompt = self.frontend.prepare(input, max_tokens=self.max_model_len - 1)
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

    def score(self, token_ids: Sequence[int], *, top: int | None = None, timeout: float = 60.0) -> ScoreResult:
        """``ninfer score``'s CausalScoring of ``token_ids`` (the same windows, so the same logprobs), run on the
        worker between cycles on a temporary slot and pages, outside the scheduler and caches; ``top``: also
        each token's rank and its ``top`` alternatives (``CausalScoreCore.score``). While generation holds every
        slot or the pages it needs, it waits for cycles to free them, then raises Overloaded after ``timeout``."""
        program = self._core.program
        core = CausalScoreCore(program, window=min(DEFAULT_WINDOW, program.max_model_len))
        end = time.monotonic() + timeout
        while True:
            self._core.ingress.check_open()
            try:
                return self._core.on_worker(lambda: core.score(token_ids, top=top), timeout=timeout)
            except NoRoomToScore as exc:
                if time.monotonic() >= end:
                    raise Overloaded(f"no room to score the prompt now: {exc}") from exc
            time.sleep(SCORE_RETRY_S)

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
    def memory(self) -> MemorySummary | None:
        """What the start took (weights, the Program's reservation, CUDA graphs, KV pages and tokens, headroom,
        budget, host budgets; docs/memory.md). None for an engine over a ModelInstance built without the
        runtime's startup (``from_instance``)."""
        return self.instance.memory

    def clear_context_cache(self) -> None:
        """Drop every context-cache checkpoint (device copies and host replicas); requests in flight go on."""
        self._core.on_worker(self._core.reuse.clear)

    @property
    def failed(self) -> bool:
        return self._core.ingress.failed is not None

    # -- lifetime ------------------------------------------------------------------------------------
    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop accepting work; end in-flight requests (or finish them with ``drain=True``); wait for the worker.
        Submits still preparing (a constraint compiling) raise EngineClosed at once."""
        core = getattr(self, "_core", None)
        if core is not None:
            core.ingress.request_close(drain=drain)  # no request prepares any more ...
        frontend = getattr(self, "frontend", None)
        if frontend is not None:
            frontend.close()  # ... so its compiles are killed and its media threads stop now
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


def _carries_media(chat: ChatInput) -> bool:
    """Media items, or content parts that mark where media sit."""
    if chat.media:
        return True
    contents = (m.get("content") for m in chat.messages if isinstance(m, dict))
    return any(isinstance(part, dict) and part.get("type") in ("image", "video")
               for content in contents if isinstance(content, list | tuple) for part in content)


def _check_vision(asked: bool | None, bound: tuple[str, ...]) -> None:
    """The model's startup kept StartupFeatures.vision: True binds the encoder, False leaves it."""
    if asked is True and "vision" not in bound:
        raise ValueError("vision was required (StartupFeatures(vision=True)) but the model started without it")
    if asked is False and "vision" in bound:
        raise ValueError("vision was turned off (StartupFeatures(vision=False)) but the model bound its encoder")


def _checked_config(config: EngineConfig | None) -> EngineConfig:
    if config is None:
        return EngineConfig()
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
    return config
