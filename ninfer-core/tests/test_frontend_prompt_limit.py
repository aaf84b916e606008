"""A prompt that cannot fit is rejected before it is tokenized (a bound from the longest token's bytes); one
near the limit still tokenizes exactly; long texts are tokenized through the GIL-releasing batch call with
the ids ``encode`` gives."""

import pytest

from ninfer.contract import ChatInput, PreparedPrompt, PromptTooLong, TextInput
from ninfer.models.common.qwen import ChatTemplate, QwenFrontend
from ninfer.models.common.qwen.tokenizer import LONG_TEXT_CHARS, QwenTokenizer
from ninfer_qwen35.testing.qwen_vocab import qwen35_frontend_resources

SPACES = 55036  # the longest Qwen3.5 token: 128 spaces


@pytest.fixture(scope="module")
def frontend():
    return QwenFrontend.from_resources(qwen35_frontend_resources(), chat_template_override="builtin:qwen3_5")


@pytest.fixture
def no_tokenizing(monkeypatch):
    """Fails the test if anything is tokenized or rendered."""
    def forbidden(*a, **kw):
        raise AssertionError("the prompt was tokenized or rendered")
    for name in ("encode", "encode_specials_as_text"):
        monkeypatch.setattr(QwenTokenizer, name, forbidden)
    monkeypatch.setattr(ChatTemplate, "render_normalized", forbidden)


def test_longest_token_is_measured_once_from_the_vocabulary(frontend):
    assert frontend.tokenizer.longest_token_bytes == 128
    assert frontend.tokenizer.encode(" " * 1280) == [SPACES] * 10


def test_text_over_the_byte_bound_is_rejected_without_tokenizing(frontend, no_tokenizing):
    limit = 1000
    with pytest.raises(PromptTooLong) as info:
        frontend.prepare(TextInput(text="a" * (128 * limit + 1)), max_tokens=limit)
    assert (info.value.tokens, info.value.limit, info.value.exact) == (limit + 1, limit, False)
    assert f"at least {limit + 1} tokens" in str(info.value) and "128" in str(info.value)
    # multi-byte text counts its UTF-8 bytes
    with pytest.raises(PromptTooLong):
        frontend.prepare(TextInput(text="é" * (64 * limit + 1)), max_tokens=limit)


def test_chat_over_the_byte_bound_is_rejected_before_rendering(frontend, no_tokenizing):
    chat = ChatInput(messages=[{"role": "user", "content": "x" * 40_000}, {"role": "assistant", "content": "ok"},
                               {"role": "user", "content": "y" * 40_000}])
    with pytest.raises(PromptTooLong, match="conversation text"):
        frontend.prepare(chat, max_tokens=600)


def test_rendered_text_over_the_byte_bound_is_rejected_before_tokenizing(monkeypatch):
    # a template that repeats the message: its client text fits the bound, its output does not
    echo = QwenFrontend.from_resources(qwen35_frontend_resources(),
                                       chat_template_override="{% for i in range(20) %}{{ messages[0].content }}"
                                                              "{% endfor %}")
    monkeypatch.setattr(QwenTokenizer, "encode", lambda *a: pytest.fail("tokenized"))
    with pytest.raises(PromptTooLong, match="rendered conversation"):
        echo.prepare(ChatInput(messages=[{"role": "user", "content": "z" * 1280}]), max_tokens=100)


def test_prompts_at_the_limit_tokenize_exactly(frontend):
    exact = frontend.prepare(TextInput(text=" " * 1280), max_tokens=10)  # the bound is tight here
    assert exact.token_ids == (SPACES,) * 10
    with pytest.raises(PromptTooLong):
        frontend.prepare(TextInput(text=" " * 1281), max_tokens=10)  # 1281 bytes cannot be 10 tokens
    text = "The quick brown fox jumps over the lazy dog. " * 200
    ids = frontend.tokenizer.encode(text)
    assert frontend.prepare(TextInput(text=text), max_tokens=len(ids)).token_ids == tuple(ids)
    chat = ChatInput(messages=[{"role": "user", "content": text}])
    n = len(frontend.prepare(chat).token_ids)
    assert len(frontend.prepare(chat, max_tokens=n).token_ids) == n


def test_token_id_prompts_are_counted_exactly(frontend):
    assert len(frontend.prepare(TextInput(token_ids=(1,) * 5), max_tokens=5)) == 5
    with pytest.raises(PromptTooLong) as info:
        frontend.prepare(TextInput(token_ids=(1,) * 6), max_tokens=5)
    assert (info.value.tokens, info.value.exact) == (6, True)
    with pytest.raises(PromptTooLong):
        frontend.prepare(PreparedPrompt(token_ids=(1,) * 6), max_tokens=5)


@pytest.mark.parametrize("text", [
    "Plain English prose, with numbers 12345 and punctuation!? " * 400,
    "<|im_start|>user\nMixed <think>tokens</think> and ünïcödé, 中文文本, emoji 🎉\n<|im_end|>" * 300,
    "e\u0301\u212a \ud55c\uad6d\uc5b4 \u1100\u1161\u11a8 " * 2000,  # text the NFC normalizer changes
])
def test_long_texts_take_the_gil_releasing_path_with_identical_ids(frontend, text):
    tok = frontend.tokenizer
    assert len(text) >= LONG_TEXT_CHARS
    assert tok.encode(text) == tok._tok.encode(text, add_special_tokens=False).ids
    nbytes = tok.text_bytes(text)  # a lower bound that holds for text the normalizer changes as well
    assert -(-nbytes // tok.longest_token_bytes) <= len(tok.encode(text))
