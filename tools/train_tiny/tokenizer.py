"""A small byte-level BPE in the Qwen3.5 layout: learned merges first, then the Qwen3.5 added tokens in their
published order (so `<|endoftext|>` is the first id after the BPE vocabulary, as in the real model)."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

VOCAB_SIZE = 4096
# Qwen3.5's pre-tokenizer regex (letters include combining marks; digits split one by one).
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# (content, special): the Qwen3.5 added tokens in id order. <tool_call>, <think> and friends are not
# "special" there (they survive skip_special_tokens), and the same holds here.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
)


def train_tokenizer(texts: Iterable[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = BpeTrainer(vocab_size=VOCAB_SIZE - len(ADDED_TOKENS), min_frequency=2, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    base = tok.get_vocab_size()
    for content, special in ADDED_TOKENS:  # one at a time: ids follow the published order exactly
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    for i, (content, _) in enumerate(ADDED_TOKENS):
        if tok.token_to_id(content) != base + i:
            raise RuntimeError(f"added token {content} got id {tok.token_to_id(content)}, expected {base + i}")
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return tok


def token_id(tok: Tokenizer, content: str) -> int:
    i = tok.token_to_id(content)
    if i is None:
        raise KeyError(f"token {content!r} is not in the tokenizer")
    return i
