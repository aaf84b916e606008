"""The context cache's identity of media placeholder tokens: the prefix index and the ResourceManager mix each
placeholder's item digest and row into the prefix, so the same image at the same place hits and a different image
(same size, same token ids) never does; a prefix that ends before the image is shared by both."""

from __future__ import annotations

import pytest

from ninfer.contract.context import CheckpointInfo, MediaRun, clip_runs, media_runs
from ninfer.contract.prompt import MediaSpan, PreparedPrompt, VisionItem
from ninfer.engine.context_cache import ResourceManager, prefix_index
from ninfer.engine.context_cache.prefix_index import PrefixIndex, common_prefix

PAD = 9
# 3 text tokens, 6 placeholders (positions 3..8), 5 text tokens: 14 tokens, blocks of 4 cut the run
TOKENS = [1, 2, 3, *[PAD] * 6, 4, 5, 6, 7, 8]
X = (MediaRun(start=3, length=6, digest="x" * 64),)
Y = (MediaRun(start=3, length=6, digest="y" * 64),)


def ckpt(cid: int, n: int, media=X) -> CheckpointInfo:
    return CheckpointInfo(id=cid, generation=1, tokens=tuple(TOKENS[:n]), kind="grid", on_device=True,
                          on_host=False, device_bytes=1, host_bytes=1, media=clip_runs(media, n))


@pytest.mark.parametrize("n", [5, 8, 9, 13])  # inside the image, at its last placeholder, after it, prompt end
def test_same_image_hits_and_a_different_image_never_does(n):
    index = PrefixIndex(block=4)
    index.add(ckpt(1, n))
    assert index.longest(TOKENS, 13, media=X).id == 1
    assert index.longest(TOKENS, 13, media=Y) is None
    assert index.present(TOKENS, [n], media=X) == {n} and index.present(TOKENS, [n], media=Y) == set()
    # the same run taking other rows of the same item (a different frame group) is another identity too
    shifted = (MediaRun(start=3, length=6, digest="x" * 64, offset=6),)
    assert index.longest(TOKENS, 13, media=shifted) is None


def test_a_prefix_before_the_image_serves_every_image():
    index = PrefixIndex(block=4)
    index.add(ckpt(1, 3))
    index.add(ckpt(2, 9, media=X))
    assert index.longest(TOKENS, 13, media=X).id == 2
    assert index.longest(TOKENS, 13, media=Y).id == 1
    assert index.longest(TOKENS, 13).id == 1  # text-only query with the same ids: the placeholders are not X


def test_the_run_check_holds_under_a_digest_collision(monkeypatch):
    monkeypatch.setattr(prefix_index, "_digest", lambda prefix, data: b"\0" * prefix_index.DIGEST_BYTES)
    index = PrefixIndex(block=4)
    index.add(ckpt(1, 13, media=X))
    assert index.longest(TOKENS, 13, media=Y) is None
    assert index.longest(TOKENS, 13, media=X).id == 1


class _Store:
    """Enough of a ContextStore for lookups (no evictions here)."""

    def checkpoint(self, checkpoint_id):
        raise AssertionError("not used")


def test_manager_lookups_sessions_and_save_points():
    rm = ResourceManager(_Store(), block=4, grid=4)
    rm.adopt([ckpt(1, 13, media=X)])
    assert rm.lookup(TOKENS + [3], media=X).id == 1
    assert rm.lookup(TOKENS + [3], media=Y) is None
    rm.bind_session("chat", 1, ckpt(2, 13, media=X))
    assert rm.lookup(TOKENS + [3], "chat", media=Y) is None  # a session's hint with another image never hits
    assert rm.known(TOKENS[:13], media=X) and not rm.known(TOKENS[:13], media=Y)
    assert rm.save_points(TOKENS, 0, media=X) == [4, 8, 12] and rm.save_points(TOKENS, 0, media=Y) == [4, 8, 12, 13]


def test_runs_of_a_prompt_and_common_prefixes():
    items = (VisionItem(kind="image", pixel_values=None, grid_thw=(1, 4, 6), digest="x" * 64),)
    prompt = PreparedPrompt(token_ids=TOKENS, vision=items,
                            media_spans=[MediaSpan(item_index=0, start=3, length=6, grid_thw=(1, 4, 6))])
    assert media_runs(prompt) == X
    assert clip_runs(X, 5) == (MediaRun(start=3, length=2, digest="x" * 64),) and clip_runs(X, 3) == ()
    assert common_prefix(TOKENS, X, TOKENS, X) == len(TOKENS)
    assert common_prefix(TOKENS, X, TOKENS, Y) == 3  # where the images differ
    assert common_prefix(TOKENS, X, TOKENS[:7], X) == 7
    assert common_prefix(TOKENS, (), [1, 2, 5], ()) == 2


@pytest.mark.parametrize("block", [1, 3, 4, 16])
def test_longest_agrees_with_a_brute_force_search(block):
    """Checkpoints of every length with either image; every query length and image: the index finds exactly the
    longest checkpoint whose tokens and runs equal the query's prefix."""
    index, infos = PrefixIndex(block=block), []
    for n in range(1, 14):
        for j, media in enumerate((X, Y)):
            if (n + j) % 3:  # leave some out, so misses happen too
                info = ckpt(2 * n + j, n, media)
                index.add(info)
                infos.append(info)
    for media in (X, Y, ()):
        for limit in range(0, 14):
            want = max((i for i in reversed(infos) if i.length <= limit and i.media == clip_runs(media, i.length)),
                       key=lambda i: i.length, default=None)  # of identical ones, the newest
            got = index.longest(TOKENS, limit, media=media)
            assert (got.id if got else None) == (want.id if want else None), (media, limit)
