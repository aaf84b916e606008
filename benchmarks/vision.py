"""The ``vision`` suite: the Qwen3.5 vision encoder on one GPU: its attention, its throughput, and a chat's time to
first token with one image, each beside what it replaces or competes with, on the same random weights.

1. attention (``--parts attention``): the packed-frames attention of one encoder layer at the lengths of the
   ``--images`` batches (16 heads x 72 for the published tower): the Triton kernel (with ``--triton-attention``; and
   the head padded to 128 instead of split 64 + 16) against torch's SDPA once per distinct length (the op's torch
   path; also with each SDPA backend forced) and SDPA once per image (as transformers calls it); relative error
   against fp32 and TFLOP/s (4 x sum(L^2) x heads x head_dim).
2. encoder (``--parts encoder``): images/s of the whole tower (``--vision published``: depth 27, hidden 1152, 16
   heads, out 4096 = the 9B LM hidden) for each ``--images`` batch (SIDExB: B images of SIDE x SIDE pixels per
   call; pixel rows already on the device): ours (bf16, the CUDA path, attention as dispatched and with the
   Triton kernel forced), the torch reference in bf16 and in fp32 (TF32 off), and transformers'
   Qwen3_5VisionModel in bf16 on the same weights, with each output's relative error against the fp32 reference
   and the FLOPs over the bf16 matmul rate measured in the same run.
3. ttft (``--parts ttft``): a random Qwen3_5ForConditionalGeneration checkpoint at the ``--text-shape`` (9B) with
   the tower, converted by the real converter; a chat with one ``--ttft-side`` image through ``ninfer.Engine``
   (submit to the first token; the prompt prepared by the Frontend, the image encoded by the Program) against
   transformers (image processor + ``generate(max_new_tokens=1)``) on the same checkpoint and images. When this
   tree's Engine refuses the vision feature or media, ours is reported as skipped with the reason.

    scripts/gpu vision                                                                   # on the GPU machine
    python -m benchmarks.vision --device cpu --vision tiny --text-shape tiny --images 64x1 64x2 ...   # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import vision_weights as vw
from benchmarks.harness import sync

clock = time.perf_counter
PARTS = ("attention", "encoder", "ttft")


def timed(device: str, warmup: int, repeats: int, fn, *call) -> dict:
    """Wall time of ``fn(*call)`` (device synchronised before and after each call), after ``warmup`` calls: median
    and min."""
    for _ in range(warmup):
        fn(*call)
    times = []
    for _ in range(repeats):
        sync(device)
        t = clock()
        fn(*call)
        sync(device)
        times.append(clock() - t)
    return {"ms": statistics.median(times) * 1e3, "ms_min": min(times) * 1e3, "repeats": repeats}


def rel_error(out, ref) -> float:
    o, r = out.double(), ref.double()
    return math.inf if not bool(o.isfinite().all()) else ((o - r).norm() / r.norm()).item()


@contextlib.contextmanager
def ops_mode(mode: str | None):
    """NINFER_OPS for the calls inside (``triton``: every Triton kernel, listed or not)."""
    before = os.environ.get("NINFER_OPS")
    if mode is not None:
        os.environ["NINFER_OPS"] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("NINFER_OPS", None)
        else:
            os.environ["NINFER_OPS"] = before


def parse_images(specs: list[str], patch: int, merge: int) -> list[tuple[int, int]]:
    """(side, images per call) from SIDExB; the side must be a multiple of patch x merge (no resize here)."""
    out = []
    for spec in specs:
        m = re.fullmatch(r"(\d+)x(\d+)", spec)
        if not m or int(m[1]) % (patch * merge) or int(m[2]) < 1:
            raise ValueError(f"--images {spec!r}: want SIDExB with SIDE a multiple of {patch * merge} and B >= 1")
        out.append((int(m[1]), int(m[2])))
    return out


def grids_for(side: int, batch: int, patch: int) -> list[tuple[int, int, int]]:
    return [(1, side // patch, side // patch)] * batch


# -- 1. attention ---------------------------------------------------------------------------------------------

def attention_variants(device: str, triton_attention: bool = False) -> dict:
    """name -> fn(q, k, v, seqs) for every attention the table compares."""
    import torch.nn.functional as F

    from ninfer.ops.vision import vision_attention_ref

    def per_image(q, k, v, seqs):  # SDPA once per sequence, as transformers' sdpa path does
        import torch

        out, start = [], 0
        for n in seqs.lengths:
            span = [x[start:start + n].transpose(0, 1) for x in (q, k, v)]
            out.append(F.scaled_dot_product_attention(*span).transpose(0, 1))
            start += n
        return torch.cat(out)

    variants = {"sdpa per length": vision_attention_ref, "sdpa per image": per_image}
    if not device.startswith("cuda"):
        return variants
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ninfer.ops.triton.vision_attention import vision_attention as kernel

    def forced(backend):
        def fn(q, k, v, seqs):
            with sdpa_kernel(backend):
                return vision_attention_ref(q, k, v, seqs)
        return fn

    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        variants[f"sdpa per length, {name} only"] = forced(backend)
    if not triton_attention:  # quarantined (docs/kernels.md): an illegal address on its first H200 run
        return variants
    variants["triton"] = kernel
    variants["triton padded head"] = lambda q, k, v, s: kernel(q, k, v, s, head_split=False)
    return variants


def attention_fp32(q, k, v, lengths):
    """softmax(q k^T / sqrt(D)) v per sequence in fp32 (explicit math, TF32 off), the error reference."""
    import torch

    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        out.append((torch.softmax(qs @ ks.transpose(1, 2) * q.shape[-1] ** -0.5, -1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


def run_attention(vc, images: list[tuple[int, int]], args, device: str) -> list[dict]:
    import torch

    from ninfer.ops.vision import PackedSequences

    heads, hd, patch = vc.num_heads, vc.head_dim, vc.patch_size
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for side, batch in images:
        lengths = [(side // patch) ** 2] * batch
        qkv = torch.randn(sum(lengths), 3 * heads, hd, generator=gen, device=device).to(
            torch.bfloat16 if device.startswith("cuda") else torch.float32)
        q, k, v = qkv[:, :heads], qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
        seqs = PackedSequences.of(lengths, device)
        ref = attention_fp32(q, k, v, lengths)
        flops = 4 * sum(n * n for n in lengths) * heads * hd
        for name, fn in attention_variants(device, args.triton_attention).items():
            row = {"images": f"{side}x{batch}", "tokens": sum(lengths), "variant": name}
            try:
                row["rel_error"] = rel_error(fn(q, k, v, seqs), ref)
                row.update(timed(device, args.warmup, args.repeats, fn, q, k, v, seqs))
                row["tflop_s"] = flops / (row["ms"] * 1e-3) / 1e12
            except Exception as exc:  # a backend that refuses the shape is a result, not a failure
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
            print(f"#   attention {row['images']} {name}: " + (row.get("error") or
                  f"{row['ms']:.3f} ms, {row['tflop_s']:.1f} TFLOP/s, rel {row['rel_error']:.2e}"), flush=True)
    return rows


# -- 2. encoder -----------------------------------------------------------------------------------------------

def encoder_flops(vc, grids) -> float:
    """Multiply-adds x 2 of one forward: patch embedding, every block's projections, MLP and attention, merger."""
    H, inter, m2 = vc.hidden_size, vc.intermediate_size, vc.spatial_merge_size ** 2
    n = sum(t * h * w for t, h, w in grids)
    frames = [h * w for t, h, w in grids for _ in range(t)]
    block = 2 * n * (4 * H * H + 2 * H * inter) + 4 * sum(L * L for L in frames) * H
    merger = 2 * (n // m2) * (H * m2) * (H * m2 + vc.out_hidden_size)
    return 2 * n * vc.patch_values * H + vc.depth * block + merger


def hf_vision_model(vision: dict, out_hidden: int, weights, device: str):
    """transformers' Qwen3_5VisionModel in bf16 with our random weights, and its attention implementation."""
    import torch
    import transformers

    cfg = transformers.Qwen3_5VisionConfig(**{k: v for k, v in vision.items() if k != "deepstack_visual_indexes"},
                                           out_hidden_size=out_hidden)
    model = transformers.Qwen3_5VisionModel(cfg)
    state = {name[len("visual."):]: weights[name] for name in weights}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"transformers' vision model does not take our weights: missing {missing}, "
                           f"unexpected {unexpected}")
    return model.to(device=device, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32).eval(), \
        model.config._attn_implementation


