"""Measure the kernels' launch choices on this GPU and write its entry into the tuning tables (``tuning``).

    python -m ninfer.ops.triton.tune [--kernels linear,moe,...] [--out DIR]

For each family asked (all by default) it times candidate configurations at the shapes its table holds (CUDA
graphs of a few launches, ``triton.testing.do_bench_cudagraph``), keeps the fastest, and writes the table of
``tables_dir()`` (the packaged one unless ``NINFER_TUNING_DIR``) with this device's entry added or replaced to
``DIR/<family>.json`` (default: the packaged folder itself, so a source checkout's ``git diff`` shows the change).
A sweep starts from the device's current choices (its entry, else the generic rule resolved for its SMs) and
keeps what it does not sweep; a family without a sweep (``vision_attention``) writes those choices as they are.
On a machine without CUDA it exits with one line.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ninfer.ops.triton import tuning

# The geometries the sweeps time: Qwen3.5 decode (attention 9B: 4 KV heads of 256, G = 4; GDN: 32 value heads of
# 128; the 35B-A3B experts: hidden 2048, 256 experts of 512, top 8) and its vocabulary.
_ATTENTION = {"kv_heads": 4, "group": 4, "head_dim": 256, "page": 16, "context": 4096}
_GDN = {"hk": 16, "hv": 32, "dk": 128, "dv": 128}
_MOE = {"hidden": 2048, "experts": 256, "inter": 512, "top_k": 8}
_VOCAB = 248320


def _time(fn: Callable[[], Any]) -> float:
    """Milliseconds per call of ``fn`` (warmed up, then replayed in a CUDA graph)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=20))


def _best(candidates: Iterable[Any], cost: Callable[[Any], float]) -> Any:
    timed = []
    for c in candidates:
        try:
            timed.append((cost(c), c))
        except Exception as exc:  # a configuration that does not compile or fit is not a candidate
            print(f"  skip {c}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                  file=sys.stderr)
    if not timed:
        raise RuntimeError("no candidate configuration ran")
    return min(timed, key=lambda t: t[0])[1]


def _randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype)


def tune_linear(reference: Mapping[str, Any], device: tuning.DeviceKey) -> dict:
    from ninfer.ops.triton import linear

    entry = _start("linear", device)
    shapes = {}
    for key in sorted(_shapes(reference)):
        N, K = map(int, key.split("x"))
        w = _randn(N, K) * 0.02
        xs = [_randn(m, K) for m in (1, 8)]

        def cost(cfg, w=w, xs=xs):
            bn, bk, split = cfg
            return sum(_time(lambda x=x: linear.linear(x, w, block_n=bn, block_k=bk, split_k=split)) for x in xs)

        shapes[key] = list(_best(itertools.product((32, 64), (128, 256), (1, 2, 4, 8)), cost))
        print(f"  linear {key}: {shapes[key]}", file=sys.stderr)
        del w, xs
    return {**entry, "shapes": shapes}


def tune_moe(reference: Mapping[str, Any], device: tuning.DeviceKey) -> dict:
    from ninfer.ops.triton import moe
    from ninfer.ops.triton.moe_shared import MoeConfig

    g = _MOE
    gate_up = _randn(g["experts"], 2 * g["inter"], g["hidden"]) * 0.02
    down = _randn(g["experts"], g["hidden"], g["inter"]) * 0.02
    entry = _start("moe", device)
    rows = []
    for row in [*entry["by_tokens"], {"tokens": None, "tiles": entry["largest"]}]:
        tokens = row["tokens"] or 2 * entry["by_tokens"][-1]["tokens"]
        x = _randn(tokens, g["hidden"])
        ids = torch.stack([torch.randperm(g["experts"], device="cuda")[:g["top_k"]] for _ in range(tokens)])
        weights = torch.rand(tokens, g["top_k"], device="cuda", dtype=torch.bfloat16)

        def cost(tiles, x=x, ids=ids, weights=weights):
            return _time(lambda: moe.moe_experts(x, gate_up, down, ids, weights, config=MoeConfig(*tiles)))

        best = list(_best(_neighbours(tuple(row["tiles"])), cost))
        print(f"  moe tokens {tokens}: {best}", file=sys.stderr)
        if row["tokens"] is None:
            entry["largest"] = best
        else:
            rows.append({"tokens": row["tokens"], "tiles": best})
    return {**entry, "by_tokens": rows}


def _neighbours(tiles: tuple[int, ...]) -> list[tuple[int, ...]]:
    """``tiles`` (block_m, block_n, block_k, warps, stages) and each field moved one step, within sane bounds."""
    steps = ((16, 32, 64, 128), (32, 64, 128, 256), (32, 64, 128, 256), (4, 8), (2, 3, 4, 5))
    out = [tiles]
    for i, allowed in enumerate(steps):
        at = allowed.index(tiles[i]) if tiles[i] in allowed else None
        for j in (() if at is None else (at - 1, at + 1)):
            if 0 <= j < len(allowed):
                out.append((*tiles[:i], allowed[j], *tiles[i + 1:]))
    return out


