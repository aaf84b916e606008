"""Startup planning with a real tiny artifact: the profile counts exactly what a start allocates, a model that
cannot fit is refused before any weight byte is read, graph calibration builds a few pages with the real
context, and a formal allocation that falls short is corrected once (a fake allocator scripts the shortfall)."""

from __future__ import annotations

import gc
import weakref

import attrs
import pytest
import torch

from ninfer.contract.config import StartupFeatures, StartupOptions
from ninfer.core.device import Device
from ninfer.core.device_memory import DeviceMemory, MemorySnapshot
from ninfer.core.device_plan import GIB, MIB, PlanError, resident_bytes, sized

pytest.importorskip("transformers")
from ninfer.artifact import Artifact, open_artifact  # noqa: E402
from ninfer.engine.startup import build_instance, start  # noqa: E402
from ninfer_qwen35.startup import Qwen35Startup, vision_tensors  # noqa: E402
from ninfer_qwen35.testing.checkpoints import convert_tiny, make_tiny_checkpoint  # noqa: E402

MTP = StartupFeatures(speculative="mtp", num_draft_tokens=2)
TEXT = StartupFeatures(vision=False)  # for budgets sized to the text model (the encoder's workspace is not small)


@pytest.fixture(scope="module")
def artifact_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("planning")
    return convert_tiny(make_tiny_checkpoint(root / "ckpt", layout="vl"), root / "tiny.ninfer")


@pytest.mark.parametrize("dtype,features", [(None, StartupFeatures()), ("float32", StartupFeatures()),
                                            ("float16", MTP), (None, MTP)])
def test_the_profile_counts_exactly_what_a_start_allocates(artifact_path, dtype, features):
    """Weights (views of the artifact's parents, or copies where the dtype differs), StateImage slot, KV page and
    verify records: the header-only profile equals the loaded bytes and the Program's backing."""
    options = StartupOptions(device="cpu", max_concurrency=2, dtype=dtype, features=features, num_pages=10)
    with open_artifact(artifact_path) as art:
        startup = Qwen35Startup()
        profile = startup.profile(art, options)
        loaded = startup.load(art, options, profile.placements[0])
        tensors = [*loaded.weights.parents.values(), *loaded.executor.params.tensors()]
        if loaded.mtp is not None:
            tensors += loaded.mtp.params.tensors()
        if loaded.vision is not None:
            tensors += vision_tensors(loaded.vision.params)
        assert (loaded.vision is not None) == (features.speculative is None)  # None binds it, but not with MTP
        assert profile.placements[0].device_bytes == resident_bytes(tensors)
        inst = start(startup, art, options, DeviceMemory(Device.parse("cpu")))
    prog, memory = inst.program, inst.memory
    assert profile.state_slot_bytes == prog.states.image_bytes
    assert profile.kv_page_bytes == prog.pool.nbytes_per_page
    assert (profile.backing_bytes > 0) == (features.speculative is not None)
    slots = prog.checkpoints.images.num_slots if prog.checkpoints.images is not None else 0
    assert prog.backing_bytes() == (profile.state_slot_bytes * (2 + 1 + slots) + profile.kv_page_bytes * (10 + 1)
                                    + profile.backing_bytes) == memory.runtime_reservation_bytes
    assert memory.weights_bytes == profile.placements[0].device_bytes


def test_a_model_that_cannot_fit_is_refused_before_any_weight_byte_is_read(artifact_path, monkeypatch):
    def refuse(what):
        def read(self, obj, *args, **kwargs):
            obj = self.objects[obj] if isinstance(obj, str) else obj
            if obj.feature != "frontend":
                raise AssertionError(f"weight object {obj.id} was read by {what}")
            return original[what](self, obj, *args, **kwargs)
        return read

    original = {"read_into": Artifact.read_into, "object_buffer": Artifact.object_buffer}
    monkeypatch.setattr(Artifact, "read_into", refuse("read_into"))
    monkeypatch.setattr(Artifact, "object_buffer", refuse("object_buffer"))
    with pytest.raises(PlanError, match=r"does not fit: it needs .*weights .* short by"):
        build_instance(artifact_path, StartupOptions(device="cpu", device_budget_bytes=1 << 20))
    with open_artifact(artifact_path) as art:
        Qwen35Startup().profile(art, StartupOptions(device="cpu", features=MTP))
        assert not any(n for f, n in art.bytes_read.items() if f != "frontend")


class RecordingStartup(Qwen35Startup):
    """Qwen3.5's Startup, recording each capacity it builds; ``fail_first_formal`` raises an out-of-memory error
    from the first formal build (what a short CUDA allocation raises)."""

    def __init__(self, fail_first_formal: bool = False) -> None:
        self.capacities = []
        self.programs = weakref.WeakSet()
        self.fail = fail_first_formal

    def instance(self, loaded, options, capacity):
        self.capacities.append(capacity)
        if self.fail and not capacity.calibration:
            self.fail = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        inst = super().instance(loaded, options, capacity)
        self.programs.add(inst.program)
        return inst


