"""Safetensors shards of a random checkpoint, written as tensors are made (the benchmarks' large checkpoints)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

GIB = 1 << 30


def write_shards(directory: Path, tensors: Iterable[tuple[str, object]], *, shard_bytes: int = 2 * GIB) -> int:
    """Save ``(name, tensor)`` pairs (CPU tensors, made one at a time by the caller) into shards of about
    ``shard_bytes`` under the published names (``model-0000i-of-0000n.safetensors``) with their
    ``model.safetensors.index.json``; host memory holds one shard at most. Returns the tensor bytes written."""
    from safetensors.torch import save_file

    shard: dict = {}
    files: list[list[str]] = []  # the names each shard holds, in order
    size = total = 0

    def flush() -> None:
        save_file(shard, str(directory / f"part-{len(files):05d}.safetensors"), metadata={"format": "pt"})
        files.append(list(shard))
        shard.clear()

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = t
        size += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for i, names in enumerate(files):  # the published shard names, now that their count is known
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (directory / f"part-{i:05d}.safetensors").rename(directory / final)
        weight_map.update(dict.fromkeys(names, final))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total
