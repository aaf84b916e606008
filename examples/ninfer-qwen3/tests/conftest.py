"""A tiny random Qwen3 checkpoint written by transformers (fp32), with a small Qwen-style tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=1000.0, rms_norm_eps=1e-6)


def write_qwen3_checkpoint(directory: Path, *, tie_word_embeddings: bool = False, seed: int = 0):
    """Write the checkpoint into ``directory``; returns the transformers model (eval, fp32)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from ninfer_qwen35.testing.checkpoints import CHAT_TEMPLATE, make_tokenizer_json

    tokenizer_json, added = make_tokenizer_json()
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**TINY, tie_word_embeddings=tie_word_embeddings,
                                      eos_token_id=added["<|im_end|>"])
    model = transformers.Qwen3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # transformers' init leaves the norms at one; random ones test that each is applied
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
    model.save_pretrained(directory)
    (directory / "tokenizer.json").write_text(tokenizer_json)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [added["<|im_end|>"], added["<|endoftext|>"]], "do_sample": False}))
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def converted(request, tmp_path_factory):
    """(transformers model, path of the converted .ninfer) for an untied and a tied tiny Qwen3."""
    from ninfer_convert.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("qwen3")
    hf = write_qwen3_checkpoint(root / "ckpt", tie_word_embeddings=request.param)
    convert_checkpoint(root / "ckpt", root / "tiny.ninfer")
    return hf, root / "tiny.ninfer"


@pytest.fixture(scope="session")
def make_qwen3_checkpoint():
    """``write_qwen3_checkpoint`` for tests that write their own."""
    return write_qwen3_checkpoint
