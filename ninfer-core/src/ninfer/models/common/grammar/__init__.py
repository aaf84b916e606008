"""Constrained decoding's shared parts: compiled grammars per vocabulary (``GrammarBook``), compiled where a
runaway grammar can be stopped (``compile_pool``, ``compile_slot``, ``compile_worker``, ``probe``), per-request matchers guarded
as they run (``TokenMatcher``), and the checks made before any compile (``schema_features``, ``productive``)."""

from ninfer.models.common.grammar.book import GrammarBook
from ninfer.models.common.grammar.compile_job import Compiled
from ninfer.models.common.grammar.matcher import TokenMatcher

__all__ = ["Compiled", "GrammarBook", "TokenMatcher"]
