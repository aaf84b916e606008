"""Qwen4Exp execution: parameters, layer calls and the model forward over ForwardBatch and state views."""
