"""The device side of programmatic dependent launch: the steps a kernel launched with ``_pdl.pdl_args`` runs.

A kernel calls ``pdl_prologue(USE_PDL)`` before it reads or writes anything: it waits until the previous kernel
in the stream has completed and its writes are visible (``griddepcontrol.wait``), then lets its own successor
be scheduled (``griddepcontrol.launch_dependents``). With ``USE_PDL`` false both compile to nothing. Kept apart
from ``_pdl`` so that choosing PDL at model startup never imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr = True):
    """Wait for the previous kernel, then (unless ``LAUNCH_DEPENDENTS`` is false: the kernel triggers later
    with ``pdl_launch_dependents``) let the next one be scheduled."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if LAUNCH_DEPENDENTS:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel be scheduled (for a kernel whose prologue did not)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
