"""Converter and loader throughput on a Qwen3.5-shaped checkpoint with random weights.

Writes a Hugging Face style source checkpoint (config.json, safetensors shards + index, tokenizer files)
with random bf16 weights (A_log and the GDN norm in fp32, as published), converts it with the real
converter (timed: converter GB/s), reads the artifact once to warm the page cache (a full checksum pass,
also timed), then times ``load_weights(features=("text",))`` onto the device several times
(warm page cache -> device memory, GB/s): with checksum verification (the default load, keys ``load_*``)
and without it (``verify=False``, keys ``load_no_verify_*``), alternating so both see the same machine
state. ``--verify on|off`` times one of them only. Prints a table and one JSON line.

    python -m benchmarks.load_throughput --shape 9b --device cuda [--workdir DIR] [--json out.json]
    python -m benchmarks.load_throughput --shape tiny --device cpu      # CPU smoke run (tested)

The 9b shape needs about 2 x 18 GB of free disk in --workdir (source + artifact; removed afterwards).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def _import_paths() -> None:
    """Make the repository's packages importable where they are not installed (the GPU machine)."""
    if str(_ROOT) not in sys.path:
        sys.path.insert(0, str(_ROOT))  # `python benchmarks/load_throughput.py` as well as `-m`
    for pkg, mod in (("ninfer-core", "ninfer"), ("ninfer-qwen35", "ninfer_qwen35"),
                     ("ninfer-convert", "ninfer_convert")):
        try:
            __import__(mod)
        except ImportError:
            sys.path.insert(0, str(_ROOT / pkg / "src"))


def _host():
    from ninfer.plugins import UnknownArchitecture, make_plugin_host

    host = make_plugin_host()
    try:
        host.architecture("Qwen3_5ForCausalLM")
    except UnknownArchitecture:  # no package metadata: register the plugin module directly
        import ninfer_qwen35.plugin

        host.register_module(ninfer_qwen35.plugin, "qwen35")
    return host


def write_source_files(directory: Path, config: dict) -> None:
    """A new checkpoint directory's files beside the weights: config.json, the small test tokenizer, its chat
    template and generation config."""
    from ninfer_qwen35.testing.checkpoints import CHAT_TEMPLATE, make_tokenizer_json

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tok, special = make_tokenizer_json()
    (directory / "tokenizer.json").write_text(tok)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [special["<|im_end|>"]]}))


def write_source(directory: Path, config: dict, device: str, shard_bytes: int = 4 << 30) -> int:
    """A random checkpoint in published naming (flat text-only); returns the tensor bytes written."""
    import torch
    from safetensors.torch import save_file

    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.source_mapping import expected_parameters

    write_source_files(directory, config)
    gen_device = "cuda" if device.startswith("cuda") else "cpu"
    g = torch.Generator(device=gen_device).manual_seed(0)
    params = expected_parameters(parse_config(config), ("text",))
    shards: list[dict] = [{}]
    size, total = 0, 0
    for name, (_, shape) in params.items():
        dtype = torch.float32 if name.endswith(("A_log", "linear_attn.norm.weight")) else torch.bfloat16
        t = torch.randn(shape, generator=g, device=gen_device, dtype=torch.float32).mul_(0.02).to(dtype).cpu()
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    weight_map = {}
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
        tensors.clear()
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


# --verify choice -> the load modes timed: (verify, result key prefix, table label)
VERIFY_MODES = {"on": ((True, "load", "verified"),), "off": ((False, "load_no_verify", "no verify"),)}
VERIFY_MODES["both"] = VERIFY_MODES["on"] + VERIFY_MODES["off"]


