"""Aliases for values that are JSON by nature (a chat message, a tool's schema, a request body before it is
validated): the one place where a contract type is left open, because the value's shape is the caller's."""

from __future__ import annotations

from typing import Any

JSON = Any  # any JSON value (object, array, string, number, bool, null); its shape is checked where it is read
JSONObject = dict[str, JSON]
