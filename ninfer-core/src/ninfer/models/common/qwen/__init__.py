"""The shared Qwen frontend: tokenizer, chat template, PreparedPrompt and per-request OutputSessions."""

from ninfer.models.common.qwen.chat_template import ChatTemplate, builtin_template
from ninfer.models.common.qwen.errors import FrontendInputError, TemplateError
from ninfer.models.common.qwen.frontend import QwenFrontend, sampling_from_generation_config
from ninfer.models.common.qwen.output_session import QwenOutputSession, TurnBoundary
from ninfer.models.common.qwen.tokenizer import QwenTokenizer

__all__ = [
    "ChatTemplate", "FrontendInputError", "QwenFrontend", "QwenOutputSession", "QwenTokenizer", "TemplateError",
    "TurnBoundary", "builtin_template", "sampling_from_generation_config",
]