def run(shape: str, device: str, workdir: Path, repeats: int, verify: str = "both") -> dict:
    import torch

    from benchmarks.shapes import SHAPES
    from ninfer.artifact import load_weights, open_artifact
    from ninfer_convert.convert import convert_checkpoint

    host = _host()
    config = dict(SHAPES[shape], dtype="bfloat16", mtp_num_hidden_layers=0)
    src, out = workdir / "source", workdir / f"{shape}.ninfer"
    t0 = time.perf_counter()
    source_bytes = write_source(src, config, device)
    t_source = time.perf_counter() - t0
    summary = convert_checkpoint(src, out, host=host, progress=sys.stderr.isatty())
    shutil.rmtree(src)  # free the disk before loading
    res = {"shape": shape, "device": device, "source_bytes": source_bytes, "source_write_s": t_source,
           "convert_s": summary.seconds, "convert_gb_s": summary.total_bytes / summary.seconds / 1e9,
           "artifact_bytes": out.stat().st_size}
    with open_artifact(out) as art:
        t0 = time.perf_counter()
        art.verify()  # reads every byte: warms the page cache
        res["verify_s"] = time.perf_counter() - t0
        res["verify_gb_s"] = res["artifact_bytes"] / res["verify_s"] / 1e9
        modes = VERIFY_MODES[verify]
        times: dict[str, list[float]] = {key: [] for _, key, _ in modes}
        loaded = 0
        for _ in range(repeats):
            for check, key, _ in modes:  # alternating: both modes see the same page cache and clocks
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                weights, report = load_weights(art, features=("text",), device=device, host=host, verify=check)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                times[key].append(time.perf_counter() - t0)
                loaded = report.total_bytes_uploaded
                assert weights.resident_bytes() == loaded and report.verified == check
                del weights
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
    res["load_bytes"] = loaded
    for _, key, _ in modes:
        res.update({f"{key}_s": times[key], f"{key}_best_gb_s": loaded / min(times[key]) / 1e9,
                    f"{key}_median_gb_s": loaded / statistics.median(times[key]) / 1e9})
    if device.startswith("cuda"):
        res["gpu"] = torch.cuda.get_device_name()
    return res


def main(argv=None) -> int:
    _import_paths()
    from benchmarks.shapes import SHAPES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="9b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--workdir", help="folder for the source checkpoint and the artifact (default: a temp dir)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--verify", choices=sorted(VERIFY_MODES), default="both",
                   help="time loads with checksum verification (on), without (off) or both, alternating "
                        "(default both)")
    p.add_argument("--keep", action="store_true", help="keep the artifact")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("load_throughput: no CUDA device; use --device cpu", file=sys.stderr)
            return 2
    base = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="ninfer-load-", dir=base))
    from benchmarks.shapes import decode_weight_shapes

    need = 2.05 * 2 * (sum(o * i for o, i in decode_weight_shapes(SHAPES[args.shape])) + SHAPES[args.shape][
        "vocab_size"] * SHAPES[args.shape]["hidden_size"])
    free = shutil.disk_usage(workdir).free  # source and artifact coexist until the source is removed
    if free < need:
        shutil.rmtree(workdir)
        print(f"load_throughput: {workdir} has {free / 1e9:.1f} GB free, needs about {need / 1e9:.1f} GB; "
              f"pass --workdir", file=sys.stderr)
        return 2
    try:
        res = run(args.shape, args.device, workdir, args.repeats, args.verify)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    gb = res["load_bytes"] / 1e9
    print(f"| shape {res['shape']} -> {res['device']} | GB | seconds | GB/s |")
    print("|---|---|---|---|")
    print(f"| convert (HF safetensors -> .ninfer) | {res['artifact_bytes'] / 1e9:.2f} | {res['convert_s']:.2f} | "
          f"{res['convert_gb_s']:.2f} |")
    print(f"| verify checksums (cold -> warm page cache) | {res['artifact_bytes'] / 1e9:.2f} | {res['verify_s']:.2f} | "
          f"{res['verify_gb_s']:.2f} |")
    for _, key, label in VERIFY_MODES[args.verify]:
        runs = res[f"{key}_s"]
        print(f"| load text ({label}), warm page cache -> {res['device']} (best of {len(runs)}) | {gb:.2f} | "
              f"{min(runs):.2f} | {res[f'{key}_best_gb_s']:.2f} |")
        print(f"| load text ({label}), median | {gb:.2f} | {statistics.median(runs):.2f} | "
              f"{res[f'{key}_median_gb_s']:.2f} |")
    print(json.dumps(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
