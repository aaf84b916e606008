"""Triton GPU paths of the ops in :mod:`ninfer.ops`.

Each module mirrors an op module (``norm``, ``activation``, ``rope``, ``conv1d``, ``gdn``, ``attention``,
``linear``, ``sampling``) and exposes functions with the same signatures as the public ops, plus an optional
``out=`` buffer so callers (CUDA graphs, the GPU tests' poisoned outputs) can own the output memory. Shared
pieces: ``_pdl`` (launching with programmatic dependent launch; no Triton import), ``_pdl_jit`` (its device
side, the prologue every kernel calls) and ``_arrivals`` (the last-arrival counters). Importing this package
does not import Triton; the op modules import these lazily, only for CUDA tensors.

Every kernel is CUDA-graph capturable: grids come from host ints that depend on shapes only, anything that
changes between steps (slots, sequence lengths, block tables) is read from device tensors, and tensors are
addressed through their actual strides, so slot views into larger state images work as they are.
"""
