"""Does greedy decoding loop? Ten varied prompts (character cues, plain text, chat messages, a tool request),
decoded greedily; per prompt the tokens generated before an end token and the share of distinct 3-grams
(a repetition loop of period p over n tokens leaves about p / n of them distinct).

Runs on the training-time model (transformers' generate), so the run can be judged on the GPU machine; the
engine's own numbers for the docs come from `ninfer generate` on the converted artifact.
"""

from __future__ import annotations

from typing import Any

import torch
from chat_render import ChatRenderer
from tokenizers import Tokenizer

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather at a place.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "a town"}},
                   "required": ["location"]}}}

PLAIN = ["ROMEO:", "ROMEO.\n", "JULIET.\nO Romeo, Romeo! ", "KING.\nWhat news from France?\n\n", "HAMLET.\n",
         "To be, or not to be:", "First Citizen:\nBefore we proceed any further, hear me speak.\n",
         "The king is dead, and"]
CHATS: list[tuple[list[dict[str, str]], list[dict[str, Any]]]] = [
    ([{"role": "user", "content": "Speak of love."}], []),
    ([{"role": "user", "content": "What weather shall we have in Verona tomorrow?"}], [WEATHER_TOOL]),
]


def distinct_trigrams(ids: list[int]) -> float:
    grams = [tuple(ids[i:i + 3]) for i in range(len(ids) - 2)]
    return len(set(grams)) / len(grams) if grams else 0.0


def prompts(renderer: ChatRenderer) -> list[tuple[str, str]]:
    """(label, text) of the ten prompts; chats rendered with a generation prompt."""
    out = [(p, p) for p in PLAIN]
    out += [(f"chat: {m[-1]['content']}" + (" (tools)" if t else ""),
             renderer.render(m, t, add_generation_prompt=True)) for m, t in CHATS]
    return out


@torch.no_grad()
def greedy_report(lm, tok: Tokenizer, renderer: ChatRenderer, eos: list[int], new_tokens: int = 80) -> dict:
    device = next(lm.parameters()).device
    rows = []
    for label, text in prompts(renderer):
        ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids], device=device)
        out = lm.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[-1])
        gen = [t for t in out[0, ids.shape[1]:].tolist() if t not in eos]
        rows.append({"prompt": label, "tokens": len(gen), "distinct_3grams": round(distinct_trigrams(gen), 3),
                     "text": tok.decode(gen, skip_special_tokens=False)})
    return {"rows": rows, "mean_distinct_3grams": sum(r["distinct_3grams"] for r in rows) / len(rows),
            "min_distinct_3grams": min(r["distinct_3grams"] for r in rows),
            "min_tokens": min(r["tokens"] for r in rows)}
