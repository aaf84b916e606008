"""Quantized checkpoints end to end on the CPU: a tiny Qwen3.5 (dense and MoE) written in each published format
with the published tensor names (or bf16 and ``--quantize``), through ``ninfer convert`` and ``ninfer inspect``,
then ``ninfer.Engine`` against Hugging Face transformers in fp32 with its weights set to the dequantized source
tensors; and ``ninfer plan`` counting the stored quantized bytes.

The oracle's dequantization is written here from each format's published definition (not ninfer's
``QuantizedWeight.dequantize``). On the CPU a quantized linear runs weight-only (the weight dequantized, the
input in fp32), so both sides compute the same fp32 model: they differ only in fp32 operation order, and the
tolerances are those of the unquantized oracle tests (tests/test_engine_moe.py, tests/test_score.py): prompt
logprobs within 1e-4, greedy tokens equal wherever transformers' top-2 logits are more than 1e-3 apart.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("ninfer_convert")

from safetensors.torch import load_file, save_file  # noqa: E402

from ninfer.artifact import load_weights, open_artifact  # noqa: E402
from ninfer.cli import main as ninfer_main  # noqa: E402
from ninfer.contract import EngineConfig  # noqa: E402
from ninfer.contract.prompt import TextInput  # noqa: E402
from ninfer.contract.quant import QUANTIZED_FORMATS  # noqa: E402
from ninfer.contract.request import GenerationRequest, SamplingParams  # noqa: E402
from ninfer_qwen35.testing.checkpoints import make_tiny_checkpoint  # noqa: E402
from ninfer_qwen35.testing.hf_model import agree_where_decisive  # noqa: E402
from ninfer_qwen35.testing.quantized_checkpoints import quantize_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

LOGPROB_ATOL = 1e-4  # fp32 both sides over the same weight values: only the order of fp32 operations differs
# FP8 blocks are 128 x 128: these dims let every MLP and attention projection fill whole blocks.
DIMS128 = dict(hidden_size=128, head_dim=32, num_key_value_heads=4, intermediate_size=256)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
BASES = {"dense": dict(DIMS128), "moe": dict(moe=True),
         "moe128": dict(moe=True, hidden_size=128, head_dim=32, num_key_value_heads=4, moe_intermediate_size=128,
                        shared_expert_intermediate_size=128)}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("qe2e")
    return {k: make_tiny_checkpoint(root / k, mtp=False, seed=7, **kw) for k, kw in BASES.items()}


def cli(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = ninfer_main(list(args))
    assert rc == 0, (args, out.getvalue())
    return out.getvalue()


# -- the oracle: each published format's dequantization --------------------------------------------------------

def _fp8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 times its scale (a multiplier, also where Qwen names it ``scale_inv``): one per tensor, per output
    row ``[N, 1]``, or per 128 x 128 block ``[ceil(N/128), ceil(K/128)]``."""
    w, s = data.double(), scale.double()
    if s.numel() == 1:
        return w * s.reshape(())
    if s.shape[-1] == 1 and s.shape[-2] == w.shape[-2]:
        return w * s
    n, k = w.shape[-2:]
    return w * s.repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k]


def _nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: float) -> torch.Tensor:
    """e2m1 pairs (element 2j in the low nibble) times an e4m3 scale per 16 inputs times the global multiplier."""
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).long()
    return E2M1[codes] * scale.double().repeat_interleave(16, -1) * global_scale


