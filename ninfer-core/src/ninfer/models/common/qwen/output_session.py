"""Per-request output interpretation for the Qwen family: preview/commit of stop handling, streaming
detokenization, the thinking/content channels and XML tool calls.

Tokens flow through four stages. ``preview`` runs them on a copy of the committed state, so it changes
nothing; ``commit`` swaps the previewed state in:

1. stop tokens (model side eos ids and the request's ``stop_token_ids``) end the output at that token,
   in any channel;
2. UTF-8 assembly: bytes of incomplete characters wait for the next token, never emitted broken;
3. channels: ``<think>``/``</think>`` split reasoning from content, ``<tool_call>`` blocks become tool-call
   fragments (only when the request offered tools); partial markers are held back;
4. stop strings (``stop_strings.StopMatcher``, linear) match the content channel's text only (what the
   client reads as the answer; never reasoning, markers or tool-call markup): content that could still
   become a stop string is held back; the first stop string to complete ends the output before it (the
   token completing it is the last accepted one).

With ``track_tokens`` (the request wants logprobs) the session also says which token produced which text
(``token_spans.Tracker``): a delta releases text only up to a token boundary, with the spans of its tokens.

With a constraint, the request's ``TokenMatcher`` checks each token first: a token it refuses ends the output
before it (``FinishReason.GRAMMAR``), a token that completes the grammar ends it after it; the matcher is
advanced on commit only, so pause, resume and Replay keep its committed state with the session.

Whitespace around the markers is trimmed the way the chat template trims history (reasoning both ends,
content after ``</think>`` and before a tool call), so a turn re-renders as it was generated.
"""

from __future__ import annotations

import codecs
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ninfer.contract.context import TurnBoundary
from ninfer.contract.events import FinishReason, OutputDelta, ToolCall, merge_tool_call_fragments
from ninfer.contract.model import Preview
from ninfer.models.common.grammar import TokenMatcher
from ninfer.models.common.qwen import tool_calls as tc
from ninfer.models.common.qwen.stop_strings import StopMatcher
from ninfer.models.common.qwen.token_spans import Tracker, join_segs, split_segs
from ninfer.models.common.qwen.tokenizer import QwenTokenizer

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

REASONING, CONTENT, TOOL = "reasoning", "content", "tool"


class _State:
    """Where the output stands after the committed tokens. Previews work on a ``copy()``; the committed
    state is never mutated, so a preview changes nothing."""

    __slots__ = ("generated", "finished", "utf8_pending", "pos", "stop_held", "stop_state", "stop_segs",
                 "stop_hit", "mode", "at_start", "trim_lead", "held", "call", "call_at", "calls",
                 "ends_with_calls", "track")

    def __init__(self, mode: str, trim_lead: bool, track: Tracker | None) -> None:
        self.generated = 0
        self.finished: FinishReason | None = None
        self.utf8_pending = b""     # bytes of an incomplete UTF-8 character
        self.pos = 0                # characters decoded so far (positions in the decoded stream)
        self.stop_held = ""         # content that may still become a stop string
        self.stop_state = 0         # the stop matcher's state after it
        self.stop_segs: tuple[tuple[int, int], ...] = ()  # where stop_held lies in the stream: (start, length)
        self.stop_hit = False       # a stop string completed: nothing after it is routed
        self.mode = mode
        self.at_start = True        # nothing routed yet: a leading <think> opens reasoning
        self.trim_lead = trim_lead  # drop whitespace before the next text of this channel
        self.held = ""              # channel text not yet routed (partial marker, trailing whitespace)
        self.call: tc.ToolCallState | None = None
        self.call_at = 0            # where the open tool call's marker began (it may still fall back to text)
        self.calls = 0
        self.ends_with_calls = False
        self.track = track

    def copy(self) -> _State:
        new = _State.__new__(_State)
        new.generated, new.finished, new.utf8_pending, new.pos = self.generated, self.finished, self.utf8_pending, self.pos
        new.stop_held, new.stop_state, new.stop_segs, new.stop_hit = (
            self.stop_held, self.stop_state, self.stop_segs, self.stop_hit)
        new.mode, new.at_start, new.trim_lead, new.held = self.mode, self.at_start, self.trim_lead, self.held
        new.call, new.call_at, new.calls, new.ends_with_calls, new.track = (
            self.call, self.call_at, self.calls, self.ends_with_calls, self.track)
        return new


@attrs.frozen
class _Native:
    base: _State
    state: _State


