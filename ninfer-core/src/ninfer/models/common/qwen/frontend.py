"""QwenFrontend: tokenizer, chat template, PreparedPrompt and OutputSessions for every Qwen architecture.

Everything model-specific comes from the artifact's FrontendResources (tokenizer.json, chat template,
generation_config, eos ids, embedding vocabulary) or a startup override of the template; nothing is inferred
from an architecture name.

Special-token strings inside chat messages are plain text unless ``special_tokens_in_content`` is set
(``literal_specials``); a raw text prompt is the user's own, so its special-token strings are tokens.
A prompt that cannot fit ``max_tokens`` is rejected before tokenizing: each token stands for at most
``tokenizer.longest_token_bytes`` bytes of text.

A chat's images and videos (``ChatInput.media``) are prepared on the frontend's own threads
(``media_preparation``) and placed into the prompt as ``media_prompt`` says, when the model runs with vision.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ninfer.contract.constraint import Constraint, ConstraintLimits, ToolCallConstraint
from ninfer.contract.errors import PromptTooLong
from ninfer.contract.prompt import ChatInput, PreparedPrompt, TextInput
from ninfer.contract.request import SamplingParams
from ninfer.contract.resources import FrontendResources
from ninfer.models.common.grammar import GrammarBook
from ninfer.models.common.qwen import tool_calls as tc
from ninfer.models.common.qwen.chat_template import ChatTemplate, builtin_template, normalize_inputs
from ninfer.models.common.qwen.errors import FrontendInputError, TemplateError
from ninfer.models.common.qwen.literal_specials import LiteralSpecials, Rendered, client_strings
from ninfer.models.common.qwen.media_preparation import MediaLimits, MediaPreparer
from ninfer.models.common.qwen.media_prompt import (
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_TOKENS,
    VisionNotEnabled,
    canonical_media_parts,
    check_media_parts,
    check_prepared_media,
    expanded_length,
    fewest_media_tokens,
    placeholder_runs,
    rewrite_placeholders,
)
from ninfer.models.common.qwen.output_session import THINK_CLOSE, THINK_OPEN, QwenOutputSession
from ninfer.models.common.qwen.tokenizer import QwenTokenizer
from ninfer.models.common.qwen.vision_preprocess import PreprocessConfig

BUILTIN_PREFIX = "builtin:"
_VISION_PADS = (IMAGE_PAD, VIDEO_PAD)
TEXT_ONLY_ARTIFACT = ("this model has no vision encoder (its artifact carries no preprocessor config), so it takes "
                      "no images or videos")
STARTED_WITHOUT_VISION = ("this model was started without vision (the vision feature is off), so it takes no images "
                          "or videos")


def _eos_from_generation_config(config: Mapping[str, Any]) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


def sampling_from_generation_config(config: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams defaults from a checkpoint's generation_config.json (``do_sample: false`` = greedy)."""
    fields: dict[str, Any] = {}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                     ("repetition_penalty", "repetition_penalty"), ("max_new_tokens", "max_tokens")):
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
                 generation_config: Mapping[str, Any], special_tokens_in_content: bool = False,
                 media: MediaPreparer | None = None, without_vision: str = TEXT_ONLY_ARTIFACT,
                 constraint_limits: ConstraintLimits | None = None) -> None:
        """``media``: prepares images and videos (the frontend owns it: ``close`` stops it); without one, a
        request with media is refused with ``without_vision`` as the reason. ``constraint_limits``: what one
        constrained request may cost (default ``ConstraintLimits()``)."""
        self.tokenizer = tokenizer
        self.special_tokens_in_content = special_tokens_in_content
        self._literal = None if special_tokens_in_content else LiteralSpecials(tokenizer)
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
        if media is not None:
            missing = [t for t in VISION_TOKENS if tokenizer.token_id(t) is None]
            if missing:
                raise ValueError(f"vision needs the tokens {missing}, which this tokenizer lacks")
            if media.config.merge_size != 2:  # MediaSpan / VisionItem count h·w/4 rows per frame group
                raise ValueError(f"the vision prompt format needs merge_size 2, the config has {media.config.merge_size}")
        self._media = media
        self._without_vision = without_vision
        # Compiled grammars for this vocabulary (built on first use); the Qwen formats write these as text.
        text_markers = (THINK_OPEN, THINK_CLOSE, tc.TOOL_CALL_OPEN, tc.TOOL_CALL_CLOSE)
        self.grammars = GrammarBook(lambda: tokenizer.grammar_vocabulary(text_markers),
                                    vocab_size=tokenizer.embedding_vocab, stop_token_ids=self.eos_token_ids,
                                    limits=constraint_limits)

    @classmethod
    def from_resources(cls, resources: FrontendResources, *, chat_template_override: str | None = None,
                       special_tokens_in_content: bool = False, vision: bool = False,
                       media_limits: MediaLimits | None = None, media_threads: int | None = None,
                       constraint_limits: ConstraintLimits | None = None) -> QwenFrontend:
        """Build from an artifact's FrontendResources. ``chat_template_override``: template text, or
        ``"builtin:qwen3_5"`` for the project's own Qwen3.5 template; it replaces the artifact's template.
        ``special_tokens_in_content``: special-token strings in chat messages are control tokens (by default
        they are plain text). ``vision``: whether the model runs with its vision encoder (the startup that binds
        it says so); it needs the artifact's preprocessor config (``resources.media``). Off, requests with
        media are refused. ``media_limits`` / ``media_threads``: the MediaPreparer's (defaults: MediaLimits(),
        min(4, CPUs) threads)."""
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
        if vision and resources.media is None:
            raise ValueError("vision was asked for, but the artifact carries no preprocessor config (resources.media)")
        media = None
        if vision:
            media = MediaPreparer(PreprocessConfig.from_preprocessor_config(resources.media), limits=media_limits,
                                  threads=media_threads)
        try:
            return cls(tokenizer, chat_template=template, eos_token_ids=eos,
                       generation_config=resources.generation_config,
                       special_tokens_in_content=special_tokens_in_content, media=media,
                       without_vision=TEXT_ONLY_ARTIFACT if resources.media is None else STARTED_WITHOUT_VISION,
                       constraint_limits=constraint_limits)
        except BaseException:
            if media is not None:
                media.close()
            raise

    @property
    def vision(self) -> bool:
        """Whether this frontend prepares images and videos."""
        return self._media is not None

    def close(self) -> None:
        """Kill the constraint compiles in flight (their callers get ConstraintClosed) and stop the media threads
        once the media accepted so far is prepared (text prompts still work, and so do open sessions)."""
        self.grammars.close()
        if self._media is not None:
            self._media.close()

    # -- Frontend contract ----------------------------------------------------------------------------

    def prepare(self, input: TextInput | ChatInput | PreparedPrompt, *, max_tokens: int | None = None
                ) -> PreparedPrompt:
        """The PreparedPrompt for ``input``; more than ``max_tokens`` tokens raise PromptTooLong (text
        that cannot fit is rejected before it is rendered or tokenized)."""
        if isinstance(input, PreparedPrompt):
            if input.media:
                raise FrontendInputError("a PreparedPrompt carries its media prepared (vision, media_spans); "
                                         "send raw media in a ChatInput")
            if (input.vision or input.media_spans) and self._media is None:
                raise VisionNotEnabled(self._without_vision)
            self._check_count(len(input.token_ids), max_tokens)
            self.tokenizer.check_ids(input.token_ids)
            if input.media_spans:
                check_prepared_media(input.token_ids, input.media_spans, input.vision,
                                     merge_size=self._media.config.merge_size,
                                     image_pad=self.tokenizer.token_id(IMAGE_PAD),
                                     video_pad=self.tokenizer.token_id(VIDEO_PAD))
            return input
        if isinstance(input, TextInput):
            if input.token_ids is not None:
                ids = list(input.token_ids)
                self._check_count(len(ids), max_tokens)
                self.tokenizer.check_ids(ids)
            else:
                self._check_bytes(self.tokenizer.text_bytes(input.text), max_tokens, "text")
                ids = self.tokenizer.encode(input.text)
            if not ids:
                raise FrontendInputError("the prompt is empty (no tokens)")
            return PreparedPrompt(token_ids=ids, reasoning_open=self._reasoning_open(ids), text=input.text)
        if isinstance(input, ChatInput):
            return self._prepare_chat(input, max_tokens)
        raise FrontendInputError(f"unsupported input type {type(input).__name__}")

    def sampling_defaults(self) -> SamplingParams:
        return self._defaults

    def end_token_ids(self, sampling: SamplingParams) -> tuple[int, ...]:
        ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            ids.update(self.eos_token_ids)
        return tuple(sorted(ids))

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (a partial UTF-8 sequence shows as U+FFFD)."""
        return self.tokenizer.decode([token_id])

    def decode(self, token_ids: Sequence[int]) -> str:
        self.tokenizer.check_ids(token_ids)
        return self.tokenizer.decode(token_ids)

    def open_session(self, prompt: PreparedPrompt, sampling: SamplingParams, constraint: Constraint | None = None,
                     *, cancel: threading.Event | None = None) -> QwenOutputSession:
        """The request's session; ``constraint`` is compiled for it (cached per vocabulary) while the caller's
        thread waits (``GrammarBook.compile``); setting ``cancel`` meanwhile abandons the compile
        (ConstraintCancelled). With a thinking block open in the prompt it applies to the answer after
        ``</think>``."""
        self.tokenizer.check_ids(sampling.stop_token_ids)
        try:
            self.tokenizer.check_ids(t for t, _ in sampling.logit_bias)
        except FrontendInputError as exc:
            raise FrontendInputError(f"logit_bias: {exc}") from None
        matcher = None
        if constraint is not None:
            compiled = self.grammars.compile(constraint, reasoning_open=prompt.reasoning_open, tools=prompt.tools,
                                             cancel=cancel)
            matcher = self.grammars.matcher(compiled)
        reasoning_open = prompt.reasoning_open
        tool_grammar = isinstance(constraint, ToolCallConstraint)
        # Under another constraint the answer is what it asks for (JSON, ...): "<tool_call>" in it is text.
        tools = prompt.tools if constraint is None or tool_grammar else ()
        return QwenOutputSession(
            self.tokenizer, stop_token_ids=list(self.end_token_ids(sampling)), stop=sampling.stop, reasoning_open=reasoning_open,
            tools=tools, turn_end_id=self._im_end, grammar=matcher, strict_tool_calls=tool_grammar,
            track_tokens=sampling.logprobs or sampling.top_logprobs > 0,
            turn_check=lambda message, output: self.turn_is_exact(message, output, reasoning_open=reasoning_open))

    def turn_is_exact(self, message: Mapping[str, Any], output_ids, *, reasoning_open: bool) -> bool | None:
        """Whether appending ``message`` to a chat history re-renders exactly ``output_ids`` (the generated
        turn through ``<|im_end|>``) after the generation prompt; None without a chat template."""
        if self.template is None:
            return None
        kwargs = {} if reasoning_open else {"enable_thinking": False}
        query = [{"role": "user", "content": "?"}]
        try:
            before, ids_before = self._encode_chat(query, (), add_generation_prompt=True, kwargs=kwargs)
            after, ids_after = self._encode_chat([*query, message], (), add_generation_prompt=False, kwargs=kwargs)
        except TemplateError:
            return None
        if not after.startswith(before):
            return False
        n = len(ids_before)
        return ids_after[:n] == ids_before and ids_after[n:n + len(output_ids)] == list(output_ids)

    # -- helpers ----------------------------------------------------------------------------------------

    def render(self, messages, *, tools=(), add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The chat template's text for a conversation (what ``prepare`` tokenizes)."""
        text, rendered = self._render(messages, tools, add_generation_prompt=add_generation_prompt,
                                      kwargs=template_kwargs)
        return text if rendered is None else rendered.text

    def _render(self, messages, tools, *, add_generation_prompt: bool, kwargs: Mapping[str, Any],
                max_tokens: int | None = None, rewrite: Callable[[str], str] | None = None
                ) -> tuple[str, Rendered | None]:
        """The template's output, passed through ``rewrite`` (which sees only the template's own special tokens:
        client ones are placeholders then); with special-token strings in client strings kept literal, also its
        split at the template's own special tokens (``literal_specials``)."""
        rewrite = rewrite or (lambda text: text)
        if self.template is None:
            raise TemplateError("this model has no chat template (the artifact carries none and no override "
                                "was given at startup); send a raw text prompt instead")
        messages, tools = normalize_inputs(messages, tools)
        if max_tokens is not None:  # before rendering: the client's text alone may be too much
            values = [[m.values() for m in messages], tools, list(kwargs.values())]
            self._check_bytes(sum(self.tokenizer.text_bytes(s) for s in client_strings(values, keys=False)),
                              max_tokens, "conversation text")
        protected = None if self._literal is None else self._literal.protect(messages, tools, kwargs)
        if protected is None:
            return rewrite(self.template.render_normalized(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, kwargs=kwargs)), None
        text = rewrite(self.template.render_normalized(protected.messages, tools=protected.tools,
                                                       add_generation_prompt=add_generation_prompt,
                                                       kwargs=protected.kwargs))
        return text, self._literal.split(text, protected)

    def _encode_chat(self, messages, tools, *, add_generation_prompt: bool, kwargs: Mapping[str, Any],
                     max_tokens: int | None = None, rewrite: Callable[[str], str] | None = None
                     ) -> tuple[str, list[int]]:
        text, rendered = self._render(messages, tools, add_generation_prompt=add_generation_prompt, kwargs=kwargs,
                                      max_tokens=max_tokens, rewrite=rewrite)
        if rendered is not None:
            text = rendered.text
        self._check_bytes(self.tokenizer.text_bytes(text), max_tokens, "rendered conversation")
        return text, self.tokenizer.encode(text) if rendered is None else self._literal.encode(rendered)

    def _check_bytes(self, nbytes: int, max_tokens: int | None, what: str) -> None:
        """PromptTooLong when ``nbytes`` of text must be more than ``max_tokens`` tokens."""
        if max_tokens is None:
            return
        per_token = self.tokenizer.longest_token_bytes
        at_least = -(-nbytes // per_token)
        if at_least > max_tokens:
            raise PromptTooLong(tokens=at_least, limit=max_tokens, exact=False,
                                detail=f" ({what} of {nbytes} bytes, a token stands for at most {per_token})")

    @staticmethod
    def _check_count(tokens: int, max_tokens: int | None) -> None:
        if max_tokens is not None and tokens > max_tokens:
            raise PromptTooLong(tokens=tokens, limit=max_tokens, exact=True)

    def _prepare_chat(self, chat: ChatInput, max_tokens: int | None) -> PreparedPrompt:
        if not chat.messages:
            raise FrontendInputError("a chat needs at least one message")
        for i, tool in enumerate(chat.tools):
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise FrontendInputError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        if not isinstance(chat.template_kwargs, Mapping) or not all(isinstance(k, str) for k in chat.template_kwargs):
            raise FrontendInputError("template kwargs must be an object with string keys")
        messages, kinds = canonical_media_parts(chat.messages)
        if kinds or chat.media:
            return self._prepare_media_chat(chat, messages, kinds, max_tokens)
        text, ids = self._encode_chat(chat.messages, chat.tools, add_generation_prompt=chat.add_generation_prompt,
                                      kwargs=chat.template_kwargs, max_tokens=max_tokens)
        if not ids:
            raise TemplateError("the chat template rendered an empty prompt")
        if self._vision_pads.intersection(ids):
            raise FrontendInputError("the rendered conversation holds image/video placeholder tokens but the "
                                     "messages have no image or video parts")
        return PreparedPrompt(token_ids=ids, reasoning_open=self._reasoning_open(ids), tools=chat.tools, text=text,
                              history_boundary=self._turn_opening(ids) if chat.add_generation_prompt else None)

    def _prepare_media_chat(self, chat: ChatInput, messages, kinds, max_tokens: int | None) -> PreparedPrompt:
        """A chat with images or videos: checks, then the text with one placeholder per image or frame group,
        each item's plan from its headers and the prompt's exact length checked, the media prepared on the pool,
        and the placeholders widened (``media_prompt``)."""
        if self._media is None:
            raise VisionNotEnabled(self._without_vision)
        check_media_parts(kinds, chat.media)
        self._media.check(chat.media)
        cfg = self._media.config
        text, ids = self._encode_chat(
            messages, chat.tools, add_generation_prompt=chat.add_generation_prompt, kwargs=chat.template_kwargs,
            max_tokens=max_tokens, rewrite=lambda t: rewrite_placeholders(t, chat.media, cfg.temporal_patch_size))
        fewest = len(ids) + fewest_media_tokens(chat.media, min_image_pixels=cfg.min_pixels, factor=cfg.factor)
        if max_tokens is not None and fewest > max_tokens:  # refused before any header is read
            raise PromptTooLong(tokens=fewest, limit=max_tokens, exact=False,
                                detail=" (counting each image at its smallest size)")
        plans = self._media.plan(chat.media)  # headers only: the exact length is known before any decoding
        pads = sum(1 for t in ids if t in self._vision_pads)
        self._check_count(expanded_length(len(ids), pads, [(p.kind, p.grid_thw) for p in plans], cfg.merge_size),
                          max_tokens)
        vision = self._media.prepare(chat.media, plans)
        grids = [(item.kind, item.grid_thw) for item in vision]
        ids, spans = placeholder_runs(ids, image_pad=self.tokenizer.token_id(IMAGE_PAD),
                                      video_pad=self.tokenizer.token_id(VIDEO_PAD), grids=grids,
                                      merge_size=cfg.merge_size)
        return PreparedPrompt(token_ids=ids, media_spans=spans, vision=vision, reasoning_open=self._reasoning_open(ids),
                              tools=chat.tools, text=text,
                              history_boundary=self._turn_opening(ids) if chat.add_generation_prompt else None)

    def _turn_opening(self, ids) -> int | None:
        """Where the open assistant turn's thinking preamble starts (``<think>`` after its last
        ``<|im_start|>``): the Qwen templates keep ``<|im_start|>assistant\n`` and the answer of a past turn
        in history but drop that preamble, so the next turn reproduces the prompt up to here only."""
        if self._think_open is None or self._im_start is None:
            return None
        start = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] == self._im_start), None)
        if start is None:
            return None
        return next((i for i in range(start + 1, len(ids)) if ids[i] == self._think_open), None)

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
