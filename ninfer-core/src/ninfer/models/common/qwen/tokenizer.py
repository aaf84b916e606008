"""The artifact's byte-level BPE tokenizer (``tokenizer.json`` through ``tokenizers``) plus the per-token bytes
that streaming detokenization needs."""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, normalizers

from ninfer.models.common.qwen.errors import FrontendInputError

# Texts at least this long are encoded through ``encode_batch_fast``, which releases the GIL while it runs
# (``encode`` holds it: a long prompt would stall every other Python thread, streams included).
LONG_TEXT_CHARS = 16_384


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


@functools.lru_cache(maxsize=4)
def _longest_token_bytes(tokenizer_json: str) -> int:
    tok = _load(tokenizer_json)
    added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
    # a byte-level piece has one character per byte; an added token is its UTF-8 text
    return max(len(added[i].encode()) if i in added else len(piece)
               for piece, i in tok.get_vocab(with_added_tokens=True).items())


@functools.lru_cache(maxsize=4)
def _load_specials_as_text(tokenizer_json: str) -> Tokenizer:
    """A separate instance that reads special-token strings as plain text (the shared one is never toggled)."""
    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True
    return tok


class QwenTokenizer:
    """Encodes text (special tokens recognised, no BOS) and maps each id to its exact bytes.

    ``embedding_vocab`` ids at or above the tokenizer's size are valid model outputs with no text
    (the embedding is padded past the vocabulary).
    """

    def __init__(self, tokenizer_json: str, *, embedding_vocab: int | None = None) -> None:
        self._json = tokenizer_json
        self._tok = _load(tokenizer_json)
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            raise ValueError("the Qwen frontend needs a byte-level BPE tokenizer.json (decoder type ByteLevel)")
        self._byte_of = _byte_level_decoding()
        self.size = self._tok.get_vocab_size(with_added_tokens=True)
        self.embedding_vocab = max(self.size, embedding_vocab or 0)
        added = self._tok.get_added_tokens_decoder()
        self._added_text = {i: t.content for i, t in added.items()}
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.special_tokens = {t.content: i for i, t in added.items() if t.special}  # text -> id
        self._bytes: dict[int, bytes] = {}
        self._normalizer = self._tok.normalizer
        self._nfc = isinstance(self._normalizer, normalizers.NFC)
        # The most bytes one token stands for (added tokens included): bounds a text's token count from below.
        self.longest_token_bytes = _longest_token_bytes(tokenizer_json)

    def encode(self, text: str) -> list[int]:
        """Token ids for ``text``; added tokens written in the text become their ids (as in a chat prompt)."""
        if len(text) < LONG_TEXT_CHARS:
            return self._tok.encode(text, add_special_tokens=False).ids
        return self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_specials_as_text(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids for each text with special-token strings read as plain text (non-special added tokens such
        as ``<think>`` still become their ids). One batch call, which releases the GIL."""
        if not texts:
            return []
        tok = _load_specials_as_text(self._json)
        return [e.ids for e in tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def text_bytes(self, text: str) -> int:
        """UTF-8 bytes of ``text`` after the tokenizer's normalizer, counted without tokenizing.

        Every token stands for at most ``longest_token_bytes`` of them, so ``ceil(text_bytes / longest)`` is a
        lower bound on the token count. NFC text is counted as it is (checked quickly, and a newer Unicode
        version can only decompose further); other text goes through the normalizer itself."""
        unchanged = self._normalizer is None or (
            self._nfc and (text.isascii() or unicodedata.is_normalized("NFC", text)))
        if unchanged and text.isascii():
            return len(text)
        if not unchanged:
            try:
                text = self._normalizer.normalize_str(text)
            except Exception:  # noqa: BLE001 - text tokenizers cannot take (lone surrogates): encode names it
                return 0
        return len(text.encode("utf-8", "surrogatepass"))

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

    def grammar_vocabulary(self, text_tokens: Iterable[str] = ()) -> list[bytes]:
        """Each token id's bytes as a grammar sees them: special tokens have none (a grammar never produces them
        as text), except ``text_tokens``, which the model's formats write as text (``<think>``, ``<tool_call>``)."""
        keep = {self.token_id(t) for t in text_tokens}
        return [b"" if i in self.special_ids and i not in keep else self.token_bytes(i) for i in range(self.size)]

    def decode(self, token_ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Whole-sequence text (invalid UTF-8 replaced); streaming uses ``token_bytes`` instead."""
        data = b"".join(self.token_bytes(t) for t in token_ids if not (skip_special and t in self.special_ids))
        return data.decode("utf-8", errors="replace")

    def check_ids(self, token_ids: Iterable[int]) -> None:
        for t in token_ids:
            if not 0 <= t < self.embedding_vocab:
                raise FrontendInputError(f"token id {t} is outside the model's vocabulary (0..{self.embedding_vocab - 1})")
