"""``ninfer plan`` on a sparse Qwen4Exp artifact of the published widths (``benchmarks/sparse.py``: the real converter
over a checkpoint whose data is a hole) at a reduced depth and with a smaller n-gram table, for an 80 GB card: the
n-gram table on the card under ``all-device`` and in host memory under ``host-tables``, the routed experts there
too under ``host-experts``, and a host too small for them is refused by name. The published shape itself is 359 GB of holes: the same code, only slower to write."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("ninfer_qwen4exp")
pytest.importorskip("ninfer_convert")

from benchmarks import architectures  # noqa: E402
from benchmarks.harness import run_with_plugins  # noqa: E402
from benchmarks.shapes import QWEN4EXP_SHAPES  # noqa: E402
from benchmarks.sparse import shape_config, write_sparse_artifact, write_sparse_source  # noqa: E402

SHAPE = "qwen4exp-published"
SMALLER = {"num_hidden_layers": 4, "ngram_vocab_size_base": 100_000}  # PLE stays on the second layer
H100_MIB = 81559  # an 80 GB card's memory
HOST_MIB = 512 << 10


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """The artifact, with its config (published widths, 4 layers)."""
    work = tmp_path_factory.mktemp("sparse")
    art = run_with_plugins(lambda _: write_sparse_artifact(SHAPE, work, **SMALLER), None)
    return art, {**shape_config(SHAPE), **SMALLER}


def _plan(art, *extra, capsys) -> tuple[int, dict]:
    from ninfer.cli import main

    rc = main(["plan", str(art), "--device", "cuda", "--vram-budget", str(H100_MIB), "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_the_published_shape_is_the_cards():
    """The model card's figures: 125B total beside 51B of n-gram table and 4B of MTP (its layer with the embedding
    and head it reads)."""
    cfg = shape_config(SHAPE)
    params = architectures.parameters(cfg, ("text", "mtp"))
    count = {n: math.prod(s) for n, (s, _) in params.items()}
    table = sum(c for n, c in count.items() if ".ngram_embedding." in n)
    mtp = sum(c for n, c in count.items() if n.startswith("mtp."))
    head = count["model.embed_tokens.weight"] + count["lm_head.weight"]
    assert round(table / 1e9) == 51 and round((mtp + head) / 1e9) == 4
    assert int((sum(count.values()) - table - mtp) / 1e9) == 125  # 125.7B
    assert QWEN4EXP_SHAPES[SHAPE]["ple_layer_ids"] == [2] and architectures.parse(cfg).ple_layers == (1,)


def test_the_sparse_source_stores_the_ngram_table_as_its_published_row_chunks(tmp_path):
    cfg = {**shape_config(SHAPE), **SMALLER}
    total = run_with_plugins(lambda _: write_sparse_source(tmp_path / "src", cfg), None)
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())["weight_map"]
    chunks = [n for n in index if ".ngram_embedding.shard_" in n]
    ple = architectures.parse(cfg).ple
    assert len(chunks) == len(ple.shard_rows(0)) == ple.split_parts
    assert "model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight" in index
    assert total == sum(math.prod(s) * b for s, b in architectures.source_tensors(cfg, ("text", "mtp")).values())


def test_plan_puts_the_ngram_table_and_the_experts_where_each_placement_says(sparse, capsys):
    art, cfg = sparse
    table = architectures.ngram_table_bytes(cfg)
    c = architectures.parse(cfg)
    experts = 4 * 512 * 3 * 640 * 2560 * 2  # 4 layers of 512 bf16 experts (the MTP layer's are not started)
    assert table == c.ple.table_rows(0) * 160 * 2
    rc, everything = _plan(art, "--placement", "all-device", "--host-memory", str(HOST_MIB), capsys=capsys)
    assert rc == 0 and everything["fits"], everything
    assert everything["host"]["weights_bytes"] == 0
    rc, host_table = _plan(art, "--placement", "host-tables", "--host-memory", str(HOST_MIB), capsys=capsys)
    assert rc == 0 and host_table["fits"], host_table
    assert host_table["host"]["weights_bytes"] == table
    assert host_table["categories"]["weights"] == everything["categories"]["weights"] - table
    rc, hosted = _plan(art, "--placement", "host-experts", "--host-memory", str(HOST_MIB), capsys=capsys)
    assert rc == 0 and hosted["fits"], hosted
    assert hosted["host"]["weights_bytes"] == table + experts
    assert hosted["categories"]["weights"] == everything["categories"]["weights"] - table - experts
    assert hosted["experts"] == 4 * 512 and 0 < hosted["expert_cache_slots"] <= hosted["experts"]
    assert hosted["kv_tokens"] > 0 and hosted["budget_bytes"] == H100_MIB << 20


def test_plan_names_the_host_memory_a_host_placement_lacks(sparse, capsys):
    art, _ = sparse
    rc, refused = _plan(art, "--placement", "host-experts", "--host-memory", "4096", capsys=capsys)
    assert rc == 1 and not refused["fits"]
    assert "host memory" in refused["error"] and "host-experts" in refused["error"]


@pytest.mark.parametrize("n", [0, 1, 3, 8, 1000, 65537, 5 << 20])
def test_the_closed_form_crc_of_a_hole_is_zlibs(n):
    import zlib

    from benchmarks.sparse import zero_crc

    assert zero_crc(n) == zlib.crc32(bytes(n))
