"""OutputSession events with the real Qwen3.5 vocabulary: stop strings and tokens, thinking channels, XML tool
calls while streaming, preview/commit semantics and turn boundaries. Each case checks the exact events."""

import json

import pytest

from ninfer.contract import ChatInput, FinishReason, OutputSession, Preview, SamplingParams, TextInput
from ninfer.contract.events import ToolCall
from ninfer.models.common.qwen import QwenFrontend, TurnBoundary, sampling_from_generation_config
from ninfer.models.common.qwen.output_session import QwenOutputSession
from ninfer_qwen35.testing.qwen_vocab import qwen35_frontend_resources

IM_END, ENDOFTEXT, THINK_CLOSE, TOOL_OPEN = 248046, 248044, 248069, 248058
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
CALL_TEXT = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def frontend():
    return QwenFrontend.from_resources(qwen35_frontend_resources(), chat_template_override="builtin:qwen3_5")


def ids(frontend, text):
    return frontend.tokenizer.encode(text)


def chat(frontend, tools=(), **kwargs):
    return frontend.prepare(ChatInput(messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                                      template_kwargs=kwargs))


def session_for(frontend, prompt, **sampling):
    session = frontend.open_session(prompt, SamplingParams(**sampling))
    session._call_prefix = "call_t"  # deterministic ids for exact expectations
    return session


def step(session, tokens, *, at_length_limit=False):
    """Preview + commit one provisional row; the event as a tuple (accepted, finish, reasoning, content, calls)."""
    p = session.preview(tokens, at_length_limit=at_length_limit)
    d = session.commit(p)
    return p.accepted, p.finish_reason, d.reasoning, d.content, d.tool_calls


def test_session_satisfies_the_contract(frontend):
    assert isinstance(frontend.open_session(chat(frontend), SamplingParams()), OutputSession)


def test_stop_string_spanning_token_boundaries(frontend):
    session = session_for(frontend, frontend.prepare(TextInput(text="x")), stop=["END!"])
    assert ids(frontend, "Hello E") == [9419, 458] and ids(frontend, "! more") == [0, 777]
    events = [step(session, [9419]), step(session, [458]), step(session, [45]), step(session, [35]),
              step(session, [0, 777])]
    assert events == [
        (1, None, "", "Hello", ()),
        (1, None, "", " ", ()),      # "E" may start "END!": held back
        (1, None, "", "", ()),       # "EN"
        (1, None, "", "", ()),       # "END"
        (1, FinishReason.STOP, "", "", ()),  # "!" completes it; " more" is not accepted
    ]
    assert session.content == "Hello " and session.finish(FinishReason.STOP).content == ""


def test_partial_stop_string_is_released_when_it_does_not_match(frontend):
    session = session_for(frontend, frontend.prepare(TextInput(text="x")), stop=["END!"])
    # (stop strings see the routed content: " E" cannot open a <think>, so its space goes out at once)
    assert [step(session, [t]) for t in (458, 45, 777)] == [
        (1, None, "", " ", ()), (1, None, "", "", ()), (1, None, "", "EN more", ())]


def test_held_stop_prefix_is_released_at_max_tokens(frontend):
    session = session_for(frontend, frontend.prepare(TextInput(text="x")), stop=["</answer>"])
    assert ids(frontend, "x </ans") == [87, 672, 581]
    assert step(session, [87, 672]) == (2, None, "", "x ", ())
    assert step(session, [581], at_length_limit=True) == (1, FinishReason.LENGTH, "", "</ans", ())


def test_stop_at_the_first_token(frontend):
    session = session_for(frontend, chat(frontend))
    preview = session.preview([IM_END, 9419])
    assert preview.accepted == 1 and preview.finish_reason is FinishReason.STOP
    assert preview.delta.token_ids == (IM_END,) and preview.delta.content == preview.delta.reasoning == ""
    assert preview.boundary == TurnBoundary(end=1, message={"role": "assistant", "content": ""}, exact=False)
    session.commit(preview)
    assert session.finish(FinishReason.STOP) == type(preview.delta)()  # already final: nothing more
    # a stop string matching inside the first token
    session = session_for(frontend, frontend.prepare(TextInput(text="x")), stop=["i"])
    assert step(session, [12675, 9419]) == (1, FinishReason.STOP, "", "H", ())


