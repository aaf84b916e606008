"""Qwen4ExpMTP against SGLang's ``qwen4_exp_mtp`` formula computed here in plain torch over transformers' own
decoder layer and gated residual (fp32, CPU, the tiny ``full`` checkpoint converted by the real converter):

    R_t      the target's residual after its last layer, before ``model.hyper_connection_mixer`` (captured from
             transformers' forward)
    e        fc_embedding((1 + w) RMS norm of embed(x_{t+1}))
    h        (1 + w) RMS norm of R_t over all S * H features (one RMS)
    R'_s     fc_hidden(h_s) + e for each stream s
    logits   lm_head(mtp.hyper_connection_mixer(indexed-attention layer(R')))

Our draft logits must match at every position: the whole sequence at once (the first pass after a prefill) and one
position at a time over the block's paged KV (chained decode). The checkpoint's MTP weights are made O(1) so the
block's output depends on every part of it.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from ninfer.artifact.materializer import load_weights
from ninfer.artifact.reader import open_artifact
from ninfer_qwen4exp.config import parse_config
from ninfer_qwen4exp.execution.model import Qwen4ExpModel
from ninfer_qwen4exp.execution.mtp import Qwen4ExpMTP, Qwen4ExpMTPParams
from ninfer_qwen4exp.execution.parameters import Qwen4ExpParameters, WeightsError

transformers = pytest.importorskip("transformers")
pytest.importorskip("ninfer_convert")
safetensors = pytest.importorskip("safetensors.torch")

_spec = importlib.util.spec_from_file_location("_oracle", Path(__file__).with_name("test_model_oracle.py"))
_oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_oracle)
Runner, logit_error = _oracle.Runner, _oracle.logit_error
PAGE = 4


def _scale_mtp(ckpt: Path, seed: int) -> None:
    """Give the random ``mtp.*`` tensors O(1) effects (the maker's are small noise)."""
    gen = torch.Generator().manual_seed(seed)
    for shard in sorted(ckpt.glob("*.safetensors")):
        tensors = safetensors.load_file(str(shard))
        for name, t in tensors.items():
            if name.startswith("mtp."):
                if t.dim() == 1:
                    tensors[name] = 0.3 * torch.randn(t.shape, generator=gen)
                else:
                    tensors[name] = torch.randn(t.shape, generator=gen) * (1.5 / math.sqrt(t.shape[-1]))
        safetensors.save_file(tensors, str(shard), metadata={"format": "pt"})



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ninfer_qwen4exp.testing import convert_tiny, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("q4mtp")
    ckpt = make_tiny_checkpoint(root / "ckpt", variant="full", seed=5, experts="fused")
    _scale_mtp(ckpt, seed=6)
    art = open_artifact(convert_tiny(ckpt, root / "tiny.ninfer"))
    weights, _ = load_weights(art, features=("text", "mtp"))
    config = parse_config(art.config)
    model = Qwen4ExpModel(Qwen4ExpParameters.from_weights(config, weights, torch.float32))
    mtp = Qwen4ExpMTP(Qwen4ExpMTPParams.from_weights(config, weights, torch.float32, "cpu"), model)
    return _References(ckpt), config, weights, model, mtp


class _References:
    """SGLang's MTP logits for x_{t+2} at every t < len - 1, from transformers' modules and the checkpoint."""

    def __init__(self, ckpt: Path) -> None:
        self.ckpt = ckpt
        self.target = transformers.Qwen4ExpForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()

    def __call__(self, ids: list[int]) -> torch.Tensor:
        return _reference(self.ckpt, self.target, ids)


def _reference(ckpt: Path, target, ids: list[int]) -> torch.Tensor:
    raw = json.loads((ckpt / "config.json").read_text())
    captured = []
    hook = target.model.hyper_connection_mixer.register_forward_hook(lambda m, args, out: captured.append(args[0]))
    with torch.no_grad():
        target(torch.tensor([ids]))
    hook.remove()
    R = captured[0][0, :-1]  # [T, S * H]
    raw.pop("mtp_num_hidden_layers", None)
    cfg = transformers.Qwen4ExpTextConfig(**{**raw, "num_hidden_layers": 1, "layer_types": ["indexed_attention"],
                                            "ple_layer_ids": []})
    cfg._attn_implementation = "eager"
    block = transformers.Qwen4ExpForCausalLM(cfg).eval()
    tensors = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        tensors.update(safetensors.load_file(str(shard)))
    state = {n.replace("mtp.layers.0.", "model.layers.0.").replace("mtp.hyper_connection_mixer.",
                                                                       "model.hyper_connection_mixer."): t
             for n, t in tensors.items() if n.startswith(("mtp.layers.0.", "mtp.hyper_connection_mixer."))}
    missing, unexpected = block.load_state_dict(state, strict=False)
    assert not unexpected and all(n.startswith(("model.embed_tokens", "lm_head")) for n in missing), missing

    def gemma_norm(x, w):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * (1.0 + w.float())

    S, H, T = cfg.hc_count, cfg.hidden_size, R.shape[0]
    with torch.no_grad():
        e = gemma_norm(target.model.embed_tokens(torch.tensor(ids[1:])), tensors["mtp.pre_fc_norm_embedding.weight"])
        e = e @ tensors["mtp.fc_embedding.weight"].T
        h = gemma_norm(R, tensors["mtp.pre_fc_norm_hidden.weight"]).view(T, S, H)
        fused = (h @ tensors["mtp.fc_hidden.weight"].T + e[:, None]).flatten(1)[None]
        positions = torch.arange(T)[None, None].expand(3, 1, T)
        pos_emb = block.model.rotary_emb(fused, positions)
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = block.model.layers[0](fused, position_embeddings=pos_emb, attention_mask=mask)
        return (block.model.hyper_connection_mixer(out)[0] @ target.lm_head.weight.T).float()


def _prompt(n: int, config) -> list[int]:
    ids = torch.randint(0, config.base.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    ids[7::13] = config.eos_token_id
    return ids.tolist()


def _mtp_caches(config, pages: int):
    b = config.base
    kv = [(torch.full((pages, PAGE, b.num_key_value_heads, b.head_dim), float("nan")),
           torch.full((pages, PAGE, b.num_key_value_heads, b.head_dim), float("nan")))]
    return kv, [torch.full((pages, PAGE, config.qsa.head_dim), float("nan"))]


def _target_residual(model, ids):
    runner = Runner(model, page_size=PAGE)
    seq = runner.new()
    batch = runner.pack([(seq, ids)])
    return model.forward(batch, runner.views, wide=True)


def test_whole_sequence_matches_the_sglang_formula(tiny):
    reference, config, _, model, mtp = tiny
    ids = _prompt(30, config)  # selection active (blocks of 4, 2 kept) and n-grams reset at EOS
    want = reference(ids)
    R = _target_residual(model, ids)[:-1]
    T = R.shape[0]
    pages = list(range(math.ceil(T / PAGE)))
    kv, keys = _mtp_caches(config, len(pages))
    from ninfer.core.batch_assembly import RowInput, build_forward_batch

    batch = build_forward_batch([RowInput(tokens=ids[1:], start=0, slot=0, pages=pages, want_logits=True)], PAGE,
                                torch.device("cpu"))
    got = mtp.logits(mtp.forward(batch, R, kv, keys))
    assert logit_error(got, want) <= 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()  # the drafter's proposal is the formula's


def test_one_position_at_a_time_over_its_kv_matches(tiny):
    reference, config, _, model, mtp = tiny
    ids = _prompt(22, config)
    want = reference(ids)
    R = _target_residual(model, ids)
    T = len(ids) - 1
    pages = list(range(math.ceil(T / PAGE)))
    kv, keys = _mtp_caches(config, len(pages))
    from ninfer.core.batch_assembly import RowInput, build_forward_batch

    for t in range(T):
        batch = build_forward_batch([RowInput(tokens=[ids[t + 1]], start=t, slot=0, pages=pages, want_logits=True)],
                                    PAGE, torch.device("cpu"))
        got = mtp.logits(mtp.forward(batch, R[t:t + 1], kv, keys))
        assert logit_error(got[0], want[t]) <= 1e-4


def test_missing_mtp_weights_are_named(tiny):
    _, config, weights, _, _ = tiny

    class Without:
        def __contains__(self, name):
            return name != "mtp.fc_hidden.weight" and name in weights

        def __getitem__(self, name):
            return weights[name]

    with pytest.raises(WeightsError, match="mtp.fc_hidden.weight"):
        Qwen4ExpMTPParams.from_weights(config, Without(), torch.float32, "cpu")
