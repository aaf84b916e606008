"""Qwen3 Startup (plugin slot ``startup``, the ``ninfer.contract.Startup`` shape): artifact -> text weights
-> Parameters -> device plan (KV pages, host budget, PDL) -> the shared Qwen Frontend and the Program."""

from __future__ import annotations

import torch

from ninfer.artifact import Artifact, load_weights
from ninfer.contract import ModelInstance, StartupOptions
from ninfer.core.device import Device, dtype_name, torch_dtype
from ninfer.core.device_plan import plan_device, resident_bytes
from ninfer.models.common.qwen import QwenFrontend
from ninfer_qwen3.config import Qwen3Config, parse_config
from ninfer_qwen3.model import Qwen3Model, Qwen3Parameters, kv_pool, state_layout
from ninfer_qwen3.program import Qwen3Program
from ninfer_qwen3.source_mapping import EMBED

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def activation_width(c: Qwen3Config) -> int:
    """Elements per token a prefill chunk's activations hold at once (residual, normed, q/k/v, MLP, logits)."""
    return 4 * c.hidden_size + 2 * c.intermediate_size + (c.num_attention_heads + 2 * c.num_key_value_heads) \
        * c.head_dim + c.vocab_size // 8


def build(artifact: Artifact, options: StartupOptions) -> ModelInstance:
    """Build the Qwen3 ModelInstance for an opened artifact."""
    if options.features.vision or options.features.speculative is not None:
        raise ValueError("the Qwen3 plugin runs text only; start without vision or a speculative backend")
    device = Device.parse(options.device)
    config = parse_config(artifact.config)
    frontend = QwenFrontend.from_resources(artifact.frontend, chat_template_override=options.chat_template,
                                           special_tokens_in_content=options.special_tokens_in_content)
    weights, _ = load_weights(artifact, features=("text",), device=str(device))
    compute = torch_dtype(options.dtype) if options.dtype is not None else weights[EMBED].dtype
    if compute not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be float32, bfloat16 or float16, got {compute}")
    params = Qwen3Parameters.from_weights(config, weights, compute, device.torch)
    pool = kv_pool(config, page_size=options.page_size, dtype=dtype_name(compute))
    plan = plan_device(options, device, compute=compute, layers=config.num_hidden_layers,
                       weight_bytes=resident_bytes([*weights.parents.values(), *params.tensors()]),
                       state_layout=state_layout(config), kv_pool=pool, activation_width=activation_width(config),
                       model_limit=config.max_position_embeddings)
    program = Qwen3Program(Qwen3Model(params), kv_pool=pool, device=device, max_concurrency=options.max_concurrency,
                           num_pages=plan.kv_pages, kv_dtype=compute, host_budget_bytes=plan.host_budget_bytes,
                           sampling_defaults=frontend.sampling_defaults(), max_model_len=plan.max_model_len,
                           cuda_graphs=options.cuda_graphs, pdl=plan.pdl, checkpoint_slots=plan.checkpoint_slots,
                           cache_host_budget_bytes=plan.cache_host_budget_bytes)
    program.plan = plan
    return ModelInstance(architecture="qwen3", config=config, model=program.model, parameters=params,
                         frontend=frontend, program=program)
