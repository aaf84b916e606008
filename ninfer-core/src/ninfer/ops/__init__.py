"""Model ops: each a public function over tensors with a pure-torch reference (``<name>_ref``, runs
on CPU) and, on CUDA, a validated Triton kernel of the same signature (see ``dispatch``).

Importing this package imports torch but never triton.
"""

from ninfer.ops.activation import silu_and_mul
from ninfer.ops.attention import norm_rope_write_kv, paged_attention, write_kv
from ninfer.ops.conv1d import causal_conv1d_decode, causal_conv1d_prefill
from ninfer.ops.gdn import gdn_decode, gdn_decode_fused, gdn_gates, gdn_prefill, gdn_verify, gdn_verify_commit
from ninfer.ops.hyper_connection import grouped_rms_norm, hyper_connection_inject, hyper_connection_mix
from ninfer.ops.linear import linear, swiglu
from ninfer.ops.moe import moe_block, moe_experts, moe_route
from ninfer.ops.norm import add_rms_norm, add_rms_norm_linear, embed_rms_norm, rms_norm, rms_norm_gated
from ninfer.ops.ple import (
    dilated_causal_conv,
    gather_rows,
    ngram_hash_ids,
    ngram_multipliers,
    ngram_windows,
    ple_layer,
)
from ninfer.ops.qsa import qsa_attention_static, qsa_select, qsa_select_static
from ninfer.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
from ninfer.ops.sampling import logprobs, sample

__all__ = [
    "add_rms_norm", "add_rms_norm_linear", "apply_rope", "causal_conv1d_decode", "causal_conv1d_prefill", "embed_rms_norm", "gdn_decode", "gdn_gates",
    "gdn_decode_fused", "gdn_prefill", "gdn_verify", "gdn_verify_commit", "linear", "logprobs", "moe_block", "moe_experts",
    "moe_route", "norm_rope_write_kv", "paged_attention", "qsa_attention_static", "qsa_select", "qsa_select_static", "rms_norm",
    "rms_norm_gated", "rope_cos_sin", "rope_inv_freq", "sample", "silu_and_mul",
    "swiglu", "write_kv",
    "dilated_causal_conv", "gather_rows", "grouped_rms_norm", "hyper_connection_inject", "hyper_connection_mix",
    "ngram_hash_ids", "ngram_multipliers", "ngram_windows", "ple_layer",
]
