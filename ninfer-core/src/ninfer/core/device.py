"""A small Device descriptor (cpu, or one CUDA ordinal) and dtype names used by the stores."""

from __future__ import annotations

from typing import Any, Literal

import attrs
import torch

_TORCH_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a contract dtype name (``"bfloat16"``), or the dtype itself."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_TORCH_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _TORCH_DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no contract name")


@attrs.frozen
class Device:
    """Where a Program's stores live: the CPU, or CUDA device ``index``."""

    type: Literal["cpu", "cuda"] = attrs.field(validator=attrs.validators.in_(("cpu", "cuda")))
    index: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    @classmethod
    def parse(cls, spec: Any = None) -> Device:
        """Accept None (cuda:0 when available, else cpu), "cpu", "cuda", "cuda:1", a torch.device or a Device."""
        if isinstance(spec, Device):
            return spec
        if spec is None:
            return cls("cuda", 0) if torch.cuda.is_available() else cls("cpu")
        try:
            d = torch.device(spec)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"invalid device {spec!r}: expected 'cpu', 'cuda' or 'cuda:N'") from exc
        if d.type == "cpu":
            return cls("cpu")
        if d.type != "cuda":
            raise ValueError(f"unsupported device type {d.type!r}; ninfer runs on 'cpu' or 'cuda'")
        index = 0 if d.index is None else d.index
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} requested but CUDA is not available")
        if index >= torch.cuda.device_count():
            raise ValueError(f"device cuda:{index} requested but only {torch.cuda.device_count()} CUDA devices exist")
        return cls("cuda", index)

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    @property
    def torch(self) -> torch.device:
        return torch.device("cpu") if self.type == "cpu" else torch.device("cuda", self.index)

    def __str__(self) -> str:
        return "cpu" if self.type == "cpu" else f"cuda:{self.index}"


def host_empty(shape: tuple[int, ...] | int, dtype: torch.dtype, device: Device) -> torch.Tensor:
    """Host memory for transfers to/from ``device``: pinned when the device is CUDA (async-capable copies)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.is_cuda)
