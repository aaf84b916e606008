"""Public contracts between the engine, architecture plugins, frontends and gateways.

Data crossing a contract boundary is frozen attrs classes; behaviour is typing.Protocol.
See docs/architecture.md for how these map onto the design document.
"""

from ninfer.contract.batch import LaunchedUnit, PendingBatch, PendingRow, RowDecision
from ninfer.contract.config import EngineConfig, StartupFeatures, StartupOptions
from ninfer.contract.constraint import (
    ChoiceConstraint,
    Constraint,
    ConstraintError,
    ConstraintLimits,
    GrammarConstraint,
    JsonConstraint,
    MaskFill,
    RegexConstraint,
    TokenMasks,
    ToolCallConstraint,
)
from ninfer.contract.context import CacheUsage, CheckpointInfo, ContextStore, TurnBoundary
from ninfer.contract.errors import PromptTooLong
from ninfer.contract.events import (
    FinishReason,
    GenerationResult,
    GenerationStart,
    OutputDelta,
    Timings,
    Usage,
)
from ninfer.contract.memory import (
    EncoderNeeds,
    GraphMemory,
    HostMemory,
    MemorySummary,
    ModelProfile,
    ModelShape,
    ProgramCapacity,
    WeightPlacement,
)
from ninfer.contract.model import (
    Frontend,
    ModelInstance,
    OutputSession,
    PipelinedDecode,
    Preview,
    Program,
    ResourceUsage,
    SnapshotCost,
    Startup,
)
from ninfer.contract.prompt import ChatInput, MediaItem, MediaSpan, PreparedPrompt, TextInput, VisionItem
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.contract.resources import FrontendResources
from ninfer.contract.serving import RequestHandle, ServingEngine
from ninfer.contract.state import KVPoolSpec, PagedField, ResumeState, StateField, StateImageLayout

__all__ = [
    "CacheUsage", "ChatInput", "CheckpointInfo", "ChoiceConstraint", "Constraint", "ConstraintError", "ConstraintLimits",
    "EncoderNeeds", "GrammarConstraint", "GraphMemory", "HostMemory", "JsonConstraint", "MaskFill", "RegexConstraint", "TokenMasks", "ToolCallConstraint", "ContextStore", "EngineConfig", "FinishReason", "Frontend", "FrontendResources", "GenerationRequest", "GenerationResult", "GenerationStart",
    "KVPoolSpec", "LaunchedUnit", "PagedField", "MediaItem", "MediaSpan", "MemorySummary", "ModelInstance", "ModelProfile", "ModelShape", "OutputDelta", "OutputSession", "PendingBatch",
    "PendingRow", "PipelinedDecode", "PreparedPrompt", "Preview", "Program", "ProgramCapacity", "PromptTooLong", "RequestHandle", "ResourceUsage", "ResumeState", "RowDecision", "SamplingParams", "ServingEngine", "SnapshotCost", "StateField", "StateImageLayout",
    "Startup", "StartupFeatures", "StartupOptions", "TextInput", "VisionItem", "Timings", "TurnBoundary", "Usage", "WeightPlacement",
]
