"""Typed configuration: what an Engine starts with, and what it asks of a model's native Startup.

``EngineConfig`` holds every choice ``ninfer.Engine`` takes (``Engine(model, config)``).
``StartupOptions`` is the part a plugin's Startup receives, ``build(artifact, options)``, with the device
fixed. Each model-side field is declared once (``_ModelOptions``, which both classes extend); ``EngineConfig``
adds the engine's own. Both are frozen and validated once, when made; a bad value is a ``ValueError``
naming the field.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import attrs

from ninfer.contract.constraint import JSON_WHITESPACE, ConstraintLimits, JsonWhitespace

MAX_CONCURRENCY = 8  # the widest decode batch an engine runs (exact-B graphs are captured for 1..this)
DTYPES = ("float32", "bfloat16", "float16")
PAUSE_CHOICES = ("auto", "snapshot", "replay")
PauseChoice = Literal["auto", "snapshot", "replay"]
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


SPECULATIVE_METHODS = ("mtp", "dflash", "dflash2")
MAX_DRAFT_TOKENS = 3


@attrs.frozen(kw_only=True)
class StartupFeatures:
    """Features selected at startup: Text is always on; Vision optional; none or one spec backend.

    ``vision``: None binds the vision encoder when the artifact carries it; True requires it (a start on an
    artifact without it fails, naming the problem); False leaves it unread (requests with media are refused).

    ``num_draft_tokens``: draft tokens a speculative backend proposes per step (1..3; the verify step runs
    1 + that many positions per row). It means nothing without ``speculative``.
    """

    vision: bool | None = attrs.field(default=None)
    speculative: Literal["mtp", "dflash", "dflash2"] | None = attrs.field(default=None)
    num_draft_tokens: int = attrs.field(default=2)

    @vision.validator
    def _vision(self, attribute: attrs.Attribute, value: Any) -> None:
        _flag(optional=True)(self, attribute, value)

    @speculative.validator
    def _speculative(self, attribute: attrs.Attribute, value: Any) -> None:
        _choice(SPECULATIVE_METHODS, optional=True)(self, attribute, value)

    @num_draft_tokens.validator
    def _num_draft_tokens(self, attribute: attrs.Attribute, value: Any) -> None:
        _int_range(1, MAX_DRAFT_TOKENS)(self, attribute, value)

    @property
    def draft_tokens(self) -> int:
        """Draft tokens per verify step: 0 without a speculative backend."""
        return self.num_draft_tokens if self.speculative is not None else 0


def default_prefill_chunk(device: str) -> int:
    """Prompt tokens per prefill unit when none is given. On a GPU, 2048: long enough for the prefill matmuls to
    run near their peak rate, short enough that a decode row waits at most one chunk (docs/performance.md,
    "Prefill"); on the CPU, 512 keeps other rows' inter-token gaps short."""
    return 2048 if device.startswith("cuda") else 512


# -- validators (each error names the field) -------------------------------------------------------
def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_range(lo: int, hi: int | None = None, *, optional: bool = False):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None and optional:
            return
        bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        if not _integer(value):
            raise ValueError(f"{attribute.name} must be an integer {bound}{' (or None)' if optional else ''}, "
                             f"got {value!r}")
        if value < lo or (hi is not None and value > hi):
            raise ValueError(f"{attribute.name} must be {bound}, got {value!r}")
    return check


def _choice(options: tuple[Any, ...], *, optional: bool = False):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if (value is None and optional) or value in options:
            return
        raise ValueError(f"{attribute.name} must be one of {', '.join(map(str, options))}"
                         f"{' (or None)' if optional else ''}, got {value!r}")
    return check


def _flag(*, optional: bool = False):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not (isinstance(value, bool) or (value is None and optional)):
            raise ValueError(f"{attribute.name} must be True or False{' (or None)' if optional else ''}, "
                             f"got {value!r}")
    return check