class FakeDevice(DeviceMemory):
    """A fake allocator for a CUDA-like start on the CPU: reserved = the weights once loaded + the explicit backing
    of every live Program; while the first formal Program lives (any formal one with ``every``) the allocator ends
    ``excess`` bytes above the budget, what a start that needed more than it planned looks like. Used adds a
    fixed context."""

    CONTEXT = 300 * MIB

    def __init__(self, startup: RecordingStartup, *, budget: int, workspace: int, total: int = 4 * GIB,
                 excess: int | None = None, every: bool = False) -> None:
        super().__init__(Device.parse("cpu"))
        self.startup, self.total, self.excess, self.every = startup, total, excess, every
        self.budget, self.workspace = budget, workspace
        self.weights = 0
        self.first_formal: weakref.ref | None = None

    @property
    def measures(self) -> bool:
        return True

    def settle(self) -> None:
        gc.collect()

    def snapshot(self) -> MemorySnapshot:
        live = list(self.startup.programs)
        formal = [p for p in live if not p_calibration(p)]
        if formal and self.first_formal is None:
            self.first_formal = weakref.ref(formal[0])
        reserved = self.weights + sum(p.backing_bytes() for p in live)
        short = (self.every and formal) or (self.first_formal is not None and self.first_formal() is not None)
        if self.excess is not None and short:
            reserved = self.budget - self.workspace + self.excess
        return MemorySnapshot(free=self.total - reserved - self.CONTEXT, total=self.total, reserved=reserved)


def p_calibration(program) -> bool:
    return program.pool.num_pages <= 5  # the calibration build's few pages (+ the scratch page)


def _fake_start(path, options, startup, **fake):
    with open_artifact(path) as art:
        profile = sized(startup.profile(art, options), options)
        memory = FakeDevice(startup, budget=options.device_budget_bytes, workspace=profile.workspace_bytes, **fake)
        memory.weights = profile.placements[0].device_bytes
        return start(startup, art, options, memory), memory


def test_calibration_builds_a_few_pages_with_the_real_context_then_the_formal_pool_takes_the_rest(artifact_path):
    startup = RecordingStartup()
    options = StartupOptions(device="cpu", max_concurrency=2, device_budget_bytes=GIB + 256 * MIB, max_model_len=1024)
    inst, memory = _fake_start(artifact_path, options, startup)
    calibration, formal = startup.capacities
    assert calibration.calibration and calibration.kv_pages == 4 and calibration.checkpoint_slots == 0
    assert calibration.max_model_len == formal.max_model_len == 1024  # graphs see the real context
    assert not formal.calibration and formal.kv_pages > 4
    summary = inst.memory
    assert summary.corrections == 0 and summary.kv_pages == formal.kv_pages == inst.program.pool.num_pages - 1
    assert summary.headroom_bytes == GIB and summary.budget_bytes == GIB + 256 * MIB
    # the fake allocator keeps nothing after the graphs go: no rebuild estimate, no retained bytes
    assert (summary.cuda_graph.rebuild_estimate, summary.cuda_graph.retained_after_release) == (0, 0)
    assert summary.cuda_graph.calibration_growth > 0 and summary.cuda_graph.formal_growth == summary.runtime_reservation_bytes
    assert summary.reserved_bytes == memory.weights + summary.runtime_reservation_bytes <= summary.budget_bytes


@pytest.mark.parametrize("how", ["over the budget", "out of memory"])
def test_a_short_formal_allocation_is_corrected_once_by_cutting_automatic_kv(artifact_path, how):
    startup = RecordingStartup(fail_first_formal=how == "out of memory")
    options = StartupOptions(device="cpu", max_concurrency=2, device_budget_bytes=GIB + 12 * MIB, features=TEXT)
    inst, _ = _fake_start(artifact_path, options, startup, excess=100 << 10 if how == "over the budget" else None)
    _, first, corrected = startup.capacities
    assert inst.memory.corrections == 1 and corrected.kv_pages < first.kv_pages
    assert inst.memory.kv_pages == corrected.kv_pages == inst.program.pool.num_pages - 1
    assert corrected.checkpoint_slots == first.checkpoint_slots  # only automatic KV is cut
    assert inst.program.usage().all_free


def test_explicit_capacity_is_never_cut_and_a_second_shortfall_fails(artifact_path):
    startup = RecordingStartup()
    options = StartupOptions(device="cpu", max_concurrency=2, device_budget_bytes=GIB + 12 * MIB, num_pages=64,
                             features=TEXT)
    with pytest.raises(PlanError, match="num_pages is explicit, so it is not cut"):
        _fake_start(artifact_path, options, startup, excess=100 << 10)
    startup = RecordingStartup()
    options = attrs.evolve(options, num_pages=None)
    with pytest.raises(PlanError, match="after one correction rebuild"):
        _fake_start(artifact_path, options, startup, excess=100 << 10, every=True)
    assert len(startup.capacities) == 3  # calibration, formal, one correction: never a fourth
