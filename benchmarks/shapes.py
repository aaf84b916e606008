"""Published Qwen3.5 dense shapes (config.json text fields) used by the benchmarks, and their arithmetic: parameters,
the bytes a decode step must move, the FLOPs of a prefill."""

from __future__ import annotations

from pathlib import Path

_BASE = {"head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
         "vocab_size": 248320, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
         "architectures": ["Qwen3_5ForCausalLM"]}

SHAPES: dict[str, dict] = {
    # transformers' default Qwen3_5TextConfig (the 9B shape).
    "9b": {**_BASE, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
           "num_attention_heads": 16, "num_key_value_heads": 4, "linear_num_key_heads": 16,
           "linear_num_value_heads": 32, "tie_word_embeddings": False},
    "0.8b": {**_BASE, "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
             "num_attention_heads": 8, "num_key_value_heads": 2, "linear_num_key_heads": 16,
             "linear_num_value_heads": 16, "tie_word_embeddings": True},
    "27b": {**_BASE, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
            "num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_key_heads": 16,
            "linear_num_value_heads": 48, "tie_word_embeddings": False},
    # For CPU smoke runs of the benchmark scripts.
    "tiny": {**_BASE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_key_head_dim": 8,
             "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
             "tie_word_embeddings": False},
}


# Published Qwen3.5 MoE shapes (qwen35_arch.md section 7), for planning and the MoE benchmarks.
MOE_SHAPES: dict[str, dict] = {
    "35b-a3b": {**_BASE, "architectures": ["Qwen3_5MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 40,
                "num_attention_heads": 16, "num_key_value_heads": 2, "linear_num_key_heads": 16,
                "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
                "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False},
}


# The published Qwen4Exp shape (qwen35_arch.md section 8: Qwen3.8-Flash-Next, 125B total with 51B of n-gram table),
# in transformers' Qwen4ExpTextConfig names, for planning, the start and the MoE benchmark. PLE on the second layer
# (ple_layer_ids are 1-indexed): 16 heads of 160 columns over consecutive primes >= 2e7 (about 320M rows).
QWEN4EXP_SHAPES: dict[str, dict] = {
    "qwen4exp-published": {
        **_BASE, "architectures": ["Qwen4ExpForCausalLM"], "hidden_size": 2560, "num_hidden_layers": 48,
        "num_attention_heads": 24, "num_key_value_heads": 2, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 640,
        "shared_expert_intermediate_size": 640, "norm_topk_prob": True, "output_gate_type": "sigmoid",
        "hc_count": 4, "hc_lowrank": 320, "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128,
        "indexer_budget": 2048, "indexer_compress_ratio": 4, "ple_layer_ids": [2], "ple_embed_dim": 2560,
        "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 8, "ngram_vocab_size_base": 20_000_000,
        "make_ngram_vocab_size_divisible_by": 128, "split_ngram_parts": 128, "seed": 1234,
        "max_position_embeddings": 262144, "eos_token_id": 248044, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    },
}

def decode_weight_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of every 2-D weight a decode step reads (all but the input embedding, a row lookup). For a MoE
    shape: the dense ones (mixers, the router with the shared expert's gate, the shared expert as the MLP), not
    the routed expert banks."""
    H, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    moe = "num_experts" in cfg
    inter = cfg["shared_expert_intermediate_size"] if moe else cfg["intermediate_size"]
    kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    vd = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    hv = cfg["linear_num_value_heads"]
    d, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: list[tuple[int, int]] = []
    for i in range(n):
        if (i + 1) % cfg["full_attention_interval"] == 0:
            out += [(2 * nh * d + 2 * nkv * d, H), (H, nh * d)]
        else:
            out += [(2 * kd + vd + vd + 2 * hv, H), (H, vd)]
        out += [(2 * inter, H), (H, inter)] + ([(cfg["num_experts"] + 1, H)] if moe else [])
    out.append((cfg["vocab_size"], H))
    return out


def model_figures(cfg: dict) -> dict:
    """Parameters, decode bytes and the per-token / per-position FLOP terms of a config.json dict."""
    shapes = decode_weight_shapes(cfg)
    head = shapes[-1]
    layer_params = sum(o * i for o, i in shapes[:-1])
    n = cfg["num_hidden_layers"]
    n_full = sum(1 for i in range(n) if (i + 1) % cfg["full_attention_interval"] == 0)
    return {
        "layer_matmul_params": layer_params,
        "lm_head_params": head[0] * head[1],
        "embedding_params": cfg["vocab_size"] * cfg["hidden_size"],
        "decode_weight_bytes": 2 * (layer_params + head[0] * head[1]),
        "full_attention_layers": n_full,
        "gdn_layers": n - n_full,
    }


def prefill_flops(cfg: dict, tokens: int) -> float:
    """Model FLOPs of one prompt of ``tokens`` from position 0: 2 x matmul params x tokens for the layers,
    the lm_head once (only the last position is sampled), causal attention (QK^T and PV over the
    prefix) and the GDN recurrence (about 6 Dk*Dv per token and value head: read-out, delta, update)."""
    f = model_figures(cfg)
    attn = 2 * 2 * cfg["num_attention_heads"] * cfg["head_dim"] * tokens * (tokens + 1) / 2 * f["full_attention_layers"]
    gdn = 6 * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * tokens \
        * f["gdn_layers"]
    return 2 * f["layer_matmul_params"] * tokens + 2 * f["lm_head_params"] + attn + gdn


def decode_bytes(cfg: dict, batch: int, context: int, dtype: str = "bfloat16", weight_bytes: int | None = None) -> int:
    """Bytes one decode step must move: every decode weight once (``weight_bytes``, default the bf16 model's),
    each row's StateImage slot read and written, each row's KV prefix read."""
    from ninfer.core.kv_pool import PagedKVPool
    from ninfer_qwen35.config import parse_config
    from ninfer_qwen35.state import kv_pools, state_layout

    config = parse_config(dict(cfg))
    state = state_layout(config, dtype).nbytes_per_slot
    pools = kv_pools(config, 16, dtype)
    kv_per_token = sum(PagedKVPool.page_bytes(p) for p in pools) // 16
    weights = model_figures(cfg)["decode_weight_bytes"] if weight_bytes is None else weight_bytes
    return weights + batch * (2 * state + context * kv_per_token)


def decode_weight_bytes(path: Path, tied: bool) -> int:
    """Bytes of the weights a decode step reads, from the artifact's header: every text object but the
    embedding, which a step reads a row of (the head when tied: then it is read whole)."""
    from ninfer.artifact import open_artifact

    with open_artifact(path) as art:
        objects = {o.id: o for o in art.header.objects if o.feature == "text"}
        embed = {b.object for b in art.header.bindings if b.name == "model.embed_tokens.weight"}
    return sum(o.nbytes for oid, o in objects.items() if tied or oid not in embed)
