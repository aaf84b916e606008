"""The artifact's byte-level BPE tokenizer (``tokenizer.json`` through ``tokenizers``) plus the per-token bytes
that streaming detokenization needs."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders

from ninfer.models.common.qwen.errors import FrontendInputError


def _byte_level_decoding() -> dict[str, int]:
    """Inverse of the byte-level alphabet (printable bytes as themselves, the rest from U+0100 up)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


@functools.lru_cache(maxsize=4)
def _load(tokenizer_json: str) -> Tokenizer:
    # Parsing a 248k vocabulary takes about a second; engines and tests reopen the same artifact.
    try:
        return Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # noqa: BLE001 - the tokenizers error type is not public
        raise ValueError(f"the artifact's tokenizer.json does not load: {e}") from e


class QwenTokenizer:
    """Encodes text (special tokens recognised, no BOS) and maps each id to its exact bytes.

    ``embedding_vocab`` ids at or above the tokenizer's size are valid model outputs with no text
    (the embedding is padded past the vocabulary).
    """

    def __init__(self, tokenizer_json: str, *, embedding_vocab: int | None = None) -> None:
        self._tok = _load(tokenizer_json)
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            raise ValueError("the Qwen frontend needs a byte-level BPE tokenizer.json (decoder type ByteLevel)")
        self._byte_of = _byte_level_decoding()
        self.size = self._tok.get_vocab_size(with_added_tokens=True)
        self.embedding_vocab = max(self.size, embedding_vocab or 0)
        added = self._tok.get_added_tokens_decoder()
        self._added_text = {i: t.content for i, t in added.items()}
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._bytes: dict[int, bytes] = {}

    def encode(self, text: str) -> list[int]:
        """Token ids for ``text``; added tokens written in the text become their ids (as in a chat prompt)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token ``token_id`` stands for (added tokens: their UTF-8 text; padding ids: none)."""
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added_text:
            out = self._added_text[token_id].encode()
        elif 0 <= token_id < self.size:
            piece = self._tok.id_to_token(token_id)
            out = bytes(self._byte_of[c] for c in piece) if piece is not None else b""
        elif self.size <= token_id < self.embedding_vocab:
            out = b""
        else:
            raise FrontendInputError(f"token id {token_id} is outside the model's vocabulary "
                                     f"(0..{self.embedding_vocab - 1})")
        self._bytes[token_id] = out
        return out

    def decode(self, token_ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Whole-sequence text (invalid UTF-8 replaced); streaming uses ``token_bytes`` instead."""
        data = b"".join(self.token_bytes(t) for t in token_ids if not (skip_special and t in self.special_ids))
        return data.decode("utf-8", errors="replace")

    def check_ids(self, token_ids: Iterable[int]) -> None:
        for t in token_ids:
            if not 0 <= t < self.embedding_vocab:
                raise FrontendInputError(f"token id {t} is outside the model's vocabulary (0..{self.embedding_vocab - 1})")
