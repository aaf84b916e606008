"""PreparedPrompt.history_boundary on the embedded model's Qwen3.5 template: where a chat's next turn stops
reproducing this prompt (the template keeps ``<|im_start|>assistant\\n`` and a past turn's answer but drops
the thinking preamble of the open turn), so the context cache saves a checkpoint exactly there."""

from __future__ import annotations

import pytest

import ninfer
from ninfer.artifact import open_artifact
from ninfer.contract.prompt import ChatInput, TextInput
from ninfer.models.common.qwen.frontend import QwenFrontend


@pytest.fixture(scope="module")
def frontend():
    with open_artifact(ninfer.default_model_path()) as art:
        return QwenFrontend.from_resources(art.frontend)


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("thinking", [False, True])
def test_the_next_turn_reproduces_the_prompt_exactly_up_to_the_boundary(frontend, thinking):
    kwargs = {"enable_thinking": thinking}
    turn1 = [{"role": "user", "content": "Name three colours."}]
    p1 = frontend.prepare(ChatInput(messages=turn1, template_kwargs=kwargs))
    answer = {"role": "assistant", "content": "Red, green and blue."}
    if thinking:
        answer["reasoning_content"] = "The user wants colours."
    p2 = frontend.prepare(ChatInput(messages=[*turn1, answer, {"role": "user", "content": "And one more?"}],
                                    template_kwargs=kwargs))
    b = p1.history_boundary
    assert b is not None and 0 < b < len(p1) - 1
    assert common_prefix(p1.token_ids, p2.token_ids) == b  # not one token less, not one more
    assert p1.token_ids[b] == frontend.tokenizer.token_id("<think>")


def test_no_boundary_without_an_open_assistant_turn(frontend):
    chat = ChatInput(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert frontend.prepare(chat).history_boundary is None
    assert frontend.prepare(TextInput(text="plain text")).history_boundary is None
