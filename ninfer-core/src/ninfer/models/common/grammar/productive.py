"""Whether a grammar derives any finite sentence (its root is productive), read from xgrammar's serialized form.

A grammar such as ``root ::= x`` / ``x ::= x`` compiles, but its matcher allows no token and is never complete,
so a request would end at once with an empty output; it is refused instead. The check is the textbook
productive-symbol fixpoint over an AND/OR graph, in time linear in the grammar: byte strings, character
classes and the empty string are productive; a rule reference is as its rule; a sequence needs every element,
a choice one alternative; a repetition needs its rule only when it must repeat at least once. Expression
kinds this module does not know (tag dispatch, token sets) count as productive, so the check can only let
a grammar through, never refuse a good one.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

# xgrammar's GrammarExprType (serialized as [type, data length, data...]); data layouts from its grammar_impl.h.
BYTE_STRING, CHAR_CLASS, CHAR_CLASS_STAR, EMPTY, RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, REPEAT = range(9)
_LEAVES = (BYTE_STRING, CHAR_CLASS, CHAR_CLASS_STAR, EMPTY)


def grammar_shape(grammar: Any) -> dict:
    """The serialized rules and expressions of an xgrammar Grammar (its ``serialize_json``)."""
    return json.loads(grammar.serialize_json())


def rule_count(shape: dict) -> int:
    return len(shape["rules"])


def derives_a_sentence(shape: dict) -> bool:
    """Whether the root rule of the serialized grammar ``shape`` derives at least one finite string."""
    rules = shape["rules"]
    data, indptr = shape["grammar_expr_data"], shape["grammar_expr_indptr"]
    n_expr = len(indptr)  # the start of each expression (no end sentinel)
    # Nodes: expressions 0..n_expr-1, then rules. need[v]: children still to become productive (AND: all of
    # them, OR: one); parents[c]: the nodes waiting on c.
    n = n_expr + len(rules)
    need = [1] * n
    parents: list[list[int]] = [[] for _ in range(n)]
    ready = deque()
    for e in range(n_expr):
        start = indptr[e]
        kind, length = data[start], data[start + 1]
        args = data[start + 2:start + 2 + length]
        children: list[int] = []
        if kind in (SEQUENCE, CHOICES):
            children = list(args)
        elif kind == RULE_REF:
            children = [n_expr + args[0]]
        elif kind == REPEAT and args[1] > 0:  # [rule, min, max]: at least once needs the rule
            children = [n_expr + args[0]]
        if not children:  # a leaf, an optional repetition, or an unknown kind (assumed productive)
            need[e] = 0
            ready.append(e)
            continue
        need[e] = len(children) if kind == SEQUENCE else 1
        for c in children:
            parents[c].append(e)
    for r, rule in enumerate(rules):
        parents[rule[1]].append(n_expr + r)  # [name, body expression, ...]: a rule is its body
    done = [False] * n
    while ready:
        v = ready.popleft()
        if done[v]:
            continue
        done[v] = True
        for p in parents[v]:
            if need[p] > 0:
                need[p] -= 1
                if need[p] == 0:
                    ready.append(p)
    return done[n_expr + shape["root_rule_id"]]
