"""Chat template rendering in the environment Hugging Face templates are written for.

Templates come from untrusted model repositories, so they run in jinja2's immutable sandbox. The environment
matches what ``transformers`` builds (``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``,
``strftime_now`` and a ``tojson`` that keeps non-ASCII and key order), so a checkpoint's own template renders
the same bytes here as there. Every failure becomes a ``TemplateError`` naming the cause.
"""

from __future__ import annotations

import copy
import datetime
import json
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from ninfer.models.common.qwen.errors import TemplateError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <>&' and sorts keys; templates expect plain json.dumps text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant tokens with it): render the body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def builtin_template(name: str = "qwen3_5") -> str:
    """The project's own template file ``templates/<name>.jinja``."""
    return resources.files(__package__).joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A deep copy of OpenAI-form messages with tool-call argument strings parsed to objects.

    Qwen templates iterate ``arguments|items``; OpenAI clients send arguments as JSON text.
    """
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"messages[{i}] must be an object, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise TemplateError(f"messages[{i}] needs a string 'role'")
        message = copy.deepcopy(dict(message))
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list | tuple):
                raise TemplateError(f"messages[{i}].tool_calls must be a list")
            parsed = []
            for j, call in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                if not isinstance(call, Mapping):
                    raise TemplateError(f"{where} must be an object")
                call = dict(call)
                fn = dict(call.get("function") or call)
                if not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise TemplateError(f"{where} needs a function name")
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError as e:
                        raise TemplateError(f"{where}.function.arguments is not valid JSON: {e}") from e
                if not isinstance(args, Mapping):
                    raise TemplateError(f"{where}.function.arguments must be a JSON object")
                fn["arguments"] = dict(args)
                if "function" in call:
                    call["function"] = fn
                else:
                    call = fn
                parsed.append(call)
            message["tool_calls"] = parsed
        out.append(message)
    return out


def normalize_inputs(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``normalize_messages`` and deep copies of the tool definitions, as ``render_normalized`` takes them."""
    try:
        return normalize_messages(messages), [copy.deepcopy(dict(t)) for t in tools]
    except TemplateError:
        raise
    except (TypeError, ValueError) as e:
        raise TemplateError(f"the conversation cannot be copied for rendering: {type(e).__name__}: {e}") from e


class ChatTemplate:
    """One compiled chat template; ``render`` is thread-safe and never mutates its inputs."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise TemplateError("the chat template is empty")
        self.source = source
        # transformers passes special_tokens_map (bos_token, eos_token, ...) to every render.
        self._defaults = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"the chat template does not compile (line {e.lineno}): {e.message}") from e

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] = (),
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        messages, tools = normalize_inputs(messages, tools)
        return self.render_normalized(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                      kwargs=kwargs)

    def render_normalized(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]],
                          add_generation_prompt: bool, kwargs: Mapping[str, Any]) -> str:
        """``render`` of messages and tools already normalized (``normalize_inputs``)."""
        reserved = {"messages", "tools", "add_generation_prompt"} & kwargs.keys()
        if reserved:
            raise TemplateError(f"template kwargs may not set {sorted(reserved)}")
        context = {**self._defaults, **kwargs}
        try:
            return self._template.render(messages=messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt, **context)
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"the chat template tried an unsafe operation: {e}") from e
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"chat template error: {e}") from e
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            raise TemplateError(f"chat template failed on this conversation: {type(e).__name__}: {e}") from e
