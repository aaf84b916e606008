"""Qwen4Exp startup planning on a tiny real artifact (the ``full`` variant: PLE on two layers, MoE, QSA): the
header-only profile counts exactly what a start allocates in every placement: ``all-device`` (the n-gram tables
on the device too), ``host-tables`` (the tables in host memory) and ``host-experts`` (the routed expert banks
too), and ``ninfer plan`` reports them."""

from __future__ import annotations

import json

import pytest
import torch

from ninfer.contract.config import StartupOptions
from ninfer.core.device import Device
from ninfer.core.device_memory import DeviceMemory
from ninfer.core.device_plan import resident_bytes

transformers = pytest.importorskip("transformers")
from ninfer.artifact import open_artifact  # noqa: E402
from ninfer.engine.startup import start  # noqa: E402
from ninfer_qwen4exp.startup import Qwen4ExpStartup, ngram_objects  # noqa: E402
from ninfer_qwen4exp.testing import convert_tiny, make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The artifact, and the bytes transformers holds: every parameter, the n-gram tables, the routed experts."""
    root = tmp_path_factory.mktemp("plan")
    ckpt = make_tiny_checkpoint(root / "ckpt", variant="full", mtp=False, seed=1)
    art = convert_tiny(ckpt, root / "full.ninfer")
    hf = transformers.Qwen4ExpForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    named = {n: p.numel() * p.element_size() for n, p in hf.named_parameters()}
    tables = sum(b for n, b in named.items() if ".ngram_embedding." in n)
    experts = sum(b for n, b in named.items() if ".mlp.experts." in n)
    return art, sum(named.values()), tables, experts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_profile_counts_exactly_what_a_start_allocates(full, dtype):
    art_path, _, tables, _ = full
    options = StartupOptions(device="cpu", max_concurrency=2, dtype=dtype, num_pages=10)
    with open_artifact(art_path) as art:
        startup = Qwen4ExpStartup()
        profile = startup.profile(art, options)
        everything, host_tables, hosted = profile.placements
        assert (everything.name, host_tables.name, hosted.name) == ("all-device", "host-tables", "host-experts")
        loaded = startup.load(art, options, everything)
        table_parents = [loaded.weights.parents[o] for o in ngram_objects(art, ("text",))]
        assert resident_bytes(table_parents) == tables  # stored fp32 and never converted: rows are read as needed
        allocated = resident_bytes([*loaded.weights.parents.values(), *loaded.executor.params.tensors()])
        assert everything.device_bytes == allocated and everything.host_bytes == 0 and not loaded.host_tables
        assert everything.step_bytes < allocated - tables  # a step reads looked-up rows and k experts per layer
        assert (host_tables.device_bytes, host_tables.host_bytes) == (allocated - tables, tables)
        assert startup.load(art, options, host_tables).host_tables
        inst = start(startup, art, options, DeviceMemory(Device.parse("cpu")))
    prog, memory = inst.program, inst.memory
    assert profile.state_slot_bytes == prog.states.image_bytes
    assert profile.kv_page_bytes == prog.pool.nbytes_per_page  # K, V and the QSA index keys
    slots = prog.checkpoints.images.num_slots if prog.checkpoints.images is not None else 0
    assert prog.backing_bytes() == (profile.state_slot_bytes * (2 + 1 + slots)
                                    + profile.kv_page_bytes * (10 + 1)) == memory.runtime_reservation_bytes
    assert memory.weights_bytes == everything.device_bytes and memory.host.weights_bytes == 0


def test_plan_counts_the_ngram_tables_and_the_expert_banks_as_host_bytes(full, capsys):
    from ninfer.cli import main

    art, total, tables, experts = full
    reports = {}
    for placement in ("all-device", "host-tables", "host-experts"):
        rc = main(["plan", str(art), "--device", "cpu", "--dtype", "float32", "--placement", placement, "--json"])
        assert rc == 0
        reports[placement] = json.loads(capsys.readouterr().out)
    everything, host_tables, hosted = reports["all-device"], reports["host-tables"], reports["host-experts"]
    assert everything["host"]["weights_bytes"] == 0
    assert host_tables["host"]["weights_bytes"] == tables
    assert hosted["host"]["weights_bytes"] == tables + experts
    device = everything["categories"]["weights"]
    assert host_tables["categories"]["weights"] == device - tables
    assert hosted["categories"]["weights"] == device - tables - experts
    # the device holds every parameter, plus each PLE layer's hash constants (a few int64 per head)
    assert 0 <= device - total <= 1024
    assert hosted["categories"]["expert staging"] > 0 and hosted["experts"] == 8 * 4  # 8 experts x 4 layers
    rc = main(["plan", str(art), "--device", "cpu", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0 and "weights" in out and "host:" in out
