"""Owning ResumeStates returned by ``pause``: Snapshot (host copies) or Replay (ledger only)."""

from __future__ import annotations

import attrs
import torch

from ninfer_qwen35.program.sequence import RowSampling


@attrs.frozen(kw_only=True, eq=False)
class ReplayResume:
    """Enough to rebuild the sequence by re-executing its accepted history.

    The sampling seed and the ledger length fix every future draw, so the continuation is the same.
    ``frontier`` is the physical frontier at pause time (what resume reserves to rebuild).
    """

    program_id: int
    ledger: tuple[int, ...]
    prompt_len: int
    sampling: RowSampling
    frontier: int

    @property
    def host_bytes(self) -> int:
        return 0

    def as_replay(self) -> ReplayResume:
        """The same accepted history without host copies (what a revoked Snapshot becomes)."""
        return ReplayResume(program_id=self.program_id, ledger=self.ledger, prompt_len=self.prompt_len,
                            sampling=self.sampling, frontier=self.frontier)


@attrs.frozen(kw_only=True, eq=False)
class SnapshotResume(ReplayResume):
    """Replay data plus host copies of the StateImage and the KV pages covering ``frontier`` positions."""

    state_image: torch.Tensor = attrs.field(repr=False)
    kv_pages: torch.Tensor = attrs.field(repr=False)  # [layers, 2, pages, page_size, kv_heads, head_dim]

    @property
    def host_bytes(self) -> int:
        return self.state_image.numel() * self.state_image.element_size() + \
            self.kv_pages.numel() * self.kv_pages.element_size()
