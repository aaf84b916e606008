"""The Qwen3.5 vision encoder (Qwen35Vision) vs Hugging Face transformers (fp32, CPU, a tiny random VL model).

The weights reach ours under the logical names the converter writes (``canonical_name`` of the checkpoint's
``model.visual.*``), and once through the real converter on a tiny checkpoint saved by transformers.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from ninfer.models.common.weights import WeightSet
from ninfer_qwen35.config import parse_config
from ninfer_qwen35.execution.parameters import WeightsError
from ninfer_qwen35.execution.vision import Qwen35Vision, VisionConfig, VisionParams
from ninfer_qwen35.source_mapping import canonical_name

RTOL = 1e-5  # max |ours - HF| <= RTOL * max |HF| (fp32)

TEXT = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=2)
# head_dim 16; patch rows of 3 x 2 x 4 x 4 = 96 values; a 10 x 10 learned grid (the test grids up- and down-sample)
VISION = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=4, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, in_channels=3, num_position_embeddings=100, out_hidden_size=48)


@attrs.define
class Tiny:
    hf: torch.nn.Module       # Qwen3_5ForConditionalGeneration
    vision: Qwen35Vision


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """HF's init is near-zero; give every vision weight an O(1) effect (norm scales around 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("pos_embed.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = math.prod(p.shape[1:])
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(fan_in)))


def _vision_weights(state: dict[str, torch.Tensor]) -> WeightSet:
    """The checkpoint's tensors under our logical names, as the converter maps them (vision feature only)."""
    out = {}
    for name, t in state.items():
        mapped = canonical_name(name)
        if mapped is not None and mapped[0] == "vision":
            out[mapped[1]] = t.detach().clone()
    return WeightSet.from_tensors(out)


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION)
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    _randomise(hf.model.visual, seed=1)
    config = parse_config(cfg.to_dict())
    params = VisionParams.from_weights(config, _vision_weights(hf.state_dict()), torch.float32)
    return Tiny(hf=hf, vision=Qwen35Vision(params))


def _pixels(grids, row: int, seed: int) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, row, generator=torch.Generator().manual_seed(seed))


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    err = (ours - ref).abs().max().item()
    assert err <= RTOL * ref.abs().max().item(), f"max |ours - HF| = {err:.3g}, max |HF| = {ref.abs().max():.3g}"


GRIDS = {
    "one_image": [(1, 8, 12)],
    "two_images": [(1, 8, 12), (1, 6, 4)],
    "video_t2": [(2, 6, 8)],
    "mixed": [(1, 2, 2), (2, 4, 10), (1, 12, 14)],
}


@pytest.mark.parametrize("case", sorted(GRIDS))
def test_matches_transformers_visual(tiny, case):
    grids = GRIDS[case]
    pixels = _pixels(grids, tiny.vision.config.patch_values, seed=len(case))
    with torch.no_grad():
        ref = tiny.hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        ours = tiny.vision.forward(pixels, grids)
    assert ours.shape == (sum(t * h * w for t, h, w in grids) // 4, VISION["out_hidden_size"])
    _close(ours, ref)


def test_matches_get_image_and_video_features(tiny):
    images, videos = [(1, 8, 12), (1, 4, 6)], [(2, 4, 4)]
    pix_img, pix_vid = _pixels(images, 96, seed=7), _pixels(videos, 96, seed=8)
    with torch.no_grad():
        ref_img = tiny.hf.get_image_features(pix_img, torch.tensor(images)).pooler_output
        ref_vid = tiny.hf.get_video_features(pix_vid, torch.tensor(videos)).pooler_output
        ours_img = tiny.vision.forward(pix_img, torch.tensor(images))
        ours_vid = tiny.vision.forward(pix_vid, videos)
    assert [r.shape[0] for r in ref_img] == [24, 6]
    _close(ours_img, torch.cat(ref_img))
    _close(ours_vid, torch.cat(ref_vid))


def test_each_frame_attends_only_to_itself(tiny):
    """Images in one batch, and the frames of a video, do not see each other: encoding them apart gives the same."""
    a, b = [(1, 6, 4)], [(2, 4, 8)]
    pa, pb = _pixels(a, 96, seed=3), _pixels(b, 96, seed=4)
    with torch.no_grad():
        together = tiny.vision.forward(torch.cat([pa, pb]), a + b)
        frames = [tiny.vision.forward(pb[i * 32:(i + 1) * 32], [(1, 4, 8)]) for i in range(2)]
        apart = torch.cat([tiny.vision.forward(pa, a), *frames])
    _close(together, apart)  # equal up to fp32 matmul blocking (the row count differs)


def test_bf16_run_stays_near_fp32(tiny):
    """The reference runs in the artifact's bf16 too (RoPE angles still fp32); within bf16 rounding of fp32."""
    weights = _vision_weights(tiny.hf.state_dict())
    params = VisionParams.from_weights(parse_config(tiny.hf.config.to_dict()), weights, torch.bfloat16)
    grids = [(1, 8, 12)]
    pixels = _pixels(grids, 96, seed=11)
    with torch.no_grad():
        ours = Qwen35Vision(params).forward(pixels, grids)
        ref = tiny.vision.forward(pixels, grids)
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - ref).abs().max() <= 0.05 * ref.abs().max()


