"""The ``cache`` suite's report: the headline figures of the on / off / grid / host engines
(``benchmarks/context_cache.py``), the result table and the leak verdict."""

from __future__ import annotations

import statistics

from benchmarks.harness import fmt

TARGETS = {"turn2_speedup": 10.0, "decode_cost_pct": 2.0}  # 9B, one H200: printed, never enforced


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def summarize(engines: dict, args) -> dict:
    """The headline figures, the result table and the leak verdict."""
    on, off = engines["on"], engines["off"]
    conv_on, conv_off = on["conversations"], off["conversations"]
    out: dict = {}
    t_on, t_off = _median(conv_on, "turn2_ttft_s"), _median(conv_off, "turn2_ttft_s")
    out["turn2"] = {"on_ttft_s": t_on, "off_ttft_s": t_off, "speedup": t_off / t_on,
                    "cached_tokens": [c["turn2_cached_tokens"] for c in conv_on],
                    "prompt_tokens": args.history + args.answer + args.new,
                    "turn1_equal": [a["turn1_tokens"] == b["turn1_tokens"] for a, b in zip(conv_on, conv_off, strict=True)],
                    "outputs_equal": [a["turn2_tokens"] == b["turn2_tokens"] for a, b in zip(conv_on, conv_off, strict=True)]}
    hit, miss = _median(on["repeats"], "second_ttft_s"), _median(on["repeats"], "first_ttft_s")
    out["repeat"] = {"hit_ttft_s": hit, "miss_ttft_s": miss, "speedup": miss / hit,
                     "off_second_ttft_s": _median(off["repeats"], "second_ttft_s"),
                     "cached_tokens": [r["second_cached_tokens"] for r in on["repeats"]],
                     "first_cached_tokens": [r["first_cached_tokens"] for r in on["repeats"]]}
    miss_off = _median(off["repeats"], "first_ttft_s")
    out["miss"] = {"on_ttft_s": miss, "off_ttft_s": miss_off, "overhead_pct": (miss / miss_off - 1) * 100}
    out["decode"] = [{"batch": a["batch"], "context": a["context"], "on_tokens_per_s": a["tokens_per_s"],
                      "off_tokens_per_s": b["tokens_per_s"], "cost_pct": (1 - a["tokens_per_s"] / b["tokens_per_s"]) * 100}
                     for a, b in zip(on["decode"], off["decode"], strict=True)]
    out["grid"] = grid_rows(engines, args)
    if "host" in engines:
        runs = engines["host"]["runs"]
        t_host = _median(runs, "ttft_s")
        out["host_restore"] = {"ttft_s": t_host, "full_prefill_ttft_s": t_off, "speedup": t_off / t_host,
                               "cached_tokens": [r["cached_tokens"] for r in runs],
                               "restored_from": [r["restored_from"] for r in runs],
                               "host_evictions": [r["host_evictions"] for r in runs],
                               "outputs_equal": [r["turn2_tokens"] == c["turn2_tokens"] if r["same_prompt_as_off"] else None
                                                 for r, c in zip(runs, conv_off, strict=False)]}
    out["leak_free"] = {name: e["leak_free"] for name, e in engines.items()}
    out["targets"] = {"turn2_speedup": {"target": f">= {TARGETS['turn2_speedup']}", "measured": t_off / t_on,
                                        "met": t_off / t_on >= TARGETS["turn2_speedup"]}}
    for d in out["decode"]:
        out["targets"][f"decode_b{d['batch']}_cost_pct"] = {
            "target": f"<= {TARGETS['decode_cost_pct']}", "measured": d["cost_pct"],
            "met": d["cost_pct"] <= TARGETS["decode_cost_pct"]}
    out["table"] = table(out)
    return out


def grid_rows(engines: dict, args) -> list[dict]:
    rows = []
    for g in args.grids:
        e = engines[f"grid-{g or 'none'}"]
        grid = args.history if g is None else g
        rows.append({"grid": g or "none", "grid_saves": len(range(grid, args.history - 1, grid)),
                     "ttft_s": e["ttft_s"], "ttft_s_all": e["ttft_s_all"], "share_tokens": e["share_tokens"],
                     "share_ttft_s": e["share_ttft_s"], "share_cached_tokens": e["share_cached_tokens"]})
    end_only = next((r["ttft_s"] for r in rows if r["grid"] == "none"), None)
    for r in rows:
        r["over_end_only_s"] = None if end_only is None else r["ttft_s"] - end_only
        r["per_save_s"] = r["over_end_only_s"] / r["grid_saves"] if end_only is not None and r["grid_saves"] else None
    return rows


