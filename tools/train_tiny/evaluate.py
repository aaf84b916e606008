"""Step 4 (CPU): check the HF export with plain transformers and write the numbers and samples for the doc.

    python tools/train_tiny/evaluate.py --hf tools/train_tiny/out/hf --data .train_data

Loads the export with `Qwen3_5ForCausalLM.from_pretrained` (which ignores `mtp.*`), recomputes the held-out
perplexity, loads the MTP weights into the training-time MTP block to measure the drafter, compares with the
unigram baseline and prints greedy and sampled continuations of plain-text and chat prompts.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
from model import TinyQwen35
from safetensors.torch import load_file
from tokenizers import Tokenizer
from train import evaluate
from transformers import Qwen3_5ForCausalLM

PROMPTS = ["ROMEO.\n", "To be, or not to be:", "KING.\nWhat news from France?\n\n"]
CHAT = [[{"role": "user", "content": "What say you of love, good sir?"}],
        [{"role": "user", "content": "Where is the king?"}]]


def render(template: str, messages) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(ValueError(message))
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def generate(lm, tok: Tokenizer, text: str, *, sample: bool, eos: list[int], new_tokens: int = 80) -> str:
    ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids])
    kwargs = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 50} if sample else {"do_sample": False}
    out = lm.generate(ids, max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=eos[-1], **kwargs)
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=Path(".train_data"))
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    lm = Qwen3_5ForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(args.hf / "tokenizer.json"))
    meta = json.loads((args.data / "meta.json").read_text())
    config = lm.config
    full = TinyQwen35(config)
    state = load_file(str(args.hf / "model.safetensors"))
    missing = full.lm.load_state_dict({k: v.float() for k, v in state.items() if not k.startswith("mtp.")},
                                      strict=False).missing_keys
    if set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"export lacks {missing}")
    full.lm.tie_weights()
    full.mtp.load_state_dict({k[4:]: v.float() for k, v in state.items() if k.startswith("mtp.")})
    full.eval()

    test = torch.from_numpy(np.fromfile(args.data / "test.u16", dtype=np.uint16).astype(np.int64))
    with torch.no_grad():
        probe = test[:256][None]
        same = torch.allclose(lm(probe).logits, full.forward_all(probe)[0], atol=1e-4)
    metrics = evaluate(full, test, args.seq, torch.device("cpu"), lambda: torch.autocast("cpu", enabled=False))
    result = {"from_pretrained_matches_training_model": bool(same), "test": metrics,
              "unigram_test_perplexity": meta["unigram_test_perplexity"], "test_tokens": int(test.numel()),
              "bits_per_char": metrics["loss"] * test.numel() / meta["test_chars"] / math.log(2), "samples": []}
    eos = config.eos_token_id
    template = (args.hf / "chat_template.jinja").read_text()
    for prompt in PROMPTS:
        for sample in (False, True):
            result["samples"].append({"prompt": prompt, "sampled": sample,
                                      "output": generate(lm, tok, prompt, sample=sample, eos=eos)})
    for messages in CHAT:
        prompt = render(template, messages)
        for sample in (False, True):
            result["samples"].append({"chat": messages, "sampled": sample,
                                      "output": generate(lm, tok, prompt, sample=sample, eos=eos)})
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
