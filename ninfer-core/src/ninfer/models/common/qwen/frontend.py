"""QwenFrontend: tokenizer, chat template, PreparedPrompt and OutputSessions for every Qwen architecture.

Everything model-specific comes from the artifact's FrontendResources (tokenizer.json, chat template,
generation_config, eos ids, embedding vocabulary) or a startup override of the template; nothing is inferred
from an architecture name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ninfer.contract.prompt import ChatInput, PreparedPrompt, TextInput
from ninfer.contract.request import SamplingParams
from ninfer.contract.resources import FrontendResources
from ninfer.models.common.qwen.chat_template import ChatTemplate, builtin_template
from ninfer.models.common.qwen.errors import FrontendInputError, TemplateError
from ninfer.models.common.qwen.output_session import THINK_CLOSE, THINK_OPEN, QwenOutputSession
from ninfer.models.common.qwen.tokenizer import QwenTokenizer

BUILTIN_PREFIX = "builtin:"
_VISION_PADS = ("<|image_pad|>", "<|video_pad|>")


def _eos_from_generation_config(config: Mapping[str, Any]) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


def sampling_from_generation_config(config: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams defaults from a checkpoint's generation_config.json (``do_sample: false`` = greedy)."""
    fields: dict[str, Any] = {}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                     ("max_new_tokens", "max_tokens")):
        if config.get(src) is not None:
            fields[dst] = config[src]
    if config.get("do_sample") is False:
        fields["temperature"] = 0.0
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the artifact's generation_config has unusable sampling defaults: {e}") from e


