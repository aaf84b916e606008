"""Kernel tuning tables (ninfer/ops/triton/tuning.py, tables/*.json): the H200 gets exactly the launch choices the
module globals held before the tables (written out below as that code had them), the CPU's stand-in mirrors it,
other devices get the generic rule scaled by their SMs, and NINFER_TUNING_DIR replaces the packaged tables."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("triton")

from ninfer.ops.triton import attention as t_attention  # noqa: E402
from ninfer.ops.triton import linear as t_linear  # noqa: E402
from ninfer.ops.triton import linear_quant as t_linear_quant  # noqa: E402
from ninfer.ops.triton import moe_shared, sampling, tuning, vision_attention  # noqa: E402
from ninfer.ops.triton.gdn_shared import default_block_v  # noqa: E402

H200 = tuning.DeviceKey("NVIDIA H200", 132)
H100 = tuning.DeviceKey("NVIDIA H100 80GB HBM3", 132)
H100_PCIE = tuning.DeviceKey("NVIDIA H100 PCIe", 114)
A100 = tuning.DeviceKey("NVIDIA A100-SXM4-80GB", 108)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# -- the launch choices as the module globals made them (ninfer.ops.triton at 18b5479) ----------------------------
OLD_MEASURED = {
    (4096, 4096): (64, 128, 4), (4096, 12288): (32, 128, 4), (10240, 4096): (32, 256, 1),
    (12352, 4096): (32, 256, 1), (24576, 4096): (64, 128, 1), (1024, 2048): (32, 128, 8),
    (1024, 3584): (64, 256, 8), (5120, 1024): (32, 256, 1), (7168, 1024): (32, 256, 1),
    (8224, 1024): (32, 256, 1), (248320, 2048): (64, 128, 1),
}


def old_linear(N: int, K: int) -> tuple[int, int, int, int, int]:
    if (N, K) in OLD_MEASURED:
        return (*OLD_MEASURED[N, K], 4, 3)
    blocks_n, split = _cdiv(N, 32), 1
    while blocks_n * split < 256 and K // (split * 2) >= 256:
        split *= 2
    return 32, 256 if split == 1 else 128, split, 4, 3


OLD_BY_TOKENS = ((1, (16, 64, 128, 4, 4)), (16, (16, 64, 64, 4, 4)), (256, (16, 128, 128, 4, 3)),
                 (512, (16, 256, 128, 8, 2)), (1024, (32, 128, 64, 4, 3)), (3072, (64, 128, 64, 4, 3)))


def old_moe(tokens: int, dtype: torch.dtype) -> tuple[int, ...]:
    bm, bn, bk, w, st = next((c for limit, c in OLD_BY_TOKENS if tokens <= limit), (128, 256, 64, 8, 4))
    if dtype == torch.float32:
        bk, st = min(bk, 32), min(st, 2)
    return bm, bn, bk, w, st


def old_attention(B: int, KVH: int, G: int, q_len: int, seq_len: int, sms: int = 132) -> tuple[int, ...]:
    decode = q_len <= 1
    tile_n = 32 if decode else 64
    block_q = min(1 if decode else max(1, 128 // G), _pow2(max(q_len, 1)))
    block_m = max(16, _pow2(block_q * G))
    splits = 1
    if decode:
        s = max(1, min(_cdiv(8 * sms, max(B * KVH, 1)), _cdiv(max(seq_len, 1), 2 * tile_n), 64))
        splits = 1 << (s.bit_length() - 1)
    return tile_n, block_q, block_m, splits, 4 if block_m <= 16 else 8, 2 if decode else 3


def old_greedy_splits(V: int) -> tuple[int, int]:
    chunk = _cdiv(_cdiv(V, 128), 2048) * 2048
    return chunk, _cdiv(V, chunk)


def old_block_v(batch: int, hv: int, dv: int) -> int:
    return 32 if batch * hv * _cdiv(dv, 32) >= 512 else 16


def old_vision_block_m(longest: int, seqs: int, heads: int, sms: int = 132) -> int:
    return 128 if _cdiv(longest, 128) * seqs * heads >= 2 * sms else 64


LINEAR_SHAPES = [*OLD_MEASURED, (2048, 4096), (4096, 2048), (151936, 4096), (1, 64), (50, 200), (8192, 8192),
                 (3072, 1024), (248320, 4096), (16, 65536), (12288, 4096)]
ATTENTION_CASES = [(b, kvh, g, q, s) for b in (1, 2, 8, 64) for kvh in (1, 2, 4, 8) for g in (1, 4, 8)
                   for q, s in ((1, 1), (1, 100), (1, 8192), (1, 262144), (7, 300), (512, 4096), (2048, 2048))]


@pytest.mark.parametrize("device", [H200, tuning.CPU], ids=["h200", "cpu"])
def test_h200_and_its_cpu_stand_in_keep_the_old_choices(device):
    for N, K in LINEAR_SHAPES:
        assert t_linear.default_config(N, K, device) == old_linear(N, K), (N, K)
    assert tuning.choices("linear", device)["prefetch_tiles"] == 1
    for tokens in (1, 2, 8, 16, 17, 100, 256, 257, 512, 1000, 1024, 3000, 3072, 3073, 65536):
        for dtype in (torch.bfloat16, torch.float32):
            cfg = moe_shared.default_config(tokens, dtype, device)
            assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) == old_moe(tokens, dtype)
    assert moe_shared.one_token_tiles(device) == moe_shared.OneTokenTiles()
    for case in ATTENTION_CASES:
        assert t_attention.launch_config(*case, device) == old_attention(*case), case
    for V in (5, 2048, 3001, 151936, 248320, 270_001):
        assert sampling.splits(V, tuning.choices("sampling", device)["programs_per_row"]) == old_greedy_splits(V)
    for batch in (1, 2, 3, 4, 8, 64):
        for hv, dv in ((32, 128), (16, 128), (64, 128), (8, 256)):
            assert default_block_v(batch, hv, dv, device) == old_block_v(batch, hv, dv)
    for longest in (16, 128, 1024, 4096, 16384):
        for seqs, heads in ((1, 16), (2, 16), (1, 12), (4, 24)):
            assert vision_attention.default_block_m(longest, seqs, heads, device) == \
                old_vision_block_m(longest, seqs, heads)


def test_the_cpu_entry_is_explicit_in_every_table():
    for family in tuning.FAMILIES:
        assert tuning.table(family)["devices"]["cpu"] == {"same_as": "NVIDIA H200"}
        assert tuning.known_entry(family, tuning.CPU) == "cpu"
        assert tuning.known_entry(family, H200) == "NVIDIA H200"


def test_the_h100_sxm_runs_the_h200_entries_it_measured_faster_with():
    """An H100 SXM (132 SMs, like the H200) decoded 9B 6 % and 0.8B 8-15 % slower under the generic rule than under
    the H200's entries (docs/kernels.md, "Tuning tables"): its entry repeats the H200's until it has its own."""
    for family in tuning.FAMILIES:
        assert tuning.known_entry(family, H100) == H100.name
        if family in MEASURED_ON_H100:
            continue
        assert tuning.table(family)["devices"][H100.name] == {"same_as": "NVIDIA H200"}
        assert tuning.choices(family, H100) == tuning.choices(family, H200)


# Families whose H100 entry is its own sweep (`scripts/gpu tune` on an H100): the quantized linears' shapes.
MEASURED_ON_H100 = {"linear_quant"}


def test_the_h100_has_its_own_quantized_linear_shapes():
    shapes = tuning.choices("linear_quant", H100)["shapes"]
    assert {"fp8_e4m3_block:4096x4096", "nvfp4:24576x4096"} <= set(shapes)
    assert t_linear_quant.default_config("fp8_e4m3_block", 4096, 12288, H100) == (32, 128, 8, 4, 3)
    assert tuning.choices("linear_quant", H200)["shapes"] == {}  # the H200 keeps the rule until measured


@pytest.mark.parametrize("device", [H100_PCIE, A100, tuning.DeviceKey("NVIDIA H200", 100),
                                    tuning.DeviceKey(H100.name, 114)])
def test_other_devices_get_the_generic_rule_scaled_by_their_sms(device):
    """Not the H200's entries: a name and SM count that is not a measured entry's takes the generic rule, whose
    per-SM choices follow the device's SM count and which holds no per-shape measurements."""
    for family in tuning.FAMILIES:
        assert tuning.known_entry(family, device) is None
    sms = device.sms
    linear = tuning.choices("linear", device)
    assert linear["programs"] == 2 * sms and linear["shapes"] == {}
    for N, K in LINEAR_SHAPES:  # the rule, never a measured shape's entry
        blocks_n, split = _cdiv(N, 32), 1
        while blocks_n * split < 2 * sms and K // (split * 2) >= 256:
            split *= 2
        assert t_linear.default_config(N, K, device) == (32, 256 if split == 1 else 128, split, 4, 3)
    assert tuning.choices("attention", device)["decode_programs"] == 8 * sms
    for case in ATTENTION_CASES:
        assert t_attention.launch_config(*case, device) == old_attention(*case, sms=sms), case
    assert tuning.choices("sampling", device)["programs_per_row"] == sms
    assert tuning.choices("gdn", device)["wide_programs"] == 4 * sms
    assert tuning.choices("vision_attention", device)["wide_programs"] == 2 * sms
    # The largest MoE tile keeps 3 stages, which fit a 164 KiB shared memory (the H200 entry has 4).
    assert moe_shared.default_config(65536, torch.bfloat16, device).num_stages == 3
    assert moe_shared.default_config(65536, torch.bfloat16, H200).num_stages == 4


