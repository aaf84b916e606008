"""A Hugging Face checkpoint directory: config.json and its safetensors tensors (sharded or single file).

Tensors are listed (name, dtype, shape, file) without reading their data; ``read`` returns one tensor
through safetensors' ``safe_open`` with its bytes unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

INDEX = "model.safetensors.index.json"

# safetensors dtype names -> artifact dtype names.
DTYPES = {"BOOL": "bool", "U8": "u8", "I8": "i8", "I16": "i16", "I32": "i32", "I64": "i64", "F16": "f16",
          "BF16": "bf16", "F32": "f32", "F64": "f64", "F8_E4M3": "f8_e4m3", "F8_E5M2": "f8_e5m2"}


class ConversionError(ValueError):
    """The source checkpoint cannot be converted; the message names the file, tensor or field."""


@attrs.frozen
class QuantSource:
    """Where a quantized source tensor's planes are and how they become the artifact's (``quantized.py``).

    ``scale_kind``: ``grid`` (already the format's scale plane, maybe bf16), ``row`` (one per output row) or
    ``tensor`` (one value, broadcast to every row). The global scale (nvfp4) is one value per tensor, a
    multiplier or, with ``global_divisor``, its reciprocal."""

    format: str
    block: tuple[int, int]
    data: str
    scale: str
    global_scale: str | None = None
    scale_kind: str = "grid"
    global_divisor: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return (self.data, self.scale) if self.global_scale is None else (self.data, self.scale, self.global_scale)


@attrs.frozen
class SourceTensor:
    name: str
    file: Path
    dtype: str  # artifact dtype name (a quantized tensor's: its data plane's)
    shape: tuple[int, ...]  # the logical shape (a quantized tensor's follows from its data plane)
    quant: QuantSource | None = None


@attrs.frozen
class PlannedTensor:
    """One logical parameter and the source tensors whose bytes, in order, make it (one, or a stacked group)."""

    feature: str
    dtype: str
    shape: tuple[int, ...]  # the logical shape
    parts: tuple[SourceTensor, ...]
    label: str  # how error messages name its source

    @classmethod
    def single(cls, feature: str, t: SourceTensor) -> PlannedTensor:
        return cls(feature, t.dtype, t.shape, (t,), repr(t.name))

    @property
    def stacked(self) -> bool:
        return len(self.parts) > 1

    @property
    def quant(self) -> QuantSource | None:
        """How the source stores it quantized (its parts agree: ``plan_stacked`` checks), or None."""
        return self.parts[0].quant


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversionError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{what} {path} is not valid JSON: {exc}") from None


class Checkpoint:
    """The tensors of one checkpoint directory; open shards are cached until ``close()``."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise ConversionError(f"checkpoint directory not found: {self.dir}")
        self.config = read_json(self.dir / "config.json", "config.json")
        if not isinstance(self.config, dict):
            raise ConversionError(f"{self.dir / 'config.json'} is not a JSON object")
        self._handles: dict[Path, Any] = {}
        self.tensors = self._list()

    def _open(self, file: Path):
        from safetensors import safe_open

        h = self._handles.get(file)
        if h is None:
            try:
                h = safe_open(str(file), framework="pt")
            except FileNotFoundError:
                raise ConversionError(f"shard not found: {file}") from None
            except Exception as exc:  # safetensors raises its own error type for a corrupt header
                raise ConversionError(f"cannot read safetensors file {file}: {exc}") from None
            self._handles[file] = h
        return h

    def _list(self) -> dict[str, SourceTensor]:
        index = self.dir / INDEX
        if index.exists():
            data = read_json(index, INDEX)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{index} has no weight_map")
            files = sorted({self.dir / f for f in weight_map.values()})
        else:
            weight_map = None
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ConversionError(f"no *.safetensors files (and no {INDEX}) in {self.dir}")
        tensors: dict[str, SourceTensor] = {}
        for file in files:
            h = self._open(file)
            for name in h.keys():
                if name in tensors:
                    raise ConversionError(f"tensor {name!r} appears in both {tensors[name].file.name} and {file.name}")
                sl = h.get_slice(name)
                dtype = DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise ConversionError(f"tensor {name!r} in {file.name} has unsupported dtype {sl.get_dtype()}")
                tensors[name] = SourceTensor(name, file, dtype, tuple(sl.get_shape()))
        if weight_map is not None:
            for name, fname in weight_map.items():
                t = tensors.get(name)
                if t is None or t.file.name != Path(fname).name:
                    raise ConversionError(f"{INDEX} places tensor {name!r} in {fname}, but that file does not hold it")
        return tensors

    def read(self, name: str):
        t = self.tensors[name]
        try:
            return self._open(t.file).get_tensor(name)
        except Exception as exc:
            raise ConversionError(f"cannot read tensor {name!r} from {t.file.name}: {exc}") from None

    def close(self) -> None:
        self._handles.clear()
