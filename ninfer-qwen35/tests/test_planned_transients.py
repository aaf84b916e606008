"""The planner sizes Qwen3.5's transients (prefill workspace, CUDA graph estimate) from the widths the plugin
declares (``ModelShape``, ``EncoderNeeds``): the bytes equal what the plugin's own heuristics gave before they
moved into core, for the embedded tiny model, the 9B (with and without the vision tower) and the 35B-A3B.
The expected figures are numbers, computed once from that earlier code."""

from __future__ import annotations

import pytest

import ninfer
from ninfer.artifact import open_artifact
from ninfer.contract import EncoderNeeds, ModelProfile, StartupFeatures, StartupOptions, WeightPlacement
from ninfer.core.device_plan import sized
from ninfer_qwen35.config import parse_config
from ninfer_qwen35.startup import Qwen35Startup, encoder_needs, model_shape

_BASE = {"head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
         "vocab_size": 248320, "full_attention_interval": 4, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
QWEN35_9B = {**_BASE, "architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
             "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
             "linear_num_key_heads": 16, "linear_num_value_heads": 32}
QWEN35_35B_A3B = {**_BASE, "architectures": ["Qwen3_5MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 40,
                  "num_attention_heads": 16, "num_key_value_heads": 2, "linear_num_key_heads": 16,
                  "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
          "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 2304,
          "hidden_act": "gelu_pytorch_tanh", "deepstack_visual_indexes": [], "out_hidden_size": 4096,
          "model_type": "qwen3_5_vision"}
PREPROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                "size": {"shortest_edge": 65536, "longest_edge": 16777216}}

# (max_concurrency, draft tokens) -> (workspace, graph estimate), bfloat16
PUBLISHED = {
    "9b": {(1, 0): (362020864, 5364352), (1, 2): (362020864, 23113344), (4, 0): (362020864, 27417088),
           (4, 2): (362020864, 146090496), (8, 0): (362020864, 70726656), (8, 2): (362020864, 435213312)},
    "35b-a3b": {(1, 0): (266604544, 5317762), (1, 2): (266604544, 22694034), (4, 0): (266604544, 27230728),
                (4, 2): (266604544, 144413256), (8, 0): (266604544, 70353936), (8, 2): (266604544, 431858832)},
}
# the 9B with its vision tower: context -> (workspace on the CPU, on CUDA)
VISION_9B = {262144: (2608857088, 2877292544), 8192: (1304428544, 1572864000), 1024: (370409472, 638844928)}
# the embedded tiny model: (max_concurrency, draft tokens, dtype) -> (workspace, graph estimate)
TINY = {(1, 0, None): (20971520, 4220928), (1, 0, "float32"): (41943040, 4231168),
        (1, 2, None): (20971520, 12822528), (1, 3, "float32"): (41943040, 13025280),
        (4, 0, None): (20971520, 16982016), (4, 2, "float32"): (41943040, 52543488),
        (8, 0, "float32"): (41943040, 34308096), (8, 3, None): (20971520, 108724224)}


def _features(k: int) -> StartupFeatures:
    return StartupFeatures(speculative="mtp", num_draft_tokens=k) if k else StartupFeatures()


def _profile(config, encoder: EncoderNeeds | None = None) -> ModelProfile:
    return ModelProfile(architecture="qwen35", dtype="bfloat16", features=("text",),
                        placements=(WeightPlacement(name="all-device", device_bytes=1),), state_slot_bytes=0,
                        kv_page_bytes=1, page_size=16, shape=model_shape(config), encoder=encoder,
                        model_limit=config.max_position_embeddings, layers=config.num_hidden_layers)


@pytest.mark.parametrize("name,raw", [("9b", QWEN35_9B), ("35b-a3b", QWEN35_35B_A3B)])
def test_published_shapes_plan_the_bytes_the_plugin_heuristics_gave(name, raw):
    profile = _profile(parse_config(raw))
    for (concurrency, k), expected in PUBLISHED[name].items():
        for device in ("cpu", "cuda"):
            options = StartupOptions(device=device, max_concurrency=concurrency, features=_features(k))
            planned = sized(profile, options)
            assert (planned.workspace_bytes, planned.graph_bytes) == expected, (name, concurrency, k, device)


def test_the_9b_vision_encoder_plans_the_bytes_the_plugin_heuristics_gave():
    text = {k: v for k, v in QWEN35_9B.items() if k != "architectures"}
    config = parse_config({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                           "text_config": {**text, "model_type": "qwen3_5_text", "max_position_embeddings": 262144,
                                           "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                               "partial_rotary_factor": 0.25,
                                                               "mrope_section": [11, 11, 10],
                                                               "mrope_interleaved": True}},
                           "vision_config": VISION, "image_token_id": 248056, "video_token_id": 248057,
                           "vision_start_token_id": 248053, "vision_end_token_id": 248054})
    for context, (cpu, cuda) in VISION_9B.items():
        profile = _profile(config, encoder_needs(config, PREPROCESSOR, 2, context))
        for device, expected in (("cpu", cpu), ("cuda", cuda)):
            planned = sized(profile, StartupOptions(device=device, max_concurrency=1, max_model_len=context))
            assert planned.workspace_bytes == expected, (context, device)


def test_the_embedded_model_plans_the_bytes_the_plugin_heuristics_gave():
    with open_artifact(ninfer.default_model_path()) as artifact:
        for (concurrency, k, dtype), expected in TINY.items():
            options = StartupOptions(device="cpu", max_concurrency=concurrency, features=_features(k), dtype=dtype)
            profile = Qwen35Startup().profile(artifact, options)
            assert (profile.workspace_bytes, profile.graph_bytes) == (0, 0)  # the plugin gives widths, not bytes
            planned = sized(profile, options)
            assert (planned.workspace_bytes, planned.graph_bytes) == expected, (concurrency, k, dtype)