def test_through_the_converter(tmp_path):
    """A tiny VL checkpoint written by transformers, converted by the real converter: the artifact's vision
    feature drives ours to transformers' image features (bf16 weights, both run in fp32)."""
    transformers = pytest.importorskip("transformers")
    from ninfer.artifact import load_weights, open_artifact
    from ninfer_qwen35.testing.checkpoints import convert_tiny, make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "hf", layout="vl", mtp=False)
    art_path = convert_tiny(ckpt, tmp_path / "tiny.ninfer")
    with open_artifact(art_path) as art:
        weights, _ = load_weights(art, features=("text", "vision"))
        config = parse_config(art.config)
    vision = Qwen35Vision(VisionParams.from_weights(config, weights, torch.float32))
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    grids = [(1, 4, 6), (2, 2, 4)]
    pixels = _pixels(grids, vision.config.patch_values, seed=5)
    with torch.no_grad():
        ref = torch.cat(hf.get_image_features(pixels, torch.tensor(grids)).pooler_output)
        ours = vision.forward(pixels, grids)
    _close(ours, ref)


@pytest.mark.parametrize("pixels_shape, grids, message", [
    ((96, 95), [(1, 8, 12)], r"want \[n_patches, 96\]"),
    ((96,), [(1, 8, 12)], r"want \[n_patches, 96\]"),
    ((95, 96), [(1, 8, 12)], "95 patch rows but grid_thw .* needs 96"),
    ((96, 96), [], "grid_thw is empty"),
    ((96, 96), [(1, 8)], r"grid_thw\[0\].*three positive integers"),
    ((96, 96), [(1, 8, 12), (0, 2, 2)], r"grid_thw\[1\].*three positive integers"),
    ((96, 96), [(1, 8, 12.0)], r"grid_thw\[0\].*three positive integers"),
    ((63, 96), [(1, 7, 9)], r"grid_thw\[0\] = \(1, 7, 9\): h and w must be multiples of the spatial merge size 2"),
])
def test_shape_errors_are_clear(tiny, pixels_shape, grids, message):
    with pytest.raises(ValueError, match=message):
        tiny.vision.forward(torch.zeros(pixels_shape), grids)


def test_integer_pixels_are_refused(tiny):
    with pytest.raises(ValueError, match="floating point"):
        tiny.vision.forward(torch.zeros(4, 96, dtype=torch.int64), [(1, 2, 2)])


def test_weights_and_config_errors(tiny):
    config = parse_config(tiny.hf.config.to_dict())
    tensors = {n: tiny.hf.state_dict()[n] for n in tiny.hf.state_dict() if n.startswith("model.visual.")}
    tensors.pop("model.visual.blocks.1.attn.qkv.bias")
    tensors["model.visual.pos_embed.weight"] = torch.zeros(81, 64)
    with pytest.raises(WeightsError, match=r"1 missing: visual\.blocks\.1\.attn\.qkv\.bias; 1 with the wrong shape: "
                                           r"visual\.pos_embed\.weight \(81, 64\) \(want \(100, 64\)\)"):
        VisionParams.from_weights(config, _vision_weights(tensors))
    with pytest.raises(ValueError, match="no vision_config"):
        VisionConfig.from_config(attrs.evolve(config, vision=None))
    with pytest.raises(ValueError, match="head dim that is a multiple of 4"):
        VisionConfig.from_config(attrs.evolve(config, vision={**config.vision, "num_heads": 32}))
    with pytest.raises(ValueError, match="not a square grid"):
        VisionConfig.from_config(attrs.evolve(config, vision={**config.vision, "num_position_embeddings": 99}))
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported"):
        VisionConfig.from_config(attrs.evolve(config, vision={**config.vision, "rope_parameters": {"rope_type": "mrope"}}))


