"""Native Startup from a real tiny .ninfer artifact: weights, capacity plan, Frontend, Program; clear refusals."""

from __future__ import annotations

import pytest
import torch

from ninfer.contract.batch import RowDecision
from ninfer.contract.config import StartupFeatures, StartupOptions
from ninfer.contract.model import ModelInstance, Program
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import SamplingParams
from ninfer.env import EnvError
from ninfer.plugins import make_plugin_host

pytest.importorskip("transformers")
from ninfer.artifact import open_artifact  # noqa: E402
from ninfer.core.device_plan import PlanError  # noqa: E402
from ninfer_qwen35.startup import Qwen35Startup, StartupError, build  # noqa: E402
from ninfer_qwen35.testing.checkpoints import convert_tiny, make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def artifact_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    return convert_tiny(make_tiny_checkpoint(root / "ckpt", layout="vl", tie_word_embeddings=True),
                        root / "tiny.ninfer")


def test_build_makes_a_working_instance(artifact_path):
    with open_artifact(artifact_path) as art:
        inst = build(art, StartupOptions(device="cpu", max_concurrency=2, dtype="float32", num_pages=40, page_size=8))
    assert isinstance(inst, ModelInstance) and isinstance(inst.program, Program)
    memory = inst.memory
    assert memory.kv_pages == 40 and memory.max_model_len == 320 and inst.model.compute == torch.float32
    assert memory.runtime_reservation_bytes == inst.program.backing_bytes() > 0
    u = inst.program.usage()
    assert (u.state_slots_total, u.kv_pages_total) == (2, 40) and u.all_free
    prompt = inst.frontend.prepare(TextInput(text="The quick brown fox"))
    prog = inst.program
    sid = prog.open_sequence(prompt, SamplingParams(temperature=0.0))
    assert prog.reserve_units(sid, len(prompt))
    batch = prog.prefill(sid, len(prompt))
    prog.commit(batch, [RowDecision(accepted=1)])
    assert prog.reserve_units(sid, 1)
    batch = prog.decode([sid])
    prog.commit(batch, [RowDecision(accepted=1, terminal=True)])
    prog.release(sid)
    assert prog.usage().all_free


def test_startup_is_registered_with_the_plugin(artifact_path):
    spec = make_plugin_host().architecture("Qwen3_5ForConditionalGeneration").spec
    assert spec.load("startup") is Qwen35Startup
    assert spec.provided() == ("startup", "source_mapping")


def test_capacity_from_budget_and_clear_refusals(artifact_path, monkeypatch):
    with open_artifact(artifact_path) as art:
        # text only: 64 MiB is sized to the text model (the encoder's workspace for a context-long image is ~110)
        inst = build(art, StartupOptions(device="cpu", max_concurrency=1, device_budget_bytes=64 << 20,
                                         features=StartupFeatures(vision=False)))
        memory = inst.memory
        assert memory.budget_bytes == 64 << 20 and memory.kv_automatic
        assert memory.weights_bytes + memory.runtime_reservation_bytes + memory.workspace_bytes <= 64 << 20
        assert memory.max_model_len == min(4096, memory.kv_tokens)
        assert inst.model.compute == torch.bfloat16  # the artifact's dtype by default
        with pytest.raises(PlanError, match="does not fit: it needs .* short by"):
            build(art, StartupOptions(device="cpu", max_concurrency=1, device_budget_bytes=1 << 20))
        with pytest.raises(StartupError, match="vision with speculative='mtp' is not supported"):
            build(art, StartupOptions(device="cpu", features=StartupFeatures(vision=True, speculative="mtp")))
        with pytest.raises(StartupError, match="speculative backend 'dflash' is not implemented"):
            build(art, StartupOptions(device="cpu", features=StartupFeatures(speculative="dflash")))
        monkeypatch.setenv("NINFER_HOST_BUDGET_MIB", "lots")
        with pytest.raises(EnvError, match="NINFER_HOST_BUDGET_MIB='lots': expected a whole number of MiB"):
            build(art, StartupOptions(device="cpu", num_pages=4))
        monkeypatch.setenv("NINFER_HOST_BUDGET_MIB", "3")
        memory = build(art, StartupOptions(device="cpu", num_pages=4)).memory
        assert memory.host.snapshot_budget_bytes == 3 << 20


