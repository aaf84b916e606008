"""Constrained decoding's shared parts: compiled grammars per vocabulary (``GrammarBook``), per-request
matchers (``TokenMatcher``), and the JSON Schema keywords refused up front (``schema_features``)."""

from ninfer.models.common.grammar.book import GrammarBook
from ninfer.models.common.grammar.matcher import TokenMatcher

__all__ = ["GrammarBook", "TokenMatcher"]
