"""Weights and bytes for benchmarks/moe.py: a MoE shape (Qwen3.5 MoE or Qwen4Exp) at a chosen depth, a random bf16
checkpoint of it in the published layout (written shard by shard), the bytes a decode step must move, and the
planner's expert cache for a budget, read from a sparse full-depth artifact.

The checkpoint's weights are random (std 0.02, the router too), so a token's experts are spread over the bank as
a trained router spreads them, not piled onto experts 0..k-1 as zero weights would pile them. The routed experts
are the published fused banks ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I].

Qwen4Exp at a reduced depth keeps the published widths but not the published n-gram table: 320M rows (102 GB)
cannot be written as random weights, and a decode step reads only 16 of its rows per token (looked up in host
memory), so its size moves no figure the benchmark reports. ``REDUCED`` names what the written model changes.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from benchmarks import architectures
from benchmarks.shapes import MOE_SHAPES, QWEN4EXP_SHAPES, SHAPES

EMBED = "model.embed_tokens.weight"
BANKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

# For CPU smoke runs: the tiny dense shape with a sparse block (8 experts, top-2), 8 layers at full depth.
_TINY = {k: v for k, v in SHAPES["tiny"].items() if k != "intermediate_size"}
TINY_MOE = {**_TINY, "architectures": ["Qwen3_5MoeForCausalLM"], "num_hidden_layers": 8, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
# The tiny MoE with every Qwen4Exp part: 4 streams, sigmoid GDN gate, a QSA budget that selects (2 blocks of 4),
# PLE on the second layer over small primes; an indexer head wide enough for the 16-wide head's full rotation.
TINY_QWEN4EXP = {**TINY_MOE, "architectures": ["Qwen4ExpForCausalLM"], "hc_count": 4, "hc_lowrank": 16,
                 "output_gate_type": "sigmoid", "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                 "indexer_budget": 8, "indexer_compress_ratio": 4, "ple_layer_ids": [2], "ple_embed_dim": 32,
                 "ngram_vocab_size_base": 211, "heads_per_ngram": 2, "ngram_size": 3, "ple_conv_kernel_size": 4,
                 "make_ngram_vocab_size_divisible_by": 8, "split_ngram_parts": 4, "eos_token_id": 400}
BENCH_SHAPES = {"35b-a3b": MOE_SHAPES["35b-a3b"], "tiny": TINY_MOE,
                "qwen4exp": QWEN4EXP_SHAPES["qwen4exp-published"], "qwen4exp-tiny": TINY_QWEN4EXP}
# What the written (random) model changes from its shape (module docstring): 16 heads of primes >= 1e5, 1.6M rows.
REDUCED = {"qwen4exp": {"ngram_vocab_size_base": 100_000}}
DEFAULT_LAYERS = {"qwen4exp": 4}  # 5 GB of routed experts a layer: checkpoint and artifact must fit one disk


def moe_config(shape: str, layers: int | None = None, *, reduced: bool = False) -> dict:
    """The shape's config.json (text-only, no MTP head) with ``layers`` decoder layers (default: full depth);
    ``reduced``: with ``REDUCED``'s changes (the model the benchmark writes)."""
    cfg = dict(BENCH_SHAPES[shape], dtype="bfloat16", mtp_num_hidden_layers=0)
    cfg["model_type"] = architectures.HF_MODEL_TYPES[architectures.family(cfg)]
    if reduced:
        cfg.update(REDUCED.get(shape, {}))
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def parameters(cfg: dict) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every text parameter: name -> (shape, bytes per element), as the checkpoint stores it (the architecture
    plugin's logical names; a Qwen4Exp n-gram table as one)."""
    return architectures.parameters(cfg, ("text",))


def weight_bytes(cfg: dict) -> dict:
    """The weights by role: ``dense_read`` is what every decode step reads whatever the routing (all but the
    embedding, a row lookup, the routed banks and the n-gram tables, whose rows are looked up in host memory);
    ``expert`` is one routed expert of one layer."""
    params = parameters(cfg)
    size = {n: math.prod(s) * b for n, (s, b) in params.items()}
    banks = sum(b for n, b in size.items() if n.endswith(BANKS))
    tables = architectures.ngram_table_bytes(cfg)
    H, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    return {"total": sum(size.values()), "embedding": size[EMBED], "banks": banks, "ngram_tables": tables,
            "dense_read": sum(size.values()) - size[EMBED] - banks - tables, "expert": 3 * inter * H * 2}


def expected_distinct(experts: int, top_k: int, batch: int) -> float:
    """Distinct experts B tokens hit in one layer when each picks its k uniformly at random."""
    return experts * (1 - (1 - top_k / experts) ** batch)


def step_bytes(cfg: dict, batch: int, context: int, distinct: float) -> float:
    """Bytes one decode step of B rows must move: the dense weights once, ``distinct`` experts per MoE layer, each
    row's StateImage slot read and written and its KV prefix read (as benchmarks/bench.py counts a dense step)."""
    w = weight_bytes(cfg)
    state, kv_per_token = architectures.stores(cfg)
    experts = cfg["num_hidden_layers"] * distinct * w["expert"]
    return w["dense_read"] + experts + batch * (2 * state + context * kv_per_token)


def expert_cache_plan(shape: str, workdir: Path, *, device: str, budget_bytes: int, max_concurrency: int,
                      max_model_len: int | None = None) -> dict:
    """The planner's host-experts plan for the full-depth shape under ``budget_bytes``, from a sparse artifact (the
    converter's header over a hole: no weight is written or read) started by the architecture's own Startup.
    ``slots_per_layer``: the plan's expert cache slots over the model's MoE layers. The device plan is the
    published model's: ``REDUCED`` changes host bytes only (the n-gram tables)."""
    from benchmarks.harness import plugin_host
    from benchmarks.sparse import SparseArtifactWriter, write_sparse_source
    from ninfer.artifact import open_artifact
    from ninfer.contract.config import StartupOptions
    from ninfer.core.device_plan import DeviceRoom, PlanError, plan_memory
    from ninfer.engine.startup import native_startup
    from ninfer_convert.convert import convert_checkpoint
    from ninfer_qwen35.startup import HOST_EXPERTS

    cfg = moe_config(shape, reduced=True)
    src, out = workdir / f"{shape}-sparse-source", workdir / f"{shape}-sparse.ninfer"
    write_sparse_source(src, cfg)
    try:
        convert_checkpoint(src, out, name=f"sparse-{shape}", host=plugin_host(), make_writer=SparseArtifactWriter)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    options = StartupOptions(device=device, max_concurrency=max_concurrency, device_budget_bytes=budget_bytes,
                             placement=HOST_EXPERTS, max_model_len=max_model_len)
    res: dict = {"shape": shape, "full_layers": cfg["num_hidden_layers"], "budget_bytes": budget_bytes,
                 "options": {"max_concurrency": max_concurrency, "placement": HOST_EXPERTS,
                             "max_model_len": max_model_len}}
    try:
        with open_artifact(out, verify=False) as artifact:
            profile = native_startup(artifact, plugin_host()).profile(artifact, options)
        candidate = next((p for p in profile.placements if p.name == HOST_EXPERTS), None)
        if candidate is None:
            raise ValueError(f"the {shape} profile has no {HOST_EXPERTS!r} placement candidate")
        room = DeviceRoom(is_cuda=device.startswith("cuda"), budget_bytes=budget_bytes)
        plan = plan_memory(profile, options, room, placement=candidate)
    except PlanError as exc:
        return {**res, "error": f"PlanError: {exc}"}
    finally:
        out.unlink(missing_ok=True)
    slots = plan.capacity().expert_cache_slots
    return {**res, "placement": {"device_bytes": candidate.device_bytes, "host_bytes": candidate.host_bytes,
                                 "staging_bytes": candidate.staging_bytes, "expert_bytes": candidate.expert_bytes},
            "table": dict(plan.table()), "kv_pages": plan.kv_pages, "expert_cache_slots": slots,
            "slots_per_layer": slots // cfg["num_hidden_layers"]}
