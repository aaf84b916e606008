"""Materializer: read each placed object's original bytes once and give it stable backing on its device.

CPU loads copy into owned host memory (so closing the artifact never invalidates weights). CUDA loads
stream through a small ring of pinned staging buffers on a side stream: the host copy of chunk i+1
overlaps the upload of chunk i. Logical parameters are then views (whole or row ranges) of the
resident parents, assembled into a ``WeightSet``.
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict

import attrs

from ninfer.artifact.binder import LoadPlan, bind
from ninfer.artifact.format import ArtifactError, PhysicalObject
from ninfer.artifact.placement import ResolvedLoad, resolve_load
from ninfer.artifact.reader import Artifact

_TORCH_DTYPES = {"bool": "bool", "u8": "uint8", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
                 "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
                 "f8_e4m3": "float8_e4m3fn", "f8_e5m2": "float8_e5m2"}


def torch_dtype(name: str):
    import torch

    return getattr(torch, _TORCH_DTYPES[name])


@attrs.frozen(kw_only=True)
class LoadReport:
    """What a load did: per-feature bytes read from the file and written to device memory, objects and time."""

    features: tuple[str, ...]
    device: str
    objects_loaded: int
    bindings_bound: int
    uses_resolved: int
    bytes_read: dict[str, int]
    bytes_uploaded: dict[str, int]
    seconds: float
    verified: bool

    @property
    def total_bytes_read(self) -> int:
        return sum(self.bytes_read.values())

    @property
    def total_bytes_uploaded(self) -> int:
        return sum(self.bytes_uploaded.values())

    @property
    def gb_per_s(self) -> float:
        return self.total_bytes_uploaded / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class Materializer:
    """Builds device backing for a ResolvedLoad from an open Artifact."""

    def __init__(self, artifact: Artifact, resolved: ResolvedLoad) -> None:
        self.artifact = artifact
        self.resolved = resolved

    def run(self, *, verify: bool = False):
        import torch

        from ninfer.models.common.weights import BoundParameter, WeightSet

        plan = self.resolved.plan
        for o in plan.objects:
            if o.format != "dense":
                raise ArtifactError(f"object {o.id!r} has format {o.format!r}; only dense objects are "
                                    f"materialized so far")
        start = time.perf_counter()
        if verify:
            self.artifact.verify(plan.objects)
        placement = {p.object: p.device for p in self.resolved.placements}
        read: dict[str, int] = defaultdict(int)
        uploaded: dict[str, int] = defaultdict(int)
        raw: dict[str, torch.Tensor] = {}
        uploader = None
        for o in plan.objects:
            device = torch.device(placement[o.id])
            dst = torch.empty(o.nbytes, dtype=torch.uint8, device=device)
            if o.nbytes:
                with self.artifact.object_buffer(o) as buf, warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only mmap: we never write through it
                    src = torch.frombuffer(buf, dtype=torch.uint8)
                    if device.type == "cpu":
                        dst.copy_(src)
                    else:
                        if uploader is None:
                            uploader = _Uploader(device, self.resolved.staging_bytes)
                        uploader.copy(src, dst)
                    del src
            read[o.feature] += o.nbytes
            uploaded[o.feature] += o.nbytes
            raw[o.id] = dst
        if uploader is not None:
            uploader.finish()
        parents = {oid: _typed(self.artifact.objects[oid], t) for oid, t in raw.items()}
        params = []
        for b in plan.bindings:
            parent = parents[b.object]
            tensor = parent[b.rows[0]:b.rows[1]] if b.rows is not None else parent
            params.append(BoundParameter(name=b.name, parent=b.object, tensor=tensor,
                                         rows=tuple(b.rows) if b.rows is not None else None))
        weights = WeightSet(parents, params)
        report = LoadReport(features=plan.features, device=str(torch.device(placement[plan.objects[0].id]))
                            if plan.objects else "cpu", objects_loaded=len(plan.objects),
                            bindings_bound=len(plan.bindings), uses_resolved=len(plan.uses), bytes_read=dict(read),
                            bytes_uploaded=dict(uploaded), seconds=time.perf_counter() - start, verified=verify)
        return weights, report


def _typed(o: PhysicalObject, flat):
    return flat.view(torch_dtype(o.dtype)).view(o.shape)


class _Uploader:
    """Pageable mmap bytes -> pinned staging ring -> device, overlapping host copies with uploads."""

    def __init__(self, device, chunk_bytes: int, depth: int = 3) -> None:
        import torch

        self.torch = torch
        self.chunk = max(1 << 20, chunk_bytes)
        self.stream = torch.cuda.Stream(device=device)
        self.ring = [(torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
                     for _ in range(depth)]
        self.i = 0

    def copy(self, src, dst) -> None:
        n = src.numel()
        for pos in range(0, n, self.chunk):
            m = min(self.chunk, n - pos)
            buf, done = self.ring[self.i % len(self.ring)]
            self.i += 1
            done.synchronize()  # the previous upload from this buffer has finished
            buf[:m].copy_(src[pos:pos + m])
            with self.torch.cuda.stream(self.stream):
                dst[pos:pos + m].copy_(buf[:m], non_blocking=True)
                done.record(self.stream)

    def finish(self) -> None:
        self.stream.synchronize()
        self.ring.clear()  # release pinned staging


def plan_load(artifact: Artifact, features=("text",), *, check_expected: bool = True, host=None) -> LoadPlan:
    """Binder step with the architecture's own expectations when its plugin provides a source mapping."""
    expected = _expected(artifact, tuple(features), host) if check_expected else None
    return bind(artifact.header, features, expected=expected)


def _expected(artifact: Artifact, features: tuple[str, ...], host) -> dict[str, tuple[int, ...]] | None:
    from ninfer.plugins import UnknownArchitecture, default_host

    host = host or default_host()
    try:
        spec = host.architecture(artifact.metadata.architecture).spec
    except UnknownArchitecture:
        return None  # nothing can run it anyway; the Startup that consumes the weights reports that
    if spec.source_mapping is None:
        return None
    mapping = spec.load("source_mapping")(artifact.config)
    wanted = tuple(f for f in features if f in mapping.validated_features)
    return {name: shape for name, (_, shape) in mapping.expected_parameters(wanted).items()}


def load_weights(artifact: Artifact, *, features=("text",), device="cpu", verify: bool = False,
                 budget_bytes: int | None = None, check_expected: bool = True, host=None):
    """Bind, place and materialize the selected features: returns ``(WeightSet, LoadReport)``.

    Only the selected features' Uses, their Bindings and the objects behind them are read, each object once.
    ``verify`` checks the crc32 of every object read (``ninfer inspect --verify`` checks the whole file).
    """
    plan = plan_load(artifact, features, check_expected=check_expected, host=host)
    resolved = resolve_load(plan, device, budget_bytes=budget_bytes)
    return Materializer(artifact, resolved).run(verify=verify)
