"""GrammarBook: the compiled grammars of one vocabulary, and the per-request matchers made from them.

The backend is xgrammar (``docs/constrained-decoding.md`` says why). Its ``TokenizerInfo`` is built once per
vocabulary, lazily (the first constrained request pays for it; serve's warmup does), from the exact bytes
of each token, with two traps closed (``shared/reference/constrained_frontend.md`` §1.6): special tokens get no
text, so a grammar never allows ``<|im_start|>`` as string content (except the markers the model's own
formats write as text, e.g. ``<think>`` and ``<tool_call>``), and every end-of-sequence id is a stop token.

``compile`` runs on the submitting thread; its results are kept in a bounded LRU keyed by the constraint,
whether the prompt opened a thinking block, and the tools. With a thinking block open the constraint applies
after ``</think>``: the reasoning before it is free text (without the think markers), then up to two newlines.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ninfer.contract.constraint import (
    ChoiceConstraint,
    Constraint,
    ConstraintError,
    GrammarConstraint,
    JsonConstraint,
    RegexConstraint,
    ToolCallConstraint,
)
from ninfer.models.common.grammar.matcher import TokenMatcher
from ninfer.models.common.grammar.schema_features import check_schema

MAX_JSON_WHITESPACE = 16  # longest whitespace run in JSON with any_whitespace (a model cannot spin on spaces)
TOOL_FORMAT = "qwen_3_5"   # xgrammar's built-in Qwen3.5 / Qwen3-Coder XML tool-call format
TOOL_WHITESPACE = 2  # whitespace run between the format's tags (it writes one newline): a weak model cannot stall there
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class GrammarBook:
    """Compiled grammars for one vocabulary. ``vocabulary()`` returns each token id's bytes (``b""`` for special
    tokens); ids from its length up to ``vocab_size`` are padding. Thread-safe."""

    def __init__(self, vocabulary: Callable[[], list[bytes]], *, vocab_size: int, stop_token_ids: Sequence[int],
                 tool_format: str = TOOL_FORMAT, cache_bytes: int = 256 << 20, cache_entries: int = 512) -> None:
        self._vocabulary = vocabulary
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.tool_format = tool_format
        self.cache_bytes = cache_bytes
        self.cache_entries = cache_entries
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._cached_bytes = 0
        self.compiles = 0  # cold compiles (cache misses)

    # -- compile --------------------------------------------------------------------------------------
    def compile(self, constraint: Constraint, *, reasoning_open: bool = False,
                tools: Sequence[Mapping[str, Any]] = ()) -> Any:
        """The CompiledGrammar of ``constraint`` (cached); raises ConstraintError naming what is wrong."""
        key = (constraint, reasoning_open,
               json.dumps(list(tools), sort_keys=True) if isinstance(constraint, ToolCallConstraint) else None)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiler = self._compiler_once()
        grammar = self._grammar(constraint, reasoning_open, tools)
        try:
            compiled = compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the reason
            raise ConstraintError(f"{_kind(constraint)} does not compile: {_reason(e)}") from e
        with self._lock:
            self.compiles += 1
            if key not in self._cache:
                self._cache[key] = compiled
                self._cached_bytes += compiled.memory_size_bytes
                while self._cache and (self._cached_bytes > self.cache_bytes or len(self._cache) > self.cache_entries):
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.memory_size_bytes
        return compiled

    def matcher(self, compiled: Any) -> TokenMatcher:
        return TokenMatcher(compiled)

    def warm(self) -> None:
        """Build the vocabulary's tokenizer info now (serve warmup), not at the first constrained request."""
        self._compiler_once()

    @property
    def cached(self) -> int:
        return len(self._cache)

    # -- parts -----------------------------------------------------------------------------------------
    def _compiler_once(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo(self._vocabulary(), xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                         stop_token_ids=list(self.stop_token_ids))
                # Our own LRU holds the results; xgrammar's cache would keep a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def _grammar(self, constraint: Constraint, reasoning_open: bool, tools: Sequence[Mapping[str, Any]]) -> Any:
        import xgrammar as xgr

        if isinstance(constraint, ToolCallConstraint):
            return self._tool_calls(xgr, constraint, reasoning_open, tools)
        try:
            body = _body(xgr, constraint)
        except ConstraintError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ConstraintError(f"{_kind(constraint)} is not valid: {_reason(e)}") from e
        return xgr.Grammar.concat(self._think(xgr), body) if reasoning_open else body

    def _tool_calls(self, xgr, c: ToolCallConstraint, reasoning_open: bool, tools: Sequence[Mapping[str, Any]]):
        if not tools:
            raise ConstraintError("tool_choice needs the request's tools, and it offers none")
        names = []
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise ConstraintError(f"tools[{i}] has no function name")
            names.append(fn["name"])
            params = fn.get("parameters")
            if params is not None:
                check_schema(params, f"tools[{i}].function.parameters")
        if c.tool_choice != "auto" and c.tool_choice not in ("required", *names):
            raise ConstraintError(f"tool_choice names function {c.tool_choice!r}, which is not among the "
                                  f"request's tools ({', '.join(names)})")
        try:
            if c.tool_choice == "auto":  # free text, and calls held to their tools' schemas once they begin
                tag = xgr.get_model_structural_tag(self.tool_format, tools=[dict(t) for t in tools], tool_choice="auto",
                                                   reasoning=reasoning_open, parallel_tool_calls=c.parallel,
                                                   max_whitespace_cnt=TOOL_WHITESPACE)
                return xgr.Grammar.from_structural_tag(tag.model_dump_json())
            # required / one named function: calls only (OpenAI's tool_choice), separated by a newline as the
            # Qwen template writes them, then the end of the turn
            chosen = [t for t, n in zip(tools, names, strict=True) if c.tool_choice in ("required", n)]
            calls = {"type": "tags_with_separator", "tags": [_qwen_call(t) for t in chosen], "separator": "\n",
                     "at_least_one": True, "stop_after_first": not c.parallel}
            body = xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": calls}))
        except Exception as e:  # noqa: BLE001
            raise ConstraintError(f"tool calls over these tools do not compile: {_reason(e)}") from e
        return xgr.Grammar.concat(self._think(xgr), body) if reasoning_open else body

    @staticmethod
    def _think(xgr) -> Any:
        """Free reasoning up to ``</think>`` (without think markers), then up to two newlines."""
        think = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
            {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": [THINK_OPEN, THINK_CLOSE]},
             "end": THINK_CLOSE},
            {"type": "regex", "pattern": "\\n{0,2}"}]}}
        return xgr.Grammar.from_structural_tag(json.dumps(think))


