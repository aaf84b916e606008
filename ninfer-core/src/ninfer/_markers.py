"""pluggy markers for the ``ninfer`` plugin project."""

from collections.abc import Callable
from typing import Any, TypeVar

import pluggy

PROJECT = "ninfer"
ENTRY_POINT_GROUP = "ninfer"

_F = TypeVar("_F", bound=Callable[..., Any])

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl: Callable[[_F], _F] = pluggy.HookimplMarker(PROJECT)