def tune_attention(reference: Mapping[str, Any], device: tuning.DeviceKey) -> dict:
    from ninfer.ops.triton import attention

    a = _attention_case()
    entry = _start("attention", device)

    def cost(cfg):
        tile_n, per_sm = cfg
        total = 0.0
        for B, args in a:
            choice = dict(entry, decode_programs=per_sm * device.sms)
            splits = attention._decode_splits(B, _ATTENTION["kv_heads"], _ATTENTION["context"], tile_n, choice)
            total += _time(lambda args=args, splits=splits: attention.paged_attention(
                *args, tile_n=tile_n, num_splits=splits))
        return total

    tile_n, per_sm = _best(itertools.product((16, 32, 64), (4, 8, 16)), cost)
    entry.pop("decode_programs", None)
    return {**entry, "decode_tile_n": tile_n, "decode_programs_per_sm": per_sm}


def _attention_case() -> list[tuple[int, tuple]]:
    c = _ATTENTION
    pages_per_seq = c["context"] // c["page"]
    cases = []
    for B in (1, 8):
        k_cache = _randn(B * pages_per_seq, c["page"], c["kv_heads"], c["head_dim"])
        q = _randn(B, c["kv_heads"] * c["group"], c["head_dim"])
        tables = torch.arange(B * pages_per_seq, device="cuda", dtype=torch.int32).view(B, pages_per_seq)
        lens = torch.full((B,), c["context"], device="cuda", dtype=torch.int32)
        starts = torch.arange(B + 1, device="cuda", dtype=torch.int32)
        cases.append((B, (q, k_cache, k_cache.clone(), tables, lens, starts, 1, c["context"], c["head_dim"] ** -0.5)))
    return cases


def tune_sampling(reference: Mapping[str, Any], device: tuning.DeviceKey) -> dict:
    from ninfer.ops.triton import sampling

    logits = _randn(1, _VOCAB, dtype=torch.float32)
    out = torch.empty(1, dtype=torch.int64, device="cuda")

    def cost(per_sm):
        programs = max(1, round(per_sm * device.sms))
        return _time(lambda: sampling.greedy(logits, out=out, programs_per_row=programs))

    return {"sms": device.sms, "programs_per_row_per_sm": _best((0.5, 1, 2, 4), cost)}


def tune_gdn(reference: Mapping[str, Any], device: tuning.DeviceKey) -> dict:
    from ninfer.ops.triton import gdn

    c = _GDN
    first_wide = None
    for B in (1, 2, 4, 8, 16, 32):
        q, k = _randn(B, c["hk"], c["dk"]), _randn(B, c["hk"], c["dk"])
        v = _randn(B, c["hv"], c["dv"])
        g, beta = -torch.rand(B, c["hv"], device="cuda"), torch.rand(B, c["hv"], device="cuda")
        states = torch.zeros(B, c["hv"], c["dk"], c["dv"], device="cuda")
        slots = torch.arange(B, device="cuda", dtype=torch.int32)
        args = (q, k, v, g, beta, states, slots)
        narrow, wide = (_time(functools.partial(gdn.gdn_decode, *args, block_v=bv)) for bv in (16, 32))
        if wide <= narrow:
            first_wide = B * c["hv"] * (c["dv"] // 32)
            break
    programs = first_wide if first_wide is not None else 1 << 30
    return {"sms": device.sms, "narrow_block_v": 16, "wide_block_v": 32, "wide_programs": programs}


def _start(family: str, device: tuning.DeviceKey) -> dict:
    """Where a sweep starts: the device's resolved choices (its measured entry, else the generic rule)."""
    return {"sms": device.sms, **_thawed(tuning.choices(family, device))}


def _shapes(reference: Mapping[str, Any]) -> set[str]:
    return {s for e in reference["devices"].values() for s in e.get("shapes", {})}


def _thawed(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thawed(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


SWEEPS: dict[str, Callable[[Mapping[str, Any], tuning.DeviceKey], dict]] = {
    "linear": tune_linear, "moe": tune_moe, "attention": tune_attention, "sampling": tune_sampling,
    "gdn": tune_gdn, "vision_attention": lambda reference, device: _start("vision_attention", device),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninfer.ops.triton.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default=",".join(tuning.FAMILIES),
                        help=f"comma list of kernel families (default: all: {','.join(tuning.FAMILIES)})")
    parser.add_argument("--out", type=Path, default=tuning.PACKAGED,
                        help="folder the tables are written to (default: the packaged tables)")
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.kernels.split(",") if f.strip()]
    unknown = sorted(set(families) - set(tuning.FAMILIES))
    if unknown:
        parser.error(f"unknown kernel families {unknown} (known: {', '.join(tuning.FAMILIES)})")
    if not torch.cuda.is_available():
        print("tune: no CUDA device here; tuning tables are measured on the GPU they are for", file=sys.stderr)
        return 1
    device = tuning.device_key(torch.device("cuda", torch.cuda.current_device()))
    args.out.mkdir(parents=True, exist_ok=True)
    for family in families:
        reference = tuning.table(family)
        print(f"tune {family} on {device.name} ({device.sms} SMs)", file=sys.stderr)
        entry = SWEEPS[family](reference, device)
        data = _thawed(reference)
        data["devices"][device.name] = entry
        path = args.out / f"{family}.json"
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