class QwenFrontend:
    """``ninfer.contract.Frontend`` for the Qwen family (shared by Qwen3.5 and Qwen4Exp)."""

    def __init__(self, tokenizer: QwenTokenizer, *, chat_template: str | None, eos_token_ids: tuple[int, ...],
                 generation_config: Mapping[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        tokenizer.check_ids(self.eos_token_ids)
        self.generation_config = dict(generation_config)
        self._defaults = sampling_from_generation_config(self.generation_config)
        special = {}
        if self.eos_token_ids:
            special["eos_token"] = tokenizer.decode([self.eos_token_ids[0]])
        if isinstance(self.generation_config.get("pad_token_id"), int):
            special["pad_token"] = tokenizer.decode([self.generation_config["pad_token_id"]])
        self.template = ChatTemplate(chat_template, special_tokens=special) if chat_template else None
        self._im_start = tokenizer.token_id("<|im_start|>")
        self._im_end = tokenizer.token_id("<|im_end|>")
        self._think_open = tokenizer.token_id(THINK_OPEN)
        self._think_close = tokenizer.token_id(THINK_CLOSE)
        self._vision_pads = {i for i in (tokenizer.token_id(t) for t in _VISION_PADS) if i is not None}

    @classmethod
    def from_resources(cls, resources: FrontendResources, *, chat_template_override: str | None = None
                       ) -> QwenFrontend:
        """Build from an artifact's FrontendResources. ``chat_template_override``: template text, or
        ``"builtin:qwen3_5"`` for the project's own Qwen3.5 template; it replaces the artifact's template."""
        template = chat_template_override if chat_template_override is not None else resources.chat_template
        if template is not None and template.startswith(BUILTIN_PREFIX):
            try:
                template = builtin_template(template[len(BUILTIN_PREFIX):])
            except FileNotFoundError as e:
                raise TemplateError(f"no built-in chat template {template!r}") from e
        tokenizer = QwenTokenizer(resources.tokenizer_json, embedding_vocab=resources.embedding_vocab)
        for text, token_id in resources.special_tokens.items():
            if tokenizer.token_id(text) != token_id:
                raise ValueError(f"the artifact lists special token {text!r} as id {token_id}, but its "
                                 f"tokenizer.json has {tokenizer.token_id(text)}")
        eos = tuple(resources.eos_token_ids) or _eos_from_generation_config(resources.generation_config)
        return cls(tokenizer, chat_template=template, eos_token_ids=eos, generation_config=resources.generation_config)

    # -- Frontend contract ----------------------------------------------------------------------------

    def prepare(self, input: TextInput | ChatInput | PreparedPrompt) -> PreparedPrompt:
        if isinstance(input, PreparedPrompt):
            self.tokenizer.check_ids(input.token_ids)
            return input
        if isinstance(input, TextInput):
            if input.token_ids is not None:
                ids = list(input.token_ids)
                self.tokenizer.check_ids(ids)
            else:
                ids = self.tokenizer.encode(input.text)
            if not ids:
                raise FrontendInputError("the prompt is empty (no tokens)")
            return PreparedPrompt(token_ids=ids, reasoning_open=self._reasoning_open(ids), text=input.text)
        if isinstance(input, ChatInput):
            return self._prepare_chat(input)
        raise FrontendInputError(f"unsupported input type {type(input).__name__}")

    def sampling_defaults(self) -> SamplingParams:
        return self._defaults

    def open_session(self, prompt: PreparedPrompt, sampling: SamplingParams) -> QwenOutputSession:
        self.tokenizer.check_ids(sampling.stop_token_ids)
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        reasoning_open = prompt.reasoning_open
        return QwenOutputSession(
            self.tokenizer, stop_token_ids=sorted(stop_ids), stop=sampling.stop, reasoning_open=reasoning_open,
            tools=prompt.tools, turn_end_id=self._im_end,
            turn_check=lambda message, output: self.turn_is_exact(message, output, reasoning_open=reasoning_open))

    def turn_is_exact(self, message: Mapping[str, Any], output_ids, *, reasoning_open: bool) -> bool | None:
        """Whether appending ``message`` to a chat history re-renders exactly ``output_ids`` (the generated
        turn through ``<|im_end|>``) after the generation prompt; None without a chat template."""
        if self.template is None:
            return None
        kwargs = {} if reasoning_open else {"enable_thinking": False}
        query = [{"role": "user", "content": "?"}]
        try:
            before = self.render(query, add_generation_prompt=True, **kwargs)
            after = self.render([*query, message], add_generation_prompt=False, **kwargs)
        except TemplateError:
            return None
        if not after.startswith(before):
            return False
        ids_before, ids_after = self.tokenizer.encode(before), self.tokenizer.encode(after)
        n = len(ids_before)
        return ids_after[:n] == ids_before and ids_after[n:n + len(output_ids)] == list(output_ids)

    # -- helpers ----------------------------------------------------------------------------------------

    def render(self, messages, *, tools=(), add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The chat template's text for a conversation (what ``prepare`` tokenizes)."""
        if self.template is None:
            raise TemplateError("this model has no chat template (the artifact carries none and no override "
                                "was given at startup); send a raw text prompt instead")
        return self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    **template_kwargs)

    def _prepare_chat(self, chat: ChatInput) -> PreparedPrompt:
        if chat.media:
            raise FrontendInputError("image and video input needs the vision feature, which this frontend "
                                     "does not provide yet")
        if not chat.messages:
            raise FrontendInputError("a chat needs at least one message")
        for i, tool in enumerate(chat.tools):
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise FrontendInputError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        if not isinstance(chat.template_kwargs, Mapping) or not all(isinstance(k, str) for k in chat.template_kwargs):
            raise FrontendInputError("template kwargs must be an object with string keys")
        text = self.render(chat.messages, tools=chat.tools, add_generation_prompt=chat.add_generation_prompt,
                           **chat.template_kwargs)
        ids = self.tokenizer.encode(text)
        if not ids:
            raise TemplateError("the chat template rendered an empty prompt")
        if self._vision_pads.intersection(ids):
            raise FrontendInputError("the conversation contains images or videos, which this frontend does not "
                                     "support yet")
        return PreparedPrompt(token_ids=ids, reasoning_open=self._reasoning_open(ids), tools=chat.tools, text=text)

    def _reasoning_open(self, ids) -> bool:
        """Whether the prompt's last turn opened a thinking block that generation continues."""
        if self._think_open is None:
            return False
        start = 0
        if self._im_start is not None:
            for i in range(len(ids) - 1, -1, -1):
                if ids[i] == self._im_start:
                    start = i
                    break
        last_open = last_close = -1
        for i in range(start, len(ids)):
            if ids[i] == self._think_open:
                last_open = i
            elif ids[i] == self._think_close:
                last_close = i
        return last_open > last_close
