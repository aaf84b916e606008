"""Step 3 (CPU): assemble the Hugging Face layout from a training run.

    python tools/train_tiny/export.py --run tools/train_tiny/out/run --data .train_data \
        --out tools/train_tiny/out/hf

Writes config.json (Qwen3_5ForCausalLM, model_type qwen3_5_text, mtp_num_hidden_layers 1),
model.safetensors (HF names incl. mtp.*), tokenizer.json, tokenizer_config.json (with the chat template),
generation_config.json and chat_template.jinja.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from chat_render import template_source
from model import MAX_POSITIONS, run_intermediate, tiny_config
from safetensors.torch import load_file, save_file
from tokenizer import ADDED_TOKENS

TEMPERATURE, TOP_P, TOP_K = 0.8, 0.95, 50
# The model's default repetition penalty (HF, vLLM and ninfer read it from generation_config.json; a request may
# set its own): an 11 M-parameter model's greedy decoding falls into loops that 1.1 breaks without costing the
# tool-call format its repeated tags (docs/embedded-model.md has the loop report with and without it).
REPETITION_PENALTY = 1.1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a train.py output folder")
    ap.add_argument("--data", type=Path, default=Path(".train_data"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    log = json.loads((args.run / "train_log.json").read_text())
    meta = json.loads((args.data / "meta.json").read_text())
    ids = meta["ids"]
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]

    tensors = {}
    for shard in log["shards"]:
        tensors.update(load_file(str(args.run / shard)))
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})

    config = tiny_config(eos_ids=[im_end, eot], pad_id=eot, intermediate=run_intermediate(log)).to_dict()
    config.update({"architectures": ["Qwen3_5ForCausalLM"], "dtype": "bfloat16",
                   "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
                   "full_attention_interval": 4, "attn_output_gate": True, "mamba_ssm_dtype": "float32"})
    (args.out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    generation = {"bos_token_id": None, "eos_token_id": [im_end, eot], "pad_token_id": eot, "do_sample": True,
                  "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K,
                  "repetition_penalty": REPETITION_PENALTY}
    (args.out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    shutil.copy(args.data / "tokenizer.json", args.out / "tokenizer.json")
    template, template_path = template_source()
    (args.out / "chat_template.jinja").write_text(template)
    base = meta["vocab_size"] - len(ADDED_TOKENS)
    tokenizer_config = {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None, "unk_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "errors": "replace",
        "clean_up_tokenization_spaces": False, "split_special_tokens": False,
        "model_max_length": MAX_POSITIONS, "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {str(base + i): {"content": c, "special": s, "lstrip": False, "rstrip": False,
                                                 "normalized": False, "single_word": False}
                                 for i, (c, s) in enumerate(ADDED_TOKENS)},
        "chat_template": template,
    }
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    print(json.dumps({"out": str(args.out), "tensors": len(tensors), "template": template_path}))


if __name__ == "__main__":
    main()
