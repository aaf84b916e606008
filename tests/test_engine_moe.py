"""Qwen3.5 MoE end to end on the CPU: a tiny ``Qwen3_5MoeForCausalLM`` checkpoint (published fused expert banks)
through the real converter, then ``ninfer.Engine`` generation and causal scoring against transformers loading
the same checkpoint (fp32 compute over the same bf16 weights)."""

from __future__ import annotations

import pytest
import torch

from ninfer.contract.config import StartupOptions
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine
from ninfer.engine.scoring import CausalScoreCore
from ninfer.engine.startup import build_instance

transformers = pytest.importorskip("transformers")
from ninfer.contract import EngineConfig  # noqa: E402
from ninfer_qwen35.testing.checkpoints import convert_tiny, make_tiny_checkpoint  # noqa: E402
from ninfer_qwen35.testing.hf_model import agree_where_decisive  # noqa: E402

PROMPTS = ["The quick brown fox", "Hello, world! How are", "def main():\n    print("]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    ckpt = make_tiny_checkpoint(root / "ckpt", moe=True, mtp=False, seed=3)
    art = convert_tiny(ckpt, root / "moe.ninfer")
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return art, hf


def test_the_artifact_holds_fused_expert_banks(moe):
    from ninfer.artifact import open_artifact

    art, hf = moe
    c = hf.config
    with open_artifact(art) as a:
        bank = a.bindings["model.layers.0.mlp.experts.gate_up_proj"]
        assert tuple(bank.shape) == (c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size)
        assert a.metadata.architecture == "Qwen3_5MoeForCausalLM"


def test_greedy_generation_matches_transformers(moe):
    art, hf = moe
    eng = Engine(art, EngineConfig(device="cpu", dtype="float32", max_concurrency=3, context_cache=False))
    try:
        requests = [GenerationRequest(input=TextInput(text=t), sampling=SamplingParams(temperature=0.0, max_tokens=12,
                                                                                       ignore_eos=True))
                    for t in PROMPTS]
        results = [h.result(timeout=120) for h in [eng.submit(r) for r in requests]]  # batched together
        compared = 0
        for text, res in zip(PROMPTS, results, strict=True):
            ids = list(eng.frontend.prepare(TextInput(text=text)).token_ids)
            compared += agree_where_decisive(hf, ids, list(res.token_ids))
        assert compared >= 24  # most of the 36 tokens were decisive
        assert eng.usage().all_free
    finally:
        eng.close()


def test_causal_scoring_matches_transformers(moe):
    art, hf = moe
    instance, _, artifact = build_instance(art, StartupOptions(device="cpu", dtype="float32", max_concurrency=1))
    try:
        ids = [int(x) for x in torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(5))]
        result = CausalScoreCore(instance.program, window=128).score(ids)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].double()
        ref = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert result.windows == 1 and result.num_scored == len(ids) - 1
        assert torch.allclose(torch.tensor(result.logprobs, dtype=torch.float64), ref, atol=1e-4)
        assert result.total_nll == pytest.approx(-float(ref.sum()), rel=1e-5)
        assert instance.program.usage().all_free
    finally:
        artifact.close()


def greedy(eng: Engine) -> list[list[int]]:
    """Ten greedy tokens for each prompt, submitted together; every page and slot free afterwards."""
    hs = [eng.submit(GenerationRequest(input=TextInput(text=t), sampling=SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True))) for t in PROMPTS]
    outs = [list(h.result(timeout=120).token_ids) for h in hs]
    assert eng.usage().all_free
    return outs


def test_mtp_speculative_decoding_of_a_moe_model_gives_plain_greedy_tokens(tmp_path):
    """The MoE model's MTP layer has its own sparse block; drafting with it changes no greedy token."""
    from ninfer.contract.config import StartupFeatures

    art = convert_tiny(make_tiny_checkpoint(tmp_path / "ckpt", moe=True, mtp=True, seed=4), tmp_path / "mtp.ninfer")
    outs = {}
    for k in (0, 2):
        eng = Engine(art, EngineConfig(device="cpu", dtype="float32", max_concurrency=2, context_cache=False,
                                       features=StartupFeatures(speculative="mtp", num_draft_tokens=k) if k else StartupFeatures()))
        try:
            outs[k] = greedy(eng)
        finally:
            eng.close()
    assert outs[2] == outs[0]


def test_host_experts_are_chosen_when_the_device_cannot_hold_the_banks_and_give_the_same_tokens(moe):
    """A budget that holds every weight but the routed expert banks: the plan picks the host-experts candidate
    (banks in host memory, everything else on the device), and greedy output is the all-device output."""
    from ninfer.artifact import open_artifact
    from ninfer.core.device_plan import sized
    from ninfer_qwen35.startup import Qwen35Startup

    art, hf = moe
    options = StartupOptions(device="cpu", dtype="float32", max_concurrency=2, context_cache=False)
    with open_artifact(art) as a:
        profile = sized(Qwen35Startup().profile(a, options), options)
    everything, hosted = profile.placements
    assert (everything.name, hosted.name) == ("all-device", "host-experts")
    assert hosted.host_bytes > 0 and hosted.device_bytes + hosted.host_bytes == everything.device_bytes
    others = profile.state_slot_bytes * 3 + profile.workspace_bytes
    assert hosted.staging_bytes > 0 and hosted.expert_bytes > 0 and hosted.experts > 0
    # A one-row step reads the dense weights and k experts per MoE layer, in either placement.
    c = hf.config
    read = hosted.device_bytes + hosted.experts // c.num_experts * c.num_experts_per_tok * hosted.expert_bytes
    assert everything.step_bytes == hosted.step_bytes == read
    budget = hosted.device_bytes + hosted.staging_bytes + others + 64 * profile.kv_page_bytes
    assert everything.device_bytes + others + 2 * profile.kv_page_bytes > budget  # all-device cannot fit
    outs = {}
    for name, kwargs in (("all-device", {}), ("host-experts", {"device_budget_bytes": budget})):
        eng = Engine(art, EngineConfig(device="cpu", dtype="float32", max_concurrency=2, context_cache=False,
                                       **kwargs))
        try:
            assert eng.memory.placement == name
            assert eng.memory.host.weights_bytes == (hosted.host_bytes if name == "host-experts" else 0)
            outs[name] = greedy(eng)
            runtime = eng.instance.program.host_experts
            assert (runtime is not None) == (name == "host-experts")
            if runtime is not None:  # what the budget left beside 64 KV pages went to the cache, or the KV
                assert eng.memory.expert_cache_slots == runtime.cache.slots
                assert runtime.stats.mixed_calls > 0 and runtime.stats.cache_misses > 0
        finally:
            eng.close()
    assert outs["host-experts"] == outs["all-device"]