def published_dequantized(ckpt: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights in float (fp32), quantized ones dequantized by their format's definition,
    per-expert weights stacked into the published banks; scales and activation scales dropped."""
    src: dict[str, torch.Tensor] = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        src.update(load_file(str(shard)))
    out: dict[str, torch.Tensor] = {}
    for name, t in src.items():
        if name.endswith(("_scale", "_scale_inv", "_scale_2", "input_scale", "input_global_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = _fp8(t, src.get(name + "_scale_inv", src.get(name + "_scale")))
        elif t.dtype == torch.uint8:
            base = name.removesuffix("_packed")
            g = float(src[base + "_scale_2"]) if base + "_scale_2" in src else 1 / float(
                src[base + "_global_scale"].double())  # compressed-tensors stores the divisor
            t, name = _nvfp4(t, src[base + "_scale"], g), base
        out[name] = t.float()
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in [n for n in out if _EXPERT.match(n)]:
        prefix, e, kind = _EXPERT.match(name).groups()
        experts.setdefault(prefix, {}).setdefault(int(e), {})[kind] = out.pop(name)
    for prefix, by_expert in experts.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in order])
        out[prefix + ".down_proj"] = torch.stack([x["down"] for x in order])
    return out


def artifact_dequantized(path: Path) -> dict[str, torch.Tensor]:
    """What ``--quantize`` stored, by logical name, each quantized weight dequantized from its planes here."""
    with open_artifact(path) as art:
        weights = load_weights(art, features=("text",))[0]
    out = {}
    for name in weights:
        w = weights[name]
        if isinstance(w, torch.Tensor):
            out[name] = w.float()
        elif w.format == "fp8_e4m3_block":
            assert tuple(w.block) == (128, 128)
            out[name] = _fp8(w.data, w.scale).float()
        else:  # a global scale per output row
            out[name] = (_nvfp4(w.data, w.scale, 1.0) * w.global_scale.double()[..., None]).float()
    return out


def transformers_model(config_dir: Path, tensors: dict[str, torch.Tensor], tmp: Path):
    """transformers' Qwen3.5 of ``config_dir``'s config (its quantization config dropped) over ``tensors``."""
    import transformers

    tmp.mkdir()
    config = json.loads((config_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    kind = "Qwen3_5MoeForCausalLM" if "num_experts" in config else "Qwen3_5ForCausalLM"
    return getattr(transformers, kind).from_pretrained(tmp, dtype=torch.float32).eval()


# -- the engine against the oracle ------------------------------------------------------------------------------


def check_against_transformers(path: Path, hf) -> None:
    import ninfer

    prompt = [int(x) for x in torch.randint(0, 400, (24,), generator=torch.Generator().manual_seed(5))]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].double().log_softmax(-1)[:-1]
    ref = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    config = EngineConfig(device="cpu", dtype="float32", max_concurrency=1, max_model_len=128, context_cache=False)
    with ninfer.Engine(path, config) as eng:
        scored = eng.score(prompt)
        torch.testing.assert_close(torch.tensor(scored.logprobs, dtype=torch.float64), ref, rtol=0,
                                   atol=LOGPROB_ATOL)
        result = eng.generate(GenerationRequest(input=TextInput(token_ids=tuple(prompt)), sampling=SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True)), timeout=120)
        assert agree_where_decisive(hf, prompt, list(result.token_ids)) >= 4
        assert eng.usage().all_free and eng.metrics().outstanding == 0


def check_inspect(path: Path, want_format: str) -> None:
    """``ninfer inspect`` lists every quantized object with its format."""
    text = cli("inspect", str(path))
    with open_artifact(path) as art:
        quantized = {o.id: o.format for o in art.objects.values() if o.format in QUANTIZED_FORMATS}
    assert quantized and set(quantized.values()) == {want_format}
    for oid, fmt in quantized.items():
        assert re.search(rf"^\s+{re.escape(oid)}\s+{fmt}\s+[\d,]+\s", text, re.M), oid


CASES = [  # (id, base, scheme, quantize_tiny_checkpoint keywords, stored format)
    ("qwen-fp8", "dense", "fp8", {}, "fp8_e4m3_block"),
    ("qwen-fp8-bf16-scales", "dense", "fp8", {"scale_dtype": torch.bfloat16}, "fp8_e4m3_block"),
    ("qwen-fp8-moe-banks", "moe", "fp8", {"fused_experts": True}, "fp8_e4m3_block"),
    ("qwen-fp8-moe-per-expert", "moe128", "fp8", {}, "fp8_e4m3_block"),
    ("ct-fp8-channel", "dense", "ct_fp8_channel", {}, "fp8_e4m3_block"),
    ("ct-fp8-block", "dense", "ct_fp8_block", {}, "fp8_e4m3_block"),
    ("ct-fp8-channel-moe", "moe", "ct_fp8_channel", {}, "fp8_e4m3_block"),
    ("modelopt-nvfp4", "dense", "modelopt_nvfp4", {}, "nvfp4"),
    ("modelopt-nvfp4-moe", "moe", "modelopt_nvfp4", {}, "nvfp4"),
    ("ct-nvfp4", "dense", "ct_nvfp4", {}, "nvfp4"),
    ("ct-nvfp4-moe", "moe", "ct_nvfp4", {}, "nvfp4"),
]


@pytest.mark.parametrize(("base", "scheme", "kw", "fmt"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_published_checkpoint_matches_transformers_on_its_dequantized_weights(bases, tmp_path, base, scheme, kw,
                                                                                fmt):
    ckpt = quantize_tiny_checkpoint(shutil.copytree(bases[base], tmp_path / "src"), scheme, **kw)
    out = tmp_path / "q.ninfer"
    cli("convert", str(ckpt), str(out))
    check_inspect(out, fmt)
    check_against_transformers(out, transformers_model(ckpt, published_dequantized(ckpt), tmp_path / "hf"))


@pytest.mark.parametrize(("option", "base"), [("fp8", "dense"), ("fp8", "moe128"), ("nvfp4", "dense"),
                                              ("nvfp4", "moe")])
def test_quantize_option_matches_transformers_on_the_stored_weights(bases, tmp_path, option, base):
    """``--quantize``: the oracle dequantizes the artifact's own planes (the source is bf16); the routed experts
    and the dense projections are quantized, the modules Qwen keeps bf16 are not."""
    out = tmp_path / "q.ninfer"
    cli("convert", str(bases[base]), str(out), "--quantize", option)
    fmt = {"fp8": "fp8_e4m3_block", "nvfp4": "nvfp4"}[option]
    check_inspect(out, fmt)
    with open_artifact(out) as art:
        formats = {o.id: o.format for o in art.objects.values()}
    assert formats["model.embed_tokens.weight"] == formats["lm_head.weight"] == "dense"
    assert formats["model.layers.0.linear_attn.in_proj_qkvzba" + ("[2:4]" if option == "nvfp4" else "")] == "dense"
    assert formats[("model.layers.0.mlp.experts.down_proj" if base.startswith("moe") else
                    "model.layers.0.mlp.down_proj.weight")] == fmt
    check_against_transformers(out, transformers_model(bases[base], artifact_dequantized(out), tmp_path / "hf"))


# -- ninfer plan ------------------------------------------------------------------------------------------------

def _plan_weights(path: Path) -> tuple[int, int]:
    """(``ninfer plan``'s weights figure, the artifact's text-feature object bytes as stored)."""
    plan = json.loads(cli("plan", str(path), "--device", "cpu", "--dtype", "bfloat16", "--json"))
    with open_artifact(path) as art:
        stored = sum(o.nbytes for o in art.objects.values() if o.feature == "text")
    return plan["categories"]["weights"], stored


@pytest.mark.parametrize(("base", "scheme"), [("dense", "--quantize fp8"), ("moe128", "fp8"), ("dense", "fp8"),
                                              ("moe", "ct_fp8_channel"), ("dense", "modelopt_nvfp4")])
def test_plan_counts_the_stored_quantized_bytes(bases, tmp_path, base, scheme):
    """The plan's weights are the stored objects (quantized planes at their stored bytes) plus what preparing the
    bf16 model copies anyway (fp32 GDN parameters cast): a group whose members differ in format (GDN's input
    projection, quantized in_proj_qkv / z beside bf16 in_proj_b / a) is stored as fused runs its matmuls view, so
    nothing is joined into a copy."""
    plain = tmp_path / "bf16.ninfer"
    cli("convert", str(bases[base]), str(plain))
    planned, stored = _plan_weights(plain)
    prepared = planned - stored
    out = tmp_path / "q.ninfer"
    if scheme.startswith("--"):
        cli("convert", str(bases[base]), str(out), *scheme.split())
    else:
        ckpt = quantize_tiny_checkpoint(shutil.copytree(bases[base], tmp_path / "src"), scheme)
        cli("convert", str(ckpt), str(out))
    with open_artifact(out) as art:
        assert any(o.format in QUANTIZED_FORMATS and o.feature == "text" for o in art.objects.values())
    planned, stored = _plan_weights(out)
    assert planned == stored + prepared
