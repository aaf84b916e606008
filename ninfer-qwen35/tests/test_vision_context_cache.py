"""The context cache with images, through the ResourceManager over a real Qwen35Program (fp32, CPU, tiny random
VL model): the same image hits its checkpoints and continues exactly as a fresh run; a different image of the
same size (same token ids) never restores past the text before it; a longer prompt that extends one with an
image restores its prompt end."""

from __future__ import annotations

import pytest

from ninfer.contract.batch import RowDecision
from ninfer.contract.context import media_runs
from ninfer.contract.request import SamplingParams
from ninfer.engine.context_cache import ResourceManager
from ninfer_qwen35.program import ProgramError
from ninfer_qwen35.testing import float32_program

pytest.importorskip("transformers")
from ninfer_qwen35.testing.vision_prompts import build_prompt, image, tiny_vl  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
STEPS = 5
TEXT_BEFORE = [5, 6, 7, 20, 21, 22]


@pytest.fixture(scope="module")
def tiny():
    return tiny_vl(seed=5)


def _program(tiny):
    return float32_program(tiny.model, vision=tiny.vision, page_size=4, num_pages=128, max_concurrency=2,
                           checkpoint_slots=8)


def _run(prog, rm, prompt, *, chunk=5):
    """One request as the engine runs it with the cache on: restore the best checkpoint, plan save points,
    prefill, decode; publish. Returns (restored length, tokens)."""
    tokens, media = prompt.token_ids, media_runs(prompt)
    hit = rm.lookup(tokens, media=media) if rm is not None else None
    sid = None
    if hit is not None:
        assert rm.lease(hit.id) is not None
        sid = prog.open_cached(prompt, GREEDY, hit.id)
        rm.unlease(hit.id)
    have = hit.length if sid is not None else 0
    if sid is None:
        sid = prog.open_sequence(prompt, GREEDY)
    if rm is not None:
        prog.plan_saves(sid, rm.save_points(tokens, have, media=media))
    out, batch = [], None
    while prog.input_remaining(sid):
        assert prog.reserve_units(sid, chunk)
        batch = prog.prefill(sid, chunk)
        if rm is not None:
            rm.adopt(prog.published())
    if batch is not None:
        prog.commit(batch, [RowDecision(accepted=1)])
        out.append(batch.rows[0].tokens[0])
    while len(out) < STEPS:
        assert prog.reserve_units(sid, 1)
        step = prog.decode([sid])
        prog.commit(step, [RowDecision(accepted=1)])
        out.append(step.rows[0].tokens[0])
    prog.release(sid)
    return have, out


def _fresh(tiny, prompt):
    return _run(_program(tiny), None, prompt)[1]


def test_same_image_hits_a_different_one_never_does(tiny):
    a = build_prompt([TEXT_BEFORE, ("image", image(1, 24, 16)), [8, 9, 10]])
    again = build_prompt([TEXT_BEFORE, ("image", image(1, 24, 16)), [8, 9, 10]])
    other = build_prompt([TEXT_BEFORE, ("image", image(2, 24, 16)), [8, 9, 10]])
    assert a.prompt.token_ids == other.prompt.token_ids
    span = a.prompt.media_spans[0]
    prog = _program(tiny)
    rm = ResourceManager(prog, block=4, grid=4)  # grid points before, inside and after the image
    first = _run(prog, rm, a.prompt)
    assert first == (0, _fresh(tiny, a.prompt))
    encoded = prog.vision.encoded
    have, tokens = _run(prog, rm, again.prompt)
    assert have == len(a.prompt) - 1 and tokens == first[1]
    assert prog.vision.encoded == encoded  # nothing left to encode: the image is inside the restored prefix
    have, tokens = _run(prog, rm, other.prompt)
    assert have <= span.start and tokens == _fresh(tiny, other.prompt)
    assert tokens != first[1]  # the image decides the answer (and a wrong hit would have given first's)
    rm.clear()
    assert prog.usage().all_free and prog.cache_usage().empty and prog.vision.items_held == 0


def test_a_restore_inside_the_image_encodes_it_again(tiny):
    """A grid checkpoint inside the image: the continuation encodes the whole image and takes the rows after the
    checkpoint."""
    a = build_prompt([TEXT_BEFORE, ("image", image(1, 24, 16)), [8, 9, 10]])
    span = a.prompt.media_spans[0]
    inside = span.start + span.length // 2
    longer = build_prompt([TEXT_BEFORE, ("image", image(1, 24, 16)), [8, 9, 10, 11, 12]])
    prog = _program(tiny)
    rm = ResourceManager(prog, block=1, grid=10_000)
    sid = prog.open_sequence(a.prompt, GREEDY)
    prog.plan_saves(sid, [inside])
    assert prog.reserve_units(sid, inside) and prog.prefill(sid, inside) is None
    rm.adopt(prog.published())
    prog.release(sid)
    encoded = prog.vision.encoded
    have, tokens = _run(prog, rm, longer.prompt)
    assert have == inside and tokens == _fresh(tiny, longer.prompt)
    assert prog.vision.encoded == encoded + 1
    rm.clear()
    assert prog.usage().all_free and prog.cache_usage().empty


def test_a_longer_prompt_with_another_image_restores_the_first_turn(tiny):
    turn1 = build_prompt([TEXT_BEFORE, ("image", image(1, 24, 16)), [8, 9, 10]])
    turn2 = build_prompt([TEXT_BEFORE, ("image", image(1, 24, 16)), [8, 9, 10, 30, 31],
                          ("image", image(3, 16, 16)), [32, 33]])
    prog = _program(tiny)
    rm = ResourceManager(prog, block=4, grid=10_000)
    _run(prog, rm, turn1.prompt)
    have, tokens = _run(prog, rm, turn2.prompt)
    assert have == len(turn1.prompt) - 1 and tokens == _fresh(tiny, turn2.prompt)
    rm.clear()
    assert prog.usage().all_free and prog.cache_usage().empty


def test_open_cached_refuses_a_checkpoint_of_another_image(tiny):
    """The Program's own check, behind the index's: token ids equal, image different."""
    a = build_prompt([TEXT_BEFORE, ("image", image(1, 24, 16)), [8, 9]])
    b = build_prompt([TEXT_BEFORE, ("image", image(2, 24, 16)), [8, 9]])
    prog = _program(tiny)
    sid = prog.open_sequence(a.prompt, GREEDY)
    prog.plan_saves(sid, [len(a.prompt) - 1])
    assert prog.reserve_units(sid, len(a.prompt)) and prog.prefill(sid, 64) is None
    (info,) = prog.published()
    assert info.media and info.media[0].digest == a.prompt.vision[0].digest
    prog.release(sid)
    assert prog.lease(info.id) is not None
    with pytest.raises(ProgramError, match="media"):
        prog.open_cached(b.prompt, GREEDY, info.id)
    prog.unlease(info.id)
    prog.retire(info.id)
    assert prog.usage().all_free and prog.cache_usage().empty
