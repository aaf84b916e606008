"""/metrics exports what the engine's start took (``Engine.memory``) as ``ninfer:memory_*`` gauges with HELP and
TYPE lines; ``ninfer serve --vram-budget MIB`` is the engine's device budget, and the server prints the memory
block of its start before it listens."""

import pytest

import ninfer
from ninfer import env
from ninfer.cli import main
from ninfer.contract.memory import GraphMemory, HostMemory, MemorySummary
from ninfer_serve.testing import ServerProcess, parse_metrics, scrape

GIB, MIB = 1 << 30, 1 << 20
DEVICE = env.get("NINFER_SERVE_TEST_DEVICE")  # "cuda" to run the server on the GPU machine


def summary(**changes) -> MemorySummary:
    fields = dict(device="cuda", placement="all-device", budget_bytes=24 * GIB, device_total_bytes=80 * GIB,
                  weights_bytes=16 * GIB, runtime_reservation_bytes=3 * GIB, startup_retained_bytes=600 * MIB,
                  workspace_bytes=200 * MIB,
                  cuda_graph=GraphMemory(calibration_growth=900 * MIB, retained_after_release=-2 * MIB,
                                         rebuild_estimate=850 * MIB, formal_growth=3 * GIB),
                  kv_pages=2048, page_size=16, kv_automatic=True, max_model_len=32768, headroom_bytes=GIB,
                  reserved_bytes=21 * GIB, corrections=1,
                  host=HostMemory(snapshot_budget_bytes=8 * GIB, cache_budget_bytes=16 * GIB, available_bytes=GIB))
    fields.update(changes)
    return MemorySummary(**fields)


def test_metrics_export_the_memory_of_the_start(engine, client):
    engine.memory = summary()
    text = client(engine).get("/metrics").text
    lines = text.splitlines()
    samples = dict(line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
    for name, value in (("weights_bytes", 16 * GIB), ("runtime_reservation_bytes", 3 * GIB),
                        ("startup_retained_bytes", 600 * MIB), ("cuda_graph_calibration_growth_bytes", 900 * MIB),
                        ("cuda_graph_retained_after_release_bytes", -2 * MIB),
                        ("cuda_graph_rebuild_estimate_bytes", 850 * MIB), ("cuda_graph_formal_growth_bytes", 3 * GIB),
                        ("kv_pages", 2048), ("kv_tokens", 32768), ("headroom_bytes", GIB), ("budget_bytes", 24 * GIB),
                        ("corrections", 1), ("host_snapshot_budget_bytes", 8 * GIB),
                        ("host_cache_budget_bytes", 16 * GIB), ("host_available_bytes", GIB)):
        assert float(samples[f'ninfer:memory_{name}{{model_name="tiny-test"}}']) == value, name
        assert f"# TYPE ninfer:memory_{name} gauge" in lines, name
        assert any(line.startswith(f"# HELP ninfer:memory_{name} ") for line in lines), name


def test_an_unknown_budget_is_not_exported(engine, client):
    engine.memory = summary(device="cpu", budget_bytes=None, device_total_bytes=None)
    m = parse_metrics(client(engine).get("/metrics").text)
    assert "ninfer:memory_budget_bytes" not in m and m["ninfer:memory_kv_tokens"] == 32768


def test_an_engine_without_a_start_summary_exports_no_memory_gauges(engine, client):
    assert engine.memory is None
    text = client(engine).get("/metrics").text
    assert "ninfer:memory_" not in text and "ninfer:num_requests_running" in text


class RecordingEngine:
    """Stands in for ``ninfer.Engine``: records the config it was given, then fails like a bad artifact."""

    configs: list = []

    def __init__(self, model, *, config):
        RecordingEngine.configs.append(config)
        raise RuntimeError("stub engine: not loading anything")


def test_vram_budget_is_the_engines_device_budget(monkeypatch, capsys):
    monkeypatch.setattr(RecordingEngine, "configs", [])
    monkeypatch.setattr(ninfer, "Engine", RecordingEngine, raising=False)
    assert main(["serve", "--port", "0", "--vram-budget", "24576"]) == 2
    assert main(["serve", "--port", "0"]) == 2
    assert [c.device_budget_bytes for c in RecordingEngine.configs] == [24 * GIB, None]
    assert "stub engine" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--vram-budget", "0"])
    assert exc.value.code == 2
    assert "argument --vram-budget: must be >= 1, got 0" in capsys.readouterr().err


def test_the_server_prints_its_memory_and_exports_it():
    with ServerProcess(None, "--device", DEVICE, "--vram-budget", "4096", "--no-warmup") as srv:
        m = scrape(srv.url)
        log = srv.log()
    start = log.index("ninfer serve: memory: ")
    assert start < log.index("ninfer serve: serving")  # printed at startup, before it listens
    assert "budget 4.00 GiB" in log[start:]
    assert m["ninfer:memory_budget_bytes"] == 4096 * MIB
    assert m["ninfer:memory_kv_tokens"] == m["ninfer:memory_kv_pages"] * 16 > 0
    assert m["ninfer:memory_weights_bytes"] > 0
