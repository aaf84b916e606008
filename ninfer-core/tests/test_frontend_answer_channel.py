"""Stop strings match the answer (content channel) only, and a session tracking tokens (the request wants
logprobs) releases text with exactly the tokens that produced it."""

import random

import pytest

from ninfer.contract import ChatInput, FinishReason, SamplingParams, TextInput
from ninfer.contract.events import merge_tool_call_fragments
from ninfer.models.common.qwen import QwenFrontend
from ninfer_qwen35.testing.qwen_vocab import byte_to_unicode, qwen35_frontend_resources

IM_END = 248046
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def frontend():
    return QwenFrontend.from_resources(qwen35_frontend_resources(), chat_template_override="builtin:qwen3_5")


def thinking_chat(frontend, tools=()):
    return frontend.prepare(ChatInput(messages=[{"role": "user", "content": "Q?"}], tools=tools))


def run(frontend, prompt, tokens, groups, **sampling):
    """Feed ``tokens`` in rows of the given sizes (then finish at the length limit); the deltas and finish."""
    session = frontend.open_session(prompt, SamplingParams(**sampling))
    deltas, i, finish = [], 0, None
    for size in groups:
        if i >= len(tokens):
            break
        preview = session.preview(tokens[i:i + size])
        deltas.append(session.commit(preview))
        i += preview.accepted
        if preview.finish_reason is not None:
            finish = preview.finish_reason
            break
    if finish is None:
        deltas.append(session.finish(FinishReason.LENGTH))
        finish = FinishReason.LENGTH
    return deltas, finish, i


def joined(deltas, field):
    return "".join(getattr(d, field) for d in deltas)


@pytest.mark.parametrize("groups", [[1] * 99, [3] * 99, [99]])
def test_stop_string_ignores_reasoning_and_cuts_the_answer(frontend, groups):
    tokens = frontend.tokenizer.encode("Let me think.\n\nStep two.\n</think>\n\nThe answer.\n\nMore text.")
    deltas, finish, accepted = run(frontend, thinking_chat(frontend), tokens, groups, stop=["\n\n"])
    assert joined(deltas, "reasoning") == "Let me think.\n\nStep two."
    assert joined(deltas, "content") == "The answer." and finish is FinishReason.STOP
    assert frontend.tokenizer.decode(tokens[:accepted]).endswith("The answer.\n\n")


