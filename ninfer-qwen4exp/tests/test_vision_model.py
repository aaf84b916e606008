"""Qwen4Exp with images and videos vs transformers' ``Qwen4ExpForConditionalGeneration`` (fp32, CPU, a tiny random
VL config whose QSA selects within the prompt (blocks of 4, a budget of 8) and whose PLE hashes the placeholder
ids): prompt logits, chunked prefill == whole, and greedy tokens equal to transformers' ``generate``.

The model runs over stores built here (the Program's, once it takes media): state filled with NaN and the
rotary-position store with junk, so a read of anything a sequence did not write shows up. A chunk's positions come
from the prompt's ``MRopePlan`` (the [3, n] table when it touches placeholders, shifted text positions otherwise),
its placeholder rows from Qwen3.5's encoder, as the vision handoff gives them.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.contract.prompt import PreparedPrompt
from ninfer.models.common.qwen.mrope import MRopePlan
from ninfer_qwen4exp.execution.forward_batch import ForwardBatch, Qwen4ExpStateViews

transformers = pytest.importorskip("transformers")
from ninfer_qwen4exp.testing.vision import TinyVL, tiny_vl  # noqa: E402
from ninfer_qwen35.testing.vision_prompts import BuiltPrompt, build_prompt, hf_logits, image  # noqa: E402

RTOL = 1e-4  # logits: max |ours - HF| <= RTOL * max |HF| (fp32)
PAGE = 4
FRAMES = [image(20 + i, 24, 16) for i in range(4)]
PROMPTS = {
    # 24 placeholder tokens (an 8 x 12 patch grid merged 2 x 2) between text; an EOS resets the n-grams
    "image": lambda: build_prompt([[5, 6, 7, 11], ("image", image(1, 48, 32)), [8, 9, 10, 11, 12, 13]]),
    # two temporal groups of 6 tokens, a timestamp before each, then text
    "video": lambda: build_prompt([[5, 14], ("video", FRAMES), [17, 18, 19, 20, 21, 22, 23]]),
}



@pytest.fixture(scope="module")
def tiny() -> TinyVL:
    return tiny_vl(seed=3)


class Runner:
    """One sequence with media over stores built here: packs each step's tokens into a ForwardBatch with the
    prompt's rotary positions and encoder rows."""

    def __init__(self, tiny: TinyVL, prompt: PreparedPrompt, num_pages: int = 40) -> None:
        c, b = tiny.model.config, tiny.model.config.base
        self.model, self.prompt = tiny.model, prompt
        self.plan = MRopePlan(len(prompt.token_ids), prompt.media_spans, tiny.vision.config.spatial_merge_size)
        self.items = [tiny.vision.forward(i.pixel_values, [i.grid_thw]) for i in prompt.vision]
        nan, attn = float("nan"), len(c.attention_layers)
        kv = (num_pages, PAGE, b.num_key_value_heads, b.head_dim)
        self.views = Qwen4ExpStateViews(
            conv=torch.full((2, len(c.gdn_layers), b.conv_dim, b.linear_conv_kernel_dim - 1), nan),
            recurrent=torch.full((2, len(c.gdn_layers), b.linear_num_value_heads, b.linear_key_head_dim,
                                  b.linear_value_head_dim), nan),
            kv=[(torch.full(kv, nan), torch.full(kv, nan)) for _ in range(attn)], page_size=PAGE,
            index_keys=[torch.full((num_pages, PAGE, c.qsa.head_dim), nan) for _ in range(attn)],
            ple_conv=torch.full((2, len(c.ple_layers), c.ple.conv_state_len, c.hc_hidden_size), nan),
            ngram=torch.full((2, c.ple.context_len), 12345, dtype=torch.int64),
            rope_positions=torch.full((num_pages, PAGE, 3), -777, dtype=torch.int32))
        self.free, self.pages, self.length = list(range(num_pages)), [], 0

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Logits [len(tokens), V] of the sequence's next tokens."""
        a, b = self.length, self.length + len(tokens)
        while len(self.pages) * PAGE < b:
            self.pages.append(self.free.pop(len(self.free) // 2))  # scattered pages
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens), positions=torch.empty(0), query_start_loc=torch.tensor([0, len(tokens)],
                                                                                                 dtype=torch.int32),
            seq_lens=torch.tensor([b], dtype=torch.int32), state_slots=torch.tensor([1]),
            has_initial_state=torch.tensor([a > 0]), block_tables=torch.tensor([self.pages], dtype=torch.int32),
            slot_mapping=torch.tensor([self.pages[t // PAGE] * PAGE + t % PAGE for t in range(a, b)]),
            logits_indices=torch.arange(len(tokens)), max_query_len=len(tokens), max_seq_len=b,
            all_initial_state=a > 0)
        self._media(batch, a, b)
        self.length = b
        return self.model.logits(self.model.forward(batch, self.views))

    def _media(self, batch: ForwardBatch, a: int, b: int) -> None:
        if not self.plan.touches_media(a, b):
            batch.positions = self.plan.text_positions(a, b)
            return
        batch.mrope_positions = self.plan.positions(a, b)
        batch.positions = batch.mrope_positions[0]
        rows, embeds = [], []
        for span in self.prompt.media_spans:
            lo, hi = max(span.start, a), min(span.start + span.length, b)
            if lo < hi:
                rows.append(torch.arange(lo - a, hi - a))
                first = span.offset + lo - span.start
                embeds.append(self.items[span.item_index][first:first + hi - lo])
        batch.vision_rows, batch.vision_embeds = torch.cat(rows), torch.cat(embeds)

    def prefill(self, chunk: int) -> torch.Tensor:
        ids = self.prompt.token_ids
        return torch.cat([self.step(ids[lo:lo + chunk]) for lo in range(0, len(ids), chunk)])


def _error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(ours).all()
    return (ours - ref).abs().max().item() / ref.abs().max().item()


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_prompt_logits_match_transformers(tiny, name):
    """The whole prompt in one chunk within 1e-4 of transformers; chunks that split the media (and single
    tokens) equal it."""
    built: BuiltPrompt = PROMPTS[name]()
    assert len(built.prompt.token_ids) // tiny.model.config.qsa.compress_ratio > tiny.model.config.qsa.block_topk
    whole = Runner(tiny, built.prompt).prefill(len(built.prompt.token_ids))
    err = _error(whole, hf_logits(tiny.hf, built))
    assert err <= RTOL, f"max relative logit error {err:.2e}"
    for chunk in (7, 1):
        err = _error(Runner(tiny, built.prompt).prefill(chunk), whole)
        assert err <= 1e-5, f"chunks of {chunk} vs whole: {err:.2e}"


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_tokens_match_generate(tiny, name):
    """20 greedy tokens (prefill in chunks of 9, then decode steps at the prompt's shifted positions) equal
    ``Qwen4ExpForConditionalGeneration.generate``'s."""
    built, n = PROMPTS[name](), 20
    ids = built.prompt.token_ids
    with torch.no_grad():
        out = tiny.hf.generate(input_ids=torch.tensor([ids]), **built.hf_inputs, max_new_tokens=n, do_sample=False)
    want = out[0, len(ids):].tolist()
    runner = Runner(tiny, built.prompt)
    got = [int(runner.prefill(9)[-1].argmax())]
    while len(got) < n:
        got.append(int(runner.step(got[-1:])[-1].argmax()))
    assert got == want
    assert len(set(got)) > 3  # the tokens vary (not one repeated token)


def test_media_needs_rope_positions(tiny):
    """A chunk with MRoPE positions over views without the rotary-position store is refused by name."""
    built = PROMPTS["image"]()
    runner = Runner(tiny, built.prompt)
    runner.views.rope_positions = None
    with pytest.raises(ValueError, match="rope_positions"):
        runner.prefill(len(built.prompt.token_ids))
