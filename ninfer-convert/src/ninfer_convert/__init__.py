"""ninfer-convert: Hugging Face checkpoints to .ninfer v3 artifacts (``ninfer convert``)."""

__version__ = "0.1.0"
