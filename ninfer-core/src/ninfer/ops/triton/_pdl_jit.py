"""The device side of programmatic dependent launch: the step a kernel launched with ``launch.pdl_args`` runs.

A kernel calls ``pdl_prologue(USE_PDL)`` before it reads or writes anything: it waits until the previous kernel
in the stream has completed and its writes are visible (``griddepcontrol.wait``), then lets its own successor
be scheduled (``griddepcontrol.launch_dependents``). With ``USE_PDL`` false both compile to nothing. Kept apart
from ``ninfer.ops.launch`` so that choosing PDL at model startup never imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """Wait for the previous kernel, then let the next one be scheduled."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
