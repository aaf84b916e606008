"""Step 2b (GPU, about 1.5 minutes on one H200; also runs on CPU with tiny settings): self-distil the MTP head.

    python tools/train_tiny/distill.py --run tools/train_tiny/out/run --data .train_data

The main training teaches the MTP block the text's token after next (0.3 x cross-entropy on x_{t+2}). A drafter
is accepted when it agrees with the main model, not with the text, so this phase freezes the main model
(embedding and head included, which the block shares) and trains only `mtp.*` to match the main model's own
next-token distribution at t+1: KL(p_main(. | x_<=t+1) || q_mtp(. | h_t, x_{t+1})), plus --hard-weight x
cross-entropy on the main model's argmax, over windows of the training stream.

The main model is read from the run's shards as exported (bf16), so the teacher is exactly the shipped model.
The run's train_log.json then lists the new shards under "shards" (the main training's stay under
"main_shards", and a re-run starts from them again) and the phase's log under "distill".
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from model import TinyQwen35, run_intermediate, tiny_config
from safetensors.torch import load_file
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


def distill_losses(model: TinyQwen35, ids: torch.Tensor, hard_weight: float) -> dict[str, torch.Tensor]:
    """Loss of the MTP block against the frozen main model on a batch of windows [B, L].

    MTP position t (fed x_{t+1} and h_t) is matched to the main model's distribution at t+1 (both predict
    x_{t+2}); every one of the L-1 positions has a teacher."""
    with torch.no_grad():
        hidden = model.lm.model(input_ids=ids).last_hidden_state
        teacher = F.log_softmax(model.lm.lm_head(hidden[:, 1:]).float(), dim=-1)
    student = F.log_softmax(model.lm.lm_head(model.mtp_hidden(ids, hidden)).float(), dim=-1)
    V = student.shape[-1]
    kl = F.kl_div(student.reshape(-1, V), teacher.reshape(-1, V), log_target=True, reduction="batchmean")
    target = teacher.argmax(-1)
    hard = F.nll_loss(student.reshape(-1, V), target.reshape(-1))
    agree = (student.argmax(-1) == target).float().mean()
    return {"loss": kl + hard_weight * hard, "kl": kl, "hard": hard, "agree": agree}


def load_run(run: Path, model: TinyQwen35, log: dict) -> None:
    state: dict[str, torch.Tensor] = {}
    for shard in log.get("main_shards", log["shards"]):
        state.update(load_file(str(run / shard)))
    model.load_export_state(state)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a train.py output folder; updated in place")
    add_run_arguments(ap, steps=400, lr=1e-3, warmup=20, weight_decay=0.0, eval_every=50, time_budget=60.0,
                      phase="distillation")
    ap.add_argument("--hard-weight", type=float, default=0.0, help="weight of the main model's argmax as a target")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    log = json.loads((args.run / "train_log.json").read_text())
    ids = json.loads((args.data / "meta.json").read_text())["ids"]
    config = tiny_config(eos_ids=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_id=ids["<|endoftext|>"],
                         intermediate=run_intermediate(log))
    config._attn_implementation = "sdpa"
    device = torch.device(args.device)
    model = TinyQwen35(config)
    load_run(args.run, model, log)
    model.to(device)
    model.lm.requires_grad_(False)
    model.lm.eval()       # no dropout either way; eval() documents that the teacher is fixed
    model.mtp.train()

    train = load_stream(args.data / "train.u16")
    sampler = train_windows(train, args.seq, json.loads((args.data / "meta.json").read_text()))
    dev = held_out(args.data / "dev.u16", args.eval_tokens)

    autocast = autocast_for(device)

    params = list(model.mtp.parameters())
    opt = adamw(params, args.lr, args.weight_decay, device)
    gen = torch.Generator().manual_seed(args.seed + 1)   # windows other than the main training's
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "curve": []}

    def checkpoint(step: int, losses: dict[str, torch.Tensor], t0: float) -> None:
        d = evaluate(model, dev, args.seq, device, autocast)
        point = {"step": step, "seconds": round(time.time() - t0, 1), "lr": opt.param_groups[0]["lr"],
                 **{f"train_{k}": v.item() for k, v in losses.items()},
                 "dev_mtp_loss": d["mtp_loss"], "dev_mtp_agree_greedy": d["mtp_agree_greedy"]}
        out["curve"].append(point)
        print(json.dumps(point), flush=True)
        model.lm.eval()   # evaluate() leaves the whole model in train mode

    out["before"] = {"dev": evaluate(model, dev, args.seq, device, autocast)}
    model.lm.eval()
    print(json.dumps({"before": out["before"]}), flush=True)
    t0 = time.time()
    step = 0
    for step in range(args.steps):
        batch = sampler.batch(args.batch, gen).to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args, time.time() - t0)
        with autocast():
            losses = distill_losses(model, batch, args.hard_weight)
        opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        last = step == args.steps - 1 or time.time() - t0 > args.time_budget
        if step % args.eval_every == 0 or last:
            checkpoint(step, losses, t0)
        if last:
            break
    out["steps_run"] = step + 1
    out["seconds"] = round(time.time() - t0, 1)
    out["dev"] = evaluate(model, dev, args.seq, device, autocast)
    out["test"] = evaluate(model, held_out(args.data / "test.u16", args.eval_tokens), args.seq, device, autocast)

    main_shards = log.get("main_shards", log["shards"])
    shards = save_shards(model.export_state_dict(), args.run, args.shard_mib, prefix="distilled")
    log.update({"main_shards": main_shards, "shards": shards, "distill": out})
    (args.run / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps({"steps": out["steps_run"], "seconds": out["seconds"], "dev": out["dev"],
                      "test": out["test"]}), flush=True)


if __name__ == "__main__":
    main()
