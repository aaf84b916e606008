"""Fixtures shared by the Qwen3.5 Program tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tiny():
    """(transformers model, our config, our model) of one tiny random Qwen3.5 (fp32, CPU)."""
    transformers = pytest.importorskip("transformers")
    from ninfer_qwen35.testing import model_from_hf

    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3_5TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512)
    hf = transformers.Qwen3_5ForCausalLM(hf_cfg).eval()
    model = model_from_hf(hf)
    return hf, model.config, model
