"""Whitespace between JSON tokens: xgrammar's JSON grammars with every whitespace run held to ninfer's bound.

xgrammar allows a run of up to ``max_whitespace_cnt`` characters of ``[ \\n\\r\\t]`` wherever JSON allows
whitespace, so a weak model can spend that many characters at every gap (and a small one does). Its grammars
are therefore built with a distinctive count, ``WS_MARK``, and ``bound_whitespace`` rewrites each such run
(docs/constrained-decoding.md, "Whitespace in JSON"): before ``:`` and ``,`` nothing; after ``:`` nothing or
one space; everywhere else (after ``{``, ``[`` and ``,``, before ``}`` and ``]``)

    ninfer_json_ws ::= "" | " " | "\\n" [ \\t]{0,MAX_JSON_INDENT}

nothing, one space, or one newline and at most ``MAX_JSON_INDENT`` spaces or tabs of indentation. Compact JSON,
``", "`` / ``": "`` separators and pretty-printed JSON up to that indentation all fit. The rewrite works on
xgrammar's printed grammar (which ``Grammar.from_ebnf`` reads back), outside string literals and character
classes, so a schema's own strings and patterns are never touched. Any xgrammar grammar built with ``max_whitespace_cnt=WS_MARK`` can be bounded
this way, the tool-call formats' JSON values included.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from ninfer.contract.constraint import MAX_JSON_INDENT

WS_MARK = 4093  # the max_whitespace_cnt xgrammar is built with: runs of this bound are the ones rewritten
WS_RULE = "ninfer_json_ws"
SPACE_RULE = "ninfer_json_space"  # after ':'
DEFINITIONS = (f'{WS_RULE} ::= ("" | " " | "\\n" [ \\t]{{0,{MAX_JSON_INDENT}}})\n'
               f'{SPACE_RULE} ::= ("" | " ")\n')
COMPACT_SEPARATORS = (",", ":")  # compact JSON: not even xgrammar's default ", " / ": "

_WS_CLASS = r"\[(?: |\\n|\\r|\\t)+\]"  # a character class of whitespace only, as xgrammar prints it
_WS_RULE_DEF = re.compile(rf"^(\w+) ::= \(\({_WS_CLASS}\)\)\n", re.MULTILINE)
_MARKED = f"{{0, {WS_MARK}}}"


def bound_whitespace(grammar: Any) -> Any:
    """``grammar`` (an xgrammar Grammar built with ``max_whitespace_cnt=WS_MARK``) with each whitespace run
    replaced by ``WS_RULE``; a RuntimeError when a marked run is left (xgrammar printed it in a form not known
    here), so a change of xgrammar cannot loosen the bound unnoticed."""
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(bounded_text(str(grammar)), root_rule_name="root")


def bounded_text(text: str) -> str:
    """The printed grammar ``text`` with its marked whitespace runs rewritten (see ``bound_whitespace``)."""
    if re.search(rf"^({WS_RULE}|{SPACE_RULE}) ::=", text, re.MULTILINE):
        raise RuntimeError(f"the grammar already defines {WS_RULE} or {SPACE_RULE}")
    names = set(_WS_RULE_DEF.findall(text))
    ref = re.compile(rf"\b(?:{'|'.join(map(re.escape, sorted(names)))})" + re.escape(_MARKED)) if names else None
    pieces = list(_pieces(text))
    out = []
    for i, (literal, piece) in enumerate(pieces):
        if literal:
            following = pieces[i + 1][1] if i + 1 < len(pieces) else ""
            if piece.startswith("[") and re.fullmatch(_WS_CLASS, piece) and following.startswith(_MARKED):
                out.append(WS_RULE)  # an inline run: the class here, its bound starts the next piece
                pieces[i + 1] = (False, following[len(_MARKED):])
            else:
                out.append(piece)
            continue
        if ref is not None:
            piece = ref.sub(WS_RULE, piece)
        if _MARKED in piece:
            raise RuntimeError(f"a whitespace run of the grammar was not recognised: ...{piece[:200]}")
        out.append(piece)
    body = _WS_RULE_DEF.sub("", "".join(_separators(out)))  # the rules now unused
    return body.rstrip("\n") + "\n" + DEFINITIONS


_BEFORE = re.compile(rf"\b{WS_RULE} $")
_AFTER = re.compile(rf"^ {WS_RULE}\b")


def _separators(out: list[str]) -> list[str]:
    """Around the ``":"`` and ``","`` separators: no run before either, at most one space after ``:``."""
    out = list(out)
    for i, piece in enumerate(out):
        if piece not in ('":"', '","'):
            continue
        if i > 0:
            out[i - 1] = _BEFORE.sub("", out[i - 1])
        if piece == '":"' and i + 1 < len(out):
            out[i + 1] = _AFTER.sub(f" {SPACE_RULE}", out[i + 1])
    return out


def _pieces(text: str) -> Iterator[tuple[bool, str]]:
    """``text`` cut into (is_literal, piece): string literals ``"..."`` and character classes ``[...]`` (their
    backslash escapes included) apart from the grammar's structure around them."""
    start = i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch not in '"[':
            i += 1
            continue
        if i > start:
            yield False, text[start:i]
        close = '"' if ch == '"' else "]"
        j = i + 1
        while j < n and text[j] != close:
            j += 2 if text[j] == "\\" else 1
        yield True, text[i:j + 1]
        start = i = j + 1
    if start < n:
        yield False, text[start:]
