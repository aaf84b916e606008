"""The project's Qwen3.5 chat template renders the documented prompt format; the environment matches
transformers' template environment and turns every failure into a TemplateError."""

import json

import pytest

from ninfer.contract import ChatInput
from ninfer.engine.errors import Unrepresentable
from ninfer.models.common.qwen import ChatTemplate, QwenFrontend, TemplateError, builtin_template
from ninfer.models.common.qwen.chat_template import normalize_messages
from ninfer_qwen35.testing.qwen_vocab import qwen35_frontend_resources

TOOL_INSTRUCTIONS = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n</IMPORTANT>")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Wetter für <Stadt> & Umgebung",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def template():
    return ChatTemplate(builtin_template())


def test_thinking_on_and_off(template):
    chat = [{"role": "user", "content": "  Hi there  "}]
    assert template.render(chat) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert template.render(chat, enable_thinking=False) == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert template.render(chat, add_generation_prompt=False) == "<|im_start|>user\nHi there<|im_end|>\n"


def test_system_and_multi_turn_drop_reasoning_of_earlier_turns(template):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "Times 3?"},
        {"role": "assistant", "content": "<think>\nMultiply.\n</think>\n\n12"},
    ]
    assert template.render(chat, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nTimes 3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nMultiply.\n</think>\n\n12<|im_end|>\n")
    # preserve_thinking keeps every turn's reasoning
    assert "<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4<|im_end|>" in template.render(
        chat, add_generation_prompt=False, preserve_thinking=True)


def test_tools_tool_calls_and_tool_responses(template):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "days": 2}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Bern", "opts": {"unit": "°C"}}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]
    expected = (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + json.dumps(WEATHER, ensure_ascii=False) + TOOL_INSTRUCTIONS + "\n\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n"
        '<parameter=opts>\n{"unit": "°C"}\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert template.render(chat, tools=[WEATHER]) == expected
    # tools without a system message; a call with no content and no arguments
    short = template.render([{"role": "user", "content": "Go"},
                             {"role": "assistant", "content": None,
                              "tool_calls": [{"function": {"name": "ping", "arguments": ""}}]}],
                            tools=[WEATHER], add_generation_prompt=False)
    assert short.startswith("<|im_start|>system\n# Tools\n")
    assert short.endswith("</IMPORTANT><|im_end|>\n<|im_start|>user\nGo<|im_end|>\n<|im_start|>assistant\n"
                          "<think>\n\n</think>\n\n<tool_call>\n<function=ping>\n</function>\n</tool_call><|im_end|>\n")


def test_same_bytes_as_transformers(template):
    from transformers.utils.chat_template_utils import render_jinja_template

    chat = normalize_messages([
        {"role": "system", "content": "Sys"}, {"role": "user", "content": "Wetter? <b>&'"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Köln"}}}]},
        {"role": "tool", "content": "ok"}])
    for kwargs in ({}, {"enable_thinking": False}):
        ours = template.render(chat, tools=[WEATHER], **kwargs)
        theirs = render_jinja_template(conversations=[chat], tools=[WEATHER], chat_template=builtin_template(),
                                       add_generation_prompt=True, **kwargs)[0][0]
        assert ours == theirs


def test_environment_matches_checkpoint_templates():
    t = ChatTemplate("{{ messages[0].content|tojson }}|{{ tools|tojson }}|{{ strftime_now('%Y') }}|{{ bos_token }}",
                     special_tokens={"bos_token": "<s>"})
    out = t.render([{"role": "user", "content": "ü <x> & 'q'"}], tools=[{"b": 1, "a": 2}])
    year = out.split("|")[2]
    assert out == f'"ü <x> & \'q\'"|[{{"b": 1, "a": 2}}]|{year}|<s>' and year.isdigit()
    loop = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
                        "{% endfor %}")
    assert loop.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"
    marked = ChatTemplate("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
                          "{{ {'k': 'v'}|tojson(indent=1) }}")
    assert marked.render([{"role": "assistant", "content": "a"}]) == '[a]{\n "k": "v"\n}'


@pytest.mark.parametrize(("source", "match"), [
    ("{{ raise_exception('Only user and assistant roles.') }}", "Only user and assistant roles"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ("{% set x = [] %}{{ x.append(1) }}", "unsafe"),
    ("{% for m in messages %}", "does not compile"),
    ("{{ messages[5].content.upper() }}", "chat template"),
])
def test_template_failures_are_clear_request_errors(source, match):
    with pytest.raises(TemplateError, match=match) as info:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert isinstance(info.value, ValueError) and isinstance(info.value, Unrepresentable)
    assert info.value.http_status == 400


@pytest.mark.parametrize(("messages", "match"), [
    ([], "no messages"),
    ([{"role": "assistant", "content": "x"}], "no user query"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "s"}], "must come first"),
    ([{"role": "wizard", "content": "x"}, {"role": "user", "content": "x"}], "Unknown message role: wizard"),
    ([{"role": "user", "content": {"text": "x"}}], "string or a list of parts"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}], "not valid JSON"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}], "must be a JSON object"),
    (["hello"], "must be an object"),
])
def test_bad_conversations(template, messages, match):
    with pytest.raises(TemplateError, match=match):
        template.render(messages)


