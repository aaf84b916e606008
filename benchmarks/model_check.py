"""Model-level numerics on the GPU: a Qwen3.5 model of a published shape in bf16 (Triton kernels) against
the same weights in fp32 (pure-torch reference ops), logit by logit.

The weights are random (one fp32 set, cast to bf16 for the fast path), the prompt is random token ids, and
both paths run the real Program's prefill (``score_window``-style packing) and the model's lm_head for every
position. Reported: relative error of the logits ‖bf16 - fp32‖ / ‖fp32‖ per position (max and median), the
fraction of positions whose top-1 token agrees, and the largest per-token logprob difference.

    python -m benchmarks.model_check --shape 9b --tokens 256          # on the GPU machine
    python -m benchmarks.model_check --shape tiny --device cpu         # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from benchmarks.shapes import SHAPES

# bf16 weights and activations against fp32 over a deep random model: stated tolerance for all logits together
# (‖bf16 - fp32‖ / ‖fp32‖ over every position) and for top-1 agreement.
REL_TOL = 5e-2
TOP1_MIN = 0.9


def _weights(shape: str, device: str, seed: int):
    from ninfer.models.common.weights import WeightSet
    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.source_mapping import expected_parameters, fused_parents

    config = parse_config(dict(SHAPES[shape]))
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, (_, dims) in expected_parameters(config, ("text",)).items():
        if name.endswith("A_log"):
            t = torch.empty(dims, device=device).uniform_(-1.0, 1.0, generator=gen)
        elif name.endswith("dt_bias"):
            t = torch.randn(dims, device=device, generator=gen) * 0.5
        elif name.endswith("linear_attn.norm.weight"):
            t = 1.0 + 0.1 * torch.randn(dims, device=device, generator=gen)   # plain scale, not 1+w
        elif len(dims) == 1:
            t = 0.1 * torch.randn(dims, device=device, generator=gen)         # (1+w) norms
        else:
            t = torch.randn(dims, device=device, generator=gen) / math.sqrt(dims[-1])
        tensors[name] = t
    return config, WeightSet.from_tensors(tensors, fused_parents(config))


def _logits(config, weights, dtype: torch.dtype, device: str, tokens: list[int]) -> torch.Tensor:
    from ninfer_qwen35.execution.model import Qwen35Model
    from ninfer_qwen35.execution.parameters import Qwen35Parameters
    from ninfer_qwen35.program import Qwen35Program
    from ninfer_qwen35.program.batching import RowInput, build_forward_batch
    from ninfer_qwen35.state import kv_pools, state_layout

    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    model = Qwen35Model(Qwen35Parameters.from_weights(config, weights, dtype, device))
    pool = kv_pools(config, 16, name)[0]
    n = len(tokens)
    program = Qwen35Program(model, state_layout=state_layout(config, name), kv_pool=pool, device=device,
                            max_concurrency=1, num_pages=-(-n // pool.page_size) + 1, vocab_size=config.vocab_size,
                            max_model_len=n + 16, cuda_graphs=False)
    slot = program.states.allocate()
    pages = program.pool.allocator.allocate(-(-n // pool.page_size))
    try:
        with torch.inference_mode():
            batch = build_forward_batch([RowInput(tokens=tokens, start=0, slot=slot, pages=pages, want_logits=False)],
                                        pool.page_size, torch.device(device))
            hidden = program.model.forward(batch, program.views)
            out = torch.cat([model.logits(hidden[i:i + 64]).float() for i in range(0, n, 64)])
    finally:
        program.pool.allocator.free(pages)
        program.states.free(slot)
    del program, model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def run(shape: str, device: str, tokens: int, seed: int = 0) -> dict:
    config, weights = _weights(shape, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=gen).tolist()
    saved = os.environ.get("NINFER_OPS")
    try:
        os.environ["NINFER_OPS"] = "torch"
        ref = _logits(config, weights, torch.float32, device, ids)
        if saved is None:
            os.environ.pop("NINFER_OPS")
        else:
            os.environ["NINFER_OPS"] = saved
        fast = _logits(config, weights, torch.bfloat16, device, ids)
    finally:
        if saved is None:
            os.environ.pop("NINFER_OPS", None)
        else:
            os.environ["NINFER_OPS"] = saved
    rel = ((fast - ref).norm(dim=-1) / ref.norm(dim=-1)).cpu()
    top1 = (fast.argmax(-1) == ref.argmax(-1)).float().mean().item()
    lp_ref, lp_fast = ref.log_softmax(-1), fast.log_softmax(-1)
    target = torch.tensor(ids[1:] + [ids[0]], device=ref.device)[:, None]
    lp_diff = (lp_ref.gather(1, target) - lp_fast.gather(1, target)).abs().max().item()
    rel_all = ((fast - ref).norm() / ref.norm()).item()
    res = {"shape": shape, "device": device, "tokens": tokens, "rel_all": rel_all, "rel_max": rel.max().item(),
           "rel_median": rel.median().item(), "top1_agree": top1, "max_token_logprob_diff": lp_diff,
           "rel_tol": REL_TOL, "top1_min": TOP1_MIN}
    res["ok"] = bool(rel_all <= REL_TOL and top1 >= TOP1_MIN and math.isfinite(res["rel_max"]))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="9b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--json")
    args = p.parse_args(argv)
    res = run(args.shape, args.device, args.tokens)
    print(f"| shape | tokens | logits rel err all (tol {REL_TOL}) | per position max / median | "
          f"top-1 agree (min {TOP1_MIN}) | max token logprob diff | ok |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {res['shape']} | {res['tokens']} | {res['rel_all']:.2e} | {res['rel_max']:.2e} / {res['rel_median']:.2e} | "
          f"{res['top1_agree']:.3f} | {res['max_token_logprob_diff']:.3f} | {res['ok']} |")
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
