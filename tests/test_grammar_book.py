"""GrammarBook, TokenMatcher and the Qwen OutputSession's matcher, below the engine (CPU).

The compile cache is an LRU bounded in entries and bytes; special tokens are never text inside a grammar
(checked on the real Qwen3.5 vocabulary); masks for draft positions leave the matcher where it was; a
session previews without moving its matcher, commits by moving it, ends at a refused token (GRAMMAR) and
at a completed grammar even when end-of-sequence is ignored.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ninfer.contract import ChoiceConstraint, JsonConstraint, RegexConstraint, SamplingParams, TextInput
from ninfer.contract.constraint import ConstraintError, ToolCallConstraint, mask_words
from ninfer.contract.events import FinishReason
from ninfer.contract.resources import FrontendResources
from ninfer.models.common.grammar import GrammarBook
from ninfer.models.common.qwen.frontend import QwenFrontend
from ninfer.models.common.qwen.tokenizer import QwenTokenizer
from ninfer_qwen35.testing.checkpoints import make_tokenizer_json

VOCAB = 448


@pytest.fixture(scope="module")
def frontend():
    tokenizer_json, special = make_tokenizer_json()
    return QwenFrontend.from_resources(FrontendResources(
        tokenizer_json=tokenizer_json, eos_token_ids=(special["<|im_end|>"],), embedding_vocab=VOCAB))


def allowed(mask_row: torch.Tensor, vocab: int) -> set[int]:
    bits = ((mask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return set(bits.nonzero().flatten().tolist())


def new_mask(rows: int = 1) -> torch.Tensor:
    return torch.zeros((rows, mask_words(VOCAB)), dtype=torch.int32)


def test_the_compile_cache_is_a_bounded_lru(frontend):
    book = GrammarBook(lambda: frontend.tokenizer.grammar_vocabulary(), vocab_size=VOCAB,
                       stop_token_ids=frontend.eos_token_ids, cache_entries=2)
    a, b, c = (ChoiceConstraint(choices=[w]) for w in ("ay", "bee", "sea"))
    first = book.compile(a)
    assert book.compile(a) is first and book.compiles == 1  # a hit compiles nothing
    book.compile(b)
    book.compile(c)  # evicts a, the least recently used
    assert book.cached == 2 and book.compiles == 3
    assert book.compile(c) is not None and book.compiles == 3
    book.compile(a)
    assert book.compiles == 4 and book.cached == 2


def test_concurrent_submitters_compile_safely(frontend):
    book = frontend.grammars
    out, errors = [], []

    def work():
        try:
            out.append(book.compile(RegexConstraint(pattern="[a-z]{3}-[0-9]{2}")))
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(out) == 6


def test_draft_rows_leave_the_matcher_where_it_was(frontend):
    tok = frontend.tokenizer
    book = frontend.grammars
    m = book.matcher(book.compile(ChoiceConstraint(choices=["yes", "no"])))
    ids = tok.encode("yes")
    before = new_mask()
    m.fill(before)
    rows = new_mask(1 + len(ids) + 2)
    m.fill(rows, [*ids, frontend.eos_token_ids[0], ids[0]])  # the last draft follows the end: refused
    after = new_mask()
    m.fill(after)
    assert torch.equal(before, after) and torch.equal(rows[0], before[0])
    assert ids[0] in allowed(rows[0], VOCAB)
    assert allowed(rows[len(ids)], VOCAB) == set(frontend.eos_token_ids)  # "yes" done: only the end
    assert not rows[-1].any()  # after the refused draft: nothing


def test_special_tokens_are_never_text_inside_a_grammar():
    from ninfer_qwen35.testing.qwen_vocab import qwen35_tokenizer_json

    tok = QwenTokenizer(qwen35_tokenizer_json(), embedding_vocab=248320)
    im_start, im_end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    book = GrammarBook(lambda: tok.grammar_vocabulary(["<think>", "</think>"]), vocab_size=248320,
                       stop_token_ids=[im_end])
    m = book.matcher(book.compile(JsonConstraint(schema={"type": "object", "properties": {"a": {"type": "string"}}})))
    n, _ = m.accept_prefix(tok.encode('{"a": "x'))
    assert n == len(tok.encode('{"a": "x'))
    assert not m.accept(im_start)  # its surface text would be legal string content
    assert m.accept(tok.token_id("<think>"))  # a marker the Qwen formats write as text stays text


def session(frontend, constraint, **sampling):
    prompt = frontend.prepare(TextInput(text="hello"))
    return frontend.open_session(prompt, SamplingParams(**sampling), constraint)


def test_preview_keeps_the_matcher_and_commit_moves_it(frontend):
    tok = frontend.tokenizer
    s = session(frontend, ChoiceConstraint(choices=["yes please"]))
    ids = tok.encode("yes please")
    before = new_mask()
    s.fill_token_mask(before)
    pv = s.preview(ids[:1])
    again = new_mask()
    s.fill_token_mask(again)
    assert pv.accepted == 1 and pv.finish_reason is None and torch.equal(before, again)
    s.commit(pv)
    moved = new_mask()
    s.fill_token_mask(moved)
    assert not torch.equal(before, moved)


def test_a_refused_token_ends_the_output_before_it(frontend):
    tok = frontend.tokenizer
    s = session(frontend, ChoiceConstraint(choices=["yes"]))
    wrong = tok.encode("no")[0]
    first = s.preview([wrong])
    assert first.accepted == 0 and first.finish_reason is FinishReason.GRAMMAR
    ids = tok.encode("yes")
    partial = s.preview([*ids, wrong])  # "yes" is complete: refusing what follows is a clean end
    assert partial.accepted == len(ids) and partial.finish_reason is FinishReason.STOP
    s2 = session(frontend, RegexConstraint(pattern="ye[s]{3}"))
    pv = s2.preview([*ids, wrong])
    assert pv.accepted == len(ids) and pv.finish_reason is FinishReason.GRAMMAR and pv.delta.content == "yes"


def test_a_completed_grammar_ends_the_output_even_when_eos_is_ignored(frontend):
    tok = frontend.tokenizer
    s = session(frontend, ChoiceConstraint(choices=["yes"]), ignore_eos=True)
    eos = frontend.eos_token_ids[0]
    pv = s.preview([*tok.encode("yes"), eos, *tok.encode("and more")])
    assert pv.finish_reason is FinishReason.STOP and pv.accepted == len(tok.encode("yes")) + 1
    assert pv.delta.content == "yes"


def test_tool_choice_needs_known_tools(frontend):
    with pytest.raises(ConstraintError, match="offers none"):
        session(frontend, ToolCallConstraint())
