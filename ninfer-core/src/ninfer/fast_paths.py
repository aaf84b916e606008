"""The optional fast paths of a CUDA start, and whether each is there.

A fast path comes from a package that may be missing; without it a slower path gives the same results, so
its absence is easy to miss. This module is the one place that checks: ``ninfer env`` lists each fast path's
status, an engine starting on CUDA logs one line for each that is unavailable, and the ops ask
``fla_available`` before taking fla-core's GDN prefill. Light at import: a package is imported only when
its status is asked for.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
from typing import Literal

import attrs

from ninfer import env

log = logging.getLogger(__name__)

CUDA_INSTALL = "pip install 'ninfer-core[cuda]'"


@attrs.frozen(kw_only=True)
class FastPath:
    """What runs fast (``name``), the distribution and module it needs, and what runs without it."""

    name: str
    package: str
    module: str
    without: str
    install: str
    op: str | None = None  # the dispatch name (``module.name``) NINFER_OPS_OFF turns it off by; None: every op


TRITON = FastPath(name="Triton kernels", package="triton", module="triton", install="pip install triton",
                  without="ninfer's CUDA kernels cannot load (NINFER_OPS=torch runs the torch references)")
GDN_PREFILL = FastPath(name="GDN prefill", package="fla-core", module="fla.ops.gated_delta_rule",
                       op="gdn.gdn_prefill", install=CUDA_INSTALL,
                       without="the torch path runs instead, much slower on long prompts")
FAST_PATHS: tuple[FastPath, ...] = (TRITON, GDN_PREFILL)


@attrs.frozen
class FastPathStatus:
    """``state``: ``available`` (``detail`` names the version), ``missing`` (``detail`` says why) or ``off``
    (turned off by ``NINFER_OPS`` / ``NINFER_OPS_OFF``, named in ``detail``)."""

    path: FastPath
    state: Literal["available", "missing", "off"]
    detail: str

    def text(self) -> str:
        """The state for a person: when missing, why, what runs instead and how to install it."""
        if self.state == "missing":
            return f"{self.detail}; {self.path.without}; {self.path.install}"
        return self.detail

    def line(self) -> str:
        return f"{self.path.name}: {self.text()}"


@functools.cache
def _import_problem(module: str, package: str) -> str | None:
    """Why ``module`` cannot be used (None: it imports). The outcome does not change within a process."""
    if importlib.util.find_spec(module.partition(".")[0]) is None:
        return f"{package} is not installed"
    try:
        importlib.import_module(module)
    except Exception as exc:  # installed but broken (its own imports failing): as good as missing
        return f"{package} is installed but does not import ({type(exc).__name__}: {exc})"
    return None


def _turned_off(path: FastPath) -> str | None:
    """The setting that turns ``path`` off, if one does."""
    try:
        if env.get("NINFER_OPS") == "torch":
            return "off (NINFER_OPS=torch)"
        if path.op is not None and path.op in env.get("NINFER_OPS_OFF"):
            return f"off (NINFER_OPS_OFF names {path.op})"
    except env.EnvError:
        return None  # a malformed value is reported by whoever reads it for real (and by `ninfer env`)
    return None


def status(path: FastPath) -> FastPathStatus:
    off = _turned_off(path)
    if off is not None:
        return FastPathStatus(path, "off", off)
    problem = _import_problem(path.module, path.package)
    if problem is not None:
        return FastPathStatus(path, "missing", problem)
    try:
        version = importlib.metadata.version(path.package)
    except importlib.metadata.PackageNotFoundError:  # importable without metadata (a source checkout)
        version = "version unknown"
    return FastPathStatus(path, "available", f"available ({path.package} {version})")


def fla_available() -> bool:
    """Whether fla-core's chunked GDN kernels import (GDN prefill's fast path)."""
    return _import_problem(GDN_PREFILL.module, GDN_PREFILL.package) is None


def log_unavailable(device: str) -> list[FastPathStatus]:
    """At a start on ``device``: on CUDA, log one warning line per fast path that is missing; returns them."""
    if not str(device).startswith("cuda"):
        return []
    missing = [s for s in map(status, FAST_PATHS) if s.state == "missing"]
    for s in missing:
        log.warning("%s", s.line())
    return missing