def test_bf16_instance_generates_like_fp32(artifact_path):
    """The artifact's own bf16 weights run the same greedy path (loosely: the first tokens agree)."""
    with open_artifact(artifact_path) as art:
        outs = []
        for dtype in ("float32", "bfloat16"):
            inst = build(art, StartupOptions(device="cpu", max_concurrency=1, dtype=dtype, num_pages=16))
            prompt = inst.frontend.prepare(TextInput(text="Hello, world!"))
            batch = inst.program.prefill(inst.program.open_sequence(prompt, SamplingParams(temperature=0.0)), 64)
            outs.append(batch.rows[0].tokens)
            inst.program.abort_pending(batch)
    assert outs[0] == outs[1]
    assert torch.get_default_dtype() == torch.float32


def test_mtp_feature_binds_the_head_and_decodes_like_plain(artifact_path, tmp_path):
    """speculative="mtp": the MTP weights are bound (only then), the pool holds the MTP layer after the target's,
    and greedy units give plain decoding's tokens; a model without an MTP head is refused by name."""
    from ninfer_qwen35.program.mtp_program import Qwen35MTPProgram

    outs = {}
    with open_artifact(artifact_path) as art:
        for k in (0, 2):
            inst = build(art, StartupOptions(device="cpu", max_concurrency=1, dtype="float32", num_pages=40,
                                             page_size=8, features=StartupFeatures(speculative="mtp", num_draft_tokens=k)
                                             if k else StartupFeatures()))
            prog = inst.program
            assert isinstance(prog, Qwen35MTPProgram) == bool(k)
            assert ("mtp" in inst.model.load_report.features) == bool(k)
            assert prog.decode_span == (4 if k else 1)
            assert prog.kv_pools[0].layers == len(inst.config.attention_layers) + (1 if k else 0)
            sid = prog.open_sequence(inst.frontend.prepare(TextInput(text="The quick brown fox")),
                                     SamplingParams(temperature=0.0))
            assert prog.reserve_units(sid, 64)
            batch = prog.prefill(sid, 64)
            tokens = list(batch.rows[0].tokens)
            prog.commit(batch, [RowDecision(accepted=1)])
            while len(tokens) < 12:
                assert prog.reserve_units(sid, prog.decode_span)
                batch = prog.decode([sid])
                row = batch.rows[0]
                assert row.drafted == k and 1 <= row.produced <= k + 1
                tokens += row.tokens
                prog.commit(batch, [RowDecision(accepted=row.produced)])
            outs[k] = tokens[:12]
            prog.release(sid)
            assert prog.usage().all_free
    assert outs[2] == outs[0]
    bare = convert_tiny(make_tiny_checkpoint(tmp_path / "ckpt", mtp=False), tmp_path / "bare.ninfer")
    with open_artifact(bare) as art, pytest.raises(StartupError, match="mtp_num_hidden_layers = 0"):
        build(art, StartupOptions(device="cpu", features=StartupFeatures(speculative="mtp")))


def test_a_speculative_unit_needs_its_whole_span_held(artifact_path):
    """A verify unit writes decode_span positions per row: without their pages it refuses (PoolExhausted, naming
    what to reserve) rather than let a row's draft positions share the scratch page."""
    from ninfer.core.kv_pool import PoolExhausted

    with open_artifact(artifact_path) as art:
        inst = build(art, StartupOptions(device="cpu", max_concurrency=2, dtype="float32", num_pages=3, page_size=4,
                                         features=StartupFeatures(speculative="mtp", num_draft_tokens=3)))
    prog = inst.program
    hog = prog.open_sequence(inst.frontend.prepare(TextInput(text="ab")), SamplingParams(temperature=0.0))
    sid = prog.open_sequence(inst.frontend.prepare(TextInput(text="The")), SamplingParams(temperature=0.0))
    n = len(prog.sequences.get(sid).ledger)
    assert prog.reserve_units(sid, n)
    batch = prog.prefill(sid, n)
    prog.commit(batch, [RowDecision(accepted=1)])
    assert prog.reserve_units(hog, 4 * prog.pool.allocator.num_free)  # the pool's last free pages go elsewhere
    free = prog.pool.allocator.num_free
    assert free == 0 and prog.kv.needed(prog.sequences.get(sid), n + prog.decode_span - 1) > 0
    with pytest.raises(PoolExhausted, match="reserve_units"):
        prog.decode([sid])
    assert prog.pool.allocator.num_free == free  # nothing taken
    prog.release(hog)
    assert prog.reserve_units(sid, prog.decode_span)
    batch = prog.decode([sid])
    prog.commit(batch, [RowDecision(accepted=batch.rows[0].produced, terminal=True)])
    prog.release(sid)
    assert prog.usage().all_free
