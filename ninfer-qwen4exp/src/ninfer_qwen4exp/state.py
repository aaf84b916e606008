"""What Qwen4Exp keeps per request: a StateImage and one paged KV pool.

The StateImage is Qwen3.5's (GDN ``conv`` and fp32 ``recurrent``, one per GDN layer) plus, with PLE, each PLE
layer's dilated-conv history ``ple_conv`` [(kernel - 1) * ngram_size, hc_hidden] in the model dtype and one
n-gram history ``ngram`` [ngram_size - 1] int64 per sequence (every PLE layer reads the same token ids). Being in
the image, they travel with forks, Snapshots and context-cache checkpoints as the GDN state does. The attention
layers share one pool ``main``; with QSA each of them also pages its indexer's raw key per token (``index_keys``),
so the keys follow the KV through copy-on-write, pause and resume. A Program that takes media also pages each
token's (t, h, w) rotary positions once for all layers (``rope_positions``): a QSA block key rotates at its first
token's, read whenever a later query scores it.
"""

from __future__ import annotations

import attrs

from ninfer.contract.state import KVPoolSpec, PagedField, StateField, StateImageLayout
from ninfer_qwen4exp.config import Qwen4ExpConfig
from ninfer_qwen35.state import kv_pools as qwen35_kv_pools
from ninfer_qwen35.state import state_layout as qwen35_state_layout

INDEX_KEYS = "index_keys"
ROPE_POSITIONS = "rope_positions"


def state_layout(config: Qwen4ExpConfig, dtype: str = "bfloat16") -> StateImageLayout:
    """Qwen3.5's fields (``conv``, ``recurrent``), then with PLE ``ple_conv`` [conv_state_len, hc_hidden] in
    ``dtype`` per PLE layer and ``ngram`` [context_len] int64 (one per sequence)."""
    base = qwen35_state_layout(config.base, dtype)
    ple = config.ple
    if ple is None:
        return base
    return attrs.evolve(base, fields=(
        *base.fields,
        StateField(name="ple_conv", dtype=dtype, shape=(ple.conv_state_len, config.hc_hidden_size),
                   layers=len(ple.layers)),
        StateField(name="ngram", dtype="int64", shape=(ple.context_len,), layers=1),
    ))


def kv_pools(config: Qwen4ExpConfig, page_size: int = 16, dtype: str = "bfloat16", mtp_layers: int = 0, *,
             media: bool = False) -> tuple[KVPoolSpec, ...]:
    """One pool ``main`` over the attention layers (in layer order), then ``mtp_layers`` MTP layers when the MTP
    drafter runs (indexed like the target's: same pages, same positions); with QSA, an auxiliary paged field
    ``index_keys`` of one indexer key [qsa.head_dim] in ``dtype`` per token of each of those layers, and with
    ``media`` (the Program takes prompts with images and videos) ``rope_positions`` int32 [3] per token."""
    pools = qwen35_kv_pools(config.base, page_size=page_size, dtype=dtype, mtp_layers=mtp_layers)
    if config.qsa is None or not pools:
        return pools
    (main,) = pools
    aux = [PagedField(name=INDEX_KEYS, layers=main.layers, shape=(config.qsa.head_dim,), dtype=dtype)]
    if media:
        aux.append(PagedField(name=ROPE_POSITIONS, layers=1, shape=(3,), dtype="int32"))
    return (attrs.evolve(main, aux=tuple(aux)),)
