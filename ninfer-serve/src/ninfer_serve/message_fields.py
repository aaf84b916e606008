"""Unknown keys inside chat messages are ignored, not refused.

Clients append the reply they got to the conversation and send it back: the OpenAI SDK's
``message.model_dump()`` carries every field of its own model, LiteLLM adds ``provider_specific_fields``,
other SDKs add their own. Refusing those would break every "append the reply and continue" loop, so inside a
message (its tool calls and content parts too) a key the schema does not know is dropped, and logged once per
key name at debug level. Unknown top-level request fields are still a 400: a misspelt parameter there would
otherwise be silently ignored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn

from ninfer.contract.values import JSON

log = logging.getLogger("ninfer_serve")

_logged: set[str] = set()
_logged_lock = threading.Lock()


def _note_ignored(cls: type, keys: Iterable[str]) -> None:
    for key in keys:
        name = f"{cls.__name__}.{key}"
        with _logged_lock:
            if name in _logged:
                continue
            _logged.add(name)
        log.debug("ignoring the unknown field %r inside chat messages (%s); it is logged once", key, cls.__name__)


def ignore_unknown_keys(conv: cattrs.Converter, classes: Iterable[type]) -> None:
    """Structure each attrs class of ``classes`` from a mapping with the keys it does not declare dropped."""
    for cls in classes:
        known = frozenset(f.name for f in attrs.fields(cls))
        structure = make_dict_structure_fn(cls, conv)

        def hook(value: JSON, _t: type, *, cls: type = cls, known: frozenset[str] = known,
                 structure: Callable[[JSON], object] = structure) -> object:
            if isinstance(value, dict):
                extra = value.keys() - known
                if extra:
                    _note_ignored(cls, sorted(extra))
                    value = {k: v for k, v in value.items() if k in known}
            return structure(value)

        conv.register_structure_hook(cls, hook)