def test_model_and_request_stop_tokens(frontend):
    assert frontend.eos_token_ids == (248046, 248044)
    session = session_for(frontend, frontend.prepare(TextInput(text="x")), stop_token_ids=[9419])
    assert step(session, [777, 9419, 777]) == (2, FinishReason.STOP, "", " more", ())
    session = session_for(frontend, frontend.prepare(TextInput(text="x")), ignore_eos=True)
    assert step(session, [ENDOFTEXT, 777]) == (2, None, "", " more", ())  # special tokens carry no text


def test_tool_call_split_across_many_deltas(frontend):
    prompt = chat(frontend, tools=[WEATHER])
    assert prompt.reasoning_open
    session = session_for(frontend, prompt)
    tokens = ids(frontend, "Checking the weather.\n") + [THINK_CLOSE] + ids(frontend, "\n\nLet me look.\n\n") \
        + ids(frontend, CALL_TEXT) + [IM_END]
    events = [e for e in (step(session, [t]) for t in tokens) if e[1:] != (None, "", "", ())]
    call = lambda args, **kw: ToolCall(index=0, id=kw.get("id", ""), name=kw.get("name", ""), arguments=args)  # noqa: E731
    assert events == [
        (1, None, "Checking", "", ()),
        (1, None, " the", "", ()),
        (1, None, " weather", "", ()),
        (1, None, ".", "", ()),       # the trailing "\n" is held, then dropped at </think>
        (1, None, "", "Let", ()),     # "\n\n" after </think> is trimmed
        (1, None, "", " me", ()),
        (1, None, "", " look", ()),
        (1, None, "", ".", ()),       # "\n\n" before <tool_call> is trimmed
        (1, None, "", "", (call("", id="call_t_0", name="get_weather"),)),   # at ">" of <function=...>
        (1, None, "", "", (call('{"city": "'),)),                            # a string value streams...
        (1, None, "", "", (call("San"),)),
        (1, None, "", "", (call(" Francisco"),)),                            # ("\n</parameter" is held)
        (1, None, "", "", (call('"'),)),                                     # ...until </parameter>
        (1, None, "", "", (call(', "days": 3'),)),                           # typed by the schema, whole
        (1, None, "", "", (call("}"),)),                                     # at </function>
        (1, FinishReason.TOOL_CALLS, "", "", ()),
    ]
    assert session.tool_calls == (ToolCall(index=0, id="call_t_0", name="get_weather",
                                           arguments='{"city": "San Francisco", "days": 3}'),)
    assert json.loads(session.tool_calls[0].arguments) == {"city": "San Francisco", "days": 3}
    assert (session.reasoning, session.content) == ("Checking the weather.", "Let me look.")


def test_tool_call_in_one_multi_token_row_and_exact_turn_boundary(frontend):
    session = session_for(frontend, chat(frontend, tools=[WEATHER]))
    tokens = ids(frontend, "Need data.\n") + [THINK_CLOSE] + ids(frontend, "\n\n" + CALL_TEXT) + [IM_END, 9419]
    preview = session.preview(tokens)
    assert preview.accepted == len(tokens) - 1 and preview.finish_reason is FinishReason.TOOL_CALLS
    assert preview.delta.reasoning == "Need data." and preview.delta.content == ""
    # the fragments of one call inside one row are joined
    assert preview.delta.tool_calls == (ToolCall(index=0, id="call_t_0", name="get_weather",
                                                 arguments='{"city": "San Francisco", "days": 3}'),)
    boundary = preview.boundary
    assert boundary.end == preview.accepted and boundary.exact is True
    assert boundary.message == {"role": "assistant", "content": "", "reasoning_content": "Need data.",
                                "tool_calls": [{"id": "call_t_0", "type": "function", "function": {
                                    "name": "get_weather", "arguments": '{"city": "San Francisco", "days": 3}'}}]}
    # the history with this message re-renders the generated tokens exactly
    history = [{"role": "user", "content": "Weather?"}, boundary.message]
    rebuilt = frontend.prepare(ChatInput(messages=history, tools=[WEATHER], add_generation_prompt=False))
    assert rebuilt.token_ids[:len(chat(frontend, tools=[WEATHER]))] == chat(frontend, tools=[WEATHER]).token_ids
    assert rebuilt.token_ids[len(chat(frontend, tools=[WEATHER])):][:preview.accepted] == tuple(tokens[:-1])


