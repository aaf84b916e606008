"""Stop strings: streaming matching agrees with a whole-text reference for every split of the text, holds back
only what may still become a stop string, costs memory linear in the stop strings, and is length-bounded."""

import tracemalloc

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ninfer.contract import FinishReason, SamplingParams, TextInput
from ninfer.contract.request import MAX_STOP_CHARS
from ninfer.models.common.qwen import QwenFrontend
from ninfer.models.common.qwen.output_session import QwenOutputSession
from ninfer.models.common.qwen.stop_strings import StopMatcher
from ninfer_qwen35.testing.qwen_vocab import qwen35_frontend_resources


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
