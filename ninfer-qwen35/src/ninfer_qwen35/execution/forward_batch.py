"""What one Qwen3.5 model call consumes: the generic ForwardBatch (``ninfer.core.forward_batch``) and
Qwen3.5's state views, the paged KV of its attention layers plus the GDN state of its StateImage.

The Program owns the physical stores and builds a ForwardBatch per unit; the model code reads and
writes the stores only through the views and indices given here. For Qwen3.5,
``ForwardBatch.has_initial_state`` False means a row's GDN conv/recurrent state starts at zero, and a
decode batch (max_query_len 1) runs the batched GDN step ops only when every row continues a state
(``all_initial_state``); a row starting fresh sends the batch through the per-sequence prefill ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ninfer.core.forward_batch import ForwardBatch, PagedKVViews

if TYPE_CHECKING:
    import torch

    from ninfer.models.common.moe.host_experts import HostExperts

__all__ = ["ForwardBatch", "ModelStateViews"]


@attrs.define(eq=False, kw_only=True)
class ModelStateViews(PagedKVViews):
    """Typed views into the Program's stores: ``kv`` and ``page_size`` of the attention layers
    (``PagedKVViews``), plus conv [S, L_gdn, conv_dim, K-1] and recurrent [S, L_gdn, HV, Dk, Dv] (fp32),
    strided views into one contiguous StateImage per slot (slot stride = the image size), indexed by
    ForwardBatch.state_slots. ``experts``: the Program's host experts runtime when the MoE routed experts live
    in host memory (None: their banks are on the device).
    """

    conv: torch.Tensor
    recurrent: torch.Tensor
    experts: HostExperts | None = None
