"""SessionHints: which checkpoint continues each session, ordered by request publication.

A session key (OpenAI ``prompt_cache_key``) names a conversation; its binding is a hint for the lookup,
never a second ledger. Every request carries a monotonic ``publication_order``: an older request that
finishes late never overwrites the binding a newer one left, even after that checkpoint is gone. A session
is named within its cache scope: ``(cache salt, key)``, so one key in two scopes names two sessions.
"""

from __future__ import annotations

from collections import OrderedDict

SessionName = tuple[str | None, str]  # (the request's cache salt, its session key)


class SessionHints:
    """Session name -> (publication order, checkpoint id or None); the least recently bound names go first."""

    def __init__(self, max_keys: int = 4096) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        self.max_keys = max_keys
        self._bindings: OrderedDict[SessionName, tuple[int, int | None]] = OrderedDict()
        self._keys_of: dict[int, set[SessionName]] = {}

    def __len__(self) -> int:
        return len(self._bindings)

    def bind(self, key: SessionName, order: int, checkpoint_id: int) -> bool:
        """Bind ``key`` to ``checkpoint_id`` unless a request of a higher order already bound it."""
        held = self._bindings.get(key)
        if held is not None:
            if held[0] > order:
                return False
            self._unlink(key, held[1])
        self._bindings[key] = (order, checkpoint_id)
        self._bindings.move_to_end(key)
        self._keys_of.setdefault(checkpoint_id, set()).add(key)
        while len(self._bindings) > self.max_keys:
            old_key, (_, old_id) = self._bindings.popitem(last=False)
            self._unlink(old_key, old_id)
        return True

    def get(self, key: SessionName) -> int | None:
        """The checkpoint bound to ``key``, or None."""
        held = self._bindings.get(key)
        return None if held is None else held[1]

    def is_bound(self, checkpoint_id: int) -> bool:
        """Whether some session's latest continuation is this checkpoint."""
        return checkpoint_id in self._keys_of

    def forget_checkpoint(self, checkpoint_id: int) -> None:
        """The checkpoint is gone: its sessions keep their order (late finishers stay refused) but no target."""
        for key in self._keys_of.pop(checkpoint_id, ()):
            self._bindings[key] = (self._bindings[key][0], None)

    def clear(self) -> None:
        self._bindings.clear()
        self._keys_of.clear()

    def _unlink(self, key: SessionName, checkpoint_id: int | None) -> None:
        if checkpoint_id is None:
            return
        keys = self._keys_of.get(checkpoint_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._keys_of[checkpoint_id]