def _qwen_call(tool: Mapping[str, Any]) -> dict:
    """One call in the Qwen3.5 XML format, its parameters held to the tool's schema (xgrammar's qwen_xml style)."""
    fn = tool["function"]
    return {"type": "tag", "begin": f"<tool_call>\n<function={fn['name']}>\n",
            "content": {"type": "json_schema", "json_schema": fn.get("parameters") or {"type": "object"},
                        "style": "qwen_xml", "max_whitespace_cnt": TOOL_WHITESPACE},
            "end": "\n</function>\n</tool_call>"}


def _body(xgr, c: Constraint) -> Any:
    """The Grammar of the answer itself."""
    if isinstance(c, JsonConstraint):
        if c.schema is not None:
            check_schema(c.schema_object)
        return xgr.Grammar.from_json_schema(c.schema or "{}", any_whitespace=c.any_whitespace, strict_mode=True,
                                            max_whitespace_cnt=MAX_JSON_WHITESPACE if c.any_whitespace else None)
    if isinstance(c, RegexConstraint):
        return xgr.Grammar.from_regex(c.pattern)
    if isinstance(c, ChoiceConstraint):
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(s) for s in c.choices))
    if isinstance(c, GrammarConstraint):
        if c.syntax == "lark":
            return xgr.Grammar.from_lark(c.grammar)
        return xgr.Grammar.from_ebnf(c.grammar, root_rule_name="root")
    raise ConstraintError(f"unknown constraint type {type(c).__name__}")


def _ebnf_string(text: str) -> str:
    """``text`` as a GBNF string literal (backslash, quote and control characters escaped)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _kind(c: Constraint) -> str:
    return {JsonConstraint: "the JSON schema", RegexConstraint: "the regex", ChoiceConstraint: "the choice",
            GrammarConstraint: "the grammar", ToolCallConstraint: "the tool calls"}.get(type(c), "the constraint")


_LOG_PREFIX = re.compile(r"\[[0-9:]+\] \S+\.cc:[0-9]+: ")  # xgrammar's C++ log prefix: time, source file, line


def _reason(e: BaseException) -> str:
    text = _LOG_PREFIX.sub("", str(e)).strip() or type(e).__name__
    return text.splitlines()[0] if len(text) > 400 else text
