"""Speculative decoding's shared core: the verify unit, acceptance, the accepted state's commit, drafting."""

from ninfer.models.common.speculative.program import SpeculativeProgram

__all__ = ["SpeculativeProgram"]