def run_encoder(vision: dict, images: list[tuple[int, int]], args, device: str, res: dict) -> list[dict]:
    import torch

    from ninfer_qwen35.execution.vision import Qwen35Vision, VisionParams

    config = vw.vision_model_config(vision, args.out_hidden)
    weights = vw.random_vision_weights(config, seed=1, device=device)
    low = torch.bfloat16 if device.startswith("cuda") else torch.float32
    p32, plow = VisionParams.from_weights(config, weights, torch.float32), VisionParams.from_weights(config, weights, low)
    vc = p32.config
    ours, reference = Qwen35Vision(plow, fast=True), Qwen35Vision(p32)
    variants = {"ours": (ours.forward, None), "ours, triton attention": (ours.forward, "triton"),
                f"torch reference {str(low).split('.')[-1]}": (ours.reference, None)}
    if args.fp32:
        variants["torch reference float32"] = (reference.forward, None)
    if not device.startswith("cuda") or not args.triton_attention:
        variants.pop("ours, triton attention")
    if args.hf:
        try:
            hf, impl = hf_vision_model(vision, args.out_hidden, weights, device)
            res["hf_attn_implementation"] = impl
            variants[f"transformers ({impl})"] = \
                (lambda px, g: hf(px, grid_thw=torch.tensor(g, device=device)).pooler_output, None)
        except Exception as exc:  # the baseline is a comparison: keep ours
            traceback.print_exc()
            res["hf_error"] = f"{type(exc).__name__}: {exc}"
    gen = torch.Generator(device=device).manual_seed(2)
    rows = []
    for side, batch in images:
        grids = grids_for(side, batch, vc.patch_size)
        n = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(n, vc.patch_values, generator=gen, device=device)
        flops = encoder_flops(vc, grids)
        with torch.inference_mode():
            ref = reference.forward(pixels, grids) if args.fp32 else None
            for name, (fn, mode) in variants.items():
                row = {"images": f"{side}x{batch}", "side": side, "batch": batch, "patches": n, "variant": name}
                try:
                    with ops_mode(mode):
                        out = fn(pixels, grids)
                        row["rel_error"] = None if ref is None else rel_error(out, ref)
                        slow = "float32" in name
                        row.update(timed(device, 1 if slow else args.warmup,
                                         min(args.repeats, 3) if slow else args.repeats, fn, pixels, grids))
                    row["images_per_s"] = batch / (row["ms"] * 1e-3)
                    row["tflop_s"] = flops / (row["ms"] * 1e-3) / 1e12
                except Exception as exc:
                    traceback.print_exc()
                    row["error"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
                print(f"#   encoder {row['images']} {name}: " + (row.get("error") or
                      f"{row['ms']:.2f} ms, {row['images_per_s']:.1f} images/s, rel {_f(row['rel_error'], '.2e')}"),
                      flush=True)
        host = pixels.cpu()
        res.setdefault("upload_ms", {})[f"{side}x{batch}"] = timed(device, 1, 3, host.to, device)["ms"]
    return rows


# -- report ---------------------------------------------------------------------------------------------------

def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(r: dict) -> str:
    d = r["device"]
    lines = [f"# Qwen3.5 vision encoder on {d.get('name', d['device'])}, torch {d['torch']}, triton {d.get('triton')}"
             + (f"; bf16 matmul {r['matmul_tflops']:.0f} TFLOP/s" if r.get("matmul_tflops") else ""),
             f"Vision tower: {r['vision']}; random weights (O(1) per block), random pixel rows."]
    if r.get("attention"):
        lines += ["", "## attention (one layer, packed frames)", "",
                  "| images | tokens | variant | ms | TFLOP/s | rel error vs fp32 |", "|---|---|---|---|---|---|"]
        for a in r["attention"]:
            lines.append(f"| {a['images']} | {a['tokens']} | {a['variant']} | "
                         + (f"{a['error']} | | |" if "error" in a else
                            f"{a['ms']:.3f} | {a['tflop_s']:.1f} | {a['rel_error']:.2e} |"))
    if r.get("encoder"):
        mm = r.get("matmul_tflops")
        lines += ["", "## encoder (whole tower, pixel rows on the device)", "",
                  "| images | patches | variant | ms / call | images/s | TFLOP/s | of matmul rate | rel error vs fp32 |",
                  "|---|---|---|---|---|---|---|---|"]
        for e in r["encoder"]:
            if "error" in e:
                lines.append(f"| {e['images']} | {e['patches']} | {e['variant']} | {e['error']} | | | | |")
                continue
            share = e["tflop_s"] / mm if mm else None
            lines.append(f"| {e['images']} | {e['patches']} | {e['variant']} | {e['ms']:.2f} | {e['images_per_s']:.1f} "
                         f"| {e['tflop_s']:.1f} | {_f(share, '.2f')} | {_f(e['rel_error'], '.2e')} |")
        if r.get("upload_ms"):
            lines.append("\nHost -> device copy of the fp32 pixel rows (not in the times above): "
                         + ", ".join(f"{k} {v:.2f} ms" for k, v in r["upload_ms"].items()))
    t = r.get("ttft")
    if t:
        from benchmarks.vision_ttft import markdown as ttft_markdown

        lines += ["", *ttft_markdown(t)]
    return "\n".join(lines)


# -- entry point ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--vision", default="published", choices=sorted(vw.VISION_SHAPES))
    p.add_argument("--out-hidden", type=int, default=4096, help="the tower's output width (the LM hidden size)")
    p.add_argument("--images", nargs="+", default=["448x1", "448x8", "1024x1", "1024x4"], metavar="SIDExB",
                   help="encoder calls: B images of SIDE x SIDE pixels each")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10, help="timed calls per figure (median)")
    p.add_argument("--no-fp32", dest="fp32", action="store_false", help="skip the fp32 reference (and errors)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--triton-attention", action="store_true",
                   help="also time the quarantined Triton attention kernel (docs/kernels.md)")
    p.add_argument("--text-shape", default="9b", choices=("9b", "0.8b", "tiny"), help="the TTFT model's text shape")
    p.add_argument("--ttft-side", type=int, default=1024, help="the TTFT image's side in pixels")
    p.add_argument("--ttft-repeats", type=int, default=5, help="timed requests after one warm-up request")
    p.add_argument("--workdir", default=None, help="folder for the TTFT checkpoint and artifact (default: temp)")
    p.add_argument("--json", default=None, help="write every figure here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from benchmarks.harness import run_with_plugins

    return run_with_plugins(_run, argv)


def _run(argv) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks.harness import device_info

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("vision: no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    vision = vw.VISION_SHAPES[args.vision]
    try:
        images = parse_images(args.images, vision["patch_size"], vision["spatial_merge_size"])
        if min(args.warmup, args.repeats - 1, args.ttft_repeats) < 0 or args.repeats < 1 or args.ttft_repeats < 1:
            raise ValueError("--repeats and --ttft-repeats must be >= 1, --warmup >= 0")
        parse_images([f"{args.ttft_side}x1"], vision["patch_size"], vision["spatial_merge_size"])
    except ValueError as exc:
        print(f"vision: {exc}", file=sys.stderr)
        return 2
    t0 = clock()
    res: dict = {"parts": args.parts, "vision": {**vision, "out_hidden_size": args.out_hidden}, "images": args.images,
                 "args": vars(args), "device": device_info(device)}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2, default=str))

    failed = False
    if device.startswith("cuda"):
        from benchmarks import ceilings

        res["matmul_tflops"] = ceilings.matmul_rate()
        # fp32 references in fp32 (the bf16 paths are unaffected)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    for part in (p for p in PARTS if p in args.parts):
        print(f"# {part}", flush=True)
        try:
            if part == "attention":
                vc = _vision_config(vision, args.out_hidden)
                res["attention"] = run_attention(vc, images, args, device)
            elif part == "encoder":
                res["encoder"] = run_encoder(vision, images, args, device, res)
            else:
                res["ttft"] = _run_ttft(args, device, vision)
                failed |= "error" in res["ttft"].get("ours", {})
        except Exception as exc:  # one part's failure must not lose the others' figures
            traceback.print_exc()
            res[part] = {"error": f"{type(exc).__name__}: {exc}"} if part == "ttft" else []
            res.setdefault("errors", {})[part] = f"{type(exc).__name__}: {exc}"
            failed = True
        save()
    res["wall_s"] = clock() - t0
    save()
    print(markdown(res))
    print(f"\n# wall time {res['wall_s']:.1f} s" + ("; FAILED" if failed else ""))
    return 1 if failed else 0


def _vision_config(vision: dict, out_hidden: int):
    from ninfer_qwen35.execution.vision import VisionConfig

    return VisionConfig.from_config(vw.vision_model_config(vision, out_hidden))


def _run_ttft(args, device: str, vision: dict) -> dict:
    from benchmarks import vision_ttft

    base = Path(args.workdir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="ninfer-vision-", dir=base))
    try:
        return vision_ttft.run(args, device, vision, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