def test_device_key_of_a_cpu_tensor_is_the_stand_in():
    assert tuning.device_key(torch.zeros(1)) == tuning.CPU
    assert tuning.device_key(torch.device("cpu")) == tuning.CPU


def test_tuning_dir_replaces_the_packaged_tables(tmp_path, monkeypatch):
    for family in tuning.FAMILIES:
        shutil.copy(tuning.PACKAGED / f"{family}.json", tmp_path)
    data = json.loads((tmp_path / "linear.json").read_text())
    data["devices"]["NVIDIA H200"]["shapes"]["4096x4096"] = [32, 64, 2]
    (tmp_path / "linear.json").write_text(json.dumps(data))
    monkeypatch.setenv("NINFER_TUNING_DIR", str(tmp_path))
    assert tuning.tables_dir() == tmp_path
    assert t_linear.default_config(4096, 4096, tuning.CPU) == (32, 64, 2, 4, 3)  # through the cpu mirror
    monkeypatch.delenv("NINFER_TUNING_DIR")
    assert t_linear.default_config(4096, 4096, tuning.CPU) == (64, 128, 4, 4, 3)


def test_broken_tables_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("NINFER_TUNING_DIR", str(tmp_path))
    with pytest.raises(tuning.TuningError, match="does not exist"):
        tuning.choices("linear", H200)
    (tmp_path / "gdn.json").write_text("{")
    with pytest.raises(tuning.TuningError, match="not JSON"):
        tuning.choices("gdn", H200)
    (tmp_path / "sampling.json").write_text(json.dumps({
        "generic": {"programs_per_row_per_sm": 1}, "devices": {"NVIDIA H200": {"sms": 132}}}))
    with pytest.raises(tuning.TuningError, match="lacks"):
        tuning.choices("sampling", H200)
    with pytest.raises(tuning.TuningError, match="cpu"):
        tuning.choices("sampling", tuning.CPU)
    with pytest.raises(tuning.TuningError, match="no tuning family"):
        tuning.choices("conv1d", H200)