@pytest.mark.parametrize("cache_experts", [0, 5])
def test_host_experts_stream_prefill_and_mix_decode_with_mtp_and_give_the_same_tokens(tmp_path, monkeypatch,
                                                                                      cache_experts):
    """Forced host experts with a small device cache: prompts of 4 tokens or more stream whole layers (the
    threshold set low), decode and MTP verification split their pairs between cache hits and the CPU team;
    greedy output (with MTP drafting) equals all-device's, and the runtime saw every mode."""
    import gc
    import threading

    from ninfer.contract.config import StartupFeatures

    monkeypatch.setenv("NINFER_MOE_STREAM_TOKENS", "4")
    art = convert_tiny(make_tiny_checkpoint(tmp_path / "ckpt", moe=True, mtp=True, seed=6), tmp_path / "m.ninfer")
    outs, stats = {}, None
    before = set(threading.enumerate())
    for placement in ("all-device", "host-experts"):
        eng = Engine(art, EngineConfig(device="cpu", dtype="float32", max_concurrency=2, context_cache=False,
                                       placement=placement,
                                       features=StartupFeatures(speculative="mtp", num_draft_tokens=2),
                                       expert_cache_bytes=None if placement == "all-device" else cache_experts * _expert_bytes(art)))
        try:
            outs[placement] = greedy(eng)
            runtime = eng.instance.program.host_experts
            if runtime is not None:
                stats = runtime.stats
                assert runtime.cache.slots == cache_experts == eng.memory.expert_cache_slots
        finally:
            eng.close()
    del eng, runtime
    gc.collect()  # the closed engine's Program, its runtime and so its CPU team
    assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("ninfer-cpu")]
    assert outs["host-experts"] == outs["all-device"]
    assert stats.streamed_calls > 0 and stats.streamed_layers > 0 and stats.mixed_calls > 0
    assert stats.cache_misses > 0
    assert (stats.cache_hits > 0) == (cache_experts > 0)


def test_plan_shows_the_host_experts_staging_and_cache(moe, capsys):
    """``ninfer plan --placement host-experts --expert-cache MIB``: the staging buffers and the cache in the table,
    the cache's experts on their own line; JSON carries the slots."""
    import json

    from ninfer.cli import main

    art, _ = moe
    per_expert = _expert_bytes(art)
    mib = -(-3 * per_expert // (1 << 20))
    rc = main(["plan", str(art), "--device", "cuda", "--vram-budget", "4096", "--placement", "host-experts",
               "--expert-cache", str(mib), "--dtype", "float32", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["placement"] == "host-experts"
    assert report["expert_cache_slots"] == min(report["experts"], mib * (1 << 20) // per_expert)
    assert report["categories"]["expert staging"] > 0 and report["categories"]["expert cache"] > 0
    rc = main(["plan", str(art), "--device", "cuda", "--vram-budget", "4096", "--placement", "host-experts",
               "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0 and "expert staging" in out and "routed experts on the device" in out


@pytest.mark.gpu
def test_host_experts_on_cuda_give_the_all_device_tokens(tmp_path, monkeypatch):
    """On CUDA: pinned host banks, the transfer stream, the staging buffers and the cache in device memory;
    streamed prefill (prompts of 4 tokens or more) and mixed decode with MTP give all-device's greedy tokens."""
    from ninfer.contract.config import StartupFeatures

    monkeypatch.setenv("NINFER_MOE_STREAM_TOKENS", "4")
    art = convert_tiny(make_tiny_checkpoint(tmp_path / "ckpt", moe=True, mtp=True, seed=6), tmp_path / "m.ninfer")
    outs, stats = {}, None
    for placement in ("all-device", "host-experts"):
        eng = Engine(art, EngineConfig(device="cuda", dtype="float32", max_concurrency=2, context_cache=False,
                                       placement=placement,
                                       features=StartupFeatures(speculative="mtp", num_draft_tokens=2),
                                       expert_cache_bytes=None if placement == "all-device" else 5 * _expert_bytes(art)))
        try:
            outs[placement] = greedy(eng)
            runtime = eng.instance.program.host_experts
            if runtime is not None:
                stats = runtime.stats
                assert runtime.banks[0][0].is_pinned() and runtime.cache.gate_up.is_cuda
        finally:
            eng.close()
    assert outs["host-experts"] == outs["all-device"]
    assert stats.streamed_calls > 0 and stats.mixed_calls > 0 and stats.cache_hits > 0 and stats.cache_misses > 0


def _expert_bytes(art) -> int:
    from ninfer.artifact import open_artifact
    from ninfer_qwen35.startup import Qwen35Startup

    with open_artifact(art) as a:
        profile = Qwen35Startup().profile(a, StartupOptions(device="cpu", dtype="float32"))
    return profile.placements[-1].expert_bytes
