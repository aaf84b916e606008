"""Convert a Hugging Face checkpoint directory into a .ninfer v3 artifact (value-preserving import).

The architecture plugin (``ArchitectureSpec.source_mapping``) names every source tensor, says which
parameters the config implies (shapes are checked), which ones a checkpoint stores split into several tensors
(stacked sources, e.g. per-expert MoE weights) and which ones are stored fused. Bytes are copied unchanged
(bf16 stays bf16); a stacked parameter is its parts' bytes in order; a fused parent is one physical object whose
members are row-range Bindings. A published quantized checkpoint's weights keep their bytes too (``quantized``:
data and scales become the artifact's planes); ``quantize=`` quantizes a float checkpoint's linears instead.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import attrs

from ninfer.artifact.format import (
    RESOURCE_FEATURE,
    ArtifactHeader,
    Binding,
    FrontendSection,
    Metadata,
    PhysicalObject,
    Use,
)
from ninfer.artifact.mapping import SourceMapping, missing_members
from ninfer.artifact.writer import ArtifactWriter
from ninfer.plugins import PluginHost, UnknownArchitecture, default_host
from ninfer_convert import __version__
from ninfer_convert.frontend import read_frontend
from ninfer_convert.objects import add_parent, fuse_problem, fuse_runs, run_name
from ninfer_convert.progress import ProgressLine
from ninfer_convert.quantize import plan_quantize
from ninfer_convert.quantized import Scheme, present, read_scheme
from ninfer_convert.source import Checkpoint, ConversionError, PlannedTensor, SourceTensor
from ninfer_convert.stacking import plan_stacked

_FEATURE_ORDER = ("text", "mtp", "dflash", "vision")


@attrs.frozen(kw_only=True)
class ConversionSummary:
    out: Path
    name: str
    architecture: str
    features: tuple[str, ...]
    tensors: int
    objects: int
    bindings: int
    bytes_by_feature: dict[str, int]
    skipped: tuple[str, ...]
    notes: tuple[str, ...]
    seconds: float

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_feature.values())

    @property
    def gb_per_s(self) -> float:
        return self.total_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def format(self) -> str:
        lines = [f"wrote {self.out} ({self.total_bytes / 1e9:.3f} GB in {self.seconds:.2f} s, "
                 f"{self.gb_per_s:.2f} GB/s)",
                 f"  name {self.name!r}, architecture {self.architecture}, features {', '.join(self.features)}",
                 f"  {self.tensors} source tensors -> {self.objects} objects, {self.bindings} bindings"]
        for f, n in sorted(self.bytes_by_feature.items()):
            lines.append(f"  {f:<9} {n / 1e6:12.3f} MB")
        if self.skipped:
            lines.append(f"  skipped {len(self.skipped)} tensors the model does not use, e.g. {self.skipped[0]}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _mapping_for(config: dict, host: PluginHost) -> tuple[str, SourceMapping]:
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConversionError("config.json has no 'architectures' list naming the model class")
    try:
        spec = host.architecture(archs[0]).spec
    except UnknownArchitecture as exc:
        raise ConversionError(f"unknown architecture: {exc}") from None
    if spec.source_mapping is None:
        raise ConversionError(f"architecture {spec.name!r} ({archs[0]}) provides no source mapping for the converter")
    try:
        mapping = spec.load("source_mapping")(config)
    except ValueError as exc:
        raise ConversionError(f"config.json: {exc}") from None
    if not isinstance(mapping, SourceMapping):
        lacks = missing_members(mapping)
        raise ConversionError(f"architecture {spec.name!r}: its source mapping {type(mapping).__name__} lacks "
                              f"{lacks} of ninfer.artifact.mapping.SourceMapping")
    return archs[0], mapping


def _plan_tensors(ckpt: Checkpoint, tensors: dict[str, SourceTensor], mapping: SourceMapping
                  ) -> tuple[dict[str, PlannedTensor], list[str], list[str]]:
    """logical name -> its planned source; skipped source names; notes. Validates names and shapes (a quantized
    tensor's shape is its logical one)."""
    try:
        groups = mapping.stacked_sources(tuple(tensors))
    except ValueError as exc:  # a group the config cannot shape (StackedSource checks its own geometry)
        raise ConversionError(f"config.json: {exc}") from None
    logical = plan_stacked(tensors, groups)
    consumed = {p.name for t in logical.values() for p in t.parts}
    skipped: list[str] = []
    for name, t in tensors.items():
        if name in consumed:
            continue
        mapped = mapping.canonical_name(name)
        if mapped is None:
            skipped.append(name)
            continue
        feature, lname = mapped
        if lname in logical:
            mixed = (": the checkpoint holds both the whole tensor and its parts" if logical[lname].stacked else "")
            raise ConversionError(f"tensors {logical[lname].label} and {name!r} both map to {lname!r}{mixed}")
        logical[lname] = PlannedTensor.single(feature, t)
    present = {t.feature for t in logical.values()}
    configured = set(mapping.configured_features())
    notes: list[str] = []
    if "text" not in present:
        raise ConversionError(f"no text weights found in {ckpt.dir} (expected names like model.layers.* or "
                              f"model.language_model.*)")
    for feature in sorted(present - configured):
        example = next(t.label for t in logical.values() if t.feature == feature)
        raise ConversionError(f"the checkpoint has {feature} tensors (e.g. {example}) but config.json does not "
                              f"configure {feature}: the config disagrees with the weights")
    for feature in sorted(configured - present):
        notes.append(f"config.json configures {feature} but the checkpoint has no {feature} tensors; "
                     f"stored without {feature}")
    for feature in mapping.validated_features:
        if feature not in present:
            continue
        expected = mapping.expected_parameters((feature,))
        for lname, (_, shape) in expected.items():
            if lname not in logical:
                raise ConversionError(f"missing tensor {lname!r} ({feature}) in {ckpt.dir}: config.json implies "
                                      f"shape {list(shape)}")
            t = logical[lname]
            if tuple(t.shape) != tuple(shape):
                raise ConversionError(f"tensor {t.label} has shape {list(t.shape)} but config.json implies "
                                      f"{list(shape)}: the config disagrees with the weights")
        for lname, t in logical.items():
            if t.feature == feature and lname not in expected:
                raise ConversionError(f"tensor {t.label} ({lname}) is not part of the model config.json "
                                      f"describes: the config disagrees with the weights")
    return logical, skipped, notes


def _quantization_record(scheme: Scheme | None, quantize: str | None, logical: dict[str, PlannedTensor],
                         kinds: dict, dense: dict[str, str], group_notes: list[str]) -> dict | None:
    """metadata.quantization: how the weights were quantized, the formats used, the linear weights left
    unquantized with why and the fused groups stored as several parents (None for an unquantized artifact)."""
    if scheme is None and quantize is None:
        return None
    formats: dict[str, int] = defaultdict(int)
    for kind in kinds.values():
        if kind is not None:
            formats[kind[0]] += 1
    if scheme is not None:  # imported as stored: what the checkpoint left unquantized
        dense = {n: "stored unquantized in the checkpoint" for n, t in logical.items()
                 if kinds[n] is None and len(t.shape) >= 2}
    method = f"ninfer convert --quantize {quantize}" if quantize else scheme.method
    return {"method": method, "formats": dict(formats), "dense": dict(sorted(dense.items())),
            "notes": [*(scheme.notes if scheme else ()), *group_notes]}


def default_name(src: Path) -> str:
    """An artifact's name when none is given: the checkpoint folder's name, or for a snapshot in the Hugging Face
    cache (``models--org--name/snapshots/<commit>``) its id, ``org/name``."""
    path = src.resolve()
    repo_folder = path.parent.parent.name
    if path.parent.name == "snapshots" and repo_folder.startswith("models--"):
        return repo_folder.removeprefix("models--").replace("--", "/", 1)
    return path.name


def convert_checkpoint(src: str | os.PathLike[str], out: str | os.PathLike[str], *, name: str | None = None,
                       host: PluginHost | None = None, progress: bool | Callable[[int, int], None] = False,
                       alignment: int = 4096, make_writer: Callable[[int], ArtifactWriter] = ArtifactWriter,
                       quantize: str | None = None) -> ConversionSummary:
    """Convert ``src`` (a Hugging Face checkpoint directory) into ``out``; atomic, never leaves a partial file.
    ``make_writer``: makes the ArtifactWriter from the alignment (a benchmark's writer may leave the data a hole).
    ``quantize``: ``fp8`` or ``nvfp4`` quantizes a float checkpoint's linear weights (``quantize.py``)."""
    start = time.perf_counter()
    src, out = Path(src), Path(out)
    if not out.parent.is_dir():
        raise ConversionError(f"output folder does not exist: {out.parent}")
    ckpt = Checkpoint(src)
    try:
        architecture, mapping = _mapping_for(ckpt.config, host or default_host())
        scheme = read_scheme(src, ckpt.config)
        if scheme is not None and quantize is not None:
            raise ConversionError(f"--quantize {quantize}: the checkpoint is already quantized ({scheme.method})")
        tensors, unused = present(ckpt.tensors, scheme)
        logical, skipped, notes = _plan_tensors(ckpt, tensors, mapping)
        notes += scheme.notes if scheme else ()
        skipped += unused
        kinds = {n: (t.quant.format, t.quant.block) if t.quant else None for n, t in logical.items()}
        targets, dense = plan_quantize(logical, quantize) if quantize else ({}, {})
        kinds.update(targets)
        features = tuple(f for f in _FEATURE_ORDER if any(t.feature == f for t in logical.values()))
        fe = read_frontend(src, ckpt.config, with_media="vision" in features)
        vocab = mapping.embedding_vocab()
        if fe.max_token_id >= vocab:
            raise ConversionError(f"tokenizer.json has token id {fe.max_token_id} but the embedding has {vocab} rows "
                                  f"(vocab_size): the config disagrees with the tokenizer")

        writer = make_writer(alignment)
        order = {f: i for i, f in enumerate(_FEATURE_ORDER)}
        expected_order = {n: i for i, n in enumerate(mapping.expected_parameters(mapping.validated_features))}
        fused_of: dict[str, tuple[str, list[str]]] = {}
        group_notes: list[str] = []  # groups that could not be one parent, and how they were stored
        for group in mapping.fused_parents():
            members = list(group.members)
            if not all(m in logical for m in members):
                continue
            tensors, member_kinds = [logical[m] for m in members], [kinds[m] for m in members]
            problem = fuse_problem(tensors, member_kinds)
            if not problem:
                for m in members:
                    fused_of[m] = (group.name, members)
                continue
            runs = fuse_runs(tensors, member_kinds)
            for lo, hi in runs:
                if hi - lo > 1:  # a run of one member is that member's own object
                    for m in members[lo:hi]:
                        fused_of[m] = (run_name(group.name, lo, hi), members[lo:hi])
            stored = ("unfused" if len(runs) == len(members) else
                      f"as {len(runs)} fused runs (members " + ", ".join(f"[{lo}:{hi}]" for lo, hi in runs) + ")")
            group_notes.append(f"{group.name}: {problem}; stored {stored}")
        notes += group_notes

        # Objects in file order: by feature, then model order, so each feature's bytes are contiguous.
        def key(lname: str) -> tuple:
            return (order[logical[lname].feature], expected_order.get(lname, len(expected_order)), lname)

        written: set[str] = set()
        digest_parts: list[tuple[str, str, list[int], str]] = []
        for lname in sorted(logical, key=key):
            t = logical[lname]
            feature = t.feature
            group = fused_of.get(lname)
            members = group[1] if group else [lname]
            oid = group[0] if group else lname
            if oid in written:
                continue
            written.add(oid)
            tensors = [logical[m] for m in members]
            rows = sum(s.shape[0] for s in tensors) if group else None
            shape = (rows, *t.shape[1:]) if group else t.shape
            add_parent(writer, ckpt.read, oid, feature=feature, shape=shape, tensors=tensors, kind=kinds[lname],
                       quantize=lname in targets)
            pos = 0
            for m, s in zip(members, tensors, strict=True):
                r = (pos, pos + s.shape[0]) if group else None
                writer.add_binding(Binding(name=m, feature=feature, object=oid, shape=s.shape, rows=r))
                pos += s.shape[0] if group else 0
                digest_parts += [(n, ckpt.tensors[n].dtype, list(ckpt.tensors[n].shape), oid)
                                 for p in s.parts for n in (p.quant.names if p.quant else (p.name,))]
        bound = set(logical)
        for lname in logical:
            writer.add_use(Use(site=lname, feature=logical[lname].feature, binding=lname))
        for use in mapping.shared_uses(bound, features):
            writer.add_use(use)

        writer.add_resource("frontend/tokenizer.json", fe.tokenizer_json, feature=RESOURCE_FEATURE)
        if fe.chat_template is not None:
            writer.add_resource("frontend/chat_template.jinja", fe.chat_template.encode("utf-8"),
                                feature=RESOURCE_FEATURE)
        frontend = FrontendSection(
            tokenizer="frontend/tokenizer.json",
            chat_template="frontend/chat_template.jinja" if fe.chat_template is not None else None,
            generation_config=fe.generation_config, special_tokens=fe.special_tokens, eos_token_ids=fe.eos_token_ids,
            embedding_vocab=vocab, media=fe.media)
        config_bytes = (src / "config.json").read_bytes()

        def source_digest(objects: tuple[PhysicalObject, ...]) -> str:
            # Object crc32s are computed over the unchanged source bytes, so this digests source content.
            h = hashlib.blake2b(config_bytes, digest_size=16)
            for part in sorted(digest_parts):
                h.update(repr(part).encode())
            for o in objects:
                h.update(f"{o.id}\0{o.checksum}\0".encode())
            return "blake2b:" + h.hexdigest()

        metadata = Metadata(name=name or default_name(src) or architecture, architecture=architecture,
                            converter_version=__version__, source_digest="blake2b:" + "0" * 32, source=src.name,
                            quantization=_quantization_record(scheme, quantize, logical, kinds, dense,
                                                              group_notes))
        bar = ProgressLine(f"converting {src.name}") if progress is True else None
        callback = bar.update if bar is not None else (progress or None)
        try:
            header: ArtifactHeader = writer.write(out, metadata=metadata, config=ckpt.config, features=features,
                                                  frontend=frontend, progress=callback, digest=source_digest)
        finally:
            if bar is not None:
                bar.close()
    finally:
        ckpt.close()
    by_feature: dict[str, int] = defaultdict(int)
    for o in header.objects:
        by_feature[o.feature] += o.nbytes
    return ConversionSummary(out=out, name=metadata.name, architecture=architecture, features=features,
                             tensors=sum(len(t.parts) for t in logical.values()), objects=len(header.objects),
                             bindings=len(header.bindings),
                             bytes_by_feature=dict(by_feature), skipped=tuple(skipped), notes=tuple(notes),
                             seconds=time.perf_counter() - start)