def test_render_does_not_mutate_input(template):
    chat = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    before = json.dumps(chat)
    template.render(chat)
    assert json.dumps(chat) == before


def test_frontend_template_selection_and_prompt():
    resources = qwen35_frontend_resources(chat_template="{{ 'artifact:' + messages[0].content }}")
    assert QwenFrontend.from_resources(resources).prepare(
        ChatInput(messages=[{"role": "user", "content": "a"}])).text == "artifact:a"
    override = QwenFrontend.from_resources(resources, chat_template_override="{{ 'override' }}")
    assert override.prepare(ChatInput(messages=[{"role": "user", "content": "a"}])).text == "override"
    frontend = QwenFrontend.from_resources(resources, chat_template_override="builtin:qwen3_5")
    prompt = frontend.prepare(ChatInput(messages=[{"role": "user", "content": "Hi"}]))
    assert prompt.reasoning_open and prompt.token_ids[-2:] == (248068, 198)  # <think> \n
    assert prompt.token_ids[:1] == (248045,)
    closed = frontend.prepare(ChatInput(messages=[{"role": "user", "content": "Hi"}],
                                        template_kwargs={"enable_thinking": False}))
    assert not closed.reasoning_open and closed.text.endswith("<think>\n\n</think>\n\n")
    with pytest.raises(TemplateError, match="builtin"):
        QwenFrontend.from_resources(resources, chat_template_override="builtin:nope")
    no_template = QwenFrontend.from_resources(qwen35_frontend_resources())
    with pytest.raises(TemplateError, match="no chat template"):
        no_template.prepare(ChatInput(messages=[{"role": "user", "content": "a"}]))
    with pytest.raises(ValueError, match="tools\\[0\\]"):
        frontend.prepare(ChatInput(messages=[{"role": "user", "content": "a"}], tools=[{"type": "function"}]))
    with pytest.raises(ValueError, match="images or videos"):
        frontend.prepare(ChatInput(messages=[{"role": "user", "content": [{"type": "image"}, {"text": "x"}]}]))


def test_empty_system_message_and_reasoning_split_from_content(template):
    assert template.render([{"role": "system", "content": "  "}, {"role": "user", "content": "x"}],
                           add_generation_prompt=False) == "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nx<|im_end|>\n"
    chat = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "<think>\n\n r \n\n</think>\n\n\n  y  "},
            {"role": "assistant", "content": "a</think>b", "reasoning_content": ""}]
    assert template.render(chat, add_generation_prompt=False).split("<|im_start|>assistant\n")[1:] == [
        "<think>\nr\n</think>\n\n  y<|im_end|>\n",  # as published: only newlines go after </think>
        "<think>\n\n</think>\n\na</think>b<|im_end|>\n",  # a reasoning_content string is not split again
    ]
