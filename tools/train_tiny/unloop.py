"""Step 2a (GPU, about 1.5 minutes on one H100; also runs on CPU with tiny settings): teach the model not to
loop under greedy decoding.

    python tools/train_tiny/unloop.py --run tools/train_tiny/out/run --data .train_data

A small model trained on little text falls into repetition loops under greedy decoding: once a line has been
repeated, repeating it again becomes more likely each time. This phase fine-tunes the trained model on its usual
next-token loss plus a loss on pseudo-repetitive windows (DITTO, Xu et al. 2022, "Learning to Break the Loop"):
a window of real text (never inside a chat), then one of its lines repeated until the window is full. On each
token of the n-th repeat the model's probability p_n of that token is pulled towards lambda * p_{n-1} (the same
token one repeat earlier, held fixed), through -log(1 - |p_n - lambda * p_{n-1}|), so each further repeat becomes
less likely instead of more.

The run's train_log.json then lists the new `unlooped-*` shards under "shards" (the main training's stay under
"trained_shards") and the phase's log, with the greedy-loop report before and after, under "unloop".
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from chat_render import ChatRenderer, template_source
from distill import load_run
from loops import greedy_report
from model import TinyQwen35, add_residual_dropout, run_intermediate, tiny_config
from tokenizers import Tokenizer
from torch.nn import functional as F
from train import (
    adamw,
    add_run_arguments,
    autocast_for,
    evaluate,
    held_out,
    load_stream,
    lr_at,
    save_shards,
    train_windows,
)


def newline_ids(tok: Tokenizer) -> torch.Tensor:
    """Ids of the tokens that end a line (their text holds a newline)."""
    return torch.tensor([i for i in range(tok.get_vocab_size()) if "\n" in tok.decode([i])])


def in_chats(stream: torch.Tensor, im_start: int, end_of_text: int) -> torch.Tensor:
    """Which positions of the stream lie inside a chat: after an `<|im_start|>`, before the `<|endoftext|>` that
    ends its conversation."""
    pos = torch.arange(stream.numel())
    last_start = torch.where(stream == im_start, pos, -1).cummax(0).values
    last_end = torch.where(stream == end_of_text, pos, -1).cummax(0).values
    return last_start > last_end


def repeated_batch(stream: torch.Tensor, line_ends: torch.Tensor, batch: int, context: int, length: int,
                   gen: torch.Generator, chats: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """[batch, length] windows: `context` tokens of real text, then the line that follows them (up to and with
    its newline, 4 to 40 tokens) repeated to the end; and each window's line length. With `chats` (`in_chats`),
    no window touches a chat: a tool call repeats its `<parameter=...>` / `</parameter>` lines by design, and
    teaching their repeats away costs the model its tool calls."""
    ends = torch.nonzero(torch.isin(stream, line_ends)).flatten()
    rows, periods = [], []
    while len(rows) < batch:
        k = int(torch.randint(1, ends.numel() - 1, (1,), generator=gen))
        start, stop = int(ends[k - 1]) + 1, int(ends[k]) + 1
        if start < context or not 4 <= stop - start <= 40:
            continue
        if chats is not None and bool(chats[start - context:stop].any()):
            continue
        line = stream[start:stop]
        reps = (length - context) // line.numel() + 1
        rows.append(torch.cat([stream[start - context:start], line.repeat(reps)])[:length])
        periods.append(line.numel())
    return torch.stack(rows), periods


def ditto_loss(logits: torch.Tensor, ids: torch.Tensor, periods: list[int], context: int, lam: float) -> torch.Tensor:
    """Mean of -log(1 - |p_n - lam * sg(p_{n-1})|) over the tokens of every repeat after the first."""
    probs = F.softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]   # p of token t+1
    losses = []
    for b, period in enumerate(periods):
        first = context + period - 1            # index into probs of the first token of the second repeat
        p_now = probs[b, first:]
        p_before = probs[b, first - period:probs.shape[1] - period].detach()
        losses.append(-torch.log((1 - (p_now - lam * p_before).abs()).clamp_min(1e-5)))
    return torch.cat(losses).mean()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a train.py output folder; updated in place")
    add_run_arguments(ap, steps=300, lr=3e-4, warmup=10, weight_decay=0.1, eval_every=50, time_budget=75.0,
                      phase="unlooping", batch_help="windows of real text per step")
    ap.add_argument("--rep-batch", type=int, default=16, help="pseudo-repetitive windows per step")
    ap.add_argument("--rep-context", type=int, default=64)
    ap.add_argument("--rep-seq", type=int, default=320)
    ap.add_argument("--lam", type=float, default=0.5, help="each repeat's target: lam x the previous one's")
    ap.add_argument("--rep-weight", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--dropout", type=float, help="residual dropout (default: the main training's)")
    ap.add_argument("--new-tokens", type=int, default=80, help="tokens per greedy-loop prompt")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    log = json.loads((args.run / "train_log.json").read_text())
    ids = json.loads((args.data / "meta.json").read_text())["ids"]
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    config = tiny_config(eos_ids=eos, pad_id=ids["<|endoftext|>"], intermediate=run_intermediate(log))
    config._attn_implementation = "sdpa"
    device = torch.device(args.device)
    model = TinyQwen35(config)
    load_run(args.run, model, {"shards": log.get("trained_shards", log["shards"])})
    model.to(device)
    if args.dropout is None:
        args.dropout = float(log["args"].get("dropout", 0.0))
    add_residual_dropout(model, args.dropout)
    tok = Tokenizer.from_file(str(args.data / "tokenizer.json"))
    renderer = ChatRenderer(template_source()[0])
    train = load_stream(args.data / "train.u16")
    sampler = train_windows(train, args.seq, json.loads((args.data / "meta.json").read_text()))
    dev = held_out(args.data / "dev.u16", args.eval_tokens)
    line_ends = newline_ids(tok)
    chats = in_chats(train, ids["<|im_start|>"], ids["<|endoftext|>"])

    autocast = autocast_for(device)

    def loops() -> dict:
        model.eval()
        report = greedy_report(model.lm, tok, renderer, eos, args.new_tokens)
        model.train()
        return report

    out = {"args": {k: str(v) for k, v in vars(args).items()}, "curve": [],
           "before": {"dev": evaluate(model, dev, args.seq, device, autocast), "loops": loops()}}
    print(json.dumps({"before": {k: v for k, v in out["before"]["loops"].items() if k != "rows"}}), flush=True)
    opt = adamw(model.parameters(), args.lr, args.weight_decay, device)
    gen = torch.Generator().manual_seed(args.seed + 2)
    model.train()
    t0 = time.time()
    step = 0
    for step in range(args.steps):
        batch = sampler.batch(args.batch, gen).to(device, non_blocking=True)
        rep, periods = repeated_batch(train, line_ends, args.rep_batch, args.rep_context, args.rep_seq, gen, chats)
        rep = rep.to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args, time.time() - t0)
        with autocast():
            main_loss, mtp_loss = model.losses(batch)
            rep_loss = ditto_loss(model.lm(input_ids=rep).logits, rep, periods, args.rep_context, args.lam)
            loss = main_loss + args.mtp_weight * mtp_loss + args.rep_weight * rep_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = step == args.steps - 1 or time.time() - t0 > args.time_budget
        if step % args.eval_every == 0 or last:
            d = evaluate(model, dev, args.seq, device, autocast)
            point = {"step": step, "seconds": round(time.time() - t0, 1), "lr": opt.param_groups[0]["lr"],
                     "train_loss": main_loss.item(), "rep_loss": rep_loss.item(), "dev_loss": d["loss"]}
            out["curve"].append(point)
            print(json.dumps(point), flush=True)
        if last:
            break
    out["steps_run"] = step + 1
    out["seconds"] = round(time.time() - t0, 1)
    out["dev"] = evaluate(model, dev, args.seq, device, autocast)
    out["test"] = evaluate(model, held_out(args.data / "test.u16", args.eval_tokens), args.seq, device, autocast)
    out["loops"] = loops()
    shards = save_shards(model.export_state_dict(), args.run, args.shard_mib, prefix="unlooped")
    log.update({"trained_shards": log.get("trained_shards", log["shards"]), "shards": shards, "unloop": out})
    log.pop("main_shards", None)
    (args.run / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps({"steps": out["steps_run"], "seconds": out["seconds"], "dev": out["dev"], "test": out["test"],
                      "loops": {k: v for k, v in out["loops"].items() if k != "rows"}}), flush=True)


if __name__ == "__main__":
    main()
