"""Stop strings: streaming matching agrees with a whole-text reference for every split of the text, holds back
only what may still become a stop string, costs memory linear in the stop strings, and is length-bounded. They
match the answer (content channel) only; a session tracking tokens (the request wants logprobs) releases text
with exactly the tokens that produced it."""

import random
import tracemalloc

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ninfer.contract import ChatInput, FinishReason, SamplingParams, TextInput
from ninfer.contract.events import merge_tool_call_fragments
from ninfer.contract.request import MAX_STOP_CHARS
from ninfer.models.common.qwen import QwenFrontend
from ninfer.models.common.qwen.output_session import QwenOutputSession
from ninfer.models.common.qwen.stop_strings import StopMatcher
from ninfer_qwen35.testing.qwen_vocab import byte_to_unicode, qwen35_frontend_resources


def first_stop(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(start, end) of the first stop string to complete in the whole text: the earliest end; at equal ends
    the longest, which starts first."""
    ends = [(i + len(s), -len(s)) for s in stops if (i := text.find(s)) >= 0]
    if not ends:
        return None
    end, neg_len = min(ends)
    return end + neg_len, end


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """The output for the whole text: everything before the first stop string to complete."""
    match = first_stop(text, stops)
    return (text, False) if match is None else (text[:match[0]], True)


def must_hold(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that may still become a stop string (and so must be held back)."""
    return max((k for k in range(1, len(text) + 1) for s in stops if len(s) > k and s.startswith(text[-k:])),
               default=0)


def stream(matcher: StopMatcher, pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    held, state, out, seen = "", 0, [], ""
    for piece in pieces:
        step = matcher.advance(held, state, piece)
        out.append(step.released)
        if step.matched:
            return "".join(out), True
        held, state, seen = step.held, step.state, seen + piece
        # released as soon as it can no longer become part of a stop string, and never more
        assert "".join(out) + held == seen and len(held) == must_hold(seen, stops)
        assert len(held) < max(map(len, stops))
    return "".join(out) + held, False


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=6), min_size=1, max_size=4),
       text=st.text(alphabet="abcd", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=12))
def test_streaming_matches_the_whole_text_reference_for_any_split(stops, text, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert stream(StopMatcher(stops), pieces, stops) == reference(text, stops)


def test_overlapping_stops_end_at_the_first_completion():
    stops = ["abcd", "bc"]
    for pieces in (["abcd"], ["a", "b", "c", "d"], ["ab", "cd"]):
        assert stream(StopMatcher(stops), pieces, stops) == ("a", True)  # "bc" completes before "abcd"
    stops = ["xab", "ab"]
    assert stream(StopMatcher(stops), ["x", "ab"], stops) == ("", True)  # same end: the longer one counts


def test_matcher_size_is_linear_in_the_stop_strings():
    stops = ["ab" * 500, "x" * MAX_STOP_CHARS, "ab" * 499 + "c"]
    assert len(StopMatcher(stops)) == 1 + 1000 + MAX_STOP_CHARS + 1  # shared prefixes share states


@pytest.fixture(scope="module")
def frontend():
    return QwenFrontend.from_resources(qwen35_frontend_resources(), chat_template_override="builtin:qwen3_5")


def run(session, ids, chunk=1):
    content, finish = [], None
    for i in range(0, len(ids), chunk):
        preview = session.preview(ids[i:i + chunk])
        content.append(session.commit(preview).content)
        if preview.finish_reason is not None:
            finish = preview.finish_reason
            break
    return "".join(content), finish


@settings(max_examples=150, deadline=None)
@given(stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=5), min_size=1, max_size=3),
       text=st.text(alphabet="ab cd", min_size=1, max_size=30), groups=st.lists(st.integers(1, 4), min_size=30))
@example(stops=["abc", "b"], text="abc", groups=[1] * 30)  # one token completes both: "b" ends first
def test_session_output_matches_the_reference_for_any_token_grouping(frontend, stops, text, groups):
    ids = frontend.tokenizer.encode(text)
    session = frontend.open_session(frontend.prepare(TextInput(text="x")), SamplingParams(stop=stops))
    content, finish, i = [], None, 0
    for g in groups:
        if i >= len(ids):
            break
        preview = session.preview(ids[i:i + g])
        content.append(session.commit(preview).content)
        i += preview.accepted
        finish = preview.finish_reason
        if finish is not None:
            break
    if finish is None:  # held text may complete a stop string at the end (then the finish says stop)
        content.append(session.finish(FinishReason.LENGTH).content)
        finish = session.finish_reason
    expected, stopped = reference(text, stops)
    assert ("".join(content), finish is FinishReason.STOP) == (expected, stopped)
    if stopped:  # the token that completes the stop string is the last one accepted
        end = first_stop(text, stops)[1]
        decoded = frontend.tokenizer.decode
        if not text[:end].strip():  # leading whitespace (it may precede <think>) reaches the stop strings with
            # the first token that shows it is content, or at the end
            end = min([len(decoded(ids[:k])) for k in range(1, len(ids) + 1) if decoded(ids[:k]).strip()],
                      default=len(text))
        assert len(decoded(ids[:i - 1])) < end <= len(decoded(ids[:i]))


