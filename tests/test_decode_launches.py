"""benchmarks/launches on the CPU: a decode step of each MoE architecture reads no device value on the host (a
CUDA graph could not hold it), each op a Triton kernel stands in for counts once, and listing the fused
hyper-connection gates takes their elementwise steps out of every hyper-connection."""

from __future__ import annotations

import pytest

from benchmarks.launches import count_step, report, tiny_artifact

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = tiny_artifact(arch, 4, None, tmp_path_factory.mktemp(arch))
        return made[arch]
    return get


@pytest.mark.parametrize("arch", ["qwen35_moe", "qwen4exp"])
def test_a_decode_step_reads_nothing_back_and_counts_kernels_once(artifacts, arch):
    res = report(count_step(artifacts(arch), batch=2, context=20), layers=4)
    assert res["syncs"] == 0, res["syncs_by_part"]
    assert res["by_kind"]["triton moe.moe_block"] == 4  # one a layer, its reference's torch ops unseen
    assert res["by_kind"]["triton sampling.greedy"] == 1 and res["launches"] == sum(res["by_part"].values())


def test_the_fused_gates_take_the_elementwise_steps_out_of_a_hyper_connection(artifacts, monkeypatch):
    def mix(res):
        return {kind: n for part, kind, n in res["detail"] if part.endswith(":_mix")}

    before = report(count_step(artifacts("qwen4exp"), batch=1, context=20), layers=4)
    monkeypatch.setenv("NINFER_OPS", "triton")  # every written kernel, the unlisted gates among them
    after = report(count_step(artifacts("qwen4exp"), batch=1, context=20), layers=4)
    hyper_connections = mix(before)["triton hyper_connection.stream_mix"]
    assert mix(after)["triton hyper_connection.hyper_connection_gates"] == hyper_connections
    assert not [k for k in mix(after) if k.startswith("torch ")] and [k for k in mix(before) if k.startswith("torch ")]
    assert after["launches"] < before["launches"]
