"""Logit adjustments before sampling: logit_bias, min_tokens, and the penalties that read a row's history.

Order (vLLM's): ``logit_bias`` is added and ``min_tokens`` refuses the row's end tokens, then the
repetition / frequency / presence penalties (``ninfer.ops.penalties``). A unit without an adjusted row pays
nothing here: the sampler calls in only when one of its rows asks.

The penalties read each row's history from ``TokenHistory``: device rows of output-token counts (int32 [V]) and
prompt marks (bool [V]), held only for sequences with a penalty (5 bytes per vocabulary entry: 1.2 MB a row at
V = 248k). A row is brought up to date from the sequence's ledger before each draw: the ledger only grows, so
that uploads just the tokens accepted since the last draw. It is read at the draw of generated token ``index``,
counting the generated tokens before it; the Program samples a row with a penalty only once every earlier unit
of it is committed (``PagedProgram.launch_decode``), so those tokens are in the ledger.

Speculative verification (``adjust(..., drafts=...)``): position j of a row sees its history plus drafts 1..j,
each position on its own history row (copies of the row with the drafts added), so verification applies
exactly the penalties plain decoding would after accepting those drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.core.readback import upload
from ninfer.models.common.context.sequence import SequenceRecord


class TokenHistory:
    """Device history rows of the sequences whose penalties read them: ``counts`` int32 [rows, V] (each token's
    occurrences in the output) and ``prompt`` bool [rows, V] (the token is in the prompt). Rows are taken on a
    sequence's first penalized draw, given back by ``forget``; the tensors double when full."""

    def __init__(self, device: torch.device, vocab: int) -> None:
        self.device = device
        self.vocab = vocab
        self.counts = torch.zeros((0, vocab), dtype=torch.int32, device=device)
        self.prompt = torch.zeros((0, vocab), dtype=torch.bool, device=device)
        self._rows: dict[int, list[int]] = {}  # sequence id -> [history row, ledger tokens counted]
        self._free: list[int] = []

    def forget(self, sequence_id: int) -> None:
        held = self._rows.pop(sequence_id, None)
        if held is not None:
            self._free.append(held[0])

    def _take(self) -> int:
        if not self._free:
            have = self.counts.shape[0]
            grow = max(4, have)
            self.counts = torch.cat([self.counts, self.counts.new_zeros((grow, self.vocab))])
            self.prompt = torch.cat([self.prompt, self.prompt.new_zeros((grow, self.vocab))])
            self._free.extend(range(have + grow - 1, have - 1, -1))
        return self._free.pop()

    def rows(self, seqs: Sequence[SequenceRecord], upto: Sequence[int]) -> list[int]:
        """The history row of each sequence, holding its ledger's first ``upto`` tokens (prompt, then output)."""
        out, fresh, marks, added = [], [], [], []
        V = self.vocab
        for seq, end in zip(seqs, upto, strict=True):
            end = min(end, len(seq.ledger))
            held = self._rows.get(seq.id)
            if held is None or held[1] > end:  # new, or ahead of this draw (a void row ran past it): rebuild
                if held is None:
                    held = self._rows[seq.id] = [self._take(), 0]
                fresh.append(held[0])
                marks.extend((held[0], t) for t in set(seq.ledger[:seq.prompt_len]) if t < V)
                held[1] = min(seq.prompt_len, end)
            added.extend((held[0], t) for t in seq.ledger[max(held[1], seq.prompt_len):end] if t < V)
            held[1] = max(held[1], end)
            out.append(held[0])
        if fresh:
            idx = upload(torch.tensor(fresh, dtype=torch.int64), self.device)
            self.counts.index_fill_(0, idx, 0)
            self.prompt.index_fill_(0, idx, False)
        if marks:
            r, t = upload(torch.tensor(marks, dtype=torch.int64), self.device).unbind(1)
            self.prompt.index_put_((r, t), torch.ones((), dtype=torch.bool, device=self.device))
        if added:
            r, t = upload(torch.tensor(added, dtype=torch.int64), self.device).unbind(1)
            self.counts.index_put_((r, t), torch.ones((), dtype=torch.int32, device=self.device), accumulate=True)
        return out


class LogitAdjust:
    """The sampler's logit adjustments (module doc); one history per Program, made at the first penalized draw."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.history: TokenHistory | None = None

    def forget(self, sequence_id: int) -> None:
        if self.history is not None:
            self.history.forget(sequence_id)

    def adjust(self, seqs: Sequence[SequenceRecord], logits: torch.Tensor, indices: Sequence[int],
               drafts: Sequence[Sequence[int]] | None = None) -> None:
        """In place on ``logits`` [rows, V]: one row per sequence, or with ``drafts`` 1 + len(drafts) consecutive
        rows (position j after drafts 1..j). ``indices``: the generated-token index each sequence's first row
        draws."""
        from ninfer.ops.penalties import apply_penalties

        per = 1 + len(drafts[0]) if drafts else 1
        V = logits.shape[1]
        bias, bans, pen = [], [], []
        for i, (seq, index) in enumerate(zip(seqs, indices, strict=True)):
            p = seq.sampling
            for j in range(per):
                row = i * per + j
                bias.extend((row, t, b) for t, b in p.logit_bias if t < V)
                if index + j < p.min_tokens:
                    bans.extend((row, t) for t in p.end_ids if t < V)
            if p.counts_tokens:
                pen.append(i)
        dev = logits.device
        if bias:
            cols = torch.tensor(bias, dtype=torch.float64)
            at = upload(cols[:, :2].long(), dev)
            logits.index_put_((at[:, 0], at[:, 1]), upload(cols[:, 2].to(logits.dtype), dev), accumulate=True)
        if bans:
            at = upload(torch.tensor(bans, dtype=torch.int64), dev)
            logits.index_put_((at[:, 0], at[:, 1]), torch.tensor(float("-inf"), dtype=logits.dtype, device=dev))
        if not pen:
            return
        if self.history is None:
            self.history = TokenHistory(self.device, V)
        hist = self.history
        rows = hist.rows([seqs[i] for i in pen], [seqs[i].prompt_len + indices[i] for i in pen])
        sel = [i * per + j for i in pen for j in range(per)]
        rows_p = [seqs[i].sampling for i in pen for _ in range(per)]
        knobs = upload(torch.tensor([[p.presence_penalty for p in rows_p], [p.frequency_penalty for p in rows_p],
                                     [p.repetition_penalty for p in rows_p]], dtype=torch.float32), dev)
        sel_t = upload(torch.tensor(sel, dtype=torch.int64), dev)
        if per == 1:
            counts, prompt = hist.counts, hist.prompt
            at = upload(torch.tensor(rows, dtype=torch.int64), dev)
        else:  # one history row per position: the row's, plus the drafts before the position
            src = upload(torch.tensor([r for r in rows for _ in range(per)], dtype=torch.int64), dev)
            counts, prompt = hist.counts[src], hist.prompt[src]
            ups = [(k * per + j, d) for k, i in enumerate(pen) for j in range(1, per) for d in drafts[i][:j] if d < V]
            if ups:
                u = upload(torch.tensor(ups, dtype=torch.int64), dev)
                counts.index_put_((u[:, 0], u[:, 1]), torch.ones((), dtype=torch.int32, device=dev), accumulate=True)
            at = torch.arange(len(sel), dtype=torch.int64, device=dev)
        apply_penalties(logits, sel_t, at, counts, prompt, knobs[0], knobs[1], knobs[2])
