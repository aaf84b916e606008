"""Published quantized checkpoints, imported as stored (no re-quantization): which scheme a checkpoint uses, which
tensors are a quantized weight's data and scales, and how those become the artifact's planes.

Schemes (the artifact's formats are ``ninfer.contract.quant``'s):

- Qwen fine-grained FP8 (``quant_method: fp8``): ``X.weight`` f8_e4m3 + ``X.weight_scale_inv`` (a multiplier per
  ``weight_block_size`` block, f32 or bf16); a stored expert bank ``B`` has ``B_scale_inv``.
- compressed-tensors ``float-quantized``: ``X.weight`` f8_e4m3 + ``X.weight_scale`` (a multiplier per block,
  group, channel or tensor).
- compressed-tensors ``nvfp4-pack-quantized``: ``X.weight_packed`` u8 + ``X.weight_scale`` e4m3 +
  ``X.weight_global_scale`` f32, a *divisor*.
- ModelOpt NVFP4 (``hf_quant_config.json`` or ``quant_method: modelopt``): ``X.weight`` u8 + ``X.weight_scale``
  e4m3 + ``X.weight_scale_2`` f32, a multiplier.

Activation scales (``input_scale``, ``input_global_scale``) and KV-cache scales are not used: ninfer quantizes
activations dynamically per token (A8) or not at all (Hopper runs NVFP4 weight-only), so they are skipped (a
static activation scheme is imported that way, with a note in the artifact's ``metadata.quantization``).

The stored dtypes decide what is quantized; the config's module lists are checked where they name a module
exactly (a glob or ``re:`` entry may be broader than the release's own choice, so it is not held against it).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ninfer.contract.quant import FP8_BLOCK, NVFP4, NVFP4_GROUP
from ninfer_convert.source import ConversionError, QuantSource, SourceTensor, read_json

HF_QUANT_CONFIG = "hf_quant_config.json"
# Calibration scales for static activation or KV-cache quantization: unused (see the module doc).
UNUSED_SUFFIXES = (".input_scale", ".input_global_scale", ".k_scale", ".v_scale")
_SCALE_DTYPES = {"f32", "bf16", "f16"}  # FP8 scales: widened to f32 exactly


@attrs.frozen(kw_only=True)
class WeightArgs:
    """One FP8 weight layout: ``strategy`` block / group / channel / tensor, with its block or group size."""

    strategy: str
    block: tuple[int, int] = (1, 1)  # block: (b0, b1); group: (1, group size)
    targets: tuple[str, ...] = ("Linear",)


@attrs.frozen(kw_only=True)
class Scheme:
    method: str  # how the artifact's metadata names it
    format: str
    data_dtype: str
    packed_suffix: str  # the data tensor's suffix beyond the logical name ("_packed" for compressed-tensors NVFP4)
    scale_suffix: str
    global_suffix: str | None = None
    global_divisor: bool = False
    groups: tuple[WeightArgs, ...] = ()
    skip: tuple[str, ...] = ()  # modules the config says are not quantized
    skip_field: str = ""
    notes: tuple[str, ...] = ()

    def skips(self, module: str) -> bool:
        return any(module_matches(p, module) for p in self.skip if not _is_pattern(p))

    def args_for(self, module: str) -> WeightArgs:
        named = [g for g in self.groups if any(t != "Linear" and module_matches(t, module) for t in g.targets)]
        return (named or list(self.groups))[0]


def _is_pattern(entry: str) -> bool:
    return entry.startswith("re:") or any(c in entry for c in "*?[")


def module_matches(pattern: str, module: str) -> bool:
    """A module list entry: ``re:REGEX`` (compressed-tensors), a glob (ModelOpt), or a module name or any dotted
    tail or head of one (``lm_head``, ``model.visual``)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(module, pattern)
    return module == pattern or module.endswith("." + pattern) or module.startswith(pattern + ".")


