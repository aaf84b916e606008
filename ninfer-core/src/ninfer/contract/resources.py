"""Frontend resources an artifact carries (read-only, shared by every request)."""

from __future__ import annotations

import attrs

from ninfer.contract.values import JSONObject


@attrs.frozen(kw_only=True)
class FrontendResources:
    """Tokenizer, chat template and model-side defaults, exactly as stored in the artifact.

    ``special_tokens`` maps token text (e.g. ``"<|im_end|>"``) to id. ``eos_token_ids`` are the model
    side's stop token ids. ``generation_config`` is the checkpoint's generation_config.json (sampling
    defaults such as temperature, top_p, top_k). ``embedding_vocab`` is the number of embedding rows
    (ids >= the tokenizer's size but < this are valid for the model). ``media`` is the preprocessor
    geometry (patch size, merge size, pixel bounds) when vision is present.
    """

    tokenizer_json: str = attrs.field(repr=lambda s: f"<{len(s)} chars>")
    chat_template: str | None = attrs.field(default=None, repr=False)
    generation_config: JSONObject = attrs.field(factory=dict)
    special_tokens: dict[str, int] = attrs.field(factory=dict)
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    embedding_vocab: int | None = None
    media: JSONObject | None = None
