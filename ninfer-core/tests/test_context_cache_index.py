"""Context cache policy parts on their own: the prefix index, session hints, retention priorities."""

from __future__ import annotations

import hashlib

import pytest

from ninfer.contract.context import CheckpointInfo
from ninfer.engine.context_cache import prefix_index
from ninfer.engine.context_cache.prefix_index import PrefixIndex, token_bytes
from ninfer.engine.context_cache.retention import (
    CostModel,
    Recency,
    device_priority,
    host_priority,
    worth_host_replica,
)
from ninfer.engine.context_cache.sessions import SessionHints


def ckpt(cid: int, tokens, *, generation: int = 1, on_device: bool = True, on_host: bool = False,
         device_bytes: int = 1000, host_bytes: int = 1000) -> CheckpointInfo:
    return CheckpointInfo(id=cid, generation=generation, tokens=tuple(tokens), kind="prompt", on_device=on_device,
                          on_host=on_host, device_bytes=device_bytes, host_bytes=host_bytes)


# -- prefix index ------------------------------------------------------------------------------------------
def test_longest_returns_the_longest_exact_prefix_within_the_limit():
    index = PrefixIndex(block=4)
    prompt = list(range(100, 120))
    for cid, n in enumerate((3, 4, 8, 11, 16), start=1):
        index.add(ckpt(cid, prompt[:n]))
    index.add(ckpt(9, prompt[:10] + [7]))  # diverges at position 10
    assert index.longest(prompt, 19).length == 16
    assert index.longest(prompt, 15).length == 11
    assert index.longest(prompt, 11).length == 11
    assert index.longest(prompt, 10).length == 8
    assert index.longest(prompt, 3).length == 3
    assert index.longest(prompt, 2) is None
    assert index.longest([5] + prompt[1:], 19) is None


def test_an_identical_repeated_prompt_hits_its_prompt_end_checkpoint():
    # SGLang #21158: lookups are capped at len - 1, so the prompt-end checkpoint must sit at len - 1.
    index = PrefixIndex(block=4)
    prompt = list(range(1, 14))
    index.add(ckpt(1, prompt[:-1]))
    assert index.longest(prompt, len(prompt) - 1).id == 1
    short = list(range(1, 4))  # shorter than one block
    index.add(ckpt(2, short[:-1]))
    assert index.longest(short, len(short) - 1).id == 2


def test_a_digest_collision_never_gives_a_wrong_hit(monkeypatch):
    monkeypatch.setattr(prefix_index, "_digest", lambda prefix, data: b"\0" * prefix_index.DIGEST_BYTES)
    index = PrefixIndex(block=2)
    index.add(ckpt(1, [1, 2, 3, 4, 5]))
    index.add(ckpt(2, [9, 9, 9, 9, 9]))  # same lengths, so the same node and tail under the collision
    index.add(ckpt(3, [1, 2, 3]))
    assert index.longest([1, 2, 3, 4, 5, 6], 5).id == 1
    assert index.longest([9, 9, 9, 9, 9, 6], 5).id == 2
    assert index.longest([1, 2, 3, 4, 0, 6], 5).id == 3
    assert index.longest([7, 7, 7, 7, 7, 7], 5) is None
    assert index.present([1, 2, 3, 4, 5], [3, 5]) == {3, 5}
    assert index.present([9, 9, 9, 9, 0], [3, 5]) == set()


def test_lookup_walks_only_the_blocks_some_checkpoint_reaches(monkeypatch):
    index = PrefixIndex(block=8)
    for cid in range(1, 501):
        index.add(ckpt(cid, [cid] * 40))
    calls = []
    real = prefix_index._digest
    monkeypatch.setattr(prefix_index, "_digest", lambda p, d: calls.append(1) or real(p, d))
    assert index.longest([7] * 1000, 999).id == 7
    assert len(calls) <= 40 // 8 + 2  # the blocks of the one matching path, its tail, one miss beyond
    calls.clear()
    assert index.longest([0] * 1000, 999) is None
    assert len(calls) <= 2


def test_remove_forgets_a_checkpoint_and_identical_tokens_keep_the_newest():
    index = PrefixIndex(block=3)
    tokens = list(range(10))
    index.add(ckpt(1, tokens[:7]))
    index.add(ckpt(2, tokens[:7]))
    index.add(ckpt(3, tokens[:4]))
    assert index.longest(tokens, 9).id == 2
    assert index.longest(tokens, 9, exclude=2).id == 1
    assert index.remove(2).id == 2
    assert index.longest(tokens, 9).id == 1
    index.remove(1)
    assert index.longest(tokens, 9).id == 3
    index.remove(3)
    assert index.longest(tokens, 9) is None and len(index) == 0
    assert not index._ends and not index._through  # nothing left behind
    with pytest.raises(KeyError):
        index.remove(3)


def test_re_adding_a_known_id_updates_its_info_but_never_its_tokens():
    index = PrefixIndex(block=3)
    index.add(ckpt(1, [1, 2, 3, 4]))
    index.add(ckpt(1, [1, 2, 3, 4], generation=2, on_device=False, on_host=True))
    assert index.get(1).generation == 2 and len(index) == 1
    with pytest.raises(ValueError, match="changed its tokens"):
        index.add(ckpt(1, [1, 2, 3, 5]))