def test_tune_refuses_without_cuda_in_one_line(capsys):
    from ninfer.ops.triton import tune

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine would run the sweeps")
    assert tune.main(["--kernels", "sampling"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device" in err
    with pytest.raises(SystemExit):
        tune.main(["--kernels", "conv1d"])


def test_tune_candidates_step_one_field_at_a_time():
    from ninfer.ops.triton import tune

    around = tune._neighbours((16, 64, 128, 4, 4))
    assert around[0] == (16, 64, 128, 4, 4) and len(set(around)) == len(around)
    assert all(sum(a != b for a, b in zip(c, around[0], strict=True)) == 1 for c in around[1:])
    start = tune._start("attention", H100_PCIE)  # the generic rule for a device without an entry
    assert start["decode_programs"] == 8 * 114 and start["sms"] == 114
    assert tune._start("linear", H200)["programs"] == 256  # a measured entry starts from itself


def test_every_sweep_writes_an_entry_the_tables_then_give(tmp_path, monkeypatch):
    """Every family's sweep, run in the interpreter at tiny shapes with a timer that prefers one candidate,
    writes this device's entry beside the others; NINFER_TUNING_DIR on that folder then gives its choices."""
    from ninfer.ops.triton import tune

    if torch.cuda.is_available():
        pytest.skip("the interpreter sweep is for machines without CUDA")
    favour = {"block_n": 64, "block_k": 128, "split_k": 2, "tile_n": 16, "programs_per_row": 9, "block_v": 16}

    def timer(fn):  # a thunk with a favoured keyword is "faster"; every candidate still runs once
        fn()
        return 1.0 - 0.1 * sum(fn.keywords.get(k) == v for k, v in favour.items())

    shapes = tune.Geometry(kv_heads=1, group=2, head_dim=16, page=4, context=16, gdn_heads=(1, 2, 16, 64),
                           moe=(32, 4, 16, 2), vocab=5000, batches=(1,), linear_shapes=("64x256",), moe_tokens=4,
                           quant_shapes=("64x256",))
    # the quantized linears' knobs, two values where the favoured one is among them (the interpreter is slow)
    monkeypatch.setattr(tune, "QUANT_STEPS", {f: ((64,), (64, 128), (1, 2), (4,), (3,)) for f in tune.QUANT_STEPS})
    bench = tune.Bench(torch.device("cpu"), timer, shapes)
    key = tuning.DeviceKey("Test GPU", 9)
    for family in tuning.FAMILIES:
        tune.write_entry(family, key, tune.SWEEPS[family](bench, key), tmp_path)
        table = json.loads((tmp_path / f"{family}.json").read_text())
        assert table["devices"]["NVIDIA H200"] == tune._thawed(tuning.table(family)["devices"]["NVIDIA H200"])
    monkeypatch.setenv("NINFER_TUNING_DIR", str(tmp_path))
    assert tuning.known_entry("linear", key) == "Test GPU"
    assert t_linear.default_config(64, 256, key) == (64, 128, 2, 4, 3)
    assert t_linear.default_config(4096, 4096, key) == (32, 256, 1, 4, 3)  # unswept: the rule, 2 programs per SM
    assert tuning.choices("attention", key)["decode_tile_n"] == 16
    assert tuning.choices("sampling", key)["programs_per_row"] == 9  # 1 per SM
    assert tuning.choices("gdn", key)["wide_programs"] == 1 << 30  # wide never timed faster
    assert tuning.choices("moe", key)["largest"] == (128, 256, 64, 8, 3)  # ties keep the generic start
    assert tuning.choices("vision_attention", key)["wide_programs"] == 18
    for fmt, block_k in (("fp8_e4m3_block", 128), ("nvfp4", 256)):
        assert t_linear_quant.default_config(fmt, 64, 256, key) == (64, 128, 2, 4, 3)
        assert t_linear_quant.default_config(fmt, 4096, 4096, key) == (64, block_k, 1, 4, 3)  # unswept: the rule
