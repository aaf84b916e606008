"""Qwen3Startup's three steps on the tiny converted checkpoint: ``profile`` reads no weight byte and counts exactly
the device bytes a ``load`` allocates (shared views and dtype copies alike), and ``instance`` builds a Program of
exactly the granted capacity (a calibration capacity keeps the planned context over its few pages)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ninfer.artifact import open_artifact  # noqa: E402
from ninfer.contract import ProgramCapacity, StartupFeatures, StartupOptions  # noqa: E402
from ninfer.core.device_plan import resident_bytes, sized  # noqa: E402
from ninfer_qwen3.startup import Qwen3Startup  # noqa: E402

PAGE = 4


@pytest.mark.parametrize("dtype", [None, "bfloat16"], ids=["stored", "cast"])
def test_profile_reads_no_weight_and_counts_what_a_load_allocates(converted, dtype):
    _, path = converted
    options = StartupOptions(device="cpu", dtype=dtype, max_concurrency=2, page_size=PAGE)
    startup = Qwen3Startup()
    with open_artifact(path) as artifact:
        profile = startup.profile(artifact, options)
        assert {f: n for f, n in artifact.bytes_read.items() if f != "frontend" and n} == {}
        (placement,) = profile.placements
        loaded = startup.load(artifact, options, placement)
        real = resident_bytes([*loaded.weights.parents.values(), *loaded.model.params.tensors()])
        assert placement.device_bytes == real
        assert real >= sum(p.nbytes for p in loaded.weights.parents.values())
        assert profile.dtype == (dtype or "float32") and profile.state_slot_bytes == 0
        assert profile.page_size == PAGE and sized(profile, options).workspace_bytes > 0 and profile.layers == 3


def test_profile_refuses_what_it_cannot_run_before_reading_a_weight(converted):
    _, path = converted
    startup = Qwen3Startup()
    with open_artifact(path) as artifact:
        with pytest.raises(ValueError, match="runs text only"):
            startup.profile(artifact, StartupOptions(device="cpu", features=StartupFeatures(vision=True)))
        assert sum(artifact.bytes_read.values()) == 0


def test_instance_builds_exactly_the_granted_capacity(converted):
    _, path = converted
    options = StartupOptions(device="cpu", max_concurrency=2, page_size=PAGE)
    startup = Qwen3Startup()
    with open_artifact(path) as artifact:
        loaded = startup.load(artifact, options, startup.profile(artifact, options).placements[0])
        formal = startup.instance(loaded, options, ProgramCapacity(kv_pages=5, max_model_len=200)).program
        assert (formal.usage().kv_pages_total, formal.max_model_len) == (5, 5 * PAGE)
        assert formal.backing_bytes() == formal.pool.nbytes  # no StateImage bytes, no checkpoint slots
        calibration = startup.instance(loaded, options, ProgramCapacity(kv_pages=2, max_model_len=200,
                                                                        calibration=True)).program
        assert (calibration.usage().kv_pages_total, calibration.max_model_len) == (2, 200)