def test_digests_are_blake2b_over_int32_little_endian_token_ids():
    assert token_bytes([1, -1, 256]) == bytes([1, 0, 0, 0, 255, 255, 255, 255, 0, 1, 0, 0])
    expected = hashlib.blake2b(b"" + token_bytes([5, 6]), digest_size=16).digest()
    assert prefix_index._digest(b"", token_bytes([5, 6])) == expected
    with pytest.raises(ValueError, match="int32"):
        token_bytes([2**31])


def test_present_reports_the_lengths_already_covered():
    index = PrefixIndex(block=4)
    tokens = list(range(30))
    index.add(ckpt(1, tokens[:8]))
    index.add(ckpt(2, tokens[:13]))
    assert index.present(tokens, [4, 8, 12, 13, 29, 40]) == {8, 13}
    assert index.present([0] * 30, [8, 13]) == set()
    assert index.present(tokens, []) == set()


# -- session hints -----------------------------------------------------------------------------------------
def test_an_older_request_finishing_late_never_overwrites_a_newer_binding():
    hints = SessionHints()
    assert hints.bind("chat", 5, 50)
    assert not hints.bind("chat", 4, 40)
    assert hints.get("chat") == 50
    assert hints.bind("chat", 5, 51)  # the same request may rebind
    assert hints.bind("chat", 6, 60)
    assert hints.get("chat") == 60 and not hints.is_bound(50) and hints.is_bound(60)


def test_a_forgotten_checkpoint_keeps_its_sessions_order():
    hints = SessionHints()
    hints.bind("chat", 5, 50)
    hints.forget_checkpoint(50)
    assert hints.get("chat") is None and not hints.is_bound(50)
    assert not hints.bind("chat", 4, 40)  # still older than the forgotten binding
    assert hints.bind("chat", 7, 70) and hints.get("chat") == 70


def test_the_least_recently_bound_keys_go_beyond_the_cap():
    hints = SessionHints(max_keys=2)
    hints.bind("a", 1, 10)
    hints.bind("b", 2, 20)
    hints.bind("a", 3, 11)  # rebinding refreshes "a"
    hints.bind("c", 4, 30)
    assert (hints.get("a"), hints.get("b"), hints.get("c")) == (11, None, 30)
    assert len(hints) == 2 and not hints.is_bound(20) and not hints.is_bound(10)
    with pytest.raises(ValueError):
        SessionHints(max_keys=0)


# -- retention ---------------------------------------------------------------------------------------------
COST = CostModel()


def test_a_host_replicated_device_copy_costs_less_to_lose_than_a_sole_one():
    sole = ckpt(1, range(1000))
    replicated = ckpt(2, range(1000), on_host=True)
    p_sole = device_priority(sole, prefix_length=0, age=0, session_bound=False, cost=COST)
    p_replicated = device_priority(replicated, prefix_length=0, age=0, session_bound=False, cost=COST)
    assert p_replicated < p_sole


def test_loss_counts_only_the_suffix_beyond_the_next_checkpoint_per_byte():
    long_unique = ckpt(1, range(1000), device_bytes=1000)
    short_unique = ckpt(2, range(1000), device_bytes=1000)
    # Same size; the first has 900 tokens nobody else covers, the second only 10.
    assert device_priority(long_unique, prefix_length=100, age=0, session_bound=False, cost=COST) > \
        device_priority(short_unique, prefix_length=990, age=0, session_bound=False, cost=COST)
    big = ckpt(3, range(1000), device_bytes=100_000)
    assert device_priority(big, prefix_length=100, age=0, session_bound=False, cost=COST) < \
        device_priority(long_unique, prefix_length=100, age=0, session_bound=False, cost=COST)


def test_age_lowers_and_a_session_binding_doubles_priority():
    c = ckpt(1, range(100))
    fresh = device_priority(c, prefix_length=0, age=0, session_bound=False, cost=COST)
    old = device_priority(c, prefix_length=0, age=64, session_bound=False, cost=COST)
    bound = device_priority(c, prefix_length=0, age=0, session_bound=True, cost=COST)
    assert old == pytest.approx(fresh / 2) and bound == pytest.approx(fresh * 2)
    clock = Recency()
    clock.use(1)
    clock.tick()
    clock.tick()
    assert clock.age(1) == 2


def test_host_priority_and_replica_worth():
    host_only = ckpt(1, range(1000), on_device=False, on_host=True, host_bytes=1000)
    both = ckpt(1, range(1000), on_host=True, host_bytes=1000)
    assert host_priority(both, prefix_length=0, age=0, session_bound=False, cost=COST) < \
        host_priority(host_only, prefix_length=0, age=0, session_bound=False, cost=COST)
    assert worth_host_replica(host_only, prefix_length=0, cost=COST)
    tiny_gain = ckpt(2, range(1000), host_bytes=10**9)  # 1 token to recompute vs a 1 GB copy
    assert not worth_host_replica(tiny_gain, prefix_length=999, cost=COST)


def test_cost_model_rejects_non_positive_figures():
    with pytest.raises(ValueError, match="recompute_s_per_token"):
        CostModel(recompute_s_per_token=0.0)
    with pytest.raises(ValueError, match="horizon"):
        CostModel(horizon=-1.0)
