"""Step 2 (GPU, about 2 minutes on one H200; also runs on CPU with tiny settings): train the tiny Qwen3.5 with
its MTP block, keep the checkpoint with the best dev-play loss, write its weights and a training log.

    python tools/train_tiny/train.py --data .train_data --out tools/train_tiny/out/run

Total loss = next-token loss + --mtp-weight * next-next-token (MTP) loss. Weights are written in HF names
(`model.*`, `mtp.*`; bf16, with A_log and the GDN norm kept fp32 as in the published checkpoints), split into
shards of at most --shard-mib so the files can travel back from the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from model import TinyQwen35, add_residual_dropout, check_mtp_causal, tiny_config  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

FP32_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")


def load_stream(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))


class Windows:
    """Random training windows of the stream. A window that would start inside a chat is moved back to the
    chat's `<|im_start|>`: the model then never sees chat turns at the start of its context without their
    markup, so a plain-text prompt (no `<|im_start|>` before it) is not read as a chat turn it should end
    with `<|im_end|>`."""

    def __init__(self, stream: torch.Tensor, length: int, eot: int, im_start: int) -> None:
        self.stream, self.length = stream, length
        starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(stream == eot).flatten() + 1])
        self.doc_starts = starts[starts < stream.numel()]
        self.chat = stream[self.doc_starts] == im_start

    def batch(self, size: int, gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, self.stream.numel() - self.length - 1, (size,), generator=gen)
        doc = torch.searchsorted(self.doc_starts, starts, right=True) - 1
        starts = torch.where(self.chat[doc], self.doc_starts[doc], starts)
        return torch.stack([self.stream[s:s + self.length] for s in starts.tolist()])


def train_windows(stream: torch.Tensor, length: int, meta: dict) -> Windows:
    return Windows(stream, length, meta["ids"]["<|endoftext|>"], meta["ids"]["<|im_start|>"])


def held_out(path: Path, tokens: int) -> torch.Tensor:
    """A held-out play's stream, or its first `tokens` tokens."""
    stream = load_stream(path)
    return stream[:tokens] if tokens else stream


def windows(stream: torch.Tensor, length: int) -> list[torch.Tensor]:
    """Windows overlapping by one token, so every token after the first is predicted exactly once."""
    out, start = [], 0
    while start < stream.numel() - 1:
        out.append(stream[start:start + length])
        start += length - 1
    return out


@torch.no_grad()
def evaluate(model: TinyQwen35, stream: torch.Tensor, length: int, device, autocast) -> dict[str, float]:
    """Mean next-token loss over the whole play, plus the MTP loss, MTP top-1 accuracy and how often the MTP
    guess equals the main model's own greedy choice (the greedy acceptance rate of a one-token draft)."""
    model.eval()
    tot = {"loss": 0.0, "n": 0, "mtp_loss": 0.0, "mtp_n": 0, "mtp_hit": 0, "mtp_agree": 0}
    for w in windows(stream, length):
        ids = w.to(device)[None]
        if ids.shape[1] < 3:
            continue
        with autocast():
            logits, mtp_logits = model.forward_all(ids)
        logits, mtp_logits = logits.float()[0], mtp_logits.float()[0]
        tot["loss"] += torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum").item()
        tot["n"] += ids.shape[1] - 1
        m = mtp_logits[:-1]
        target = ids[0, 2:]
        tot["mtp_loss"] += torch.nn.functional.cross_entropy(m, target, reduction="sum").item()
        tot["mtp_n"] += target.numel()
        guess = m.argmax(-1)
        tot["mtp_hit"] += (guess == target).sum().item()
        tot["mtp_agree"] += (guess == logits[1:-1].argmax(-1)).sum().item()
    model.train()
    loss = tot["loss"] / tot["n"]
    return {"loss": loss, "ppl": math.exp(loss), "mtp_loss": tot["mtp_loss"] / tot["mtp_n"],
            "mtp_top1": tot["mtp_hit"] / tot["mtp_n"], "mtp_agree_greedy": tot["mtp_agree"] / tot["mtp_n"]}


def autocast_for(device: torch.device):
    """A factory of the phase's autocast context: bf16 on the GPU, plain fp32 on the CPU."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return lambda: torch.autocast("cpu", enabled=False)


def adamw(params, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW as every phase uses it: weight decay on matrices only, betas 0.9 / 0.95."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def lr_at(step: int, args, elapsed: float = 0.0) -> float:
    """Linear warmup, then cosine to min_lr_frac; the cosine ends at --steps or at --time-budget, whichever
    comes first, so a slower machine still finishes its schedule."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, max((step - args.warmup) / max(1, args.steps - args.warmup), elapsed / args.time_budget))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_shards(state: dict[str, torch.Tensor], out: Path, shard_mib: float, prefix: str = "weights") -> list[str]:
    tensors = {k: (v.float() if k.endswith(FP32_SUFFIXES) else v.to(torch.bfloat16)).contiguous().cpu()
               for k, v in state.items()}
    limit = int(shard_mib * 2**20)
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    names = []
    for i, shard in enumerate(shards):
        name = f"{prefix}-{i:02d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        names.append(name)
    return names


