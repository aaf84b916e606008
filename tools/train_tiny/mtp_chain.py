"""Chained MTP drafts on held-out text, and how many of them greedy verification would accept.

At position t the block is fed x_{t+1} and the main model's h_t (step 1, as in training). Chained step j+1 is
fed step j's argmax and its normed output, one position further on, as ninfer's Qwen35MTP drafts: its layer
attends to the step-1 entries up to t (x_{t+2} is not known yet, so nothing later) and to the chain's own earlier
entries. The drafts are compared with the main model's greedy continuation of x_0..x_{t+1}; a verify step with
k drafts emits 1 + (the number of leading drafts that match) tokens.
"""

from __future__ import annotations

import torch
from model import TinyQwen35


def chain_mask(n: int, depth: int, device) -> torch.Tensor:
    """[depth*n, depth*n] bool, True = attend. Entry (a, i) is chain step a+1 drafted from origin i: it sees
    the step-1 entries s <= i and its own chain's entries (b, i) for b <= a."""
    a = torch.arange(depth, device=device).repeat_interleave(n)
    i = torch.arange(n, device=device).repeat(depth)
    step1 = (a[None, :] == 0) & (i[None, :] <= i[:, None])
    own_chain = (a[None, :] >= 1) & (a[None, :] <= a[:, None]) & (i[None, :] == i[:, None])
    return step1 | own_chain


@torch.no_grad()
def chain_drafts(model: TinyQwen35, ids: torch.Tensor, hidden: torch.Tensor,
                 depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy drafts [depth, L-1] for one window `ids` [1, L] with the main model's final-normed `hidden`
    [1, L, H], and the block's normed outputs [depth, L-1, H]: row j, column t is chain step j+1 drafted from
    origin t (a guess for x_{t+2+j})."""
    mtp, head, embed = model.mtp, model.lm.lm_head, model.lm.model.embed_tokens
    n = ids.shape[1] - 1
    origin = torch.arange(n, device=ids.device)
    inputs = [mtp.fuse(embed(ids[:, 1:]), hidden[:, :-1])]
    out = mtp.decode(inputs[0], model.rope(inputs[0], origin[None]))
    outputs, drafts = [out[0]], [head(out).argmax(-1)[0]]
    for j in range(1, depth):
        inputs.append(mtp.fuse(embed(drafts[-1][None]), out))
        x = torch.cat(inputs, dim=1)
        positions = torch.cat([origin + b for b in range(j + 1)])[None]
        mask = chain_mask(n, j + 1, ids.device)[None, None]
        out = mtp.decode(x, model.rope(x, positions), attention_mask=mask)[:, j * n:]
        outputs.append(out[0])
        drafts.append(head(out).argmax(-1)[0])
    return torch.stack(drafts), torch.stack(outputs)


@torch.no_grad()
def greedy_continuation(model: TinyQwen35, prefixes: torch.Tensor, depth: int) -> torch.Tensor:
    """The main model's next `depth` greedy tokens [B, depth] after each prefix [B, T] (full forwards, so they
    match the teacher-forced pass the drafts were made from)."""
    seq = prefixes
    for _ in range(depth):
        logits = model.lm(input_ids=seq).logits[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[:, prefixes.shape[1]:]


def acceptance(matches: torch.Tensor) -> dict[str, object]:
    """Statistics of `matches` [N, depth] (bool: draft j equals the main model's greedy token j)."""
    depth = matches.shape[1]
    leading = matches.long().cumprod(dim=1)          # 1 while every earlier draft was accepted
    out: dict[str, object] = {"positions": int(matches.shape[0])}
    out["step_agreement"] = [float(matches[:, j].float().mean()) for j in range(depth)]
    out["conditional_acceptance"] = [
        float(leading[:, j].sum() / max(1, int(leading[:, j - 1].sum()) if j else matches.shape[0]))
        for j in range(depth)]
    for k in range(1, depth + 1):
        accepted = float(leading[:, :k].sum(dim=1).float().mean())
        out[f"k{k}"] = {"mean_accepted_drafts": accepted, "mean_tokens_per_step": 1.0 + accepted}
    return out


@torch.no_grad()
def chained_acceptance(model: TinyQwen35, windows: list[torch.Tensor], every: int, depth: int, device) -> dict:
    """`acceptance` at origins t = every-1, 2*every-1, ... of each held-out window (the same origins in every
    window, so the prefixes of one origin batch without padding)."""
    rows: list[torch.Tensor] = []
    max_len = max(w.numel() for w in windows)
    drafts = []
    for w in windows:
        ids = w.to(device)[None]
        hidden = model.lm.model(input_ids=ids).last_hidden_state
        drafts.append(chain_drafts(model, ids, hidden, depth)[0])
    for t in range(every - 1, max_len - 1, every):
        batch = [i for i, w in enumerate(windows) if w.numel() >= t + 2]
        prefixes = torch.stack([windows[i][:t + 2] for i in batch]).to(device)
        greedy = greedy_continuation(model, prefixes, depth)
        guessed = torch.stack([drafts[i][:, t] for i in batch])
        rows.append(guessed == greedy)
    return acceptance(torch.cat(rows))