class _Out:
    """Delta accumulator for one preview."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def tool_calls(self) -> tuple[ToolCall, ...]:
        """Fragments with consecutive pieces of one call joined (one entry per call and delta, mostly)."""
        merged: list[ToolCall] = []
        for f in self.calls:
            last = merged[-1] if merged else None
            if last is not None and last.index == f.index and not f.id and not f.name:
                merged[-1] = ToolCall(index=last.index, id=last.id, name=last.name,
                                      arguments=last.arguments + f.arguments)
            else:
                merged.append(f)
        return tuple(merged)


class QwenOutputSession:
    """One request's OutputSession (``ninfer.contract.OutputSession``); engine-worker only, not thread-safe."""

    def __init__(self, tokenizer: QwenTokenizer, *, stop_token_ids: Sequence[int], stop: Sequence[str] = (),
                 reasoning_open: bool = False, tools: Sequence[Mapping[str, Any]] = (),
                 turn_end_id: int | None = None, call_id_prefix: str | None = None,
                 turn_check: Callable[[Mapping[str, Any], Sequence[int]], bool | None] | None = None,
                 grammar: TokenMatcher | None = None, track_tokens: bool = False,
                 strict_tool_calls: bool = False) -> None:
        self._tok = tokenizer
        self._grammar = grammar
        self.constrained = grammar is not None
        self._strict_calls = strict_tool_calls  # a tool-call grammar wrote the calls: read them as it allowed
        self._stop_ids = frozenset(stop_token_ids)
        self._stop = StopMatcher(stop) if stop else None
        self._tools = tuple(tools)
        self._markers = (THINK_CLOSE, tc.TOOL_CALL_OPEN) if self._tools else (THINK_CLOSE,)
        self._turn_end = turn_end_id
        self._call_prefix = call_id_prefix or f"call_{uuid.uuid4().hex[:16]}"
        self._turn_check = turn_check
        self._special = tokenizer.special_ids
        self._state = _State(REASONING if reasoning_open else CONTENT, reasoning_open,
                             Tracker() if track_tokens else None)
        # Committed output, for the history message and complete tool calls.
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._fragments: list[ToolCall] = []
        self._token_ids: list[int] = []

    # -- contract ---------------------------------------------------------------------------------

    def preview(self, tokens: Sequence[int], *, at_length_limit: bool = False) -> Preview:
        """The effect of appending ``tokens``; changes nothing. ``accepted`` < len(tokens) when a stop ends
        the output inside them. ``at_length_limit``: these tokens reach max_tokens (or the context limit)."""
        base = self._state
        if base.finished is not None:
            raise RuntimeError(f"preview after the output finished ({base.finished.value})")
        if not tokens:
            raise ValueError("preview needs at least one token")
        out = _Out()
        st = base.copy()
        accepted = 0
        finish: FinishReason | None = None
        boundary = None
        grammar = self._grammar
        for tok in tokens:
            if grammar is not None and not grammar.accept(tok):  # complete already: a clean end, else a dead end
                finish = FinishReason.STOP if grammar.completed else FinishReason.GRAMMAR
                break
            accepted += 1
            if tok in self._stop_ids:
                finish = FinishReason.STOP
                if tok == self._turn_end:
                    boundary = accepted
                break
            piece = b"" if tok in self._special else self._tok.token_bytes(tok)
            start = st.pos
            text = self._decode(st, piece, final=False)
            st.pos += len(text)
            if st.track is not None and piece:
                st.track = st.track.add_token(base.generated + accepted - 1, start, st.pos)
            self._route(st, text, out, final=False)
            if st.stop_hit:  # whatever follows the stop string, complete or not, is dropped
                st.utf8_pending, st.held = b"", ""
                finish = FinishReason.STOP
                break
            if grammar is not None and grammar.terminated:  # a stop token completed it (eos ignored here)
                finish = FinishReason.STOP
                break
        if grammar is not None:
            grammar.rollback(accepted)
            if accepted == 0:  # the constraint refuses the first token: nothing of it is kept
                return Preview(accepted=0, finish_reason=finish, delta=OutputDelta())
        st.generated += accepted
        if finish is None and at_length_limit:
            finish = FinishReason.LENGTH
        if finish is not None:
            self._flush(st, out, finish)
            finish = st.finished
        delta = self._delta(st, out, token_ids=tuple(tokens)[:accepted])
        if boundary is not None:
            message = self._message(delta)
            exact = None if self._turn_check is None else self._turn_check(
                message, [*self._token_ids, *delta.token_ids])
            boundary = TurnBoundary(end=boundary, message=message, exact=exact)
        return Preview(accepted=accepted, finish_reason=finish, delta=delta, boundary=boundary,
                       native=_Native(base, st))

    def commit(self, preview: Preview) -> OutputDelta:
        """Adopt a preview made from the current state (after the Program committed); returns its delta."""
        native = preview.native
        if not isinstance(native, _Native) or native.base is not self._state:
            raise RuntimeError("commit of a preview that was not made from this session's current state")
        if self._grammar is not None:
            advanced, _ = self._grammar.accept_prefix(preview.delta.token_ids)
            if advanced != len(preview.delta.token_ids):
                raise RuntimeError("the constraint refused a token its preview accepted")
        self._adopt(native.state, preview.delta)
        return preview.delta

    def fill_token_mask(self, out: Any, drafts: Sequence[int] = ()) -> None:
        """The constraint's allowed tokens after the committed output (and after each draft prefix)."""
        if self._state.finished is not None or self._grammar.terminated:
            out.fill_(-1)  # nothing follows; the row's token is never kept
            return
        self._grammar.fill(out, drafts)

    def finish(self, reason: FinishReason) -> OutputDelta:
        """End the output (length, cancel, deadline...): release held-back text, and the matcher with its
        memory (nothing is matched after the end); idempotent."""
        if self._grammar is not None:
            self._grammar.close()
        if self._state.finished is not None:
            return OutputDelta()
        out = _Out()
        st = self._state.copy()
        self._flush(st, out, reason)
        delta = self._delta(st, out)
        self._adopt(st, delta)
        return delta

    # -- what was committed ------------------------------------------------------------------------

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._state.finished

    @property
    def generated(self) -> int:
        return self._state.generated

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return merge_tool_call_fragments(self._fragments)

    def message(self) -> dict[str, Any]:
        """The committed output as an assistant message for a chat history (OpenAI form)."""
        return self._message(OutputDelta())

    # -- stages -------------------------------------------------------------------------------------

    def _adopt(self, state: _State, delta: OutputDelta) -> None:
        self._state = state
        self._token_ids.extend(delta.token_ids)
        if delta.content:
            self._content.append(delta.content)
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
        self._fragments.extend(delta.tool_calls)

    def _message(self, extra: OutputDelta) -> dict[str, Any]:
        calls = merge_tool_call_fragments([*self._fragments, *extra.tool_calls])
        message: dict[str, Any] = {"role": "assistant", "content": self.content + extra.content}
        reasoning = self.reasoning + extra.reasoning
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message

    @staticmethod
    def _decode(st: _State, piece: bytes, *, final: bool) -> str:
        data = st.utf8_pending + piece if st.utf8_pending else piece
        if not data:
            return ""
        text, used = codecs.utf_8_decode(data, "replace", final)
        st.utf8_pending = data[used:]
        return text

    def _delta(self, st: _State, out: _Out, token_ids: tuple[int, ...] = ()) -> OutputDelta:
        """The preview's delta; when tracking, the text released up to a token boundary, with its spans."""
        calls = out.tool_calls()
        if st.track is None:
            return OutputDelta(content="".join(out.content), reasoning="".join(out.reasoning),
                               token_ids=token_ids, tool_calls=calls)
        decided = st.pos - len(st.held)  # the undecided text: held stop prefix, held routing, an open call
        if st.stop_segs:
            decided = min(decided, st.stop_segs[0][0])
        if st.mode == TOOL:
            decided = min(decided, st.call_at)
        st.track, text, spans = st.track.release(None if st.finished is not None else decided)
        return OutputDelta(content=text.get(CONTENT, ""), reasoning=text.get(REASONING, ""),
                           token_ids=token_ids, tool_calls=calls, token_spans=spans)

    def _stop_strings(self, st: _State, out: _Out, text: str, start: int) -> None:
        """Stage 4 on routed content: emit what can no longer become a stop string, hold the rest."""
        step = self._stop.advance(st.stop_held, st.stop_state, text)
        if st.track is None:  # positions only matter to the tracker
            st.stop_held, st.stop_state, st.stop_hit = step.held, step.state, step.matched
            if step.released:
                out.content.append(step.released)
            return
        segs = join_segs(st.stop_segs, start, len(text))
        released, rest = split_segs(segs, len(step.released))
        if step.matched:
            st.stop_hit = True
            rest = ()
        st.stop_held, st.stop_state, st.stop_segs = step.held, step.state, rest
        at = 0
        for p, n in released:
            self._emit_out(st, out, CONTENT, step.released[at:at + n], p)
            at += n

    def _flush(self, st: _State, out: _Out, reason: FinishReason) -> None:
        """Terminal: undecodable bytes become U+FFFD, channels close, held stop-string prefixes are text."""
        start = st.pos
        text = self._decode(st, b"", final=True)
        st.pos += len(text)
        if st.track is not None:
            st.track = st.track.stretch_last(start, st.pos)
        self._route(st, text, out, final=True)
        if not st.stop_hit and st.stop_held:
            if st.track is None:
                out.content.append(st.stop_held)
            at = 0
            for p, n in st.stop_segs:
                self._emit_out(st, out, CONTENT, st.stop_held[at:at + n], p)
                at += n
        st.stop_held, st.stop_state, st.stop_segs, st.held = "", 0, (), ""
        if st.stop_hit and reason == FinishReason.LENGTH:  # held text completed a stop string after all
            reason = FinishReason.STOP
        if reason == FinishReason.STOP and st.ends_with_calls:
            reason = FinishReason.TOOL_CALLS
        st.finished = reason

    def _route(self, st: _State, text: str, out: _Out, *, final: bool) -> None:
        """Channel routing of decoded text (stage 3). ``buf`` always ends at ``st.pos``, so its text starts at
        ``st.pos - len(buf)`` in the stream."""
        buf = st.held + text if st.held else text
        while not st.stop_hit:
            if st.mode == TOOL:
                res = tc.feed(st.call, buf, self._tools, final=final)
                out.calls.extend(res.fragments)
                if res.state is not None:
                    st.call, st.held = res.state, res.held
                    return
                st.mode, st.call = CONTENT, None
                if res.fallback is not None:  # "<tool_call>" that was not a call: plain content
                    st.calls -= 1
                    st.trim_lead = st.ends_with_calls = False
                    self._emit(st, out, CONTENT, res.fallback,
                               max(st.call_at, st.pos - len(res.rest) - len(res.fallback)))
                else:
                    st.trim_lead = st.ends_with_calls = True
                buf = res.rest
                continue
            if st.at_start and st.mode == CONTENT:
                lead = buf.lstrip()
                if lead.startswith(THINK_OPEN):
                    st.mode, st.at_start, st.trim_lead = REASONING, False, True
                    buf = lead[len(THINK_OPEN):]
                    continue
                if not final and THINK_OPEN.startswith(lead):
                    st.held = buf
                    return
            if st.trim_lead:
                buf = buf.lstrip()
                if not buf:
                    st.held = ""
                    return
                st.trim_lead = False
            if buf:
                st.at_start = False
            markers = self._markers if st.mode == REASONING else self._markers[1:]
            pos, marker = -1, ""
            if "<" in buf:
                for m in markers:
                    i = buf.find(m)
                    if i >= 0 and (pos < 0 or i < pos):
                        pos, marker = i, m
            if pos >= 0:
                self._emit_text(st, out, buf[:pos].rstrip(), st.pos - len(buf))
                at = st.pos - len(buf) + pos
                buf = buf[pos + len(marker):]
                if marker == THINK_CLOSE:
                    st.mode, st.trim_lead = CONTENT, True
                else:
                    st.call_at = at
                    st.call = tc.ToolCallState(index=st.calls, call_id=f"{self._call_prefix}_{st.calls}",
                                               strict=self._strict_calls)
                    st.mode = TOOL
                    st.calls += 1
                continue
            if final:
                st.held = ""
                self._emit_text(st, out, buf.rstrip() if st.mode == REASONING else buf, st.pos - len(buf))
                return
            # Hold what may still be a marker (markers hold "<" only at their start, so a partial one
            # begins at the last "<"), and trailing whitespace where the template would trim it.
            cut = len(buf)
            lt = buf.rfind("<")
            if lt >= 0 and any(m.startswith(buf[lt:]) for m in markers):
                cut = lt
            if st.mode == REASONING or self._tools:
                cut = len(buf[:cut].rstrip())
            st.held = buf[cut:]
            self._emit_text(st, out, buf[:cut], st.pos - len(buf))
            return

    def _emit_text(self, st: _State, out: _Out, text: str, start: int) -> None:
        if text:
            self._emit(st, out, st.mode, text, start)
            if st.mode == CONTENT and st.ends_with_calls and not text.isspace():
                st.ends_with_calls = False

    def _emit(self, st: _State, out: _Out, mode: str, text: str, start: int) -> None:
        """Routed text that begins at stream position ``start``: content passes the stop strings first."""
        if not text:
            return
        if mode == CONTENT and self._stop is not None:
            self._stop_strings(st, out, text, start)
        else:
            self._emit_out(st, out, mode, text, start)

    @staticmethod
    def _emit_out(st: _State, out: _Out, mode: str, text: str, start: int) -> None:
        if not text:
            return
        if st.track is not None:
            st.track = st.track.add_piece(mode, start, text)
        else:
            (out.reasoning if mode == REASONING else out.content).append(text)
