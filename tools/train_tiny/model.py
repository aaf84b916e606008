"""The tiny Qwen3.5: transformers' Qwen3_5ForCausalLM plus an MTP block with the exact Qwen3.5 structure.

Dimensions keep the family's per-head geometry (attention head_dim 256 with 64 rotary dims, GDN heads of
128) so the engine's kernels see the same shapes as on the published models; only the head counts and the
width shrink.
"""

from __future__ import annotations

import copy

import torch
from tokenizer import VOCAB_SIZE
from torch import nn
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

MAX_POSITIONS = 2048


def tiny_config(eos_ids: list[int], pad_id: int, intermediate: int = 768) -> Qwen3_5TextConfig:
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=intermediate, num_hidden_layers=8,
        num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, tie_word_embeddings=True,
        eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=None,
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    return config


class MTPBlock(nn.Module):
    """Qwen3.5 multi-token prediction: [norm(embed(x_{t+1})); norm(h_t)] -> fc -> one full-attention layer ->
    norm, then the shared head predicts x_{t+2}. Parameter names match the checkpoint's `mtp.*`."""

    def __init__(self, config: Qwen3_5TextConfig):
        super().__init__()
        H = config.hidden_size
        layer_config = copy.deepcopy(config)
        layer_config.layer_types = ["full_attention"]
        layer_config.num_hidden_layers = 1
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, 0)])
        self.norm = Qwen3_5RMSNorm(H, eps=config.rms_norm_eps)

    def fuse(self, next_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer input fc([norm(embed(x_{t+1})); norm(h_t)])."""
        return self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def decode(self, x: torch.Tensor, position_embeddings, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The layer and the final norm over fused inputs; `attention_mask` (bool, True = attend) replaces the
        causal pattern when the entries are not one plain sequence (chained drafts)."""
        for layer in self.layers:
            # No mask: sdpa runs causal when the mask is None (checked by check_mtp_causal).
            x = layer(x, position_embeddings=position_embeddings, attention_mask=attention_mask)
        return self.norm(x)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
        return self.decode(self.fuse(next_embeds, hidden), position_embeddings)


class TinyQwen35(nn.Module):
    """Main model and MTP block; `losses` returns (next-token loss, next-next-token loss)."""

    def __init__(self, config: Qwen3_5TextConfig, init_std: float = 0.02):
        super().__init__()
        self.lm = Qwen3_5ForCausalLM(config)
        self.mtp = MTPBlock(config)
        for module in self.mtp.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=init_std)

    def positions(self, batch: int, length: int, device) -> torch.Tensor:
        return torch.arange(length, device=device).view(1, 1, -1).expand(3, batch, -1)

    def rope(self, x: torch.Tensor, positions: torch.Tensor):
        """cos / sin of the main model's rotary embedding at `positions` [B, L] (text positions)."""
        return self.lm.model.rotary_emb(x, positions[None].expand(3, -1, -1))

    def mtp_hidden(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP block's normed output [B, L-1, H] from the main model's final-normed hidden [B, L, H]."""
        B, L = ids.shape
        h = hidden[:, :-1]
        rope = self.lm.model.rotary_emb(h, self.positions(B, L - 1, ids.device))
        return self.mtp(self.lm.model.embed_tokens(ids[:, 1:]), h, rope)

    def forward_all(self, ids: torch.Tensor):
        """Logits of the main head [B, L, V] and of the MTP head [B, L-1, V] (position t predicts x_{t+2})."""
        hidden = self.lm.model(input_ids=ids).last_hidden_state     # final-normed, as the MTP expects
        return self.lm.lm_head(hidden), self.lm.lm_head(self.mtp_hidden(ids, hidden))

    def losses(self, ids: torch.Tensor):
        logits, mtp_logits = self.forward_all(ids)
        V = logits.shape[-1]
        main = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1))
        mtp = nn.functional.cross_entropy(mtp_logits[:, :-1].reshape(-1, V).float(), ids[:, 2:].reshape(-1))
        return main, mtp

    def load_export_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors (`export_state_dict`'s names, any dtype) into this model, as fp32."""
        main = {k: v.float() for k, v in state.items() if not k.startswith("mtp.")}
        missing = self.lm.load_state_dict(main, strict=False).missing_keys
        if set(missing) - {"lm_head.weight"}:
            raise ValueError(f"the weights lack {sorted(set(missing) - {'lm_head.weight'})}")
        self.lm.tie_weights()
        self.mtp.load_state_dict({k[4:]: v.float() for k, v in state.items() if k.startswith("mtp.")})

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """HF checkpoint names: the main model's own names (lm_head dropped when tied) plus `mtp.*`."""
        out = {k: v for k, v in self.lm.state_dict().items()
               if not (k == "lm_head.weight" and self.lm.config.tie_word_embeddings)}
        out.update({f"mtp.{k}": v for k, v in self.mtp.state_dict().items()})
        return out


def run_intermediate(log: dict) -> int:
    """The MLP width a train.py run used (its log keeps the arguments as strings)."""
    return int(log["args"].get("intermediate", 768))


def add_residual_dropout(model: TinyQwen35, p: float) -> None:
    """Dropout on every mixer's and MLP's output before it joins the residual stream, and on the embeddings
    (GPT-2's resid / embd dropout). transformers' Qwen3.5 has attention-probability dropout only; with 1.4 M
    tokens of text the model overfits after a few epochs without it. Active in train() mode only."""
    if p <= 0:
        return

    def drop(module, args, output):
        if isinstance(output, tuple):
            return (nn.functional.dropout(output[0], p, module.training), *output[1:])
        return nn.functional.dropout(output, p, module.training)

    layers = [*model.lm.model.layers, *model.mtp.layers]
    for layer in layers:
        mixer = layer.linear_attn if layer.block_type == "linear_attention" else layer.self_attn
        mixer.register_forward_hook(drop)
        layer.mlp.register_forward_hook(drop)
    model.lm.model.embed_tokens.register_forward_hook(drop)


def check_mtp_causal(model: TinyQwen35, ids: torch.Tensor) -> None:
    """Changing the last token must not move any earlier MTP output (the no-mask causal path is real)."""
    with torch.no_grad():
        _, a = model.forward_all(ids)
        changed = ids.clone()
        changed[:, -1] = (changed[:, -1] + 1) % model.lm.config.vocab_size
        _, b = model.forward_all(changed)
    if not torch.allclose(a[:, :-1].float(), b[:, :-1].float(), atol=1e-4, rtol=1e-3):
        raise RuntimeError("MTP layer is not causal without a mask on this transformers version")