def test_unterminated_thinking_at_max_tokens(frontend):
    session = session_for(frontend, chat(frontend))
    assert ids(frontend, "I think\n\n") == [40, 1683, 271]
    assert step(session, [40, 1683]) == (2, None, "I think", "", ())
    assert step(session, [271]) == (1, None, "", "", ())  # trailing whitespace may end the reasoning: held
    assert step(session, [672], at_length_limit=True) == (1, FinishReason.LENGTH, "\n\n </", "", ())
    assert session.reasoning == "I think\n\n </" and session.content == ""
    # finish() on a live session flushes the same way (e.g. deadline), reasoning stays reasoning
    session = session_for(frontend, chat(frontend))
    step(session, [40, 1683, 271])
    assert session.finish(FinishReason.DEADLINE).reasoning == ""
    assert session.finish_reason is FinishReason.DEADLINE and session.reasoning == "I think"


def test_thinking_disabled_and_model_opened_thinking(frontend):
    session = session_for(frontend, chat(frontend, enable_thinking=False))
    tokens = ids(frontend, "Sunny.") + [IM_END]
    assert step(session, tokens) == (len(tokens), FinishReason.STOP, "", "Sunny.", ())
    # a raw prompt: the model opens <think> itself (Qwen3 style)
    session = session_for(frontend, frontend.prepare(TextInput(text="Q:")))
    tokens = [248068] + ids(frontend, "\nhm\n") + [THINK_CLOSE] + ids(frontend, "\n\nA")
    assert step(session, tokens) == (len(tokens), None, "hm", "A", ())


def test_tool_call_inside_unclosed_thinking_ends_reasoning(frontend):
    session = session_for(frontend, chat(frontend, tools=[WEATHER]))
    tokens = ids(frontend, "Use the tool.\n\n") + ids(frontend, CALL_TEXT) + [IM_END]
    accepted, finish, reasoning, content, calls = step(session, tokens)
    assert (accepted, finish, reasoning, content) == (len(tokens), FinishReason.TOOL_CALLS, "Use the tool.", "")
    assert session.tool_calls[0].name == "get_weather"


def test_without_tools_tool_call_text_is_content(frontend):
    session = session_for(frontend, chat(frontend, enable_thinking=False))
    text = "<tool_call>\n<function=f>\n</function>\n</tool_call>"
    assert step(session, ids(frontend, text) + [IM_END]) == (
        len(ids(frontend, text)) + 1, FinishReason.STOP, "", text, ())


def test_arguments_are_typed_by_schema(frontend):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
        "o": {"type": "object"}, "a": {"type": "array"}, "z": {"type": ["integer", "null"]}}}}}
    body = ("<tool_call>\n<function=f>\n<parameter=s>\n001\n</parameter>\n<parameter=i>\n42\n</parameter>\n"
            "<parameter=n>\n2.5\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{'k': [1]}\n"
            "</parameter>\n<parameter=a>\n[1, \"é\"]\n</parameter>\n<parameter=z>\nnull\n</parameter>\n"
            "<parameter=u>\nline1\nline2\n<parameter=i>\nnot a number\n</parameter>\n</function>\n</tool_call>")
    session = session_for(frontend, chat(frontend, tools=[tool], enable_thinking=False))
    step(session, ids(frontend, body) + [IM_END])
    args = session.tool_calls[0].arguments
    assert args == ('{"s": "001", "i": 42, "n": 2.5, "b": true, "o": {"k": [1]}, "a": [1, "é"], "z": null, '
                    '"u": "line1\\nline2", "i": "not a number"}')