def _names(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConversionError(f"{where} must be a list of module names, got {value!r}")
    return tuple(value)


def read_scheme(src: Path, config: Mapping[str, Any]) -> Scheme | None:
    """The checkpoint's quantization scheme, or None for an unquantized one; refuses schemes ninfer cannot
    import, naming the field."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    modelopt_file = src / HF_QUANT_CONFIG
    if qc is None and modelopt_file.exists():
        quant = read_json(modelopt_file, HF_QUANT_CONFIG).get("quantization")
        return _modelopt(quant, f"{HF_QUANT_CONFIG} quantization")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConversionError(f"config.json quantization_config is not an object: {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _qwen_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "modelopt":
        return _modelopt(qc.get("quantization", qc), "config.json quantization_config")
    raise ConversionError(f"config.json quantization_config.quant_method {method!r} is not supported: ninfer "
                          f"imports fp8 (Qwen fine-grained FP8), compressed-tensors FP8 / NVFP4 and modelopt NVFP4")


def _qwen_fp8(qc: dict) -> Scheme:
    where = "config.json quantization_config"
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConversionError(f"{where}.fmt {qc.get('fmt')!r} is not supported (only e4m3)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ConversionError(f"{where}.activation_scheme {qc.get('activation_scheme')!r} is not supported: ninfer "
                              f"quantizes activations dynamically (activation_scheme 'dynamic')")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConversionError(f"{where}.weight_block_size must be two positive sizes such as [128, 128], got "
                              f"{block!r}")
    return Scheme(method="fp8 (fine-grained, config.json quantization_config)", format=FP8_BLOCK,
                  data_dtype="f8_e4m3", packed_suffix="", scale_suffix="_scale_inv",
                  groups=(WeightArgs(strategy="block", block=tuple(block)),),
                  skip=_names(qc.get("modules_to_not_convert"), f"{where}.modules_to_not_convert"),
                  skip_field="modules_to_not_convert")


def _compressed_tensors(qc: dict) -> Scheme:
    where = "config.json quantization_config"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConversionError(f"{where}.config_groups is missing or empty")
    formats = {g.get("format") or qc.get("format") for g in groups.values() if isinstance(g, dict)}
    if len(formats) != 1 or not formats <= {"float-quantized", "nvfp4-pack-quantized"}:
        raise ConversionError(f"{where}.format {sorted(map(str, formats))} is not supported: ninfer imports "
                              f"compressed-tensors 'float-quantized' (FP8) or 'nvfp4-pack-quantized'")
    fmt = formats.pop()
    args, static = [], False
    for name, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        at = f"{where}.config_groups.{name}.weights"
        if not isinstance(w, dict):
            raise ConversionError(f"{at} is missing")
        if w.get("type") != "float" or w.get("symmetric", True) is not True or w.get("dynamic", False):
            raise ConversionError(f"{at} (type {w.get('type')!r}, symmetric {w.get('symmetric')!r}, dynamic "
                                  f"{w.get('dynamic')!r}) is not supported: only symmetric static float weights")
        targets = _names(g.get("targets", ["Linear"]), f"{where}.config_groups.{name}.targets")
        inputs = g.get("input_activations")
        static = static or (isinstance(inputs, dict) and inputs.get("dynamic") is False)
        strategy = w.get("strategy")
        if fmt == "nvfp4-pack-quantized":
            if w.get("num_bits") != 4 or strategy != "tensor_group" or w.get("group_size") != NVFP4_GROUP:
                raise ConversionError(f"{at}: NVFP4 needs num_bits 4, strategy 'tensor_group', group_size "
                                      f"{NVFP4_GROUP}; got {w.get('num_bits')}, {strategy!r}, {w.get('group_size')}")
            continue
        if w.get("num_bits") != 8:
            raise ConversionError(f"{at}.num_bits {w.get('num_bits')!r}: only 8-bit float weights are supported")
        if strategy == "block":
            block = w.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise ConversionError(f"{at}.block_structure must be two positive sizes, got {block!r}")
            args.append(WeightArgs(strategy="block", block=tuple(block), targets=targets))
        elif strategy == "group" and isinstance(w.get("group_size"), int) and w["group_size"] > 0:
            args.append(WeightArgs(strategy="group", block=(1, w["group_size"]), targets=targets))
        elif strategy in ("channel", "tensor"):
            args.append(WeightArgs(strategy=strategy, targets=targets))
        else:
            raise ConversionError(f"{at}.strategy {strategy!r} is not supported (block, group, channel, tensor)")
    skip = _names(qc.get("ignore"), f"{where}.ignore")
    notes = (f"{where} quantizes activations statically; their calibrated scales are not used (activations are "
             f"quantized per token at run time, or not at all)",) if static else ()
    if fmt == "nvfp4-pack-quantized":
        return Scheme(method="compressed-tensors nvfp4-pack-quantized", format=NVFP4, data_dtype="u8",
                      packed_suffix="_packed", scale_suffix="_scale", global_suffix="_global_scale",
                      global_divisor=True, skip=skip, skip_field="ignore", notes=notes)
    return Scheme(method="compressed-tensors float-quantized (FP8)", format=FP8_BLOCK, data_dtype="f8_e4m3",
                  packed_suffix="", scale_suffix="_scale", groups=tuple(args), skip=skip, skip_field="ignore",
                  notes=notes)


def _modelopt(quant: Any, where: str) -> Scheme:
    if not isinstance(quant, dict):
        raise ConversionError(f"{where} is missing or not an object")
    algo = quant.get("quant_algo")
    if algo != "NVFP4":
        raise ConversionError(f"{where}.quant_algo {algo!r} is not supported: ninfer imports ModelOpt 'NVFP4'")
    if quant.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
        raise ConversionError(f"{where}.group_size {quant.get('group_size')!r}: NVFP4 groups are {NVFP4_GROUP} wide")
    return Scheme(method="modelopt NVFP4", format=NVFP4, data_dtype="u8", packed_suffix="", scale_suffix="_scale",
                  global_suffix="_scale_2", skip=_names(quant.get("exclude_modules"), f"{where}.exclude_modules"),
                  skip_field="exclude_modules")


def present(tensors: Mapping[str, SourceTensor], scheme: Scheme | None) -> tuple[dict[str, SourceTensor], list[str]]:
    """The checkpoint as the source mapping sees it: each quantized weight one tensor under its logical name
    (``X.weight``, or an expert bank's name) with its logical shape and its planes attached; scales consumed.
    Returns (tensors, unused activation / KV-cache scale names)."""
    if scheme is None:
        return dict(tensors), []
    unused = [n for n in tensors if n.endswith(UNUSED_SUFFIXES)]
    consumed = set(unused)
    out: dict[str, SourceTensor] = {}
    for name, t in tensors.items():
        if t.dtype != scheme.data_dtype or name in consumed or not name.endswith(scheme.packed_suffix):
            continue
        base = name[:len(name) - len(scheme.packed_suffix)]
        q = _quant_source(tensors, scheme, name, base)
        consumed.update(q.names)
        out[base] = SourceTensor(base, t.file, t.dtype, _logical_shape(scheme.format, t.shape), quant=q)
    suffixes = tuple(s for s in (scheme.scale_suffix, scheme.global_suffix) if s)
    for name, t in tensors.items():
        if name in consumed:
            continue
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        if suffix is not None:
            owner = name[:-len(suffix)] + scheme.packed_suffix
            found = tensors.get(owner)
            state = "not in the checkpoint" if found is None else f"stored as {found.dtype}, not quantized"
            raise ConversionError(f"tensor {name!r} is a {scheme.method} scale but its weight {owner!r} is {state}")
        if t.dtype in ("f8_e4m3", "f8_e5m2"):
            raise ConversionError(f"tensor {name!r} is {t.dtype} but {scheme.method} gives it no scale: expected a "
                                  f"{scheme.data_dtype} weight with its '{scheme.scale_suffix}' scale")
        out[name] = t
    return out, unused


def _module(base: str) -> str:
    return base[:-len(".weight")] if base.endswith(".weight") else base


def _logical_shape(format: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-1], shape[-1] * 2) if format == NVFP4 else tuple(shape)


def _quant_source(tensors: Mapping[str, SourceTensor], scheme: Scheme, name: str, base: str) -> QuantSource:
    """Checks a quantized weight's companions (present, dtype, shape) and says how to read them."""
    data = tensors[name]
    if scheme.skips(_module(base)):
        raise ConversionError(f"tensor {name!r} is stored as {data.dtype} but its module is in the config's "
                              f"{scheme.skip_field} list (not quantized)")
    if len(data.shape) not in (2, 3):
        raise ConversionError(f"tensor {name!r} is {data.dtype}{list(data.shape)}: a quantized weight is [out, in] "
                              f"or a bank [experts, out, in]")
    *lead, n, k = _logical_shape(scheme.format, data.shape)
    lead = tuple(lead)
    scale_name = base + scheme.scale_suffix
    if scheme.format == NVFP4:
        if k % NVFP4_GROUP:
            raise ConversionError(f"tensor {name!r} holds {k} inputs per row, not a multiple of {NVFP4_GROUP}")
        _companion(tensors, scale_name, name, {"f8_e4m3"}, [(*lead, n, k // NVFP4_GROUP)])
        global_name = base + scheme.global_suffix
        _companion(tensors, global_name, name, {"f32"}, [(), (1,), lead, (*lead, 1)])
        return QuantSource(format=NVFP4, block=(1, NVFP4_GROUP), data=name, scale=scale_name,
                           global_scale=global_name, scale_kind="grid", global_divisor=scheme.global_divisor)
    args = scheme.args_for(_module(base))
    if args.strategy in ("block", "group"):
        b0, b1 = args.block
        _companion(tensors, scale_name, name, _SCALE_DTYPES, [(*lead, math.ceil(n / b0), math.ceil(k / b1))])
        return QuantSource(format=FP8_BLOCK, block=(b0, b1), data=name, scale=scale_name)
    if args.strategy == "channel":
        _companion(tensors, scale_name, name, _SCALE_DTYPES, [(*lead, n, 1), (*lead, n)])
        return QuantSource(format=FP8_BLOCK, block=(1, k), data=name, scale=scale_name, scale_kind="row")
    _companion(tensors, scale_name, name, _SCALE_DTYPES, [(), (1,), lead, (*lead, 1)])
    return QuantSource(format=FP8_BLOCK, block=(1, k), data=name, scale=scale_name, scale_kind="tensor")


def _companion(tensors: Mapping[str, SourceTensor], name: str, weight: str, dtypes: set[str],
               shapes: list[tuple[int, ...]]) -> None:
    t = tensors.get(name)
    want = f"{' or '.join(sorted(dtypes))} {' or '.join(str(list(s)) for s in dict.fromkeys(shapes))}"
    if t is None:
        raise ConversionError(f"tensor {weight!r} is quantized but its scale {name!r} is missing (expected {want})")
    if t.dtype not in dtypes or t.shape not in shapes:
        raise ConversionError(f"scale {name!r} of {weight!r} is {t.dtype}{list(t.shape)}; expected {want}")


def read_plane(read, t: SourceTensor, plane: str) -> Any:
    """One artifact plane (``data``, ``scale``, ``global_scale``) of a quantized source tensor; ``read(name)``
    gives a source tensor. Data and NVFP4 block scales are the stored bytes; FP8 scales are widened to f32 (exact)
    and broadcast per row; the NVFP4 global scale becomes one value per row."""
    q = t.quant
    *lead, n, _ = t.shape
    if plane == "data":
        return read(q.data)
    if plane == "scale":
        scale = read(q.scale)
        if q.format == NVFP4:
            return scale
        scale = scale.float()
        return scale if q.scale_kind == "grid" else scale.reshape(*lead, -1, 1).expand(*lead, n, 1).contiguous()
    g = read(q.global_scale).double()
    if q.global_divisor:
        if bool((g == 0).any()):
            raise ConversionError(f"global scale {q.global_scale!r} is zero: compressed-tensors stores a divisor")
        g = 1.0 / g  # compressed-tensors stores the divisor: inverted in float64, then rounded to f32 once
    return g.float().reshape(*lead, 1).expand(*lead, n).contiguous()
