"""What the GDN decode kernels (``gdn``) and the verification kernel (``gdn_verify``) share: the value block."""

from __future__ import annotations

import triton

from ninfer.ops.triton import tuning


def default_block_v(batch: int, hv: int, dv: int, device: tuning.DeviceKey) -> int:
    """Value columns per program: narrow blocks put more programs in flight while there are few rows; from about
    ``wide_programs`` programs of wide blocks on, the wider block wins (the block_v sweeps in docs/kernels.md)."""
    c = tuning.choices("gdn", device)
    wide = c["wide_block_v"]
    return wide if batch * hv * triton.cdiv(dv, wide) >= c["wide_programs"] else c["narrow_block_v"]
