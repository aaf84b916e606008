"""What one Qwen4Exp model call consumes: the generic ForwardBatch (``ninfer.core.forward_batch``) and Qwen4Exp's
state views: the paged KV of its attention layers with their QSA indexer keys, the GDN state of its StateImage,
and the PLE state (the dilated conv's history and the n-gram history).

``ForwardBatch.has_initial_state`` False means a row starts fresh: GDN conv/recurrent and PLE conv history at zero,
the n-gram history all EOS (as transformers starts a sequence).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ninfer.core.forward_batch import ForwardBatch, PagedKVViews

if TYPE_CHECKING:
    import torch

    from ninfer.models.common.moe.host_experts import HostExperts

__all__ = ["ForwardBatch", "Qwen4ExpStateViews"]


@attrs.define(eq=False, kw_only=True)
class Qwen4ExpStateViews(PagedKVViews):
    """Typed views into the Program's stores, indexed by ``ForwardBatch.state_slots`` (StateImage fields) or by the
    batch's block tables and slot mapping (paged fields):

    - ``kv`` / ``page_size`` (``PagedKVViews``): (k_cache, v_cache) per attention layer, in layer order;
    - ``index_keys``: per attention layer, its QSA indexer's raw keys [num_pages, page_size, indexer_head_dim]
      (empty without QSA), paged like the KV;
    - ``conv`` [S, L_gdn, conv_dim, K-1] and ``recurrent`` [S, L_gdn, HV, Dk, Dv] fp32: the GDN layers' state;
    - ``ple_conv`` [S, L_ple, conv_state_len, hc_hidden]: each PLE layer's last ``(kernel - 1) * ngram_size``
      normed gated values (None without PLE);
    - ``ngram`` [S, context_len] int64: the sequence's last ``ngram_size - 1`` token ids (None without PLE);
    - ``experts``: the Program's host experts runtime when the routed experts live in host memory;
    - ``rope_positions`` [num_pages, page_size, 3] int32, paged like the KV (None without media): each cached
      token's (t, h, w) rotary positions, which the QSA block keys rotate by. A Program that takes media gives it
      (a sequence's positions then differ from its token indices from its first media item on).
    """

    conv: torch.Tensor
    recurrent: torch.Tensor
    index_keys: tuple[torch.Tensor, ...] = attrs.field(default=(), converter=tuple)
    ple_conv: torch.Tensor | None = None
    ngram: torch.Tensor | None = None
    experts: HostExperts | None = None
    rope_positions: torch.Tensor | None = None
