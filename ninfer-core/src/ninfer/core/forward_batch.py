"""What one model call consumes: the packed batch geometry a Program builds, and the paged KV views.

A Program owns the physical stores and builds a ForwardBatch per unit (a prefill chunk, a compact
decode step of exactly B rows, or a verify step with several tokens per row); model code reads and
writes the stores only through the views and indices given here. Every paged-attention model reads
``PagedKVViews``; an architecture with a recurrent StateImage extends it with typed views of its
fields (e.g. Qwen3.5's GDN conv and recurrent state).
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
    has_initial_state [B] bool (False: the sequence starts here, its recurrent state starts at zero);
    block_tables [B, P] int32 (KV page ids per sequence; unused entries may hold any valid page id);
    slot_mapping [N] int64 (flat KV index page * page_size + offset where each new token's K/V goes);
    logits_indices [M] int64 (rows of the N new tokens whose logits are wanted).
    Vision (all None in a text-only batch): ``mrope_positions`` [3, N] int64, the (t, h, w) rotary positions of
    every new token when a sequence's chunk holds media placeholders (None: all three axes are ``positions``,
    which then already carry each sequence's MRoPE offset); ``vision_rows`` [M] int64 and ``vision_embeds``
    [M, H]: the encoder's embeddings that replace the token embeddings of those rows of the N new tokens.
    ``max_query_len`` / ``max_seq_len`` are host ints for kernel grids (no device sync needed).
    ``all_initial_state`` is the host copy of ``has_initial_state.all()`` when the builder knows it: a
    model with recurrent state may take a batched decode path only when every row continues a state.
    None makes such a model read the tensor (a device sync, not allowed inside CUDA-graph capture), so
    graph-captured decode batches pass True.
    ``static`` True: the batch's tensors are static buffers a CUDA graph captures (each replay rewrites them), and
    ``max_seq_len`` is their fixed bound, not this batch's longest sequence: the model must read no tensor on
    the host and take no data-dependent shape (an op whose reference reads lengths on the host takes its
    static form).
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
    static: bool = False
    mrope_positions: torch.Tensor | None = None
    vision_rows: torch.Tensor | None = None
    vision_embeds: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.state_slots.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


@attrs.define(eq=False, kw_only=True)
class PagedKVViews:
    """The paged KV every attention model reads: kv [L_attn] entries are (k_cache, v_cache), each
    [num_pages, page_size, kv_heads, head_dim] (non-owning views of ``PagedKVPool.caches()``), indexed
    by ForwardBatch.block_tables / slot_mapping."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    page_size: int
