"""Request bodies as JSON: decoded, then checked for text that is not Unicode and for excessive nesting.

This runs on the event loop for every request, so its cost is what a large body makes every other client wait:
a body without a surrogate escape cannot hold a lone surrogate, so usually only the containers are walked (for
their depth); the full walk, which names the parameter at fault, runs only when a check fails.
"""

from __future__ import annotations

import json
import re

from ninfer.contract.values import JSON
from ninfer_serve.errors import bad_request

MAX_JSON_DEPTH = 64  # arrays/objects nested in a request body, the body itself counting as one
_SURROGATE = re.compile("[\ud800-\udfff]")  # valid pairs are joined by json.loads: what is left is lone
# What can decode to a surrogate: a \uD800-\uDFFF escape, or its UTF-8 form (json.loads passes it through)
_SURROGATE_SOURCE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def parse_json(raw: bytes) -> JSON:
    """Decode a request body: malformed JSON, non-Unicode text and excessive nesting answer 400."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep",
                          code="nesting_too_deep") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if _SURROGATE_SOURCE.search(raw) is not None or _deeper_than(body, MAX_JSON_DEPTH):
        check_json_values(body)
    return body


def _deeper_than(body: JSON, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` levels (containers only: no paths, no strings)."""
    level, depth = [body] if isinstance(body, dict | list) else [], 1
    while level:
        if depth > limit:
            return True
        below = []
        for value in level:
            for child in (value.values() if isinstance(value, dict) else value):
                if isinstance(child, dict | list):
                    below.append(child)
        level, depth = below, depth + 1
    return False


def _lone_surrogate(text: str) -> str | None:
    m = _SURROGATE.search(text)
    return None if m is None else f"\\u{ord(m.group()):04x}"


def check_json_values(body: JSON) -> None:
    """Refuse text that is not Unicode (lone surrogates, in keys or values) and nesting deeper than
    MAX_JSON_DEPTH, naming the parameter path; iterative, so no input can exhaust the stack."""
    stack: list[tuple[JSON, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            bad = _lone_surrogate(value)
            if bad is not None:
                raise bad_request(f"invalid value for '{path}': the string holds a lone surrogate ({bad}), "
                                  "which is not Unicode text", param=path or None, code="invalid_unicode")
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep (at '{path}')",
                              param=path or None, code="nesting_too_deep")
        if isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in reversed(list(enumerate(value))))
            continue
        children = []
        for key, v in value.items():
            bad = _lone_surrogate(key)
            if bad is not None:
                escaped = key.encode("utf-8", "backslashreplace").decode("ascii")
                name = f"{path}.{escaped}" if path else escaped
                raise bad_request(f"invalid parameter name '{name}': it holds a lone surrogate ({bad}), which is "
                                  "not Unicode text", param=name, code="invalid_unicode")
            children.append((v, f"{path}.{key}" if path else key, depth + 1))
        stack.extend(reversed(children))
