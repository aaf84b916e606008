"""Request errors the Qwen frontend raises; a gateway maps them to HTTP 400 (``Unrepresentable``)."""

from __future__ import annotations

from ninfer.contract.errors import Unrepresentable


class FrontendInputError(Unrepresentable, ValueError):
    """The input cannot be turned into a prompt for this model (bad token ids, messages, tools or kwargs)."""


class TemplateError(FrontendInputError):
    """The chat template failed to render this conversation (syntax, ``raise_exception``, sandbox)."""
