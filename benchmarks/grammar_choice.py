"""xgrammar against llguidance on the real Qwen3.5 vocabulary (issue 18's library choice), on the CPU.

For each grammar kind an engine needs (JSON object, a JSON Schema, regex, choice, GBNF, Qwen3.5 tool calls):
the one-off tokenizer build, the compile (xgrammar: ``GrammarCompiler``, cold and cached; llguidance: a matcher
from the grammar string), and the per-token mask fill over a valid output tokenized by ninfer's own Qwen
tokenizer (248,320 embedding rows), p50 / p99 / max. Then the traps ``shared/reference/constrained_frontend.md``
lists: a special token inside a JSON string, and a matcher fed a token it does not allow.

    pip install xgrammar llguidance        # not project dependencies yet
    python -m benchmarks.grammar_choice --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "format": "email"}, "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                    "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "role", "tags", "address", "active"], "additionalProperties": False}
SCHEMA_OUT = ('{"name": "Juliet Capulet", "age": 13, "email": "juliet@verona.it", "role": "user", '
              '"tags": ["balcony", "rose"], "address": {"city": "Verona", "zip": "37121"}, "active": true}')
GBNF = r'''root ::= select
select ::= "SELECT " cols " FROM " ident where?
cols ::= "*" | ident ("," " "? ident)*
where ::= " WHERE " ident " " op " " value
op ::= "=" | "<" | ">" | "<=" | ">="
value ::= [0-9]+ | "'" [a-zA-Z ]* "'"
ident ::= [a-z_] [a-z0-9_]*
'''
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                          "unit": {"enum": ["c", "f"]}},
                         "required": ["city"]}}}]
TOOL_OUT = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nVerona\n</parameter>\n"
            "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>")
CASES = {  # kind -> (xgrammar compile call, llguidance grammar, a valid output)
    "json_object": ("json_schema", json.dumps({"type": "object"}), '{"city": "Verona", "year": 1597, "ok": true}'),
    "json_schema": ("json_schema", json.dumps(SCHEMA), SCHEMA_OUT),
    "regex": ("regex", r"[A-Z][a-z]+, [0-9]{1,3} (BC|AD)", "Verona, 597 AD"),
    "choice": ("regex", "(Montague|Capulet|Escalus|Friar Laurence)", "Capulet"),
    "gbnf": ("gbnf", GBNF, "SELECT name, age FROM lovers WHERE age < 14"),
    "qwen35_tools": ("tools", "", TOOL_OUT),
}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _stats(times: list[float]) -> dict:
    us = [t * 1e6 for t in times]
    return {"p50_us": pct(us, 0.5), "p99_us": pct(us, 0.99), "max_us": max(us), "mean_us": statistics.mean(us)}


def vocabulary():
    import tokenizers
    import transformers

    from ninfer.models.common.qwen.tokenizer import QwenTokenizer
    from ninfer_qwen35.testing.qwen_vocab import qwen35_tokenizer_json

    text = qwen35_tokenizer_json()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(text))
    return text, hf, QwenTokenizer(text, embedding_vocab=248320)


def xgrammar_side(hf, ours, vocab: int, reps: int, im_end: int) -> dict:
    import xgrammar as xgr

    out: dict = {}
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[im_end])
    out["tokenizer_s"] = time.perf_counter() - t
    for kind, (how, grammar, sample) in CASES.items():
        row = {}
        for cached in (False, True):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=cached)
            if cached:
                _compile(xgr, compiler, how, grammar)
            t = time.perf_counter()
            compiled = _compile(xgr, compiler, how, grammar)
            row["compile_cached_s" if cached else "compile_s"] = time.perf_counter() - t
        ids = ours.encode(sample)
        fills, bitmask = [], xgr.allocate_token_bitmask(1, vocab)
        for rep in range(reps + 1):  # the first pass warms caches up and is not counted
            m = xgr.GrammarMatcher(compiled)
            for tok in ids:
                t = time.perf_counter()
                m.fill_next_token_bitmask(bitmask)
                if rep:
                    fills.append(time.perf_counter() - t)
                if not m.accept_token(tok):
                    raise RuntimeError(f"xgrammar {kind}: token {tok} of the valid sample refused")
        row.update(_stats(fills), tokens=len(ids))
        out[kind] = row
    return out


def _compile(xgr, compiler, how: str, grammar: str):
    if how == "json_schema":
        return compiler.compile_json_schema(grammar, any_whitespace=True)
    if how == "regex":
        return compiler.compile_regex(grammar)
    if how == "gbnf":
        return compiler.compile_grammar(grammar)
    tag = xgr.get_model_structural_tag("qwen_3_5", tools=TOOLS, tool_choice="required", reasoning=False)
    return compiler.compile_structural_tag(tag)


def llguidance_side(hf, ours, vocab: int, reps: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    out: dict = {}
    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    out["tokenizer_s"] = time.perf_counter() - t
    for kind, (how, grammar, sample) in CASES.items():
        if how == "tools":
            out[kind] = {"note": "no built-in Qwen3.5 tool-call format (a hand-written Lark grammar is needed)"}
            continue
        source = llguidance.grammar_from("json_schema" if how == "json_schema" else how, grammar)
        t = time.perf_counter()
        m = llguidance.LLMatcher(lltok, source)
        compile_s = time.perf_counter() - t
        if m.is_error():
            out[kind] = {"error": m.get_error()}
            continue
        ids = ours.encode(sample)
        fills, bitmask = [], llguidance.torch.allocate_token_bitmask(1, vocab)
        for rep in range(reps + 1):  # the first pass warms caches up and is not counted
            m = llguidance.LLMatcher(lltok, source)
            for tok in ids:
                t = time.perf_counter()
                llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)
                if rep:
                    fills.append(time.perf_counter() - t)
                if not m.consume_token(tok):
                    raise RuntimeError(f"llguidance {kind}: token {tok} of the valid sample refused: {m.get_error()}")
        out[kind] = {"compile_s": compile_s, **_stats(fills), "tokens": len(ids)}
    return out


def traps(hf, ours, vocab: int, im_start: int) -> dict:
    """Is ``<|im_start|>`` allowed inside a JSON string? What does an invalid token do to a matcher?"""
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import xgrammar as xgr

    inside = ours.encode('{"name": "')   # inside a JSON string
    after_key = ours.encode('{"name"')     # only ':' (after optional whitespace) may follow
    wrong, colon = ours.encode("x")[0], ours.encode(":")[0]
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}})
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(schema)
    m = xgr.GrammarMatcher(compiled)
    for tok in inside:
        m.accept_token(tok)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    m.fill_next_token_bitmask(bitmask)
    xgr_special = bool((bitmask[0, im_start // 32] >> (im_start % 32)) & 1)
    m = xgr.GrammarMatcher(compiled)
    for tok in after_key:
        m.accept_token(tok)
    xgr_refused = not m.accept_token(wrong)
    xgr_after = m.accept_token(colon)
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    source = llguidance.grammar_from("json_schema", schema)
    lm = llguidance.LLMatcher(lltok, source)
    for tok in inside:
        lm.consume_token(tok)
    lbm = llguidance.torch.allocate_token_bitmask(1, vocab)
    llguidance.torch.fill_next_token_bitmask(lm, lbm, 0)
    llg_special = bool((lbm[0, im_start // 32] >> (im_start % 32)) & 1)
    lm = llguidance.LLMatcher(lltok, source)
    for tok in after_key:
        lm.consume_token(tok)
    llg_refused = not lm.consume_token(wrong)
    llg_after = lm.consume_token(colon) and not lm.is_error()
    return {"xgrammar": {"im_start_allowed_in_json_string": xgr_special, "invalid_token_refused": xgr_refused,
                         "usable_after_refusal": xgr_after},
            "llguidance": {"im_start_allowed_in_json_string": llg_special, "invalid_token_refused": llg_refused,
                           "usable_after_refusal": llg_after}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    _, hf, ours = vocabulary()
    vocab = 248320
    im_end, im_start = ours.token_id("<|im_end|>"), ours.token_id("<|im_start|>")
    result = {"vocab": vocab, "xgrammar": xgrammar_side(hf, ours, vocab, args.reps, im_end),
              "llguidance": llguidance_side(hf, ours, vocab, args.reps), "traps": traps(hf, ours, vocab, im_start)}
    print("| kind | xgrammar compile ms (cached) | xgrammar mask p50 / p99 / max us | "
          "llguidance matcher ms | llguidance mask p50 / p99 / max us |")
    print("|---|---|---|---|---|")
    for kind in CASES:
        x, g = result["xgrammar"][kind], result["llguidance"][kind]
        xs = f"{x['compile_s'] * 1e3:.1f} ({x['compile_cached_s'] * 1e3:.2f})"
        xm = f"{x['p50_us']:.1f} / {x['p99_us']:.1f} / {x['max_us']:.0f}"
        gs = f"{g['compile_s'] * 1e3:.1f}" if "compile_s" in g else g.get("note") or g.get("error")
        gm = f"{g['p50_us']:.1f} / {g['p99_us']:.1f} / {g['max_us']:.0f}" if "p50_us" in g else "-"
        print(f"| {kind} | {xs} | {xm} | {gs} | {gm} |")
    print(f"tokenizer build: xgrammar {result['xgrammar']['tokenizer_s']:.2f} s, "
          f"llguidance {result['llguidance']['tokenizer_s']:.2f} s")
    print("traps:", json.dumps(result["traps"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
