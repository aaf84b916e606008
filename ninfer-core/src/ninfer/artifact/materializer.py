"""Materializer: read each placed object's original bytes once and give it stable backing on its device.

CPU loads pread straight into owned host memory (closing the artifact never invalidates weights). CUDA
loads stream through a small ring of pinned staging buffers: parallel preads fill the next slots while
one slot uploads on a side stream. Verification (on by default) is part of each read: the reading
thread takes the crc32 of the chunk it just read while the other threads read on, and the chunk crcs
are joined per object at the end (``checksum.ChunkChecksums``); the bytes are never read twice.
Logical parameters are then views (whole or row ranges) of the resident parents, assembled into a
``WeightSet``. A quantized object stays as stored: its parent is a ``QuantizedWeight`` whose planes are typed
views into the object's one raw allocation (nothing is converted at load).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor

import attrs

from ninfer.artifact.binder import LoadPlan, bind
from ninfer.artifact.checksum import ChunkChecksums
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

    def __init__(self, artifact: Artifact, resolved: ResolvedLoad, *, chunk_bytes: int = 32 << 20,
                 threads: int = 4, unpinned: frozenset[str] = frozenset()) -> None:
        self.artifact = artifact
        self.resolved = resolved
        self.unpinned = unpinned
        self.chunk = max(1 << 20, chunk_bytes)
        self.threads = max(1, threads)

    def run(self, *, verify: bool | None = None):
        """Read, verify (default: the artifact's ``verify_on_load``) and place every planned object."""
        import torch

        plan = self.resolved.plan
        start = time.perf_counter()
        if verify is None:
            verify = self.artifact.verify_on_load
        sums = ChunkChecksums(self.artifact.path) if verify else None
        # Hashing takes part of each reader's time: more readers keep the file streaming meanwhile.
        workers = self.threads * 2 if verify else self.threads

        def read_chunk(o: PhysicalObject, pos: int, out: memoryview) -> None:
            self.artifact.read_into(o, pos, out)
            if sums is not None:
                sums.add(o, pos, out)

        placement = {p.object: p.device for p in self.resolved.placements}
        read: dict[str, int] = defaultdict(int)
        raw: dict[str, torch.Tensor] = {}
        host_jobs, device_jobs = [], []
        # Host parents of a CUDA load are pinned: CUDA copies them asynchronously (MoE experts on the host).
        pin = any(d.startswith("cuda") for d in placement.values())
        for o in plan.objects:  # one allocation per physical parent and device, however many Uses share it
            device = torch.device(placement[o.id])
            raw[o.id] = torch.empty(o.nbytes, dtype=torch.uint8, device=device,
                                    pin_memory=pin and device.type == "cpu" and o.id not in self.unpinned)
            (host_jobs if device.type == "cpu" else device_jobs).append((o, raw[o.id]))
            read[o.feature] += o.nbytes
        with ThreadPoolExecutor(max_workers=workers) as pool:
            # Host backing: pread straight into the owned tensor, in parallel chunks.
            list(pool.map(lambda job: read_chunk(*job),
                          [(o, pos, memoryview(t.numpy())[pos:pos + self.chunk])
                           for o, t in host_jobs for pos in range(0, o.nbytes, self.chunk)]))
            if device_jobs:
                _upload(read_chunk, device_jobs, pool, self.chunk, depth=workers + 1)
        if sums is not None:
            sums.check(plan.objects)  # before any weight is handed out
        weights = _bind(plan, {oid: _typed(self.artifact.objects[oid], t) for oid, t in raw.items()})
        devices = sorted({p.device for p in self.resolved.placements}) or ["cpu"]
        report = LoadReport(features=plan.features, device=",".join(devices), objects_loaded=len(plan.objects),
                            bindings_bound=len(plan.bindings), uses_resolved=len(plan.uses), bytes_read=dict(read),
                            bytes_uploaded=dict(read), seconds=time.perf_counter() - start, verified=verify)
        return weights, report


def meta_weights(artifact: Artifact, *, features=("text",), check_expected: bool = True, host=None):
    """The WeightSet ``load_weights`` would make, on the meta device: every parent's shape and dtype and every
    view's sharing, from the header alone (no byte is read). A profile prepares Parameters from it and counts
    the storages a real load allocates."""
    import torch

    plan = plan_load(artifact, features, check_expected=check_expected, host=host)
    return _bind(plan, {o.id: _typed(o, torch.empty(o.nbytes, dtype=torch.uint8, device="meta"))
                        for o in plan.objects})


def _bind(plan: LoadPlan, parents: dict):
    """Logical parameters as views (whole, a row range, or a named plane) of their resident parents; a row range
    of a quantized parent is ``QuantizedWeight.rows`` (its scale rows follow)."""
    from ninfer.artifact.weights import BoundParameter, WeightSet, row_range

    params = []
    for b in plan.bindings:
        view = parents[b.object]
        if b.plane is not None:
            view = getattr(view, b.plane)
        if b.rows is not None:
            view = row_range(view, *b.rows)
        params.append(BoundParameter(name=b.name, parent=b.object, tensor=view,
                                     rows=tuple(b.rows) if b.rows is not None else None))
    return WeightSet(parents, params)


def _typed(o: PhysicalObject, flat):
    """The resident parent over an object's raw bytes ``flat`` (uint8): a typed tensor, or for a quantized object
    a QuantizedWeight of typed plane views (the reader has checked the planes against the format)."""
    if o.format == "dense":
        return flat.view(torch_dtype(o.dtype)).view(o.shape)
    if o.format == "bytes":
        raise ArtifactError(f"object {o.id!r} is a bytes resource, not a weight")
    from ninfer.ops.quant import QuantizedWeight

    planes = {p.name: flat[p.offset:p.offset + p.nbytes].view(torch_dtype(p.dtype)).view(p.shape)
              for p in o.planes}
    try:
        return QuantizedWeight(format=o.format, data=planes["data"], scale=planes["scale"],
                               global_scale=planes.get("global_scale"), block=tuple(o.block))
    except ValueError as exc:
        raise ArtifactError(f"object {o.id!r}: {exc}") from None


def _upload(read, jobs, pool: ThreadPoolExecutor, chunk: int, depth: int) -> None:
    """File -> ring of pinned staging buffers (parallel ``read(obj, pos, out)``) -> device on a side stream.

    Chunk i reuses the slot of chunk i - depth only after that chunk's upload finished, so up to ``depth - 1``
    reads (each with its crc32 when verifying) run while one upload is in flight. Small objects are one
    chunk each.
    """
    import torch

    device = jobs[0][1].device
    stream = torch.cuda.Stream(device=device)
    size = max(1, min(chunk, max(o.nbytes for o, _ in jobs)))
    ring = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
    views = [memoryview(b.numpy()) for b in ring]
    done = [torch.cuda.Event() for _ in range(depth)]
    chunks = [(o, dst, pos, min(size, o.nbytes - pos)) for o, dst in jobs for pos in range(0, o.nbytes, size)]
    pending: deque = deque()

    def issue(entry) -> None:
        future, (o, dst, pos, m), slot = entry
        future.result()
        with torch.cuda.stream(stream):
            dst[pos:pos + m].copy_(ring[slot][:m], non_blocking=True)
            done[slot].record(stream)

    try:
        for i, (o, dst, pos, m) in enumerate(chunks):
            slot = i % depth
            if len(pending) == depth:
                issue(pending.popleft())
            done[slot].synchronize()  # the slot's previous upload has finished reading it
            future = pool.submit(read, o, pos, views[slot][:m])
            pending.append((future, (o, dst, pos, m), slot))
        while pending:
            issue(pending.popleft())
    finally:
        for future, _, _ in pending:  # never free a staging buffer a read is still writing
            future.exception()
        stream.synchronize()
        torch.cuda.current_stream(device).wait_stream(stream)


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


def load_weights(artifact: Artifact, *, features=("text",), device="cpu", verify: bool | None = None,
                 budget_bytes: int | None = None, check_expected: bool = True, host=None,
                 host_objects: frozenset[str] = frozenset(), unpinned: frozenset[str] = frozenset()):
    """Bind, place and materialize the selected features: returns ``(WeightSet, LoadReport)``.

    Only the selected features' Uses, their Bindings and the objects behind them are read, each object once.
    ``verify`` (default: the artifact's ``verify_on_load``, itself on unless opened with ``verify=False``)
    checks the crc32 of every object read, as it is read; a mismatch raises ChecksumError naming the object
    (``ninfer inspect --verify`` checks the whole file). ``host_objects``: object ids kept in host memory
    (``resolve_load``); on a CUDA load they are pinned (the device copies from them asynchronously) except those in
    ``unpinned``, which only the CPU reads (a lookup table gathered on the host: pinning tens of GiB it never
    copies whole would only lock that memory).
    """
    plan = plan_load(artifact, features, check_expected=check_expected, host=host)
    resolved = resolve_load(plan, device, budget_bytes=budget_bytes, host_objects=host_objects)
    return Materializer(artifact, resolved, unpinned=unpinned).run(verify=verify)
