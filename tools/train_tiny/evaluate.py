"""Step 4 (GPU or CPU): check the HF export with plain transformers; the numbers and samples for the doc.

    python tools/train_tiny/evaluate.py --hf tools/train_tiny/out/hf --data .train_data

Loads the export with `Qwen3_5ForCausalLM.from_pretrained` (which ignores `mtp.*`), recomputes the held-out
perplexity, loads the MTP weights into the training-time MTP block to measure the drafter, compares with the
unigram baseline and prints greedy and sampled continuations of plain-text and chat prompts.

The drafter numbers, on the held-out play: `test.mtp_agree_greedy`, how often the MTP argmax at t (fed the true
x_{t+1} and h_t) equals the main model's argmax at t+1, over every position; and `mtp_chain`, drafts chained
as the engine chains them (see mtp_chain.py) against the main model's greedy continuation, at every
--chain-every-th position: per-step agreement and the mean tokens per verify step with k = 1..--chain-depth
drafts. `tool_prompts` runs the held-out synthetic chats prepare.py wrote (synthetic_eval.json), greedily, and
counts the well-formed tool calls with the expected function and arguments.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from chat_render import ChatRenderer
from model import TinyQwen35
from mtp_chain import chained_acceptance
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tool_prompts import tool_prompt_results
from train import evaluate, held_out, windows
from transformers import Qwen3_5ForCausalLM

PROMPTS = ["ROMEO.\n", "To be, or not to be:", "KING.\nWhat news from France?\n\n"]
CHAT = [[{"role": "user", "content": "What say you of love, good sir?"}],
        [{"role": "user", "content": "Where is the king?"}]]


def generate(lm, tok: Tokenizer, text: str, *, sample: bool, eos: list[int], new_tokens: int = 80) -> str:
    device = next(lm.parameters()).device
    ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids], device=device)
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
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chain-every", type=int, default=32, help="chained drafts from every n-th position")
    ap.add_argument("--chain-depth", type=int, default=3)
    ap.add_argument("--tool-prompts", type=int, default=30, help="held-out synthetic chats to run (0: none)")
    ap.add_argument("--new-tokens", type=int, default=80, help="tokens per sample (tool prompts get twice as many)")
    ap.add_argument("--eval-tokens", type=int, default=0, help="evaluate on this many tokens of the held-out "
                    "play (0: all; fewer for smoke runs)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    lm = Qwen3_5ForCausalLM.from_pretrained(args.hf, dtype=torch.float32).to(device).eval()
    tok = Tokenizer.from_file(str(args.hf / "tokenizer.json"))
    meta = json.loads((args.data / "meta.json").read_text())
    config = lm.config
    full = TinyQwen35(config)
    full.load_export_state(load_file(str(args.hf / "model.safetensors")))
    full.to(device).eval()

    test = held_out(args.data / "test.u16", args.eval_tokens)
    with torch.no_grad():
        probe = test[:256][None].to(device)
        same = torch.allclose(lm(probe).logits, full.forward_all(probe)[0], atol=1e-4)
    metrics = evaluate(full, test, args.seq, device, lambda: torch.autocast(device.type, enabled=False))
    full.eval()
    result = {"from_pretrained_matches_training_model": bool(same), "test": metrics,
              "unigram_test_perplexity": meta["unigram_test_perplexity"], "test_tokens": int(test.numel())}
    if not args.eval_tokens:
        result["bits_per_char"] = metrics["loss"] * test.numel() / meta["test_chars"] / math.log(2)
    result["mtp_chain"] = chained_acceptance(full, windows(test, args.seq), args.chain_every, args.chain_depth,
                                             device)
    print(json.dumps({k: result[k] for k in ("test", "mtp_chain")}, indent=2), flush=True)

    eos = config.eos_token_id
    renderer = ChatRenderer((args.hf / "chat_template.jinja").read_text())

    def complete(text: str, sample: bool = False, new_tokens: int = args.new_tokens) -> str:
        return generate(lm, tok, text, sample=sample, eos=eos, new_tokens=new_tokens)

    eval_chats = args.data / "synthetic_eval.json"
    if args.tool_prompts and eval_chats.exists():
        prompts = json.loads(eval_chats.read_text())[:args.tool_prompts]
        result["tool_prompts"] = tool_prompt_results(
            prompts, lambda text: complete(text, new_tokens=2 * args.new_tokens), renderer)
    result["samples"] = [{"prompt": prompt, "sampled": sample, "output": complete(prompt, sample)}
                         for prompt in PROMPTS for sample in (False, True)]
    result["samples"] += [{"chat": messages, "sampled": sample,
                           "output": complete(renderer.render(messages, add_generation_prompt=True), sample)}
                          for messages in CHAT for sample in (False, True)]
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