# -- the CUDA path (bf16 weights on a CUDA device) -----------------------------------------------------------

def _random_params(vision: dict, out_hidden: int, dtype: torch.dtype, device: str = "cpu") -> VisionParams:
    from benchmarks.vision_weights import random_vision_weights, vision_model_config

    config = vision_model_config(vision, out_hidden)
    return VisionParams.from_weights(config, random_vision_weights(config, seed=1, device="cpu"), dtype, device)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


SIZES = {  # vision tower, LM hidden, grids: several lengths, a 4-patch frame, a video, more than one 128-row block
    "tiny": ("TINY_VISION", 96, [(1, 8, 12), (2, 4, 4), (1, 2, 2)]),
    "mid": ("PUBLISHED_VISION", 2048, [(1, 32, 32), (1, 8, 12), (2, 16, 16), (1, 2, 2), (1, 8, 12)]),
}


def test_fast_path_steps_match_the_reference_on_cpu():
    """The CUDA path's steps (tables kept per frame size, positions and bias in one addmm, the packed attention
    op) forced on the CPU in fp32: the reference's function to fp32 rounding, over repeated and new sizes."""
    from benchmarks.vision_weights import TINY_VISION

    params = _random_params(TINY_VISION, 96, torch.float32)
    reference, fast = Qwen35Vision(params), Qwen35Vision(params, fast=True)
    assert not reference.fast and reference.tables is None
    for grids in (SIZES["tiny"][2], [(1, 8, 12)], [(3, 4, 6), (1, 8, 12)]):
        pixels = _pixels(grids, params.config.patch_values, seed=len(grids))
        with torch.no_grad():
            _close(fast.forward(pixels, grids), reference.forward(pixels, grids))
    assert len(fast.tables) == 4  # (8, 12), (4, 4), (2, 2), (4, 6)


def test_frame_tables_are_evicted_by_bytes():
    from benchmarks.vision_weights import TINY_VISION

    params = _random_params(TINY_VISION, 96, torch.float32)
    fast = Qwen35Vision(params, fast=True, table_cache_bytes=(8 * 8) * (64 + 2 * 8) * 4)  # one 8 x 8 frame
    one = fast.tables.frame(8, 8)
    assert fast.tables.frame(8, 8) is one and len(fast.tables) == 1
    fast.tables.frame(4, 4)  # pushes the 8 x 8 frame out
    assert len(fast.tables) == 1 and fast.tables.frame(8, 8) is not one
    fast.tables.frame(16, 16)  # larger than the whole cache: computed, not kept
    assert len(fast.tables) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("ops", ["auto"])  # "triton": the quarantined attention kernel (docs/kernels.md)
def test_cuda_path_matches_fp32_reference(size, ops, monkeypatch):
    """bf16 weights on CUDA take the CUDA path; against the fp32 reference on the same device (TF32 off) its
    relative error is at most 3e-2 and at most 1.5x the bf16 torch reference's own (about 1e-2 for both on
    the CPU at these sizes). ``ops``: the attention as dispatched by default, or the Triton kernel forced."""
    import benchmarks.vision_weights as vw

    monkeypatch.setenv("NINFER_OPS", ops)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    vision, out_hidden, grids = SIZES[size]
    p32 = _random_params(getattr(vw, vision), out_hidden, torch.float32, "cuda")
    p16 = _random_params(getattr(vw, vision), out_hidden, torch.bfloat16, "cuda")
    pixels = _pixels(grids, p32.config.patch_values, seed=9)
    fast = Qwen35Vision(p16)
    assert fast.fast
    with torch.no_grad():
        ref = Qwen35Vision(p32).forward(pixels, grids)
        torch_bf16 = fast.reference(pixels, grids)
        out = fast.forward(pixels, grids)
        again = fast.forward(pixels, grids)  # the frame tables now come from the cache
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.isfinite(out).all() and torch.equal(out, again)
    err, base = _rel(out, ref), _rel(torch_bf16, ref)
    assert err <= 3e-2 and err <= 1.5 * base, f"CUDA path {err:.3e}, bf16 torch reference {base:.3e}"
