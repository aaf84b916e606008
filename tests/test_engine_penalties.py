"""Penalties, logit_bias and min_tokens through the whole engine, on the embedded model in fp32 on the CPU.

Presence and frequency penalties give the tokens a step-by-step reference predicts (each step a one-token greedy
request over the text so far, with the penalties written as that step's logit_bias: the same arithmetic on the
logits, computed by another path); logit_bias -100 bans a token and +100 forces it; min_tokens holds back a stop
token; a row's output does not depend on its batch neighbours; MTP speculative decoding gives plain decoding's
greedy tokens with every adjustment, and seeded rows that do not depend on their neighbours.
"""

from __future__ import annotations

import collections

import pytest

from ninfer import default_model_path
from ninfer.contract import EngineConfig
from ninfer.contract.config import StartupFeatures
from ninfer.contract.events import FinishReason
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine
from ninfer.testing.scheduling import submit_together

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PROMPTS = ["To be, or not to be, that is the question:", "Double, double toil and trouble;"]
TOKENS = 8


def _engine(k: int) -> Engine:
    features = StartupFeatures(speculative="mtp", num_draft_tokens=k) if k else StartupFeatures()
    return Engine(default_model_path(), EngineConfig(device="cpu", dtype="float32", features=features,
                                                     max_concurrency=4, prefill_chunk=16,
                                                     context_cache=False))


@pytest.fixture(scope="module")
def plain(one_cpu_thread):
    with _engine(0) as eng:
        yield eng


@pytest.fixture(scope="module")
def mtp(one_cpu_thread):
    with _engine(2) as eng:
        yield eng


def req(text: str | tuple[int, ...], **s) -> GenerationRequest:
    s.setdefault("temperature", 0.0)
    s.setdefault("ignore_eos", True)
    s.setdefault("max_tokens", TOKENS)
    s.setdefault("repetition_penalty", 1.0)  # not the model's default (its generation_config): the references have none
    inp = TextInput(text=text) if isinstance(text, str) else TextInput(token_ids=text)
    return GenerationRequest(input=inp, sampling=SamplingParams(**s))


def tokens(eng: Engine, requests) -> list[tuple[int, ...]]:
    return [h.result(timeout=300).token_ids for h in submit_together(eng, requests)]


def test_presence_and_frequency_penalties_follow_the_reference(plain):
    # Negative penalties make the model repeat its last token unless the history holds it: a pipelined step
    # that sampled before the step it follows was committed would miss it.
    for text, presence, frequency in ((PROMPTS[0], 0.8, 0.6), (PROMPTS[1], -1.0, -0.5)):
        ids = tuple(plain.frontend.prepare(TextInput(text=text)).token_ids)
        out: list[int] = []
        for _ in range(20):  # long enough that the greedy output repeats a token (the positive penalties' case)
            counts = collections.Counter(out)
            bias = {t: -(frequency * c + presence) for t, c in counts.items()}
            (step,) = tokens(plain, [req(ids + tuple(out), max_tokens=1, logit_bias=bias)])
            out.extend(step)
        (got,) = tokens(plain, [req(text, presence_penalty=presence, frequency_penalty=frequency, max_tokens=20)])
        assert list(got) == out, text
        (free,) = tokens(plain, [req(text, max_tokens=20)])
        assert free != got  # the penalties changed the greedy output


def test_logit_bias_bans_and_forces(plain):
    (free,) = tokens(plain, [req(PROMPTS[0])])
    banned, forced = tokens(plain, [req(PROMPTS[0], logit_bias={free[0]: -100}),
                                    req(PROMPTS[0], logit_bias={free[0]: -100, 1234: 100})])
    assert free[0] not in banned and banned[0] != free[0]
    assert forced == (1234,) * TOKENS


def test_min_tokens_holds_back_the_end_tokens(plain, mtp):
    (free,) = tokens(plain, [req(PROMPTS[1])])
    stop = free[2]
    for eng in (plain, mtp):
        short, held = [h.result(timeout=300) for h in submit_together(
            eng, [req(PROMPTS[1], stop_token_ids=(stop,)), req(PROMPTS[1], stop_token_ids=(stop,), min_tokens=6)])]
        assert short.finish_reason is FinishReason.STOP and len(short.token_ids) <= 3
        assert stop not in held.token_ids[:6] and len(held.token_ids) >= 6


MIXED = [dict(repetition_penalty=1.5), dict(presence_penalty=1.2, frequency_penalty=0.5),
         dict(frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={13: 2.0}),
         dict(temperature=0.9, top_k=40, seed=5, repetition_penalty=1.3, presence_penalty=0.5)]


def test_outputs_ignore_batch_neighbours_and_mtp_matches_plain(plain, mtp):
    requests = [req(PROMPTS[i % 2], **k) for i, k in enumerate(MIXED)]
    together = tokens(plain, requests + [req(PROMPTS[0])])
    alone = [tokens(plain, [r])[0] for r in requests]
    assert together[:len(requests)] == alone
    assert together[0] != together[-1]  # repetition changed the greedy output of the same prompt
    spec = tokens(mtp, requests)
    greedy = [i for i, k in enumerate(MIXED) if "seed" not in k]
    assert [spec[i] for i in greedy] == [alone[i] for i in greedy]
    # A sampled row keeps its distribution (lossless verification), not plain decoding's draws: it is
    # reproducible, alone or beside others.
    assert [tokens(mtp, [requests[i]])[0] for i in range(len(requests))] == spec
