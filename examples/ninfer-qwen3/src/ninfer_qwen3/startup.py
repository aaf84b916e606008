"""Qwen3 Startup (plugin slot ``startup``, a ``ninfer.contract.Startup`` class): profile -> load -> instance.

``profile`` says what the model needs from the artifact's header alone: it prepares the very Parameters a load
makes, on the meta device (``meta_weights``), so the weight bytes it reports are what a load allocates (views of
the artifact's parents where dtype and layout allow, copies where not); KV page, workspace and a CUDA graph
estimate complete it. The runtime plans the budget (docs/memory.md); ``load`` reads the text weights and
``instance`` builds a Program of exactly the granted capacity.
"""

from __future__ import annotations

import attrs
import torch

from ninfer.artifact import Artifact, LoadReport, load_weights, meta_weights
from ninfer.contract import (
    ModelInstance,
    ModelProfile,
    ModelShape,
    ProgramCapacity,
    StartupOptions,
    WeightPlacement,
)
from ninfer.core.device import Device, dtype_name, torch_dtype
from ninfer.core.device_plan import resident_bytes
from ninfer.core.kv_pool import PagedKVPool
from ninfer.models.common.qwen import QwenFrontend
from ninfer.models.common.weights import WeightSet
from ninfer_qwen3.config import Qwen3Config, parse_config
from ninfer_qwen3.model import Qwen3Model, Qwen3Parameters, kv_pool, state_layout
from ninfer_qwen3.program import Qwen3Program
from ninfer_qwen3.source_mapping import EMBED

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FEATURES = ("text",)


@attrs.frozen(kw_only=True, eq=False)
class Qwen3Loaded:
    """What ``load`` made: the config, the bound weights, the model over its prepared Parameters, the Frontend."""

    config: Qwen3Config
    weights: WeightSet
    load_report: LoadReport
    model: Qwen3Model
    frontend: QwenFrontend
    compute: torch.dtype


class Qwen3Startup:
    """Qwen3's side of startup: what it needs, its weights, and a Program of a granted capacity."""

    def profile(self, artifact: Artifact, options: StartupOptions) -> ModelProfile:
        config = _checked(artifact, options)
        weights = meta_weights(artifact, features=FEATURES)
        compute = _compute_dtype(options, weights[EMBED].dtype)
        params = Qwen3Parameters.from_weights(config, weights, compute, torch.device("meta"))
        pool = kv_pool(config, page_size=options.page_size, dtype=dtype_name(compute))
        fixed = resident_bytes([*weights.parents.values(), *params.tensors()])
        return ModelProfile(
            architecture=artifact.metadata.architecture, dtype=dtype_name(compute), features=FEATURES,
            placements=(WeightPlacement(name="all-device", device_bytes=fixed),),
            state_slot_bytes=state_layout(config).nbytes_per_slot, kv_page_bytes=PagedKVPool.page_bytes(pool),
            page_size=pool.page_size, shape=ModelShape(
                hidden_size=config.hidden_size, vocab_size=config.vocab_size, mlp_width=2 * config.intermediate_size,
                mixer_width=(config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim),
            model_limit=config.max_position_embeddings, layers=config.num_hidden_layers)

    def load(self, artifact: Artifact, options: StartupOptions, placement: WeightPlacement) -> Qwen3Loaded:
        if placement.host_bytes:
            raise ValueError(f"Qwen3 places every weight on the device; placement {placement.name!r} asks for "
                             f"{placement.host_bytes} host bytes")
        config = _checked(artifact, options)
        device = Device.parse(options.device)
        frontend = QwenFrontend.from_resources(artifact.frontend, chat_template_override=options.chat_template,
                                               special_tokens_in_content=options.special_tokens_in_content,
                                               constraint_limits=options.constraint_limits)
        weights, report = load_weights(artifact, features=FEATURES, device=str(device))
        compute = _compute_dtype(options, weights[EMBED].dtype)
        model = Qwen3Model(Qwen3Parameters.from_weights(config, weights, compute, device.torch))
        return Qwen3Loaded(config=config, weights=weights, load_report=report, model=model, frontend=frontend,
                           compute=compute)

    def instance(self, loaded: Qwen3Loaded, options: StartupOptions, capacity: ProgramCapacity) -> ModelInstance:
        pool = kv_pool(loaded.config, page_size=options.page_size, dtype=dtype_name(loaded.compute))
        program = Qwen3Program(
            loaded.model, kv_pool=pool, device=options.device, max_concurrency=options.max_concurrency,
            capacity=capacity, kv_dtype=loaded.compute, sampling_defaults=loaded.frontend.sampling_defaults(),
            cuda_graphs=options.cuda_graphs)
        return ModelInstance(architecture="qwen3", config=loaded.config, model=loaded.model,
                             parameters=loaded.model.params, frontend=loaded.frontend, program=program)


def _checked(artifact: Artifact, options: StartupOptions) -> Qwen3Config:
    """The config; refuses the features this Startup cannot run."""
    if options.features.vision or options.features.speculative is not None:
        raise ValueError("the Qwen3 plugin runs text only; start without vision or a speculative backend")
    return parse_config(artifact.config)


def _compute_dtype(options: StartupOptions, stored: torch.dtype) -> torch.dtype:
    compute = torch_dtype(options.dtype) if options.dtype is not None else stored
    if compute not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be float32, bfloat16 or float16, got {compute}")
    return compute
