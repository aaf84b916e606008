"""The startup memory block (``summary_lines``) and the ``ninfer:memory_*`` gauges (``memory_gauges``) of a
MemorySummary: every figure the design names is shown and exported; the CPU shows no CUDA graph line; the budget
and the host's available memory are exported only when known."""

import pytest

from ninfer.contract.memory import GraphMemory, HostMemory, MemorySummary
from ninfer.engine.memory_report import GIB, MIB, format_bytes, memory_gauges, summary_lines, summary_text


def summary(**changes) -> MemorySummary:
    fields = dict(device="cuda", placement="all-device", budget_bytes=24 * GIB, device_total_bytes=80 * GIB,
                  weights_bytes=16 * GIB + 700 * MIB, runtime_reservation_bytes=3 * GIB,
                  startup_retained_bytes=600 * MIB, workspace_bytes=200 * MIB,
                  cuda_graph=GraphMemory(calibration_growth=900 * MIB, retained_after_release=-2 * MIB,
                                         rebuild_estimate=850 * MIB, formal_growth=3 * GIB),
                  kv_pages=2048, page_size=16, kv_automatic=True, max_model_len=32768, headroom_bytes=GIB,
                  reserved_bytes=21 * GIB, corrections=1,
                  host=HostMemory(snapshot_budget_bytes=8 * GIB, cache_budget_bytes=16 * GIB,
                                  available_bytes=100 * GIB),
                  calibration_seconds=2.5)
    fields.update(changes)
    return MemorySummary(**fields)


def test_format_bytes_picks_the_unit_and_keeps_the_sign():
    assert format_bytes(16 * GIB + 700 * MIB) == "16.68 GiB"
    assert format_bytes(512 * MIB) == "512.0 MiB"
    assert format_bytes(-2 * MIB) == "-2.0 MiB"
    assert format_bytes(3 * 1024) == "3.0 KiB"
    assert format_bytes(100) == "100 B"


def test_the_cuda_block_names_every_figure_in_four_lines():
    lines = summary_lines(summary())
    assert len(lines) == 4
    text = "\n".join(lines)
    for words in ("memory: cuda", "weights 16.68 GiB (all-device)", "KV 2,048 pages (32,768 tokens)",
                  "context 32,768", "runtime reservation 3.00 GiB", "workspace 200.0 MiB",
                  "startup retained 600.0 MiB", "headroom 1.00 GiB", "calibration growth 900.0 MiB",
                  "retained after release -2.0 MiB", "rebuild est. 850.0 MiB", "formal growth 3.00 GiB",
                  "calibrated in 2.5 s", "budget 24.00 GiB of 80.00 GiB", "reserved 21.00 GiB",
                  "1 correction rebuild", "host: Snapshots 8.00 GiB, cache replicas 16.00 GiB"):
        assert words in text, words


def test_the_cpu_block_has_no_graph_line_and_no_budget_when_none_was_set():
    m = summary(device="cpu", budget_bytes=None, device_total_bytes=None, cuda_graph=GraphMemory(),
                headroom_bytes=0, reserved_bytes=0, corrections=0, kv_automatic=False, calibration_seconds=0.0)
    lines = summary_lines(m)
    assert len(lines) == 3
    text = "\n".join(lines)
    assert "CUDA graphs" not in text and "budget" not in text and "correction" not in text
    assert "(32,768 tokens, num_pages)" in text  # an explicit page count says so


def test_summary_text_indents_the_block_under_its_prefix():
    text = summary_text(summary(), prefix="ninfer serve: ")
    first, *rest = text.split("\n")
    assert first.startswith("ninfer serve: memory: cuda")
    assert rest and all(line.startswith(" " * len("ninfer serve: memory: ")) for line in rest)


def test_gauges_export_the_design_documents_fields():
    gauges = {g.name: g.value for g in memory_gauges(summary())}
    expected = {
        "ninfer:memory_weights_bytes": 16 * GIB + 700 * MIB, "ninfer:memory_runtime_reservation_bytes": 3 * GIB,
        "ninfer:memory_startup_retained_bytes": 600 * MIB,
        "ninfer:memory_cuda_graph_calibration_growth_bytes": 900 * MIB,
        "ninfer:memory_cuda_graph_retained_after_release_bytes": -2 * MIB,
        "ninfer:memory_cuda_graph_rebuild_estimate_bytes": 850 * MIB,
        "ninfer:memory_cuda_graph_formal_growth_bytes": 3 * GIB, "ninfer:memory_kv_pages": 2048,
        "ninfer:memory_kv_tokens": 32768, "ninfer:memory_headroom_bytes": GIB, "ninfer:memory_budget_bytes": 24 * GIB,
        "ninfer:memory_corrections": 1, "ninfer:memory_host_snapshot_budget_bytes": 8 * GIB,
        "ninfer:memory_host_cache_budget_bytes": 16 * GIB, "ninfer:memory_host_available_bytes": 100 * GIB,
        "ninfer:memory_host_weights_bytes": 0,
    }
    for name, value in expected.items():
        assert gauges[name] == value, name
    assert all(g.help for g in memory_gauges(summary()))


def test_unknown_budget_and_host_memory_are_not_exported():
    m = summary(budget_bytes=None, device_total_bytes=None, host=HostMemory())
    names = {g.name for g in memory_gauges(m)}
    assert "ninfer:memory_budget_bytes" not in names
    assert "ninfer:memory_device_total_bytes" not in names
    assert "ninfer:memory_host_available_bytes" not in names
    assert "ninfer:memory_kv_tokens" in names


def test_the_cpu_block_leaves_out_what_the_cpu_does_not_measure():
    text = "\n".join(summary_lines(summary(device="cpu")))
    assert "startup retained" not in text and "headroom" not in text and "CUDA graphs" not in text


# -- ninfer generate prints the block of its start; --vram-budget is its budget --------------------------------
def test_generate_prints_the_memory_block_with_its_budget(capsys):
    from ninfer.cli import main

    args = ["generate", "--prompt", "ROMEO:", "--max-tokens", "2", "--device", "cpu"]
    assert main([*args, "--vram-budget", "256"]) == 0
    err = capsys.readouterr().err
    block = err[err.index("memory: cpu"):].splitlines()[:3]
    assert "weights" in block[0] and "KV " in block[0] and "tokens)" in block[0]
    assert "runtime reservation" in block[1]
    assert "budget 256.0 MiB" in block[2] and "host: Snapshots" in block[2]
    assert "finish: length" in err


def test_generate_refuses_a_budget_too_small_with_its_numbers(capsys):
    from ninfer.cli import main

    assert main(["generate", "--prompt", "x", "--device", "cpu", "--vram-budget", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ninfer generate: ") and "does not fit" in err and "short by" in err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--vram-budget", "-5"])
    assert "argument --vram-budget: must be >= 1, got -5" in capsys.readouterr().err
