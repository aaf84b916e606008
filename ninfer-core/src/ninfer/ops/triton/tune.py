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

import attrs
import torch

from ninfer.ops.triton import tuning


def graph_time(fn: Callable[[], Any]) -> float:
    """Milliseconds per call of ``fn`` (warmed up, then replayed in a CUDA graph)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=20))


@attrs.frozen
class Geometry:
    """The shapes the sweeps time. Defaults: Qwen3.5 decode (the 9B's attention, 4 KV heads of 256 with G = 4;
    its GDN, 32 value heads of 128; the 35B-A3B experts, hidden 2048, 256 experts of 512, top 8) and its
    vocabulary. ``linear_shapes``: "NxK" weights (None: every shape the linear table holds); ``moe_tokens``: the
    most tokens a MoE call is timed with (None: each token row's limit, twice the last for the largest tile)."""

    kv_heads: int = 4
    group: int = 4
    head_dim: int = 256
    page: int = 16
    context: int = 4096
    gdn_heads: tuple[int, int, int, int] = (16, 32, 128, 128)  # key heads, value heads, Dk, Dv
    moe: tuple[int, int, int, int] = (2048, 256, 512, 8)  # hidden, experts, intermediate, top k
    vocab: int = 248320
    batches: tuple[int, ...] = (1, 8)
    linear_shapes: tuple[str, ...] | None = None
    moe_tokens: int | None = None
    quant_shapes: tuple[str, ...] = ("4096x4096", "12288x4096", "12352x4096", "24576x4096", "4096x12288",
                                     "1024x2048", "1024x3584", "5120x1024", "7168x1024", "8224x1024")


@attrs.frozen
class Bench:
    """Where and how a sweep measures: the torch device, the timer (milliseconds of a thunk), the shapes."""

    device: torch.device
    time: Callable[[Callable[[], Any]], float] = graph_time
    shapes: Geometry = Geometry()

    def randn(self, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=dtype)


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


def tune_linear(bench: Bench, key: tuning.DeviceKey) -> dict:
    from ninfer.ops.triton import linear

    entry = _start("linear", key)
    shapes = {}
    for name in bench.shapes.linear_shapes or sorted(_shapes(tuning.table("linear"))):
        N, K = map(int, name.split("x"))
        w = bench.randn(N, K) * 0.02
        xs = [bench.randn(m, K) for m in bench.shapes.batches]

        def cost(cfg, w=w, xs=xs):
            bn, bk, split = cfg
            return sum(bench.time(functools.partial(linear.linear, x, w, block_n=bn, block_k=bk, split_k=split))
                       for x in xs)

        shapes[name] = list(_best(itertools.product((32, 64), (128, 256), (1, 2, 4, 8)), cost))
        print(f"  linear {name}: {shapes[name]}", file=sys.stderr)
    return {**entry, "shapes": shapes}


# The quantized linears' knobs, swept one at a time from the rule (block_k: FP8 tiles stay inside a 128-wide K block).
QUANT_STEPS = {"fp8_e4m3_block": ((16, 32, 64, 128), (64, 128), (1, 2, 4, 8, 16), (4, 8), (2, 3, 4)),
               "nvfp4": ((16, 32, 64, 128), (128, 256, 512), (1, 2, 4, 8, 16), (4, 8), (2, 3, 4))}


def tune_linear_quant(bench: Bench, key: tuning.DeviceKey) -> dict:
    """Per format and "NxK": each knob in turn (block_n, block_k, split_k, warps, stages) takes its fastest value
    with the others held, starting from the rule, timed at every batch of the geometry."""
    from ninfer.ops.quant import quantize_fp8_block, quantize_nvfp4
    from ninfer.ops.triton import linear_quant

    entry = _start("linear_quant", key)
    kernels = {"fp8_e4m3_block": (linear_quant.linear_fp8, quantize_fp8_block),
               "nvfp4": (linear_quant.linear_nvfp4, quantize_nvfp4)}
    shapes = {}
    for name in bench.shapes.quant_shapes:
        N, K = map(int, name.split("x"))
        dense = bench.randn(N, K, dtype=torch.float32) * K ** -0.5
        xs = [bench.randn(m, K) for m in bench.shapes.batches]
        for fmt, (fn, quantize) in kernels.items():
            w = quantize(dense)

            def cost(cfg, fn=fn, w=w, xs=xs):
                bn, bk, split, warps, stages = cfg
                return sum(bench.time(functools.partial(fn, x, w, block_n=bn, block_k=bk, split_k=split,
                                                        num_warps=warps, num_stages=stages)) for x in xs)

            best = tuple(linear_quant.default_config(fmt, N, K, key))
            for i, values in enumerate(QUANT_STEPS[fmt]):
                best = _best([(*best[:i], v, *best[i + 1:]) for v in values], cost)
            shapes[f"{fmt}:{name}"] = list(best)
            print(f"  linear_quant {fmt}:{name}: {shapes[f'{fmt}:{name}']}", file=sys.stderr)
    return {**entry, "shapes": shapes}


def tune_moe(bench: Bench, key: tuning.DeviceKey) -> dict:
    from ninfer.ops.triton import moe
    from ninfer.ops.triton.moe_shared import MoeConfig

    hidden, experts, inter, top_k = bench.shapes.moe
    gate_up = bench.randn(experts, 2 * inter, hidden) * 0.02
    down = bench.randn(experts, hidden, inter) * 0.02
    entry = _start("moe", key)
    rows = []
    for row in [*entry["by_tokens"], {"tokens": None, "tiles": entry["largest"]}]:
        tokens = min(row["tokens"] or 2 * entry["by_tokens"][-1]["tokens"], bench.shapes.moe_tokens or 1 << 30)
        x = bench.randn(tokens, hidden)
        ids = torch.rand(tokens, experts, device=bench.device).argsort(dim=1)[:, :top_k]  # distinct per token
        weights = torch.rand(tokens, top_k, device=bench.device, dtype=x.dtype)

        def cost(tiles, x=x, ids=ids, weights=weights):
            return bench.time(functools.partial(moe.moe_experts, x, gate_up, down, ids, weights,
                                                config=MoeConfig(*tiles)))

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


def tune_attention(bench: Bench, key: tuning.DeviceKey) -> dict:
    from ninfer.ops.triton import attention

    g = bench.shapes
    cases = [(B, _attention_args(bench, B)) for B in g.batches]
    entry = _start("attention", key)

    def cost(cfg):
        tile_n, per_sm = cfg
        choice = {**entry, "decode_programs": per_sm * key.sms}
        total = 0.0
        for B, args in cases:
            splits = attention._decode_splits(B, g.kv_heads, g.context, tile_n, choice)
            total += bench.time(functools.partial(attention.paged_attention, *args, tile_n=tile_n,
                                                  num_splits=splits))
        return total

    tile_n, per_sm = _best(itertools.product((16, 32, 64), (4, 8, 16)), cost)
    entry.pop("decode_programs")
    return {**entry, "decode_tile_n": tile_n, "decode_programs_per_sm": per_sm}


def _attention_args(bench: Bench, B: int) -> tuple:
    """paged_attention's arguments for B decode rows over ``context`` keys each."""
    g = bench.shapes
    pages = g.context // g.page
    k_cache = bench.randn(B * pages, g.page, g.kv_heads, g.head_dim)
    q = bench.randn(B, g.kv_heads * g.group, g.head_dim)
    tables = torch.arange(B * pages, device=bench.device, dtype=torch.int32).view(B, pages)
    lens = torch.full((B,), g.context, device=bench.device, dtype=torch.int32)
    starts = torch.arange(B + 1, device=bench.device, dtype=torch.int32)
    return q, k_cache, k_cache.clone(), tables, lens, starts, 1, g.context, g.head_dim ** -0.5


def tune_sampling(bench: Bench, key: tuning.DeviceKey) -> dict:
    from ninfer.ops.triton import sampling

    logits = bench.randn(1, bench.shapes.vocab, dtype=torch.float32)

    def cost(per_sm):
        programs = max(1, round(per_sm * key.sms))
        return bench.time(functools.partial(sampling.greedy, logits, programs_per_row=programs))

    return {"sms": key.sms, "programs_per_row_per_sm": _best((0.5, 1, 2, 4), cost)}


def tune_gdn(bench: Bench, key: tuning.DeviceKey) -> dict:
    """The program count from which wide value blocks win: the first batch where they time no slower."""
    from ninfer.ops.triton import gdn

    entry = _start("gdn", key)
    hk, hv, dk, dv = bench.shapes.gdn_heads
    narrow, wide = entry["narrow_block_v"], entry["wide_block_v"]
    entry["wide_programs"] = 1 << 30  # never, unless a batch below shows otherwise
    for B in (1, 2, 4, 8, 16, 32):
        args = (bench.randn(B, hk, dk), bench.randn(B, hk, dk), bench.randn(B, hv, dv),
                -torch.rand(B, hv, device=bench.device), torch.rand(B, hv, device=bench.device),
                torch.zeros(B, hv, dk, dv, device=bench.device), torch.arange(B, device=bench.device))
        t_narrow, t_wide = (bench.time(functools.partial(gdn.gdn_decode, *args, block_v=bv)) for bv in (narrow, wide))
        if t_wide <= t_narrow:
            entry["wide_programs"] = B * hv * -(-dv // wide)
            break
    return entry


def _start(family: str, key: tuning.DeviceKey) -> dict:
    """Where a sweep starts: the device's resolved choices (its measured entry, else the generic rule)."""
    return {"sms": key.sms, **_thawed(tuning.choices(family, key))}


def _shapes(table: Mapping[str, Any]) -> set[str]:
    return {s for e in table["devices"].values() for s in e.get("shapes", {})}


def _thawed(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thawed(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


SWEEPS: dict[str, Callable[[Bench, tuning.DeviceKey], dict]] = {
    "linear": tune_linear, "linear_quant": tune_linear_quant, "moe": tune_moe, "attention": tune_attention, "sampling": tune_sampling,
    "gdn": tune_gdn, "vision_attention": lambda bench, key: _start("vision_attention", key),
}


def write_entry(family: str, key: tuning.DeviceKey, entry: dict, out: Path) -> Path:
    """``family``'s current table with ``key``'s entry set to ``entry``, written to ``out/<family>.json``."""
    data = _thawed(tuning.table(family))
    data["devices"][key.name] = entry
    path = out / f"{family}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


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
    device = torch.device("cuda", torch.cuda.current_device())
    key, bench = tuning.device_key(device), Bench(device)
    args.out.mkdir(parents=True, exist_ok=True)
    for family in families:
        print(f"tune {family} on {key.name} ({key.sms} SMs)", file=sys.stderr)
        print(f"wrote {write_entry(family, key, SWEEPS[family](bench, key), args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
