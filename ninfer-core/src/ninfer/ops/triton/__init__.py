"""Triton GPU paths of the ops in :mod:`ninfer.ops`.

Each module mirrors an op module (``norm``, ``activation``, ``rope``, ``conv1d``, ``gdn``, ``attention``,
``linear``, ``sampling``) and exposes functions with the same signatures as the public ops, plus an optional
``out=`` buffer so callers (CUDA graphs, the GPU tests' poisoned outputs) can own the output memory. Shared
pieces: ``ninfer.ops.launch`` (programmatic dependent launch and the arrival counters, per Program; no Triton
import), ``_pdl_jit`` (the prologue every kernel calls), ``tuning`` (the launch choices per device, from the
tables in ``tables/``; ``tune`` regenerates them), and the helpers two kernel modules share (``gdn_shared``,
``moe_shared``, ``moe_layout``). Importing this package does not import Triton; the op modules import the
kernels lazily, only for CUDA tensors.

Every kernel is CUDA-graph capturable: grids come from host ints that depend on shapes only, anything that
changes between steps (slots, sequence lengths, block tables) is read from device tensors, and tensors are
addressed through their actual strides, so slot views into larger state images work as they are.
"""
