"""What the benchmarks need to know of an architecture, dispatched by a config.json's ``architectures``: its parsed
config, its StateImage and KV pools (the bytes a step moves besides the weights), and the tensors a checkpoint of
it holds in published naming, read from the architecture plugin's own source mapping (not Qwen3.5's hard-wired).

Qwen3.5 (dense and MoE) and Qwen4Exp are known; a Qwen4Exp checkpoint stores each PLE n-gram table as its
published row chunks (``...ngram_embedding.shard_{k}.weight``), which the converter assembles into one object.
"""

from __future__ import annotations

import math

from benchmarks.harness import FP32

QWEN35 = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
          "Qwen3_5MoeForConditionalGeneration")
QWEN4EXP = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")
# transformers' AutoModelForCausalLM reads a flat text config of these model types
HF_MODEL_TYPES = {"qwen35": "qwen3_5_text", "qwen35-moe": "qwen3_5_moe_text", "qwen4exp": "qwen4_exp_text"}


def family(cfg: dict) -> str:
    """``qwen35``, ``qwen35-moe`` or ``qwen4exp`` from the config's first architecture."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError("the benchmark config names no architectures")
    if archs[0] in QWEN4EXP:
        return "qwen4exp"
    if archs[0] in QWEN35:
        return "qwen35-moe" if "num_experts" in cfg else "qwen35"
    raise ValueError(f"the benchmarks know no architecture {archs[0]!r} (known: {', '.join(QWEN35 + QWEN4EXP)})")


def label(cfg: dict) -> str:
    return {"qwen35": "Qwen3.5", "qwen35-moe": "Qwen3.5 MoE", "qwen4exp": "Qwen4Exp"}[family(cfg)]


def parse(cfg: dict):
    """The architecture's parsed config (``Qwen35Config`` or ``Qwen4ExpConfig``)."""
    if family(cfg) == "qwen4exp":
        from ninfer_qwen4exp.config import parse_config
    else:
        from ninfer_qwen35.config import parse_config
    return parse_config(dict(cfg))


def stores(cfg: dict, dtype: str = "bfloat16", page_size: int = 16):
    """(StateImage bytes per slot, KV bytes per token over every pool) of the architecture."""
    from ninfer.core.kv_pool import PagedKVPool

    if family(cfg) == "qwen4exp":
        from ninfer_qwen4exp.state import kv_pools, state_layout
    else:
        from ninfer_qwen35.state import kv_pools, state_layout
    config = parse(cfg)
    state = state_layout(config, dtype).nbytes_per_slot
    kv = sum(PagedKVPool.page_bytes(p) for p in kv_pools(config, page_size, dtype)) // page_size
    return state, kv


def mapping(cfg: dict):
    """The architecture plugin's source mapping for ``cfg`` (``ArchitectureSpec.source_mapping``)."""
    from benchmarks.harness import plugin_host

    return plugin_host().architecture(cfg["architectures"][0]).spec.load("source_mapping")(dict(cfg))


def parameters(cfg: dict, features: tuple[str, ...] = ("text",)) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every logical parameter of ``features``: name -> (shape, bytes per element as published: fp32 for
    ``FP32``, bf16 for the rest)."""
    return {name: (tuple(shape), 4 if name.endswith(FP32) else 2)
            for name, (_, shape) in mapping(cfg).expected_parameters(features).items()}


def ngram_table_bytes(cfg: dict) -> int:
    """Bytes of the PLE n-gram tables (host memory; a step reads only the rows it looks up); 0 without PLE."""
    if family(cfg) != "qwen4exp":
        return 0
    from ninfer_qwen4exp.source_mapping import NGRAM_TABLE

    return sum(math.prod(s) * b for n, (s, b) in parameters(cfg).items() if n.endswith(NGRAM_TABLE))


def source_tensors(cfg: dict, features: tuple[str, ...] = ("text",)) -> dict[str, tuple[tuple[int, ...], int]]:
    """The tensors of a published checkpoint of ``features``: ``parameters`` with each Qwen4Exp n-gram table split
    into its published row chunks (``shard_{k}``, ``PLEConfig.shard_rows``)."""
    params = parameters(cfg, features)
    if family(cfg) != "qwen4exp":
        return params
    from ninfer_qwen4exp.source_mapping import NGRAM_TABLE

    config = parse(cfg)
    out: dict[str, tuple[tuple[int, ...], int]] = {}
    for name, (shape, size) in params.items():
        if not name.endswith(NGRAM_TABLE):
            out[name] = (shape, size)
            continue
        layer = int(name.split(".")[2])  # model.layers.{i}.ple...
        stem = name[: -len("weight")]
        for k, rows in enumerate(config.ple.shard_rows(config.ple_layers.index(layer))):
            out[f"{stem}shard_{k}.weight"] = ((rows, shape[1]), size)
    return out


def qwen35_view(config):
    """The Qwen3.5 geometry of a parsed config (``vocab_size``, ``moe``, ...): a Qwen4ExpConfig's ``base``, else the
    config itself."""
    if type(config).__name__ == "Qwen4ExpConfig":
        return config.base
    return config


def once_per_forward(program, rows: int):
    """What a decode step of ``rows`` one-token rows runs once per forward rather than once per layer, as a
    callable, or None: Qwen4Exp's PLE (the n-gram windows, then the addend of its PLE layers: one layer in the
    published model). A reduced-depth benchmark times it apart so that scaling to full depth does not repeat it."""
    import types

    import torch

    config = program.model.config
    if type(config).__name__ != "Qwen4ExpConfig" or config.ple is None:
        return None
    from ninfer.ops import ngram_windows
    from ninfer_qwen4exp.execution.layers import ple_addend

    p, e = program.model.params, config.ple
    dev, vocab = p.embed.device, config.base.vocab_size
    gen = torch.Generator(device=dev).manual_seed(rows)
    ids = torch.randint(0, vocab, (rows,), device=dev, generator=gen)
    history = torch.randint(0, vocab, (rows, e.context_len), device=dev, generator=gen)
    batch = types.SimpleNamespace(  # the three ForwardBatch fields the PLE addend reads
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=dev),
        state_slots=torch.arange(rows, device=dev), has_initial_state=torch.ones(rows, dtype=torch.bool, device=dev))
    x = torch.randn(rows, config.hc_hidden_size, dtype=p.embed.dtype, device=dev, generator=gen)
    conv = torch.zeros(rows, e.conv_state_len, config.hc_hidden_size, dtype=p.embed.dtype, device=dev)
    layers = [layer.ple for layer in p.layers if layer.ple is not None]

    def run() -> None:
        windows, _ = ngram_windows(ids, history, batch.query_start_loc, batch.has_initial_state, config.eos_token_id)
        for ple in layers:
            ple_addend(config, ple, x, windows, batch, conv)
    return run