def table(s: dict) -> list[dict]:
    """The result table: one row per measurement, ``gain`` how many times better the cache does."""
    t2, rep, miss = s["turn2"], s["repeat"], s["miss"]
    yes = lambda flags: "yes" if all(flags) else f"NO ({sum(map(bool, flags))}/{len(flags)})"  # noqa: E731
    rows = [
        {"measurement": "turn-2 TTFT", "on": t2["on_ttft_s"] * 1e3, "off": t2["off_ttft_s"] * 1e3, "unit": "ms",
         "gain": t2["speedup"], "detail": f"cached {t2['cached_tokens'][0]} of {t2['prompt_tokens']}; turn-2 outputs "
                                          f"equal on/off: {yes(t2['outputs_equal'])}"},
        {"measurement": "repeated prompt: 2nd (hit) / 1st (miss) TTFT", "on": rep["hit_ttft_s"] * 1e3,
         "off": rep["miss_ttft_s"] * 1e3, "unit": "ms", "gain": rep["speedup"],
         "detail": f"cached {rep['cached_tokens'][0]}"},
        {"measurement": "fresh prompt TTFT (miss)", "on": miss["on_ttft_s"] * 1e3, "off": miss["off_ttft_s"] * 1e3,
         "unit": "ms", "gain": miss["off_ttft_s"] / miss["on_ttft_s"],
         "detail": f"checkpointing a miss costs {miss['overhead_pct']:+.1f} %"}]
    for d in s["decode"]:
        rows.append({"measurement": f"decode B={d['batch']}, context {d['context']}", "on": d["on_tokens_per_s"],
                     "off": d["off_tokens_per_s"], "unit": "tok/s", "gain": d["on_tokens_per_s"] / d["off_tokens_per_s"],
                     "detail": f"cost {d['cost_pct']:+.2f} % (target <= {TARGETS['decode_cost_pct']} %)"})
    if "host_restore" in s:
        h = s["host_restore"]
        rows.append({"measurement": "turn-2 TTFT from a host replica (1 slot) / full prefill", "on": h["ttft_s"] * 1e3,
                     "off": h["full_prefill_ttft_s"] * 1e3, "unit": "ms", "gain": h["speedup"],
                     "detail": f"cached {h['cached_tokens'][0]}, restored from {h['restored_from'][0]}, "
                               f"{h['host_evictions'][0]} host evictions"})
    return rows


def markdown(result: dict) -> str:
    d = result["device"]
    lines = [f"# ninfer context cache on {d['name']} ({d['device']}), torch {d['torch']}, triton {d['triton']}"]
    for shape, r in result["shapes"].items():
        if "error" in r:
            lines += ["", f"## {shape}: FAILED: {r['error']}"]
            continue
        lines += ["", f"## {shape}: history {r['history']} + answer {r['answer']} + new {r['new']} tokens, "
                      f"prefill chunk {r['prefill_chunk']}; TTFTs are medians of {len(r['engines']['on']['conversations'])} "
                      f"runs, decode the best of {result['args']['decode_reps']}",
                  "", "| measurement | cache on | cache off | gain | detail |", "|---|---|---|---|---|"]
        for row in r["table"]:
            lines.append(f"| {row['measurement']} | {row['on']:.1f} {row['unit']} | {row['off']:.1f} {row['unit']} "
                         f"| {row['gain']:.2f}x | {row['detail']} |")
        if r["grid"]:
            lines += ["", f"| checkpoint grid | grid saves | fresh TTFT ms | over prompt end only ms | per save ms "
                          f"| sharing {r['grid'][0]['share_tokens']} tokens: TTFT ms | cached |",
                      "|---|---|---|---|---|---|---|"]
        for g in r["grid"]:
            over = None if g["over_end_only_s"] is None else g["over_end_only_s"] * 1e3
            per = None if g["per_save_s"] is None else g["per_save_s"] * 1e3
            lines.append(f"| {g['grid']} | {g['grid_saves']} | {g['ttft_s'] * 1e3:.2f} | {fmt(over, '+.2f')} "
                         f"| {fmt(per, '.3f')} | {g['share_ttft_s'] * 1e3:.2f} | {g['share_cached_tokens']} |")
        c = r["calibration"]
        dflt = c["cost_model_defaults"]
        lines += ["", f"StateImage per checkpoint slot {c['image_bytes'] / 2**20:.2f} MiB, one device copy "
                      f"{c['image_copy_s'] * 1e3:.3f} ms; host replica of a {r['history']}-token checkpoint "
                      f"{c['replica_bytes'] / 2**20:.1f} MiB.",
                  f"CostModel: prefill {c['recompute_s_per_token']:.3g} s/token (default "
                  f"{dflt['recompute_s_per_token']:.3g}); {'pinned ' if c['pinned'] else ''}host->device "
                  f"{c['h2d_bytes_per_s'] / 1e9:.1f} GB/s = {c['transfer_s_per_byte']:.3g} s/byte (default "
                  f"{dflt['transfer_s_per_byte']:.3g}).",
                  "Leak checks (idle after each run, all free after clearing): " + ", ".join(
                      f"{k} {'ok' if v else 'LEAK'}" for k, v in r["leak_free"].items())]
        for k, t in r["targets"].items():
            lines.append(f"- target {k} {t['target']}: measured {t['measured']:.2f} -> {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)

