"""Stored responses for ``previous_response_id``: bounded in count and bytes, least recently used out first.

A stored response keeps its whole conversation (every earlier turn's messages, its input, its output) and
the conversation's session key: the next turn sends that key to the engine as ``session_key``, so the context
cache restores the conversation's cached prefix instead of prefilling it again. The cache itself may have
evicted that prefix (the turn then prefills it, answering the same); a response evicted from this store is
gone: its id answers 404. Entries are scoped like the context cache (per API key when the server has several),
so one key cannot continue or read another's conversation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import attrs

from ninfer.contract.values import JSONObject
from ninfer_serve.schemas import ChatMessage

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 256 << 20


@attrs.frozen(kw_only=True)
class StoredResponse:
    messages: tuple[ChatMessage, ...]  # the conversation through this response's output, without instructions
    session_key: str
    body: JSONObject  # the response object, as answered
    size: int


class ResponseStore:
    """(key scope, response id) -> StoredResponse; at most ``max_responses`` entries and ``max_bytes`` in all
    (an entry larger than that is not kept)."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, scope: str | None, response_id: str, entry: StoredResponse) -> bool:
        """Keep ``entry``, evicting the least recently used as needed; False when it cannot be kept at all."""
        if entry.size > self.max_bytes or self.max_responses == 0:
            return False
        with self._lock:
            self._drop((scope, response_id))
            self._entries[(scope, response_id)] = entry
            self._bytes += entry.size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.size
        return True

    def get(self, scope: str | None, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get((scope, response_id))
            if entry is not None:
                self._entries.move_to_end((scope, response_id))
            return entry

    def delete(self, scope: str | None, response_id: str) -> bool:
        with self._lock:
            return self._drop((scope, response_id))

    def _drop(self, key: tuple[str | None, str]) -> bool:
        old = self._entries.pop(key, None)
        if old is None:
            return False
        self._bytes -= old.size
        return True