def test_malformed_tool_call_falls_back_to_content(frontend):
    session = session_for(frontend, chat(frontend, tools=[WEATHER], enable_thinking=False))
    text = "<tool_call>\nnot xml at all"
    assert step(session, ids(frontend, text) + [IM_END]) == (
        len(ids(frontend, text)) + 1, FinishReason.STOP, "", text, ())


def test_unterminated_tool_call_at_max_tokens_closes_its_arguments(frontend):
    session = session_for(frontend, chat(frontend, tools=[WEATHER], enable_thinking=False))
    partial = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n4"
    accepted, finish, _, content, calls = step(session, ids(frontend, partial), at_length_limit=True)
    assert finish is FinishReason.LENGTH and content == ""
    assert session.tool_calls == (ToolCall(index=0, id="call_t_0", name="get_weather",
                                           arguments='{"city": "Paris"}'),)


def test_preview_changes_nothing_and_commit_checks_its_base(frontend):
    session = session_for(frontend, frontend.prepare(TextInput(text="x")), stop=["END!"])
    first = session.preview([9419, 458])
    again = session.preview([9419, 458])
    assert (first.accepted, first.delta) == (again.accepted, again.delta) and session.generated == 0
    other = session.preview([777])
    session.commit(first)
    assert session.generated == 2 and session.content == "Hello "
    with pytest.raises(RuntimeError, match="current state"):
        session.commit(other)  # made before the last commit
    with pytest.raises(RuntimeError, match="current state"):
        session.commit(Preview(accepted=1, finish_reason=None, delta=first.delta))
    session.commit(session.preview([45, 35, 0], at_length_limit=False))
    with pytest.raises(RuntimeError, match="after the output finished"):
        session.preview([1])


def test_sampling_defaults_come_from_generation_config(frontend):
    assert frontend.sampling_defaults() == SamplingParams(temperature=1.0, top_p=0.95, top_k=20)
    assert sampling_from_generation_config({"do_sample": False, "temperature": 0.7}).temperature == 0.0
    assert sampling_from_generation_config({}) == SamplingParams()
    # as transformers and vLLM read it: the model's default, also under greedy decoding
    assert sampling_from_generation_config({"do_sample": False, "repetition_penalty": 1.1}) == SamplingParams(
        temperature=0.0, repetition_penalty=1.1)
    with pytest.raises(ValueError, match="generation_config"):
        sampling_from_generation_config({"top_p": 2.0})


def test_session_class_is_exported():
    assert QwenOutputSession.__module__.endswith("output_session")


def _run_grouped(frontend, prompt, tokens, groups, **sampling):
    """Feed ``tokens`` in provisional rows of the given sizes; return the joined output and the finish."""
    session = session_for(frontend, prompt, **sampling)
    reasoning, content, fragments, i, finish = [], [], [], 0, None
    for size in groups:
        row = tokens[i:i + size]
        if not row:
            break
        preview = session.preview(row, at_length_limit=i + size >= len(tokens))
        delta = session.commit(preview)
        assert preview.accepted == len(row) or preview.finish_reason is not None
        reasoning.append(delta.reasoning)
        content.append(delta.content)
        fragments.extend(delta.tool_calls)
        i += preview.accepted
        finish = preview.finish_reason
        if finish is not None:
            break
    return "".join(reasoning), "".join(content), session.tool_calls, finish, i