def test_session_memory_is_linear_in_a_long_stop_string(frontend):
    # Every prefix of an 8000-character stop string would be 32 M characters; the matcher is a few per character.
    tracemalloc.start()
    try:
        QwenOutputSession(frontend.tokenizer, stop_token_ids=(), stop=["y" * 7999 + "z"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8000 * 500


def test_a_long_stop_string_matches_across_many_tokens(frontend):
    stop = "".join(f"line {i}: the quick brown fox\n" for i in range(40))[:1000]
    assert len(stop) == 1000
    prompt = frontend.prepare(TextInput(text="x"))
    ids = frontend.tokenizer.encode("Answer. " + stop + " trailing words")
    for chunk in (1, 3, 64):
        session = frontend.open_session(prompt, SamplingParams(stop=[stop]))
        assert run(session, ids, chunk) == ("Answer. ", FinishReason.STOP)
    # a near miss (the last character differs) is released whole
    session = frontend.open_session(prompt, SamplingParams(stop=[stop]))
    near = frontend.tokenizer.encode("Answer. " + stop[:-1] + "#")
    content, finish = run(session, near)
    assert finish is None and content + session.finish(FinishReason.LENGTH).content == "Answer. " + stop[:-1] + "#"


def test_stop_string_length_is_bounded():
    SamplingParams(stop=["s" * MAX_STOP_CHARS])
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters"):
        SamplingParams(stop=["s" * (MAX_STOP_CHARS + 1)])


# -- the answer channel: stop strings match content only; tracked sessions release text with its tokens ----------
IM_END = 248046
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def thinking_chat(frontend, tools=()):
    return frontend.prepare(ChatInput(messages=[{"role": "user", "content": "Q?"}], tools=tools))


def run_rows(frontend, prompt, tokens, groups, **sampling):
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
    deltas, finish, accepted = run_rows(frontend, thinking_chat(frontend), tokens, groups, stop=["\n\n"])
    assert joined(deltas, "reasoning") == "Let me think.\n\nStep two."
    assert joined(deltas, "content") == "The answer." and finish is FinishReason.STOP
    assert frontend.tokenizer.decode(tokens[:accepted]).endswith("The answer.\n\n")


def test_stop_strings_never_match_markers_or_tool_call_markup(frontend):
    text = ("Thinking: think of a function for Rome.\n</think>\n\nCalling.<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    tokens = frontend.tokenizer.encode(text) + [IM_END]
    stops = ["think", "</think>", "<tool_call>", "function", "Rome"]
    deltas, finish, _ = run_rows(frontend, thinking_chat(frontend, [WEATHER]), tokens, [1] * 99, stop=stops)
    assert joined(deltas, "content") == "Calling." and finish is FinishReason.TOOL_CALLS
    assert "".join(c.arguments for d in deltas for c in d.tool_calls) == '{"city": "Rome"}'
    # in the answer the same string stops the output
    tokens = frontend.tokenizer.encode("hm\n</think>\n\nI think so") + [IM_END]
    deltas, finish, _ = run_rows(frontend, thinking_chat(frontend), tokens, [2] * 99, stop=stops)
    assert (joined(deltas, "reasoning"), joined(deltas, "content"), finish) == ("hm", "I ", FinishReason.STOP)


def test_stop_token_ids_end_the_output_inside_reasoning(frontend):
    stop_id = frontend.tokenizer.encode(".")[0]
    tokens = frontend.tokenizer.encode("Let me see. More\n</think>\n\nA.")
    deltas, finish, accepted = run_rows(frontend, thinking_chat(frontend), tokens, [1] * 99, stop=["\n"],
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
            plain, _, _ = run_rows(frontend, thinking_chat(frontend, tools), tokens, [1] * len(tokens), stop=stops)
            deltas, finish, accepted = run_rows(frontend, thinking_chat(frontend, tools), tokens, groups, stop=stops,
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
    deltas, _, _ = run_rows(frontend, prompt, tokens, [1] * 9, logprobs=True)
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
    plain, finish, accepted = run_rows(frontend, prompt, tokens, [1] * len(tokens), stop=stop)
    deltas, finish2, accepted2 = run_rows(frontend, prompt, tokens, [rng.randint(1, 6) for _ in tokens], stop=stop,
                                     logprobs=True)
    _check_spans(deltas, accepted2)
    assert (finish2, accepted2) == (finish, accepted)
    for field in ("content", "reasoning"):
        assert joined(deltas, field) == joined(plain, field)
    calls = [[(c.name, c.arguments) for c in merge_tool_call_fragments([f for d in ds for f in d.tool_calls])]
             for ds in (plain, deltas)]
    assert calls[0] == calls[1]
