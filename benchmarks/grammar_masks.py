"""Real-world JSON Schemas on the real Qwen3.5 vocabulary, through ninfer's own GrammarBook (CPU): does each
compile (or which ConstraintError), its compile time cold and cached, and the per-token mask fill.

The workload is ``benchmarks/data/jsonschemabench_sample.jsonl``: 50 schemas from JSONSchemaBench, 5 from each
of its subsets (``benchmarks/data/README.md``). The book is built as the Qwen frontend builds it: 248,320
embedding rows, special tokens without text except the think / tool-call markers
(``QwenTokenizer.grammar_vocabulary``), and the model's end-of-sequence tokens ``<|im_end|>`` and
``<|endoftext|>`` as the tokens that end a grammar.

Each schema is compiled as ``JsonConstraint(schema=...)`` (any whitespace, as a request gets by default) with the
book's LRU empty for it (cold), then again (cached). The masks are filled along one valid output, walked
through a TokenMatcher token by token (a mask filled before each token):

- schemas that ship a valid instance (JSONSchemaBench's tests, 41 of the 50): the instance written as
  ``json.dumps`` does (``", "`` / ``": "``), tokenized by ninfer's Qwen tokenizer; each token is taken while
  the grammar allows it. At the first one it refuses (the grammar's property order or whitespace differs
  from the text), the walk continues with the longest allowed vocabulary token that spells the next bytes of
  the text; when none does, the instance cannot be followed (e.g. a property the schema does not define) and
  the rest is completed at random, as below. Once the text is spelled, the stop token ends it;
- the rest, and any completion: a random allowed token (seeded per schema), the stop token as soon as it is
  allowed, and with probability 0.8 a token made only of ``"``, ``}`` and ``]`` when one is allowed, so that
  open strings and structures close, else one with some non-whitespace text when one is allowed; at most
  ``--max-tokens`` tokens.

Walk kinds in the table: ``instance`` (spelled by its own tokens), ``instance*`` (re-spelled after a refusal),
``instance+random`` (left the text), ``random``; ``unfinished`` when the cap came first (the masks still count).
The walk is the warm-up; the figures are ``--reps`` more passes over the same tokens with fresh matchers.
A compile runs in this process without a time limit (the sample has no schema that takes minutes).

    python -m benchmarks.grammar_masks --json out.json [--limit N] [--subset Kubernetes ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
import unicodedata
from collections import Counter
from importlib import metadata
from pathlib import Path

SAMPLE = Path(__file__).with_name("data") / "jsonschemabench_sample.jsonl"
EMBEDDING_ROWS = 248320  # Qwen3.5's embedding rows: ids past the tokenizer's 248,077 are padding
TEXT_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # written as text by the Qwen3.5 formats
CLOSERS = frozenset(b'"}]')
CLOSE_BIAS = 0.8

clock = time.perf_counter


def qwen_grammar_book(**book_args):
    """(QwenTokenizer, GrammarBook, token bytes per id as the book sees them) over the real Qwen3.5 vocabulary."""
    from ninfer.models.common.grammar import GrammarBook
    from ninfer.models.common.qwen.tokenizer import QwenTokenizer
    from ninfer_qwen35.testing.qwen_vocab import QWEN35_EOS_TOKEN_IDS, qwen35_tokenizer_json

    tok = QwenTokenizer(qwen35_tokenizer_json(), embedding_vocab=EMBEDDING_ROWS)
    vocab = tok.grammar_vocabulary(TEXT_MARKERS)  # as QwenFrontend builds its book
    book = GrammarBook(lambda: vocab, vocab_size=tok.embedding_vocab,
                       stop_token_ids=QWEN35_EOS_TOKEN_IDS, **book_args)
    return tok, book, vocab


def quantiles(values: list[float]) -> dict:
    """p50 / p90 / p99 / max / mean of ``values`` (nearest rank), or an empty dict for none."""
    if not values:
        return {}
    v = sorted(values)

    def q(p: float) -> float:
        return v[min(len(v) - 1, int(p * len(v)))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": v[-1], "mean": statistics.mean(v), "n": len(v)}


def allowed_ids(mask) -> list[int]:
    """Token ids whose bit is set in one mask row (int32 words, bit t % 32 of word t // 32)."""
    import numpy as np

    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


def _is_set(mask, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


class Walker:
    """Walks a TokenMatcher along one valid output (the module docstring says how) and records its tokens."""

    def __init__(self, tok, vocab: list[bytes], stop: int, max_tokens: int) -> None:
        self.tok, self.vocab, self.stop, self.max_tokens = tok, vocab, stop, max_tokens
        self.by_bytes: dict[bytes, int] = {}
        for i, b in enumerate(vocab):
            if b:
                self.by_bytes.setdefault(b, i)
        self.longest = max(len(b) for b in vocab)

    def walk(self, matcher, words: int, instance, seed: int) -> tuple[list[int], str]:
        import torch

        rng = random.Random(seed)
        out = torch.zeros(1, words, dtype=torch.int32)
        # NFC, as the tokenizer normalizes: the text's bytes are then the bytes its tokens spell
        text = b"" if instance is None else unicodedata.normalize(
            "NFC", json.dumps(instance, ensure_ascii=False)).encode()
        pending = self.tok.encode(text.decode()) if text else []
        pos, kind = 0, "instance" if text else "random"
        tokens: list[int] = []
        while len(tokens) < self.max_tokens and not matcher.terminated:
            matcher.fill(out)
            row = out[0]
            token = None
            if pos < len(text):
                if pending and _is_set(row, pending[0]):
                    token = pending.pop(0)
                else:
                    pending = []  # refused: spell the rest with allowed tokens
                    kind = "instance*"
                    token = self._spelling(row, text, pos)
                    if token is None:
                        kind, pos = "instance+random", len(text)
                if token is not None:
                    pos += len(self.vocab[token])
            if token is None:
                if kind in ("instance", "instance*") and not _is_set(row, self.stop):
                    kind = "instance+random"  # spelled, but the grammar wants more
                token = self._random(row, rng)
            if not matcher.accept(token):
                raise RuntimeError(f"token {token} was in the mask but the matcher refused it")
            tokens.append(token)
        return tokens, kind if matcher.terminated else "unfinished"

    def _spelling(self, row, text: bytes, pos: int) -> int | None:
        for n in range(min(self.longest, len(text) - pos), 0, -1):
            t = self.by_bytes.get(text[pos:pos + n])
            if t is not None and _is_set(row, t):
                return t
        return None

    def _random(self, row, rng: random.Random) -> int:
        if _is_set(row, self.stop):
            return self.stop
        ids = allowed_ids(row)
        if not ids:
            raise RuntimeError("the grammar allows no token and has not ended")
        closing = [t for t in ids if self.vocab[t] and set(self.vocab[t]) <= CLOSERS]
        if closing and rng.random() < CLOSE_BIAS:
            return rng.choice(closing)
        text = [t for t in ids if self.vocab[t].strip()]  # whitespace only when nothing else is allowed
        return rng.choice(text or ids)


def time_fills(book, compiled, tokens: list[int], words: int, reps: int) -> list[float]:
    """Seconds per mask fill along ``tokens``, ``reps`` passes with fresh matchers."""
    import torch

    out = torch.zeros(1, words, dtype=torch.int32)
    fills = []
    for _ in range(reps):
        m = book.matcher(compiled)
        for t in tokens:
            t0 = clock()
            m.fill(out)
            fills.append(clock() - t0)
            m.accept(t)
    return fills


_AT = re.compile(r"^JSON schema at (?P<at>\S+): (?P<why>.*)$", re.S)


def refusal(message: str) -> str:
    """A short category for a ConstraintError: the refused keyword, the unsupported format, or the compile error."""
    from ninfer.models.common.grammar.schema_features import UNSUPPORTED

    m = _AT.match(message)
    if m:
        why = m.group("why")
        for key, text in UNSUPPORTED.items():
            if why == text:
                return f"refused {key}"
        fmt = re.match(r"string format ('[^']*'|\"[^\"]*\")", why)
        return f"refused format {fmt.group(1)}" if fmt else f"refused: {why[:80]}"
    for prefix in ("the JSON schema does not compile: ", "the JSON schema is not valid: "):
        message = message.removeprefix(prefix)
    return "compile error: " + message.removeprefix("Check failed: (false) is false: ")[:100]


_LOG_LINE = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # xgrammar's C++ log prefix: time, source file, line


@contextlib.contextmanager
def native_stderr(lines: list[str]):
    """Collect what native code writes to file descriptor 2 in the block (xgrammar logs there what it relaxes
    while compiling, e.g. oneOf compiled as anyOf), one entry per distinct message, prefix removed."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines():
                line = _LOG_LINE.sub("", line).strip()
                if line and line not in lines:
                    lines.append(line)


def run_schema(book, walker: Walker, row: dict, index: int, reps: int) -> dict:
    from ninfer.contract.constraint import ConstraintError, JsonConstraint, mask_words

    res: dict = {"subset": row["subset"], "file": row["file"], "has_instance": row["instance"] is not None}
    try:
        constraint = JsonConstraint(schema=row["schema"])
    except ValueError as e:
        return {**res, "ok": False, "reason": f"invalid schema: {e}"}
    warnings: list[str] = []
    t0 = clock()
    try:
        with native_stderr(warnings):
            compiled = book.compile(constraint)
    except ConstraintError as e:
        return {**res, "ok": False, "compile_s": clock() - t0, "reason": refusal(str(e)), "error": str(e)[:400]}
    res["compile_s"] = clock() - t0
    res["backend_warnings"] = warnings
    t0 = clock()
    book.compile(constraint)
    res["compile_cached_s"] = clock() - t0
    t0 = clock()
    matcher = book.matcher(compiled)
    res["matcher_s"] = clock() - t0
    words = mask_words(book.vocab_size)
    tokens, kind = walker.walk(matcher, words, row["instance"], seed=index)
    fills = time_fills(book, compiled, tokens, words, reps)
    us = quantiles([f * 1e6 for f in fills])
    return {**res, "ok": True, "walk": kind, "tokens": len(tokens), "fill_us": us, "_fills": fills}


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["ok"]]
    fills_us = [f * 1e6 for r in ok for f in r["_fills"]]
    by_subset: dict[str, dict] = {}
    for r in rows:
        s = by_subset.setdefault(r["subset"], {"schemas": 0, "compiled": 0})
        s["schemas"] += 1
        s["compiled"] += r["ok"]
    return {
        "schemas": len(rows), "compiled": len(ok), "compiled_fraction": len(ok) / len(rows) if rows else None,
        "reasons": dict(Counter(r["reason"] for r in rows if not r["ok"]).most_common()),
        "by_subset": by_subset, "walks": dict(Counter(r["walk"] for r in ok)),
        "relaxed": sum(bool(r["backend_warnings"]) for r in ok),
        "backend_warnings": dict(Counter(_warning_kind(w) for r in ok for w in r["backend_warnings"]).most_common()),
        "compile_ms": quantiles([r["compile_s"] * 1e3 for r in ok]),
        "compile_cached_ms": quantiles([r["compile_cached_s"] * 1e3 for r in ok]),
        "fill_us": quantiles(fills_us) | ({"p999": sorted(fills_us)[int(0.999 * len(fills_us))]} if fills_us else {}),
        "fills_over_1ms": sum(f > 1e3 for f in fills_us), "fills_over_5ms": sum(f > 5e3 for f in fills_us),
        "tokens": sum(r["tokens"] for r in ok),
    }


def _warning_kind(message: str) -> str:
    """A backend warning without its specifics (the regex it quotes)."""
    return message.removeprefix("Warning: ").split(": ^")[0][:160]


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(result: dict) -> str:
    lines = ["| subset | schema | result | compile ms (cached) | tokens | walk | fill p50 / p99 / max us |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        name = r["file"].rsplit("---", 1)[-1]
        if not r["ok"]:
            lines.append(f"| {r['subset']} | {name} | {r['reason']} | {_f(r.get('compile_s', 0) * 1e3, '.1f')} "
                         f"| - | - | - |")
            continue
        u = r["fill_us"]
        ok = f"ok, {len(r['backend_warnings'])} relaxed" if r["backend_warnings"] else "ok"
        lines.append(f"| {r['subset']} | {name} | {ok} | {r['compile_s'] * 1e3:.1f} ({r['compile_cached_s'] * 1e3:.3f}) "
                     f"| {r['tokens']} | {r['walk']} | {u['p50']:.1f} / {u['p99']:.1f} / {u['max']:.0f} |")
    s = result["summary"]
    c, cc, fu = s["compile_ms"], s["compile_cached_ms"], s["fill_us"]
    lines += ["", f"compiled {s['compiled']} of {s['schemas']} ({100 * (s['compiled_fraction'] or 0):.0f} %); "
              f"not compiled: " + (", ".join(f"{k} x{n}" for k, n in s["reasons"].items()) or "none"),
              "per subset: " + ", ".join(f"{k} {v['compiled']}/{v['schemas']}" for k, v in s["by_subset"].items()),
              "walks: " + ", ".join(f"{k} {n}" for k, n in s["walks"].items()),
              f"compiled but relaxed by the backend (its warnings): {s['relaxed']} schemas"
              + "".join(f"\n  - {k} x{n}" for k, n in s["backend_warnings"].items())]
    if c:
        lines += [f"compile ms (cold): p50 {c['p50']:.1f}, p90 {c['p90']:.1f}, max {c['max']:.1f}; "
                  f"cached p50 {cc['p50']:.3f}, max {cc['max']:.3f}",
                  f"mask fill us over {fu['n']} fills ({s['tokens']} tokens x {result['args']['reps']} passes): "
                  f"p50 {fu['p50']:.1f}, p90 {fu['p90']:.1f}, p99 {fu['p99']:.1f}, p99.9 {fu['p999']:.1f}, "
                  f"max {fu['max']:.0f}, mean {fu['mean']:.1f}; over 1 ms: {s['fills_over_1ms']}, "
                  f"over 5 ms: {s['fills_over_5ms']}"]
    lines.append(f"vocabulary build {result['vocabulary_s']:.2f} s, tokenizer info {result['tokenizer_info_s']:.2f} s")
    return "\n".join(lines)


def load_sample(path: Path, subsets: list[str] | None, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if subsets:
        rows = [r for r in rows if r["subset"] in subsets]
    return rows[:limit] if limit else rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=Path, default=SAMPLE)
    ap.add_argument("--subset", nargs="+", default=None, help="only these JSONSchemaBench subsets")
    ap.add_argument("--limit", type=int, default=None, help="only the first N schemas (after --subset)")
    ap.add_argument("--reps", type=int, default=3, help="timed passes over each walk (after the walk itself)")
    ap.add_argument("--max-tokens", type=int, default=3000, help="longest walk")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.max_tokens < 1 or (args.limit is not None and args.limit < 1):
        print("grammar_masks: --reps, --max-tokens and --limit must be >= 1", file=sys.stderr)
        return 2
    rows = load_sample(args.sample, args.subset, args.limit)
    if not rows:
        print(f"grammar_masks: no schema in {args.sample} matches", file=sys.stderr)
        return 2
    t0 = clock()
    tok, book, vocab = qwen_grammar_book()
    vocabulary_s = clock() - t0
    t0 = clock()
    book.warm()
    info_s = clock() - t0
    from ninfer.contract.constraint import JsonConstraint

    book.compile(JsonConstraint(schema={"type": "boolean"}))  # first-compile costs out of the first row's time
    walker = Walker(tok, vocab, book.stop_token_ids[0], args.max_tokens)
    result: dict = {"host": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
                             "python": platform.python_version(), "xgrammar": metadata.version("xgrammar")},
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "vocab_rows": book.vocab_size, "vocabulary_s": vocabulary_s, "tokenizer_info_s": info_s,
                    "rows": []}
    for i, row in enumerate(rows):
        res = run_schema(book, walker, row, i, args.reps)
        result["rows"].append(res)
        print(f"# {i + 1}/{len(rows)} {row['subset']} {row['file'].rsplit('---', 1)[-1]}: "
              + (f"{res['compile_s'] * 1e3:.0f} ms, {res['tokens']} tokens ({res['walk']})" if res["ok"]
                 else res["reason"]), file=sys.stderr, flush=True)
    result["summary"] = summarize(result["rows"])
    for r in result["rows"]:
        r.pop("_fills", None)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
