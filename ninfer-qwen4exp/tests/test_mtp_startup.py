"""Qwen4Exp Startup with ``speculative="mtp"``: what it refuses before reading weights, and what it builds on a
tiny converted checkpoint: a ``Qwen4ExpMTPProgram`` whose KV pool holds the MTP layer after the attention layers
(its QSA indexer keys paged alike) and whose verify steps (GDN, PLE conv, n-gram) are the profile's backing
bytes."""

from __future__ import annotations

import types

import pytest
import torch

from ninfer.contract.config import StartupFeatures, StartupOptions
from ninfer_qwen4exp.startup import Qwen4ExpStartup, StartupError

pytest.importorskip("transformers")
pytest.importorskip("ninfer_convert")

MTP = StartupFeatures(speculative="mtp", num_draft_tokens=2)
RAW = dict(vocab_size=448, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=16, shared_expert_intermediate_size=16, hc_count=4, hc_lowrank=8,
           eos_token_id=3, layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])


@pytest.mark.parametrize(("raw", "features", "match"), [
    (RAW, ("text",), "mtp_num_hidden_layers = 0"),
    ({**RAW, "mtp_num_hidden_layers": 1}, ("text",), "this artifact has no mtp feature"),
])
def test_mtp_is_refused_before_any_weight_read(raw, features, match):
    artifact = types.SimpleNamespace(config=raw, features=features)  # the refusal reads nothing else
    with pytest.raises(StartupError, match=match):
        Qwen4ExpStartup().profile(artifact, StartupOptions(device="cpu", features=MTP))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from ninfer.artifact import open_artifact
    from ninfer_qwen4exp.testing import convert_tiny, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("q4mtp")
    ckpt = make_tiny_checkpoint(root / "ckpt", variant="full", seed=2)
    with open_artifact(convert_tiny(ckpt, root / "tiny.ninfer")) as art:
        yield art


def test_the_mtp_program_and_its_profile(artifact):
    from ninfer_qwen4exp.program.mtp_program import Qwen4ExpMTPProgram, steps_bytes
    from ninfer_qwen4exp.startup import build
    from ninfer_qwen4exp.state import INDEX_KEYS

    options = StartupOptions(device="cpu", dtype="float32", max_concurrency=2, num_pages=16, context_cache=False,
                             features=MTP)
    profile = Qwen4ExpStartup().profile(artifact, options)
    plain = Qwen4ExpStartup().profile(artifact, StartupOptions(device="cpu", dtype="float32", max_concurrency=2))
    assert profile.features == ("text", "mtp") and plain.features == ("text",)
    assert plain.backing_bytes == 0
    assert profile.placements[0].device_bytes > plain.placements[0].device_bytes  # the MTP block's weights
    inst = build(artifact, options)
    prog, config = inst.program, inst.config
    assert isinstance(prog, Qwen4ExpMTPProgram) and prog.draft_tokens == 2
    attention = len(config.attention_layers)
    assert len(prog.pool.caches()) == attention + 1 and len(prog.views.kv) == attention
    assert len(prog.pool.aux_caches(INDEX_KEYS)) == attention + 1 and len(prog.mtp_index_keys) == 1
    s = prog.steps
    assert s.conv.shape[:2] == s.ple_conv.shape[:2] == s.ngram.shape[:2] == (2, 3)
    assert s.ngram.dtype == torch.int64 and s.recurrent.dtype == torch.float32
    assert profile.backing_bytes == steps_bytes(s) > 0
    assert prog.backing_bytes() >= steps_bytes(s)
    assert "mtp.fc_hidden.weight" in inst.model.weights