def test_stop_strings_never_match_markers_or_tool_call_markup(frontend):
    text = ("Thinking: think of a function for Rome.\n</think>\n\nCalling.<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    tokens = frontend.tokenizer.encode(text) + [IM_END]
    stops = ["think", "</think>", "<tool_call>", "function", "Rome"]
    deltas, finish, _ = run(frontend, thinking_chat(frontend, [WEATHER]), tokens, [1] * 99, stop=stops)
    assert joined(deltas, "content") == "Calling." and finish is FinishReason.TOOL_CALLS
    assert "".join(c.arguments for d in deltas for c in d.tool_calls) == '{"city": "Rome"}'
    # in the answer the same string stops the output
    tokens = frontend.tokenizer.encode("hm\n</think>\n\nI think so") + [IM_END]
    deltas, finish, _ = run(frontend, thinking_chat(frontend), tokens, [2] * 99, stop=stops)
    assert (joined(deltas, "reasoning"), joined(deltas, "content"), finish) == ("hm", "I ", FinishReason.STOP)


def test_stop_token_ids_end_the_output_inside_reasoning(frontend):
    stop_id = frontend.tokenizer.encode(".")[0]
    tokens = frontend.tokenizer.encode("Let me see. More\n</think>\n\nA.")
    deltas, finish, accepted = run(frontend, thinking_chat(frontend), tokens, [1] * 99, stop=["\n"],
                                   stop_token_ids=(stop_id,))
    assert (joined(deltas, "reasoning"), joined(deltas, "content"), finish) == ("Let me see", "", FinishReason.STOP)


def _check_spans(deltas, accepted):
    """Each delta's spans rebuild its text per channel; indexes rise and name accepted tokens."""
    last = -1
    for d in deltas:
        assert d.token_spans is not None
        for channel in ("content", "reasoning"):
            assert "".join(s.text for s in d.token_spans if s.channel == channel) == getattr(d, channel)
        for s in d.token_spans:
            assert last <= s.index < accepted and (s.part or s.index > last)
            last = s.index


@pytest.mark.parametrize("seed", range(8))
def test_token_spans_carry_exactly_the_text_for_any_grouping(frontend, seed):
    rng = random.Random(seed)
    alphabet = byte_to_unicode()

    def as_bytes(text):  # one token per byte: characters and markers split over tokens
        return [frontend.tokenizer.token_id(alphabet[b]) for b in text.encode()]

    enc = frontend.tokenizer.encode
    parts = [enc(" Größe 🤖 ok.\n\n"), as_bytes("é 🎉</think>"), enc("\n\n  Antwort: 🎉 "), as_bytes("ü\n\n"),
             enc("<tool_call>\n<function=get_weather>\n<parameter=city>\nKöln\n</parameter>\n</function>\n"
                 "</tool_call>"), enc(" Danach <tool_call> nicht.\n\nEnde"), as_bytes("ß"),
             as_bytes("ß")[:1]]  # the output ends inside a character: U+FFFD
    tokens = [t for p in parts for t in p]
    for stops in ([], ["\n\nE"], ["Danach"]):
        for tools in ((), (WEATHER,)):
            groups = [rng.randint(1, 6) for _ in tokens]
            plain, _, _ = run(frontend, thinking_chat(frontend, tools), tokens, [1] * len(tokens), stop=stops)
            deltas, finish, accepted = run(frontend, thinking_chat(frontend, tools), tokens, groups, stop=stops,
                                           logprobs=True)
            _check_spans(deltas, accepted)
            # tracking changes when text goes out, never what it is
            for field in ("content", "reasoning"):
                assert joined(deltas, field) == joined(plain, field)
            assert joined(deltas, "reasoning") == "Größe 🤖 ok.\n\né 🎉"
            if not stops:
                assert joined(deltas, "content").endswith("nicht.\n\nEndeß\ufffd")


def test_leading_whitespace_of_a_completion_goes_out_with_its_token(frontend):
    """A raw prompt: leading whitespace waits (it may precede <think>); its token waits with it."""
    prompt = frontend.prepare(TextInput(text="x"))
    tokens = frontend.tokenizer.encode(" Hello world")
    deltas, _, _ = run(frontend, prompt, tokens, [1] * 9, logprobs=True)
    assert [(d.content, [s.text for s in d.token_spans]) for d in deltas if d.content] == [
        (" Hello", [" Hello"]), (" world", [" world"])]


@pytest.mark.parametrize("seed", range(12))
def test_marker_soup_tracked_and_untracked_agree(frontend, seed):
    """Fuzz: markers, partial tags, tool calls that fall back to text, split characters and stop strings in
    random rows: tracking never changes the text, and every delta's spans rebuild it exactly."""
    rng = random.Random(2000 + seed)
    alphabet = byte_to_unicode()
    pieces = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n<function=get_weather>\n", "<function=",
              "<parameter=city>\n", "\n</parameter>\n", "</function>", "</", "<", ">", "\n", "\n\n", " ", "Köln",
              "x<y", "🤖", "END", "EN"]
    tokens = []
    for _ in range(rng.randint(5, 40)):
        text = rng.choice(pieces)
        split = rng.random() < 0.5
        tokens += [frontend.tokenizer.token_id(alphabet[b]) for b in text.encode()] if split else \
            frontend.tokenizer.encode(text)
    if rng.random() < 0.5:
        tokens.append(IM_END)
    tools = [WEATHER] if rng.random() < 0.7 else []
    prompt = thinking_chat(frontend, tools) if rng.random() < 0.5 else frontend.prepare(TextInput(text="x"))
    stop = rng.choice([[], ["END"], ["\n\n"], [" "]])
    plain, finish, accepted = run(frontend, prompt, tokens, [1] * len(tokens), stop=stop)
    deltas, finish2, accepted2 = run(frontend, prompt, tokens, [rng.randint(1, 6) for _ in tokens], stop=stop,
                                     logprobs=True)
    _check_spans(deltas, accepted2)
    assert (finish2, accepted2) == (finish, accepted)
    for field in ("content", "reasoning"):
        assert joined(deltas, field) == joined(plain, field)
    calls = [[(c.name, c.arguments) for c in merge_tool_call_fragments([f for d in ds for f in d.tool_calls])]
             for ds in (plain, deltas)]
    assert calls[0] == calls[1]
