"""Sampling a unit's rows: per-row counter-based draws, greedy / sampled / logprobs launch, PendingRows.

Each row draws with its own ``torch.Generator``, reseeded for every draw from
``draw_seed(seed, index of the generated token)``: a row's tokens never depend on its batch
neighbours, and abort, Snapshot and Replay need no RNG state beyond the ledger. ``launch`` queues
the sampling (and the logprobs rows ask for) and the one packed copy to the host (``Readback``);
``wait`` blocks on that copy; ``pending_rows`` turns the results into the PendingBatch rows.

Rows the engine's ``TokenMasks`` constrain get their allowed-token mask applied to the logits first (filled on
the host into pinned rows, one upload per unit); a unit without a constrained row pays nothing for it. Then rows
with a logit_bias, min_tokens or a penalty get those (``models.common.penalties``); a unit without one pays a
check per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.contract.batch import PendingRow
from ninfer.contract.constraint import MaskFill, TokenMasks, mask_words
from ninfer.core.readback import CopyStream, Readback, RowLogprobs, upload
from ninfer.models.common.context.sequence import RowSampling, SequenceRecord, draw_seed
from ninfer.models.common.penalties import LogitAdjust

TOPK_PATH = 1024  # largest top_k sampled from its top-k candidates; wider (or none) sorts the vocabulary


class MaskRows:
    """A unit's mask rows: int32 [rows, words] filled on the host (pinned on CUDA), uploaded once."""

    def __init__(self, device: torch.device, vocab_size: int, rows: int) -> None:
        shape = (rows, mask_words(vocab_size))
        cuda = device.type == "cuda"
        self.host = torch.empty(shape, dtype=torch.int32, pin_memory=cuda)
        self.device = torch.empty(shape, dtype=torch.int32, device=device) if cuda else self.host
        self._uploaded: torch.cuda.Event | None = None

    def gather(self, seq_ids: Sequence[int], masks: TokenMasks,
               drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor | None:
        """The rows of ``seq_ids`` on the device (all ones for unconstrained ones); None when none is constrained.
        With ``drafts`` each sequence has 1 + len(its drafts) consecutive rows (the mask after each draft prefix)."""
        flags = [masks.constrained(i) for i in seq_ids]
        if not any(flags):
            return None
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous unit's upload has read the host rows
        per = 1 + len(drafts[0]) if drafts else 1
        host = self.host[:len(seq_ids) * per]
        fills = []
        for i, (seq_id, constrained) in enumerate(zip(seq_ids, flags, strict=True)):
            row = i * per
            if constrained:
                fills.append(MaskFill(sequence_id=seq_id, out=host[row:row + per],
                                      drafts=drafts[i] if drafts else ()))
            else:
                host[row:row + per].fill_(-1)
        masks.fill(fills)
        if self.device is self.host:
            return host
        dev = self.device[:len(seq_ids)]
        dev.copy_(host, non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record()
        return dev


class Sampler:
    """The draws of one Program's sequences on ``device`` (one generator per sequence, made on first use).
    ``mask_rows``: the most rows a unit samples (the mask rows allocated at the first constrained unit)."""

    def __init__(self, device: torch.device, *, mask_rows: int = 0) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        self.mask_rows = mask_rows
        self._masks: MaskRows | None = None  # allocated at the first constrained unit
        self.adjustments = LogitAdjust(device)
        self.copies = CopyStream()  # the readback copies' stream: this Program's, released with it

    def forget(self, sequence_id: int) -> None:
        """The sequence is released: drop its generator and its token history."""
        self._generators.pop(sequence_id, None)
        self.adjustments.forget(sequence_id)

    def generator(self, seq: SequenceRecord, index: int) -> torch.Generator:
        """The generator of the sequence's ``index``-th sampled token (counter-based: see ``draw_seed``)."""
        gen = self._generators.get(seq.id)
        if gen is None:
            gen = self._generators[seq.id] = torch.Generator(device=self.device)
        gen.manual_seed(draw_seed(seq.sampling.seed, index))
        return gen

    def launch(self, seqs: Sequence[SequenceRecord], logits: torch.Tensor, indices: Sequence[int],
               masks: TokenMasks | None = None) -> Readback:
        """Queue sampling (and logprobs) of every row of ``logits`` [B, V], then one device->host copy of the
        results. ``indices``: the generated-token index each row draws (its counter-based seed). ``masks``:
        the engine's token masks; constrained rows' logits are masked in place first, then adjusted (logit_bias,
        min_tokens, penalties: ``adjust``)."""
        from ninfer.ops.sampling import greedy, sample

        dev = logits.device
        if masks is not None:
            self._apply_masks(seqs, logits, masks)
        sp = [s.sampling for s in seqs]
        raw = logits
        if any(p.adjusted for p in sp):
            raw = self._adjust(seqs, logits, indices)
        if all(p.greedy for p in sp):
            tokens = greedy(logits)  # what sample() does for temperature 0, without its per-row setup
        else:
            knobs = _knobs(sp, dev)
            drawn = [p for p in sp if not p.greedy]
            narrow = all(0 < p.top_k <= TOPK_PATH for p in drawn)  # filter top-k candidates, no vocabulary sort
            tokens = sample(logits, knobs[:, 0], knobs[:, 3].long(), knobs[:, 1], knobs[:, 2],
                            [None if p.greedy else self.generator(s, i)
                             for s, p, i in zip(seqs, sp, indices, strict=True)],
                            max_top_k=max(p.top_k for p in drawn) if narrow else None)
        want = tuple(i for i, p in enumerate(sp) if p.logprobs)
        return launch_readback(tokens, raw, tokens, want, max((sp[i].top_logprobs for i in want), default=0),
                               copies=self.copies)

    def _adjust(self, seqs: Sequence[SequenceRecord], logits: torch.Tensor, indices: Sequence[int],
                drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """Adjust ``logits`` in place; returns what logprobs are reported from: the logits before the adjustments
        (a copy, when a row wants logprobs), as vLLM reports them."""
        raw = logits.clone() if any(s.sampling.logprobs for s in seqs) else logits
        self.adjustments.adjust(seqs, logits, indices, drafts)
        return raw

    def _apply_masks(self, seqs: Sequence[SequenceRecord], logits: torch.Tensor, masks: TokenMasks,
                     drafts: Sequence[Sequence[int]] | None = None) -> None:
        """Mask the constrained rows of ``logits`` [rows, V] in place (1 + len(drafts) rows per sequence)."""
        from ninfer.ops.sampling import apply_token_mask

        rows, V = logits.shape
        # Outside inference mode: the rows (and their views) are filled in place, possibly on other threads.
        with torch.inference_mode(False):
            if self._masks is None or self._masks.host.shape[0] < rows or self._masks.host.shape[1] != mask_words(V):
                self._masks = MaskRows(logits.device, V, max(self.mask_rows, rows))
            mask = self._masks.gather([s.id for s in seqs], masks, drafts)
        if mask is not None:
            apply_token_mask(logits, mask)

    def mask_verify(self, seqs: Sequence[SequenceRecord], drafts: Sequence[Sequence[int]], logits: torch.Tensor,
                    masks: TokenMasks) -> None:
        """Mask a verify unit's logits [B*R, V] in place: each constrained row's mask after every draft prefix."""
        self._apply_masks(seqs, logits, masks, drafts)

    def adjust_verify(self, seqs: Sequence[SequenceRecord], drafts: Sequence[Sequence[int]], logits: torch.Tensor,
                      indices: Sequence[int]) -> torch.Tensor:
        """Adjust a verify unit's logits [B*R, V] in place (logit_bias, min_tokens, penalties), each position as
        plain decoding would after accepting the drafts before it; ``indices``: each row's first draw. Returns
        the logits logprobs are reported from (``_adjust``)."""
        return self._adjust(seqs, logits, indices, drafts)

    def verify(self, seqs: Sequence[SequenceRecord], logits: torch.Tensor, drafts: torch.Tensor,
               indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B, R], accepted [B]) of a verify unit (``ops.speculative``): logits [B, R, V] (masked),
        drafts [B, R-1] (device), ``indices`` the generated-token index of each row's first position."""
        from ninfer.ops.speculative import verify_greedy, verify_ref

        B, R, V = logits.shape
        sp = [s.sampling for s in seqs]
        if all(p.greedy for p in sp):  # the longest prefix equal to the argmax, then the argmax (no draws)
            return verify_greedy(logits, drafts)
        knobs = _knobs(sp, logits.device)
        noise, uniform = self.verify_draws(seqs, indices, R, V)
        num = torch.full((B,), R - 1, dtype=torch.int64, device=logits.device)
        # ops.speculative.verify without its argument checks (one of them reads the device): shapes hold here
        return verify_ref(logits, drafts, num, knobs[:, 0], knobs[:, 3].long(), knobs[:, 1], knobs[:, 2], noise,
                          uniform)

    def verify_draws(self, seqs: Sequence[SequenceRecord], indices: Sequence[int], positions: int,
                     vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The randomness of verifying drafts (``ops.speculative.verify``): per row and position i, Exp(1) noise
        over the vocabulary then one uniform, from the generator of generated token ``indices[row] + i``: the
        noise plain sampling of that token would draw, so verification without drafts samples as decode does.
        Greedy rows draw nothing (zeros: verification does not read them)."""
        noise = torch.zeros((len(seqs), positions, vocab), dtype=torch.float32, device=self.device)
        uniform = torch.zeros((len(seqs), positions), dtype=torch.float32, device=self.device)
        for row, (seq, base) in enumerate(zip(seqs, indices, strict=True)):
            if seq.sampling.greedy:
                continue
            for i in range(positions):
                gen = self.generator(seq, base + i)
                noise[row, i].exponential_(generator=gen)
                uniform[row, i:i + 1].uniform_(generator=gen)
        return noise, uniform

    @staticmethod
    def wait(readback: Readback) -> tuple[list[int], dict[int, RowLogprobs]]:
        """Block until ``readback``'s copy is on the host: every row's token, and the logprobs of the rows
        that want them."""
        return readback.wait()


def _knobs(sp: Sequence[RowSampling], dev: torch.device) -> torch.Tensor:
    """[temperature, top_p, min_p, top_k] of every row, fp32 [B, 4] on ``dev`` in one host->device copy (top_k is
    exact in fp32 below 2**24)."""
    return upload(torch.tensor([[p.temperature, p.top_p, p.min_p, min(p.top_k, 1 << 24)] for p in sp],
                               dtype=torch.float32), dev)


def launch_readback(pack: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, want: tuple[int, ...],
                    top_n: int, *, copies: CopyStream) -> Readback:
    """The unit's one copy to the host: ``pack`` (its sampled tokens, and whatever else the unit reports), plus
    the logprobs of rows ``want`` of ``logits`` [N, V] for their ``tokens`` [N] with their ``top_n`` best."""
    from ninfer.ops.sampling import logprobs

    if not want:
        return Readback.launch(pack, copies=copies)
    if len(want) == logits.shape[0]:
        lps = logprobs(logits, tokens, top_n)
    else:
        idx = upload(torch.tensor(want), logits.device)
        lps = logprobs(logits[idx], tokens[idx], top_n)
    return Readback.launch(pack, want, top_n, lps, copies=copies)


def pending_row(seq: SequenceRecord, tokens: tuple[int, ...], logprobs: Sequence[RowLogprobs] | None,
                drafted: int = 0) -> PendingRow:
    """The PendingRow of ``seq``'s ``tokens``; ``logprobs`` (one entry per token) when the row asked for them:
    each token's logprob and its ``top_logprobs`` best."""
    if logprobs is None:
        return PendingRow(sequence_id=seq.id, tokens=tokens, drafted=drafted)
    n = seq.sampling.top_logprobs
    return PendingRow(sequence_id=seq.id, tokens=tokens, drafted=drafted,
                      logprobs=tuple(chosen for chosen, _ in logprobs),
                      top_logprobs=tuple(tuple(zip([int(t) for t in ids[:n]], lps[:n], strict=True))
                                         for _, (ids, lps) in logprobs))


def pending_rows(seqs: Sequence[SequenceRecord], rows_at: Sequence[int], tokens: list[int],
                 logprobs: dict[int, RowLogprobs]) -> list[PendingRow]:
    """One PendingRow per sequence, whose results are row ``rows_at[k]`` of the sampled unit; rows that asked
    for logprobs carry the chosen token's and their ``top_logprobs`` best."""
    return [pending_row(seq, (tokens[i],), [logprobs[i]] if i in logprobs else None)
            for seq, i in zip(seqs, rows_at, strict=True)]