def add_run_arguments(ap: argparse.ArgumentParser, *, steps: int, lr: float, warmup: int, weight_decay: float,
                      eval_every: int, time_budget: float, phase: str, batch_help: str | None = None) -> None:
    """The options every phase (training, unlooping, distillation) shares; the defaults are each phase's own."""
    ap.add_argument("--data", type=Path, default=Path(".train_data"))
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch", type=int, default=32, help=batch_help)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--weight-decay", type=float, default=weight_decay)
    ap.add_argument("--eval-every", type=int, default=eval_every)
    ap.add_argument("--time-budget", type=float, default=time_budget, help=f"seconds of {phase} before stopping early")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shard-mib", type=float, default=15.0)
    ap.add_argument("--eval-tokens", type=int, default=0, help="evaluate on this many tokens of each held-out "
                    "play (0: all; fewer for smoke runs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    add_run_arguments(ap, steps=240, lr=1.5e-3, warmup=60, weight_decay=0.1, eval_every=20, time_budget=480.0,
                      phase="training")
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--dropout", type=float, default=0.0, help="residual and embedding dropout while training")
    ap.add_argument("--intermediate", type=int, default=768, help="the MLP width")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    meta = json.loads((args.data / "meta.json").read_text())
    ids = meta["ids"]
    config = tiny_config(eos_ids=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_id=ids["<|endoftext|>"],
                         intermediate=args.intermediate)
    config._attn_implementation = "sdpa"
    device = torch.device(args.device)
    model = TinyQwen35(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_main = sum(p.numel() for p in model.lm.parameters())

    train = load_stream(args.data / "train.u16")
    dev = held_out(args.data / "dev.u16", args.eval_tokens)
    test = held_out(args.data / "test.u16", args.eval_tokens)

    autocast = autocast_for(device)

    sampler = train_windows(train, args.seq, meta)
    check_mtp_causal(model, train[:64].to(device)[None])
    add_residual_dropout(model, args.dropout)

    opt = adamw(model.parameters(), args.lr, args.weight_decay, device)
    gen = torch.Generator().manual_seed(args.seed)
    log = {"args": {k: str(v) for k, v in vars(args).items()}, "params": n_params, "params_main": n_main,
           "params_mtp": n_params - n_main, "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "curve": []}
    print(json.dumps({"params": n_params, "params_main": n_main, "train_tokens": train.numel()}), flush=True)

    best, best_state = float("inf"), None
    t0 = time.time()
    step = 0
    for step in range(args.steps):
        batch = sampler.batch(args.batch, gen).to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args, time.time() - t0)
        with autocast():
            main_loss, mtp_loss = model.losses(batch)
            loss = main_loss + args.mtp_weight * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = step == args.steps - 1 or time.time() - t0 > args.time_budget
        if step % args.eval_every == 0 or last:
            d = evaluate(model, dev, args.seq, device, autocast)
            point = {"step": step, "tokens": (step + 1) * args.batch * args.seq, "seconds": round(time.time() - t0, 1),
                     "lr": opt.param_groups[0]["lr"], "train_loss": main_loss.item(), "train_mtp_loss": mtp_loss.item(),
                     "grad_norm": float(grad_norm), "dev_loss": d["loss"], "dev_mtp_loss": d["mtp_loss"]}
            log["curve"].append(point)
            print(json.dumps(point), flush=True)
            if d["loss"] < best:
                best = d["loss"]
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                log["best_step"] = step
        if last:
            break
    log["steps_run"] = step + 1
    log["train_seconds"] = round(time.time() - t0, 1)
    model.load_state_dict(best_state)
    log["dev"] = evaluate(model, dev, args.seq, device, autocast)
    log["test"] = evaluate(model, test, args.seq, device, autocast)
    log["unigram_test_perplexity"] = meta["unigram_test_perplexity"]
    log["shards"] = save_shards(model.export_state_dict(), args.out, args.shard_mib)
    (args.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps({"best_step": log.get("best_step"), "dev": log["dev"], "test": log["test"],
                      "seconds": log["train_seconds"]}), flush=True)


if __name__ == "__main__":
    main()