def _device(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """An EngineConfig may leave the device to be found (None); a Startup's options have it fixed."""
    optional = not isinstance(instance, StartupOptions)
    if value is None and optional:
        return
    if not isinstance(value, str) or not _DEVICE.match(value):
        raise ValueError(f"{attribute.name} must be 'cpu', 'cuda' or 'cuda:N'"
                         f"{' (or None: cuda when available)' if optional else ''}, got {value!r}")


def _text(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{attribute.name} must be a string (or None), got {value!r}")


def _features(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, StartupFeatures):
        raise ValueError(f"{attribute.name} must be a StartupFeatures, got {value!r}")


def _constraint_limits(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, ConstraintLimits):
        raise ValueError(f"{attribute.name} must be a ConstraintLimits, got {value!r}")


# -- the model-side options: each declared once, here; EngineConfig inherits them ------------------------
@attrs.frozen(kw_only=True)
class _ModelOptions:
    """The fields ``StartupOptions`` and ``EngineConfig`` share (see ``StartupOptions``)."""

    device: str | None = attrs.field(default=None, validator=_device)
    max_concurrency: int = attrs.field(default=4, validator=_int_range(1, MAX_CONCURRENCY))
    max_model_len: int | None = attrs.field(default=None, validator=_int_range(2, optional=True))
    context_cache: bool = attrs.field(default=True, validator=_flag())
    # the model-side knobs (mean nothing to an already built model)
    features: StartupFeatures = attrs.field(default=StartupFeatures(), validator=_features)
    device_budget_bytes: int | None = attrs.field(default=None, validator=_int_range(1, optional=True))
    host_budget_bytes: int | None = attrs.field(default=None, validator=_int_range(0, optional=True))
    checkpoint_slots: int | None = attrs.field(default=None, validator=_int_range(0, optional=True))
    cache_host_budget_bytes: int | None = attrs.field(default=None, validator=_int_range(0, optional=True))
    dtype: str | None = attrs.field(default=None, validator=_choice(DTYPES, optional=True))
    page_size: int = attrs.field(default=16, validator=_int_range(1))
    num_pages: int | None = attrs.field(default=None, validator=_int_range(1, optional=True))
    cuda_graphs: bool = attrs.field(default=True, validator=_flag())
    pdl: bool | None = attrs.field(default=None, validator=_flag(optional=True))
    chat_template: str | None = attrs.field(default=None, validator=_text)
    special_tokens_in_content: bool = attrs.field(default=False, validator=_flag())
    placement: str | None = attrs.field(default=None, validator=_text)
    expert_cache_bytes: int | None = attrs.field(default=None, validator=_int_range(0, optional=True))
    # the Frontend's bound on one decoded image or video frame, in pixels (None: the model's)
    media_max_pixels: int | None = attrs.field(default=None, validator=_int_range(1, optional=True))
    # the Frontend's bound on one request's image and video placeholder tokens together (None: its default)
    media_max_tokens: int | None = attrs.field(default=None, validator=_int_range(1, optional=True))
    # constrained decoding: what one request's grammar may cost (the Frontend's compile workers and matchers)
    constraint_limits: ConstraintLimits = attrs.field(default=ConstraintLimits(), validator=_constraint_limits)


# Shared fields the engine reads too; the others are the model's alone.
_ENGINE_READS = ("device", "max_concurrency", "max_model_len", "context_cache")
MODEL_KNOBS = tuple(f.name for f in attrs.fields(_ModelOptions) if f.name not in _ENGINE_READS)


@attrs.frozen(kw_only=True)
class StartupOptions(_ModelOptions):
    """What the engine asks of a native Startup. ``device`` is fixed ("cpu", "cuda", "cuda:N").

    ``max_model_len``: None lets the model use its limit. ``device_budget_bytes``: None takes the device's
    memory (``NINFER_VRAM_BUDGET_MIB`` caps it). ``host_budget_bytes``: host bytes paused Snapshots may hold
    (None: the model's default, ``NINFER_HOST_BUDGET_MIB`` sets it). ``dtype``: compute dtype (None: the
    artifact's). ``page_size`` / ``num_pages``: KV positions per page and pages (None: sized from the
    budget). ``cuda_graphs``: capture decode graphs on CUDA. ``pdl``: programmatic dependent launch (None:
    the model decides, ``ninfer.ops.launch.prefers_pdl``). ``chat_template``: overrides the artifact's.
    ``special_tokens_in_content``: special-token strings in chat messages are read as control tokens.
    ``context_cache``: build the checkpoint store (prefix reuse, session continuations); ``checkpoint_slots``:
    device StateImage slots for checkpoints (None: sized from the budget; 0 keeps checkpoints on the host
    only); ``cache_host_budget_bytes``: pinned host bytes for checkpoint replicas (None: the model's
    default, ``NINFER_CACHE_HOST_BUDGET_MIB`` sets it). ``placement``: the weight placement to use (one of the
    model's candidates, e.g. "host-experts"; None: the first that fits the budget). ``expert_cache_bytes``: device
    bytes for the GPU cache of host-resident MoE experts (None: sized from the budget; 0: no cache).
    ``media_max_pixels``: width x height of one image or video frame as decoded, checked from its header before
    decoding (None: the model's bound, twice the pixels its preprocessor resizes a picture to).
    ``media_max_tokens``: placeholder tokens of all of one request's images and videos, counted from their headers
    before decoding (None: the Frontend's default, 32,768; the pixel rows a request holds are bounded by it).
    ``constraint_limits``: what one constrained request may cost (``ConstraintLimits``; the Frontend's grammar
    compile workers, matcher memory and time).
    """


@attrs.frozen(kw_only=True)
class EngineConfig(_ModelOptions):
    """Everything ``ninfer.Engine`` is started with (see docs/engine.md, "Configuration").

    Engine fields: ``max_concurrency`` (resident requests, 1..8), ``max_queue`` (waiting places beyond
    them), ``max_model_len`` (None: the model's limit), ``prefill_chunk`` (prompt tokens per prefill unit;
    None: ``default_prefill_chunk(device)``), ``bypass_limit`` (fresh admissions that may overtake one paused
    request; default ``max_concurrency``), ``pause_mode`` (auto: Snapshot when host room allows, else
    Replay), ``device`` (None: cuda when available, else cpu), ``verify`` (check the artifact's checksums
    as it is read), ``context_cache`` (reuse checkpointed prefixes and session continuations; on by default),
    ``checkpoint_grid`` (prompt positions between checkpoints inside a long prompt; None: the prefill chunk),
    ``json_whitespace`` (whitespace in JSON output whose ``JsonConstraint`` leaves it unset: "bounded" or
    "compact"). The rest are the model's startup options, declared once for both classes (``StartupOptions``
    documents them).
    """

    max_queue: int = attrs.field(default=64, validator=_int_range(0))
    prefill_chunk: int | None = attrs.field(default=None, validator=_int_range(1, optional=True))
    bypass_limit: int = attrs.field(default=attrs.Factory(lambda self: self.max_concurrency, takes_self=True),
                                    validator=_int_range(0))
    pause_mode: PauseChoice = attrs.field(default="auto", validator=_choice(PAUSE_CHOICES))
    verify: bool = attrs.field(default=True, validator=_flag())
    checkpoint_grid: int | None = attrs.field(default=None, validator=_int_range(1, optional=True))
    json_whitespace: JsonWhitespace = attrs.field(default="bounded", validator=_choice(JSON_WHITESPACE))

    def for_device(self, device: str) -> EngineConfig:
        """This configuration on ``device``, with ``prefill_chunk`` fixed (the device's default when unset)."""
        chunk = self.prefill_chunk if self.prefill_chunk is not None else default_prefill_chunk(device)
        return attrs.evolve(self, device=device, prefill_chunk=chunk)

    def for_model(self, limit: int) -> EngineConfig:
        """This configuration with ``max_model_len`` fixed: the model's ``limit`` when unset; above it is an error."""
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's limit {limit}")
        return attrs.evolve(self, max_model_len=self.max_model_len if self.max_model_len is not None else limit)

    def startup_options(self) -> StartupOptions:
        """What the model's Startup receives; needs the device fixed (``for_device``)."""
        if self.device is None:
            raise ValueError("startup options need a device: call EngineConfig.for_device first")
        return StartupOptions(**{f.name: getattr(self, f.name) for f in attrs.fields(_ModelOptions)})

    def startup_fields_set(self) -> tuple[str, ...]:
        """Model-side options that differ from their defaults (they mean nothing to an already built model)."""
        defaults = attrs.fields_dict(_ModelOptions)
        return tuple(name for name in MODEL_KNOBS if getattr(self, name) != defaults[name].default)

