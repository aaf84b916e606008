"""``ninfer inspect [FILE.ninfer]``: metadata, config summary, features, objects and bytes per feature and per
format, quantized objects (format, bytes, block, each plane's dtype and shape; how the weights were quantized and
what stayed unquantized) and MoE expert banks (3-D ``experts`` parameters: experts x rows x cols) summed per
feature and kind.

Without a file (or with ``default``) it shows the embedded model."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

_LIST_QUANTIZED = 64  # more quantized objects than this are counted, and listed only with --objects
_LIST_NOTES = 4
_CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                "linear_num_value_heads", "tie_word_embeddings", "mtp_num_hidden_layers", "num_experts")


def add_inspect_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("inspect", help="show what a .ninfer artifact holds")
    p.add_argument("file", nargs="?", help="a .ninfer file, or 'default' (default: the embedded model)")
    p.add_argument("--verify", action="store_true", help="also check every object's checksum")
    p.add_argument("--objects", action="store_true", help="list every physical object")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_inspect)


def config_summary(config: dict) -> dict:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    out = {k: text[k] for k in _CONFIG_KEYS if k in text}
    if "tie_word_embeddings" in config:
        out["tie_word_embeddings"] = config["tie_word_embeddings"]
    if isinstance(text.get("layer_types"), list):
        kinds: dict[str, int] = defaultdict(int)
        for t in text["layer_types"]:
            kinds[t] += 1
        out["layer_types"] = dict(kinds)
    if isinstance(config.get("vision_config"), dict):
        v = config["vision_config"]
        out["vision"] = {k: v[k] for k in ("depth", "hidden_size", "num_heads", "patch_size") if k in v}
    return out


def expert_banks(header) -> list[dict]:
    """Per (feature, bank kind, per-expert shape, dtype): how many layers hold such a bank, experts, bytes."""
    objects = {o.id: o for o in header.objects}
    groups: dict[tuple, dict] = {}
    for b in header.bindings:
        if len(b.shape) != 3 or "experts" not in b.name.split("."):
            continue
        o = objects[b.object]
        kind = b.name.rsplit("experts.", 1)[1]
        dtype = o.dtype if o.format == "dense" else o.format
        key = (b.feature, kind, b.shape, dtype)
        g = groups.setdefault(key, {"feature": b.feature, "kind": kind, "layers": 0, "experts": b.shape[0],
                                    "expert_shape": list(b.shape[1:]), "dtype": dtype, "bytes": 0})
        g["layers"] += 1
        g["bytes"] += o.nbytes if b.rows is None else o.nbytes * (b.rows[1] - b.rows[0]) // o.shape[0]
    return list(groups.values())


def quantized_objects(header) -> list[dict]:
    return [{"id": o.id, "feature": o.feature, "format": o.format, "shape": list(o.shape), "nbytes": o.nbytes,
             "block": list(o.block or ()), "planes": [{"name": p.name, "dtype": p.dtype, "shape": list(p.shape)}
                                                       for p in o.planes]}
            for o in header.objects if o.planes]


def describe(artifact, *, with_objects: bool = False) -> dict:
    h = artifact.header
    per_feature: dict[str, dict[str, int]] = defaultdict(lambda: {"objects": 0, "bytes": 0, "bindings": 0})
    for o in h.objects:
        per_feature[o.feature]["objects"] += 1
        per_feature[o.feature]["bytes"] += o.nbytes
    for b in h.bindings:
        per_feature[b.feature]["bindings"] += 1
    per_format: dict[str, dict[str, int]] = defaultdict(lambda: {"objects": 0, "bytes": 0})
    for o in h.objects:
        per_format[o.format]["objects"] += 1
        per_format[o.format]["bytes"] += o.nbytes
    fe = h.frontend
    out = {
        "file": str(artifact.path), "file_bytes": artifact.file_size, "version": h.version,
        "metadata": {"name": h.metadata.name, "architecture": h.metadata.architecture,
                     "converter": f"{h.metadata.converter} {h.metadata.converter_version}",
                     "source": h.metadata.source, "source_digest": h.metadata.source_digest},
        "config": config_summary(h.config), "features": list(h.features),
        "objects": len(h.objects), "bindings": len(h.bindings), "uses": len(h.uses),
        "shared_uses": [f"{u.site} -> {u.binding}" for u in h.uses if u.site != u.binding],
        "per_feature": dict(per_feature), "per_format": dict(per_format), "expert_banks": expert_banks(h),
        "quantization": h.metadata.quantization, "quantized_objects": quantized_objects(h),
        "frontend": None if fe is None else {
            "special_tokens": len(fe.special_tokens), "eos_token_ids": list(fe.eos_token_ids),
            "embedding_vocab": fe.embedding_vocab, "chat_template": fe.chat_template is not None,
            "generation_config": fe.generation_config, "media": fe.media is not None},
    }
    if with_objects:
        out["object_list"] = [{"id": o.id, "feature": o.feature, "format": o.format, "dtype": o.dtype,
                               "shape": list(o.shape), "offset": o.offset, "nbytes": o.nbytes, "checksum": o.checksum}
                              for o in h.objects]
    return out


def _print_text(d: dict) -> None:
    m = d["metadata"]
    print(f"{d['file']}: .ninfer v{d['version']}, {d['file_bytes'] / 1e9:.3f} GB")
    print(f"  name          {m['name']}")
    print(f"  architecture  {m['architecture']}")
    print(f"  converter     {m['converter']} (source {m['source']}, {m['source_digest']})")
    print(f"  features      {', '.join(d['features'])}")
    print("  config        " + ", ".join(f"{k}={v}" for k, v in d["config"].items()))
    print(f"  {d['objects']} objects, {d['bindings']} bindings, {d['uses']} uses")
    for s in d["shared_uses"]:
        print(f"    shared use  {s}")
    print(f"  {'feature':<10} {'objects':>8} {'bindings':>9} {'bytes':>16}")
    for f, row in sorted(d["per_feature"].items()):
        print(f"  {f:<10} {row['objects']:>8} {row['bindings']:>9} {row['bytes']:>16,}")
    print(f"  {'format':<15} {'objects':>8} {'bytes':>16}")
    for f, row in sorted(d["per_format"].items()):
        print(f"  {f:<15} {row['objects']:>8} {row['bytes']:>16,}")
    _print_quantization(d, listed="object_list" in d)
    for bank in d["expert_banks"]:
        print(f"  expert banks  {bank['feature']} {bank['kind']}: {bank['layers']} layers x {bank['experts']} "
              f"experts x {bank['expert_shape']} {bank['dtype']}, {bank['bytes']:,} bytes")
    fe = d["frontend"]
    if fe:
        print(f"  frontend      {fe['special_tokens']} special tokens, eos {fe['eos_token_ids']}, embedding vocab "
              f"{fe['embedding_vocab']}, chat template {'yes' if fe['chat_template'] else 'no'}, "
              f"media {'yes' if fe['media'] else 'no'}")
    planes = {q["id"]: q for q in d["quantized_objects"]}
    for o in d.get("object_list", []):
        kind = o["dtype"] if o["format"] == "dense" else o["format"]
        print(f"    {o['id']:<60} {o['feature']:<8} {kind:<5} {str(o['shape']):<16} {o['nbytes']:>12,} "
              f"{o['checksum']}")
        if o["id"] in planes:
            print(f"      {_planes_text(planes[o['id']])}")
    if "verified" in d:
        print(f"  checksums     {'all objects verified' if d['verified'] else 'not verified'}")


def _planes_text(q: dict) -> str:
    return f"block {q['block']}: " + ", ".join(f"{p['name']} {p['dtype']}{p['shape']}" for p in q["planes"])


def _print_quantization(d: dict, *, listed: bool) -> None:
    q = d["quantization"]
    if q:
        formats = ", ".join(f"{n} weights {f}" for f, n in sorted(q.get("formats", {}).items()))
        print(f"  quantization  {q.get('method', '?')}: {formats or 'no quantized objects'}")
        dense = q.get("dense") or {}
        reasons: dict[str, int] = defaultdict(int)
        for why in dense.values():
            reasons[why] += 1
        for why, n in sorted(reasons.items()):
            print(f"    left unquantized  {n} weights: {why}")
        notes = q.get("notes", [])
        for note in notes[:_LIST_NOTES]:
            print(f"    note  {note}")
        if len(notes) > _LIST_NOTES:
            print(f"    ... and {len(notes) - _LIST_NOTES} more notes (--json shows them all)")
    objects = d["quantized_objects"]
    if listed or not objects:
        return  # the object list shows their planes
    if len(objects) > _LIST_QUANTIZED:
        print(f"  {len(objects)} quantized objects (--objects lists them with their planes)")
        return
    for o in objects:
        print(f"    {o['id']:<60} {o['format']:<15} {o['nbytes']:>12,}  {_planes_text(o)}")


def run_inspect(args: argparse.Namespace) -> int:
    import ninfer
    from ninfer.artifact import open_artifact

    try:
        with open_artifact(ninfer.resolve_model_path(args.file)) as art:
            d = describe(art, with_objects=args.objects)
            if args.verify:
                art.verify()
                d["verified"] = True
    except ValueError as exc:  # an ArtifactError, a missing file, no embedded model
        print(f"ninfer inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        _print_text(d)
    return 0
