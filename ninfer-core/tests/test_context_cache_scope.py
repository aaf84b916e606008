"""Cache scopes (``GenerationRequest.cache_salt``): a checkpoint saved under one salt is found only by lookups
with that salt; checkpoints without a salt are shared by every request without one. Sessions, save points,
``known`` and the retention's restore length all stay inside their scope, and a digest collision never
crosses scopes."""

from __future__ import annotations

import pytest

from ninfer.contract.context import CheckpointInfo, MediaRun
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import MAX_CACHE_SALT_CHARS, GenerationRequest
from ninfer.engine.context_cache import ResourceManager, prefix_index
from ninfer.engine.context_cache.prefix_index import PrefixIndex, scope_root
from ninfer.engine.context_cache.sessions import SessionHints

TOKENS = list(range(1, 40))
SALTS = [None, "alice", "bob"]


def ckpt(cid: int, n: int, media=()) -> CheckpointInfo:
    return CheckpointInfo(id=cid, generation=cid, tokens=tuple(TOKENS[:n]), kind="grid", on_device=True,
                          on_host=False, device_bytes=1, host_bytes=1, media=media)


@pytest.mark.parametrize("n", [2, 4, 13, 16])  # inside the first block, one block, a tail, whole blocks
@pytest.mark.parametrize("saved", SALTS)
def test_a_checkpoint_is_found_only_in_its_own_scope(saved, n):
    index = PrefixIndex(block=4)
    index.add(ckpt(1, n), salt=saved)
    for asked in SALTS:
        found = index.longest(TOKENS, 30, salt=asked)
        assert (found.id if found else None) == (1 if asked == saved else None), asked
        assert index.present(TOKENS, [n], salt=asked) == ({n} if asked == saved else set())
    assert index.salt(1) == saved
    index.remove(1)
    assert len(index) == 0 and index.longest(TOKENS, 30, salt=saved) is None


def test_media_identity_is_scoped_with_the_tokens():
    x = (MediaRun(start=2, length=4, digest="x" * 64),)
    index = PrefixIndex(block=4)
    index.add(ckpt(1, 9, media=x), salt="alice")
    assert index.longest(TOKENS, 20, media=x, salt="alice").id == 1
    assert index.longest(TOKENS, 20, media=x) is None
    assert index.longest(TOKENS, 20, media=x, salt="bob") is None


def test_each_scope_keeps_its_own_newest_copy_of_one_prefix():
    index = PrefixIndex(block=4)
    for cid, salt in enumerate(SALTS, start=1):
        index.add(ckpt(cid, 10), salt=salt)
    assert [index.longest(TOKENS, 20, salt=s).id for s in SALTS] == [1, 2, 3]
    index.remove(2)
    assert index.longest(TOKENS, 20, salt="alice") is None and index.longest(TOKENS, 20).id == 1


def test_a_digest_collision_never_crosses_scopes(monkeypatch):
    monkeypatch.setattr(prefix_index, "_digest", lambda prefix, data: b"\0" * prefix_index.DIGEST_BYTES)
    scope_root.cache_clear()
    try:
        index = PrefixIndex(block=4)
        index.add(ckpt(1, 10), salt="alice")
        assert index.longest(TOKENS, 20, salt="bob") is None and index.longest(TOKENS, 20) is None
        assert index.longest(TOKENS, 20, salt="alice").id == 1
    finally:
        scope_root.cache_clear()


def test_a_scope_cannot_change_and_roots_differ():
    index = PrefixIndex(block=4)
    index.add(ckpt(1, 10), salt="alice")
    index.add(ckpt(1, 10), salt="alice")  # a newer info of the same checkpoint
    with pytest.raises(ValueError, match="cache scope"):
        index.add(ckpt(1, 10), salt="bob")
    assert len({scope_root(None), scope_root(""), scope_root("a"), scope_root("b")}) == 4


class _Store:
    """Enough of a ContextStore for lookups, sessions and clear."""

    def __init__(self):
        self.retired = []
        self.pending = []

    def published(self):
        out, self.pending = self.pending, []
        return out

    def retire(self, checkpoint_id):
        self.retired.append(checkpoint_id)

    def checkpoint(self, checkpoint_id):
        raise AssertionError("not used")


def test_the_manager_scopes_lookups_save_points_and_known():
    rm = ResourceManager(_Store(), block=4, grid=8)
    rm.adopt([ckpt(1, 20)], salt="alice")
    assert rm.lookup(TOKENS[:30], salt="alice").id == 1
    assert rm.lookup(TOKENS[:30]) is None and rm.lookup(TOKENS[:30], salt="bob") is None
    assert rm.known(TOKENS[:20], salt="alice") and not rm.known(TOKENS[:20])
    # a prefix another scope holds is saved again in this one
    assert rm.save_points(TOKENS[:30], 0, salt="alice") == [8, 16, 24, 29]
    assert rm.save_points(TOKENS[:30], 0, [20], salt="alice") == [8, 16, 24, 29]
    for other in (None, "bob"):
        assert rm.save_points(TOKENS[:30], 0, [20], salt=other) == [8, 16, 20, 24, 29]


def test_sessions_are_named_within_their_scope():
    rm = ResourceManager(_Store(), block=4, grid=8)
    rm.bind_session("chat", 1, ckpt(1, 20), salt="alice")
    assert rm.lookup(TOKENS[:30], "chat", salt="alice").id == 1
    assert rm.lookup(TOKENS[:30], "chat") is None and rm.lookup(TOKENS[:30], "chat", salt="bob") is None
    rm.bind_session("chat", 2, ckpt(2, 12), salt="bob")  # the same key in another scope is another session
    assert rm.lookup(TOKENS[:30], "chat", salt="bob").id == 2
    assert rm.lookup(TOKENS[:30], "chat", salt="alice").id == 1
    hints = SessionHints()
    hints.bind(("alice", "k"), 5, 1)
    assert hints.bind(("bob", "k"), 1, 2)  # one scope's newer order does not refuse another scope's binding
    assert hints.get(("alice", "k")) == 1 and hints.get(("bob", "k")) == 2 and hints.get((None, "k")) is None


def test_unadopted_publications_are_retired_never_indexed():
    store = _Store()
    rm = ResourceManager(store, block=4, grid=8)
    rm.adopt([ckpt(1, 20)], salt="alice")
    store.pending = [ckpt(2, 10)]  # a unit failed before its saves were adopted
    rm.retire_unadopted()
    assert store.retired == [2] and [i.id for i in rm.checkpoints()] == [1]
    rm.clear()
    assert store.retired == [2, 1] and rm.checkpoints() == []


@pytest.mark.parametrize("salt,words", [
    ("", "non-empty"), (5, "non-empty string"),
    ("s" * (MAX_CACHE_SALT_CHARS + 1), f"at most {MAX_CACHE_SALT_CHARS}"),
])
def test_the_request_contract_validates_cache_salt(salt, words):
    with pytest.raises(ValueError, match=words):
        GenerationRequest(input=TextInput(text="x"), cache_salt=salt)
    longest = "s" * MAX_CACHE_SALT_CHARS
    assert GenerationRequest(input=TextInput(text="x"), cache_salt=longest).cache_salt == longest
