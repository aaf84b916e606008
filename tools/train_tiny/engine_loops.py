"""The greedy-loop report of loops.py, through the ninfer engine on a converted artifact (the numbers
docs/embedded-model.md quotes, and what tests/test_embedded_model.py checks):

    .venv/bin/python tools/train_tiny/engine_loops.py [ARTIFACT] [--json]

Runs the ten prompts greedily, 80 new tokens each, on CPU in fp32; prints per prompt the tokens generated
before an end token, the share of distinct 3-grams and the text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loops import CHATS, PLAIN, distinct_trigrams

import ninfer


def engine_report(artifact: str, new_tokens: int = 80) -> list[dict]:
    from ninfer.contract.events import FinishReason, GenerationResult
    from ninfer.contract.prompt import ChatInput, TextInput
    from ninfer.contract.request import GenerationRequest, SamplingParams

    inputs = [(p, TextInput(text=p)) for p in PLAIN]
    inputs += [(f"chat: {m[-1]['content']}" + (" (tools)" if t else ""), ChatInput(messages=m, tools=t))
               for m, t in CHATS]
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    rows = []
    with ninfer.Engine(artifact, ninfer.EngineConfig(device="cpu", dtype="float32", max_concurrency=8)) as engine:
        handles = [(label, engine.submit(GenerationRequest(input=i, sampling=sampling))) for label, i in inputs]
        for label, handle in handles:
            result = next(e for e in handle if isinstance(e, GenerationResult))
            if result.error is not None:
                raise RuntimeError(f"{label!r}: {result.error}")
            ids = list(result.token_ids)
            if result.finish_reason is FinishReason.STOP:
                ids = ids[:-1]                                        # the end token itself
            rows.append({"prompt": label, "tokens": len(ids), "distinct_3grams": round(distinct_trigrams(ids), 3),
                         "finish": result.finish_reason.value, "text": engine.frontend.tokenizer.decode(ids)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", nargs="?", default=ninfer.default_model_path())
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = engine_report(args.artifact)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        return
    for r in rows:
        print(f"| {json.dumps(r['prompt'])} | {r['tokens']} | {r['distinct_3grams']:.2f} | {r['finish']} | "
              f"{json.dumps(r['text'])} |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