@pytest.mark.parametrize("seed", range(6))
def test_grouping_of_tokens_into_rows_does_not_change_the_output(frontend, seed):
    """Speculative rows of any size give the same output as token-by-token decoding, also when the markers,
    stop strings and multi-byte characters arrive split into single-byte tokens."""
    import random

    from ninfer_qwen35.testing.qwen_vocab import byte_to_unicode

    rng = random.Random(seed)
    alphabet = byte_to_unicode()

    def as_bytes(text):  # a non-canonical tokenization: one token per byte
        return [frontend.tokenizer.token_id(alphabet[b]) for b in text.encode()]

    parts = [ids(frontend, "Größe prüfen 🤖 ok.\n"), as_bytes("</think>"), ids(frontend, "\n\nAntwort: 🎉 "),
             as_bytes("<tool_call>\n<function=get_weather>\n<parameter=city>\nK"), ids(frontend, "öln\n"),
             as_bytes("</parameter>\n</function>\n</tool_call>"), ids(frontend, " Danach STOP hier"), [IM_END]]
    tokens = [t for p in parts for t in p]
    prompt = chat(frontend, tools=[WEATHER])
    one_by_one = _run_grouped(frontend, prompt, tokens, [1] * len(tokens), stop=["STOP"])
    # whitespace around the tool call is trimmed as the template trims it
    assert one_by_one[:2] == ("Größe prüfen 🤖 ok.", "Antwort: 🎉Danach ")
    assert one_by_one[2][0].arguments == '{"city": "Köln"}' and one_by_one[3] is FinishReason.STOP
    groups = [rng.randint(1, 9) for _ in tokens]
    assert _run_grouped(frontend, prompt, tokens, groups, stop=["STOP"]) == one_by_one


def test_streamed_string_values_keep_markup_quotes_and_newlines(frontend):
    from ninfer_qwen35.testing.qwen_vocab import byte_to_unicode

    alphabet = byte_to_unicode()
    tool = {"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "text": {"type": "string"}}}}}
    value = 'if a <b and c</p:\n\treturn "x\\n"\n\n'
    body = f"<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=text>\n{value}\n" \
           "</parameter>\n</function>\n</tool_call>"
    tokens = [frontend.tokenizer.token_id(alphabet[b]) for b in body.encode()] + [IM_END]  # one byte per token
    session = session_for(frontend, chat(frontend, tools=[tool], enable_thinking=False))
    pieces = [step(session, [t])[4] for t in tokens]
    assert json.loads(session.tool_calls[0].arguments) == {"path": "a.py", "text": value}
    text_pieces = [c.arguments for p in pieces for c in p]
    assert text_pieces.count("") == 1 and len(text_pieces) > 20  # the name once, then the value streams
    assert session.finish_reason is FinishReason.TOOL_CALLS
    # cut off inside the streamed string: it is closed with what arrived
    session = session_for(frontend, chat(frontend, tools=[tool], enable_thinking=False))
    step(session, ids(frontend, "<tool_call>\n<function=write>\n<parameter=text>\nhello wor"), at_length_limit=True)
    assert session.tool_calls[0].arguments == '{"text": "hello wor"}'


@pytest.mark.parametrize("seed", range(8))
def test_random_marker_soup_never_fails_and_tool_arguments_stay_json(frontend, seed):
    """Fuzz: arbitrary mixes of markers, partial tags, whitespace and text, canonical or byte-split, in random
    rows, with or without tools: no exception, grouping does not matter, every tool call's arguments parse."""
    import random

    from ninfer_qwen35.testing.qwen_vocab import byte_to_unicode

    rng = random.Random(1000 + seed)
    alphabet = byte_to_unicode()
    pieces = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n<function=get_weather>\n", "<function=",
              "<parameter=city>\n", "<parameter=days>", "\n</parameter>\n", "</function>", "</", "<", ">", "\n",
              "\n\n", " ", "Köln", "42", "x<y", '"q"', "🤖", "END"]
    tokens = []
    for _ in range(rng.randint(5, 40)):
        text = rng.choice(pieces)
        if rng.random() < 0.5:
            tokens += [frontend.tokenizer.token_id(alphabet[b]) for b in text.encode()]
        else:
            tokens += ids(frontend, text)
    if rng.random() < 0.5:
        tokens.append(IM_END)
    tools = [WEATHER] if rng.random() < 0.7 else []
    prompt = chat(frontend, tools=tools, enable_thinking=rng.random() < 0.3)
    stop = ["END"] if rng.random() < 0.3 else []
    one = _run_grouped(frontend, prompt, tokens, [1] * len(tokens), stop=stop)
    grouped = _run_grouped(frontend, prompt, tokens, [rng.randint(1, 6) for _ in tokens], stop=stop)
    assert grouped == one
    for call in one[2]:
        assert isinstance(json.loads(call.arguments), dict) and call.name and call.id
