"""What one model call consumes: the batch geometry built by the Program, and the state/KV views.

The Program owns the physical stores and builds a ForwardBatch per unit (a prefill chunk, a
compact decode step of exactly B rows, or a verify step with several tokens per row); the model
code reads and writes the stores only through the views and indices given here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch


@attrs.define(eq=False, kw_only=True)
class ForwardBatch:
    """B sequences, N new tokens in total, packed back to back (sequence i owns
    ``input_ids[query_start_loc[i]:query_start_loc[i+1]]``).

    input_ids [N] int64; positions [N] int64 (absolute text positions);
    query_start_loc [B+1] int32; seq_lens [B] int32 (tokens in KV after this call, new ones included);
    state_slots [B] int64 (StateImage slot of each sequence);
    has_initial_state [B] bool (False: GDN conv/recurrent state starts at zero);
    block_tables [B, P] int32 (KV page ids per sequence; unused entries may hold any valid page id);
    slot_mapping [N] int64 (flat KV index page * page_size + offset where each new token's K/V goes);
    logits_indices [M] int64 (rows of the N new tokens whose logits are wanted).
    ``max_query_len`` / ``max_seq_len`` are host ints for kernel grids (no device sync needed).
    ``all_initial_state`` is the host copy of ``has_initial_state.all()`` when the builder knows it
    (added for the model): a decode batch (max_query_len 1) runs the batched GDN step ops only when
    every row continues a state; a row starting fresh sends the batch through the per-sequence prefill
    ops. None makes the model read the tensor (a device sync, not allowed inside CUDA-graph capture),
    so graph-captured decode batches must pass True.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    state_slots: torch.Tensor
    has_initial_state: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    max_query_len: int
    max_seq_len: int
    all_initial_state: bool | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.state_slots.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


@attrs.define(eq=False, kw_only=True)
class ModelStateViews:
    """Typed views into the Program's stores.

    conv [S, L_gdn, conv_dim, K-1] and recurrent [S, L_gdn, HV, Dk, Dv] (fp32) are strided views
    into one contiguous StateImage per slot (slot stride = the image size), indexed by
    ForwardBatch.state_slots. kv [L_attn] entries are (k_cache, v_cache), each
    [num_pages, page_size, kv_heads, head_dim], indexed by ForwardBatch.block_tables / slot_mapping.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    page_size: int
