"""What Qwen3.5 keeps per request: a StateImage (GDN conv + recurrent state) and one paged KV pool.

Every GDN layer carries its conv history [conv_dim, K-1] (model dtype, the last K-1 projected inputs)
and its recurrent state [HV, Dk, Dv] (fp32, as the checkpoints' ``mamba_ssm_dtype`` asks); the
attention layers (every 4th) share one paged KV pool ``main``.
"""

from __future__ import annotations

from ninfer.contract.state import KVPoolSpec, StateField, StateImageLayout
from ninfer_qwen35.config import Qwen35Config


def state_layout(config: Qwen35Config, dtype: str = "bfloat16") -> StateImageLayout:
    """Fields ``conv`` [conv_dim, K-1] in ``dtype`` and ``recurrent`` [HV, Dk, Dv] fp32, one per GDN layer."""
    layers = len(config.gdn_layers)
    if layers == 0:
        raise ValueError("this Qwen3.5 config has no linear_attention layers, so no StateImage")
    return StateImageLayout(fields=(
        StateField(name="conv", dtype=dtype, shape=(config.conv_dim, config.linear_conv_kernel_dim - 1),
                   layers=layers),
        StateField(name="recurrent", dtype="float32", layers=layers,
                   shape=(config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)),
    ))


def kv_pools(config: Qwen35Config, page_size: int = 16, dtype: str = "bfloat16",
             mtp_layers: int = 0) -> tuple[KVPoolSpec, ...]:
    """One pool ``main`` over the full-attention layers (in layer order), then ``mtp_layers`` MTP layers when the
    MTP drafter runs: its KV is indexed like the target's (same pages, same positions)."""
    layers = len(config.attention_layers)
    if layers == 0:
        return ()
    return (KVPoolSpec(name="main", layers=layers + mtp_layers, kv_heads=config.num_key_value_heads,
                       head_dim=config.head_dim, dtype=dtype, page_size=page_size),)
