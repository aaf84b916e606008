"""One resident sequence: its accepted token ledger, physical frontier, pages, slot and sampling."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import attrs

from ninfer.contract.request import SamplingParams

if TYPE_CHECKING:
    from ninfer.models.common.context.prompt_media import PromptMedia


@attrs.frozen(kw_only=True)
class RowSampling:
    """SamplingParams with every default resolved; ``seed`` is fixed at open so Replay draws the same tokens.
    ``end_ids``: the tokens ``min_tokens`` refuses (the request's stop_token_ids, to which the engine adds EOS)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    logprobs: bool
    top_logprobs: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    end_ids: tuple[int, ...] = ()

    @classmethod
    def resolve(cls, params: SamplingParams, defaults: SamplingParams | None) -> RowSampling:
        d = defaults or SamplingParams()

        def pick(name, neutral):
            value = getattr(params, name)
            if value is None:
                value = getattr(d, name)
            return neutral if value is None else value

        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return cls(temperature=float(pick("temperature", 1.0)), top_k=int(pick("top_k", 0)),
                   top_p=float(pick("top_p", 1.0)), min_p=float(pick("min_p", 0.0)), seed=seed,
                   logprobs=params.logprobs or params.top_logprobs > 0, top_logprobs=params.top_logprobs,
                   presence_penalty=float(pick("presence_penalty", 0.0)),
                   frequency_penalty=float(pick("frequency_penalty", 0.0)),
                   repetition_penalty=float(pick("repetition_penalty", 1.0)),
                   logit_bias=tuple((int(t), float(b)) for t, b in params.logit_bias), min_tokens=params.min_tokens,
                   end_ids=tuple(params.stop_token_ids) if params.min_tokens else ())

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def counts_tokens(self) -> bool:
        """A penalty reads the row's token history (``models.common.penalties``)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusted(self) -> bool:
        """The row's logits change before sampling: penalties, logit_bias or min_tokens."""
        return self.counts_tokens or bool(self.logit_bias) or self.min_tokens > 0


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of a sequence's ``index``-th sampled token (splitmix64 of seed and index).

    Counter-based: the draw depends only on (seed, index), so abort, pause and Replay need no RNG
    state beyond the accepted ledger, and a row never depends on its batch neighbours.
    """
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


@attrs.define(eq=False, kw_only=True)
class SequenceRecord:
    """Program-private record of one bound sequence.

    ``ledger`` holds the accepted tokens (prompt, then generated). ``computed`` counts the positions
    whose K/V and recurrent state are in the stores. A decode-ready sequence has computed ==
    len(ledger) - 1: its last accepted token is the next input. ``pages`` is the block table;
    pages beyond those covering ``computed`` are this sequence's reservation. ``first_by_decode``: the
    prompt is prefilled up to its last token, which is the first decode input (then the state after
    every prompt token but the last is a checkpoint any extension of the prompt can restore).
    ``save_points``: frontier positions where prefill ends a unit and saves a checkpoint. ``media``: the
    prompt's images and videos (None: text only), which set its rotary positions and its encoder inputs.
    """

    id: int
    slot: int
    prompt_len: int
    ledger: list[int]
    sampling: RowSampling
    computed: int = 0
    pages: list[int] = attrs.field(factory=list)
    pending: bool = False  # a collected PendingBatch row awaits commit/abort: no other unit until then
    launched: int = 0      # LaunchedUnits holding a row of this sequence, not collected yet (0..2)
    void_ahead: bool = False  # the chained (second) launched row lost its input: collect drops it
    pages_epoch: int = 0   # bumped whenever ``pages`` is truncated (graph block-table rows are cached by it)
    adopted: int = 0       # leading positions read from another history's pages (``KVHistoryStore``)
    first_by_decode: bool = False
    save_points: list[int] = attrs.field(factory=list)
    drafts: tuple[int, ...] = ()  # a speculative Program's drafts for the next unit (after the last accepted token)
    media: PromptMedia | None = None

    @property
    def generated(self) -> int:
        return len(self.ledger) - self.prompt_len

    @property
    def target(self) -> int:
        """Positions to compute before the next sample: all of the prompt, or history minus the next input."""
        return len(self.ledger) - 1 if self.generated > 0 or self.first_by_decode else len(self.ledger)

    @property
    def input_remaining(self) -> int:
        # Negative while a launched row runs ahead of the ledger (its input is not accepted yet): nothing to run.
        return max(0, self.target - self.computed)
