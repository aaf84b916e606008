"""Native Qwen3.5 Startup: artifact -> weights -> Parameters -> capacity plan -> Frontend + Program.

Only the selected features are bound and read (Text; with ``speculative="mtp"`` the MTP head too;
Vision and the DFlash backends are refused clearly until they exist). The device plan is the shared one (``ninfer.core.device_plan``: KV
pages from the budget after weights, StateImages, workspace and headroom; host budget; PDL); Qwen3.5
supplies its activation width per token for the workspace estimate. Options arrive typed and validated
(``ninfer.contract.StartupOptions``).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ninfer.contract.config import StartupOptions
from ninfer.contract.model import ModelInstance
from ninfer.core.device import Device, dtype_name, torch_dtype
from ninfer.core.device_plan import plan_device, resident_bytes
from ninfer_qwen35.config import Qwen35Config, parse_config


class StartupError(ValueError):
    """The artifact, the selected features or the budget cannot make a working instance."""


@attrs.frozen(kw_only=True, eq=False)
class Qwen35Loaded:
    """The read-only Model: config, bound weights and how they were loaded."""

    config: Qwen35Config
    weights: Any
    load_report: Any
    executor: Any  # Qwen35Model, the fixed model calls


def build(artifact: Any, options: StartupOptions) -> ModelInstance:
    """Build the Qwen3.5 ModelInstance for an opened artifact (``ninfer.contract.Startup``)."""
    from ninfer.artifact import load_weights
    from ninfer.models.common.qwen import QwenFrontend
    from ninfer_qwen35.execution.model import Qwen35Model
    from ninfer_qwen35.execution.mtp import Qwen35MTP
    from ninfer_qwen35.execution.parameters import MTPParams, Qwen35Parameters
    from ninfer_qwen35.program import Qwen35Program
    from ninfer_qwen35.program.mtp_program import Qwen35MTPProgram, verify_steps
    from ninfer_qwen35.state import kv_pools, state_layout

    features, max_concurrency, page_size = options.features, options.max_concurrency, options.page_size
    if features.vision:
        raise StartupError("Qwen3.5 Vision is not implemented yet; start without the vision feature")
    if features.speculative not in (None, "mtp"):
        raise StartupError(f"speculative backend {features.speculative!r} is not implemented yet for Qwen3.5")
    dev = Device.parse(options.device)
    config = parse_config(artifact.config)
    k = features.draft_tokens
    if k and not config.mtp_num_hidden_layers:
        raise StartupError("speculative='mtp' needs an MTP head, and this model's config has "
                           "mtp_num_hidden_layers = 0")
    frontend = QwenFrontend.from_resources(artifact.frontend, chat_template_override=options.chat_template,
                                           special_tokens_in_content=options.special_tokens_in_content)

    weights, report = load_weights(artifact, features=("text", "mtp") if k else ("text",), device=str(dev))
    compute = torch_dtype(options.dtype) if options.dtype is not None else weights["model.embed_tokens.weight"].dtype
    if compute not in (torch.float32, torch.bfloat16, torch.float16):
        raise StartupError(f"compute dtype must be float32, bfloat16 or float16, got {compute}")
    params = Qwen35Parameters.from_weights(config, weights, compute, dev.torch)
    executor = Qwen35Model(params)
    fixed = [*weights.parents.values(), *params.tensors()]
    mtp = steps = None
    if k:
        mtp = Qwen35MTP(MTPParams.from_weights(config, weights, compute, dev.torch), executor)
        steps = verify_steps(config, rows=max_concurrency, draft_tokens=k, dtype=compute, device=dev.torch)
        fixed += [*mtp.params.tensors(), steps.conv, steps.recurrent]
    layout = state_layout(config, dtype_name(compute))
    pools = kv_pools(config, page_size=page_size, dtype=dtype_name(compute),
                     mtp_layers=config.mtp_num_hidden_layers if k else 0)
    if len(pools) != 1:
        raise StartupError(f"this Program runs exactly one KV pool (the attention layers); the config gives "
                           f"{len(pools)}")
    (pool_spec,) = pools
    # The workspace a prefill chunk holds per token: residual stream and projections, MLP, conv, logits rows.
    width = 4 * config.hidden_size + 2 * config.intermediate_size + 2 * config.conv_dim + config.vocab_size // 8
    plan = plan_device(options, dev, compute=compute,
                       weight_bytes=resident_bytes(fixed),
                       layers=config.num_hidden_layers, state_layout=layout, kv_pool=pool_spec,
                       activation_width=width, model_limit=config.max_position_embeddings)
    common = dict(state_layout=layout, kv_pool=pool_spec, device=dev, max_concurrency=max_concurrency,
                  num_pages=plan.kv_pages, kv_dtype=compute, vocab_size=config.vocab_size,
                  host_budget_bytes=plan.host_budget_bytes, sampling_defaults=frontend.sampling_defaults(),
                  max_model_len=plan.max_model_len, cuda_graphs=options.cuda_graphs, pdl=plan.pdl,
                  checkpoint_slots=plan.checkpoint_slots, cache_host_budget_bytes=plan.cache_host_budget_bytes)
    if k:
        program = Qwen35MTPProgram(executor, mtp=mtp, steps=steps, draft_tokens=k, **common)
    else:
        program = Qwen35Program(executor, **common)
    program.plan = plan
    model = Qwen35Loaded(config=config, weights=weights, load_report=report, executor=executor)
    return ModelInstance(architecture="qwen35", config=config, model=model, parameters=params, frontend=frontend,
                         program=program)
