"""Native Qwen3.5 Startup: artifact -> weights -> Parameters -> capacity plan -> Frontend + Program.

Only the selected features are bound and read (Text now; Vision and speculative backends are
refused clearly until they exist). The KV pool takes what the device budget leaves after the
resident weights, the StateImage slots, a workspace estimate and a fixed headroom of at least
1 GiB (design document); on CPU a modest default budget applies.

Options arrive typed and validated (``ninfer.contract.StartupOptions``). Environment:
``NINFER_VRAM_BUDGET_MIB`` caps the CUDA budget when ``device_budget_bytes`` is not given;
``NINFER_HOST_BUDGET_MIB`` sets the host bytes Snapshot pauses may hold when ``host_budget_bytes`` is not.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ninfer import env
from ninfer.contract.config import StartupOptions
from ninfer.contract.model import ModelInstance
from ninfer.core.device import Device, dtype_name, torch_dtype
from ninfer.core.kv_pool import PagedKVPool, pages_for
from ninfer_qwen35.config import Qwen35Config, parse_config

GIB = 1 << 30
MIB = 1 << 20
CPU_KV_BUDGET = 256 * MIB          # modest default on the CPU
CPU_HOST_BUDGET = 256 * MIB
CUDA_HOST_BUDGET = 8 * GIB
HEADROOM = GIB                     # capacity-planning buffer for what is not counted exactly
WORKSPACE_TOKENS = 2048            # largest prefill chunk the workspace estimate covers


class StartupError(ValueError):
    """The artifact, the selected features or the budget cannot make a working instance."""


@attrs.frozen(kw_only=True)
class CapacityPlan:
    """What Startup decided, in bytes and pages (reported by ``ninfer score`` and the engine)."""

    device: str
    dtype: str
    weight_bytes: int
    state_bytes: int
    workspace_bytes: int
    headroom_bytes: int
    kv_page_bytes: int
    kv_pages: int
    page_size: int
    max_model_len: int
    host_budget_bytes: int

    @property
    def kv_bytes(self) -> int:
        return self.kv_page_bytes * self.kv_pages


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
    from ninfer_qwen35.execution.parameters import Qwen35Parameters
    from ninfer_qwen35.program import Qwen35Program
    from ninfer_qwen35.state import kv_pools, state_layout

    features, max_concurrency, page_size = options.features, options.max_concurrency, options.page_size
    if features.vision:
        raise StartupError("Qwen3.5 Vision is not implemented yet; start without the vision feature")
    if features.speculative is not None:
        raise StartupError(f"speculative backend {features.speculative!r} is not implemented yet for Qwen3.5")
    dev = Device.parse(options.device)
    config = parse_config(artifact.config)
    frontend = QwenFrontend.from_resources(artifact.frontend, chat_template_override=options.chat_template,
                                           special_tokens_in_content=options.special_tokens_in_content)

    weights, report = load_weights(artifact, features=("text",), device=str(dev))
    compute = torch_dtype(options.dtype) if options.dtype is not None else weights["model.embed_tokens.weight"].dtype
    if compute not in (torch.float32, torch.bfloat16, torch.float16):
        raise StartupError(f"compute dtype must be float32, bfloat16 or float16, got {compute}")
    params = Qwen35Parameters.from_weights(config, weights, compute, dev.torch)
    executor = Qwen35Model(params)
    pdl = False
    if dev.torch.type == "cuda":
        from ninfer.ops.triton._pdl import prefers_pdl

        pdl = options.pdl if options.pdl is not None else \
            prefers_pdl(_resident_bytes(weights, params) / config.num_hidden_layers)

    layout = state_layout(config, dtype_name(compute))
    pools = kv_pools(config, page_size=page_size, dtype=dtype_name(compute))
    if len(pools) != 1:
        raise StartupError(f"this Program runs exactly one KV pool (the attention layers); the config gives "
                           f"{len(pools)}")
    (pool_spec,) = pools
    plan = plan_capacity(config, dev, compute=compute, weight_bytes=_resident_bytes(weights, params),
                         state_bytes=layout.nbytes_per_slot * (max_concurrency + 1),
                         page_bytes=PagedKVPool.page_bytes(pool_spec), page_size=page_size,
                         max_concurrency=max_concurrency, device_budget_bytes=options.device_budget_bytes,
                         num_pages=options.num_pages, host_budget_bytes=options.host_budget_bytes,
                         max_model_len=options.max_model_len)
    program = Qwen35Program(executor, state_layout=layout, kv_pool=pool_spec, device=dev,
                            max_concurrency=max_concurrency, num_pages=plan.kv_pages, kv_dtype=compute,
                            vocab_size=config.vocab_size, host_budget_bytes=plan.host_budget_bytes,
                            sampling_defaults=frontend.sampling_defaults(), max_model_len=plan.max_model_len,
                            cuda_graphs=options.cuda_graphs, pdl=pdl)
    program.plan = plan
    model = Qwen35Loaded(config=config, weights=weights, load_report=report, executor=executor)
    return ModelInstance(architecture="qwen35", config=config, model=model, parameters=params, frontend=frontend,
                         program=program)


def _resident_bytes(weights: Any, params: Any) -> int:
    """Distinct storages of the artifact's resident parents and of Parameters (converted copies count too)."""
    seen: dict[int, int] = {}
    for t in [*getattr(weights, "parents", {}).values(), *params.tensors()]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _env_mib(name: str) -> int | None:
    mib = env.get(name)
    return None if mib is None else mib * MIB


def plan_capacity(config: Qwen35Config, device: Device, *, compute: torch.dtype, weight_bytes: int,
                  state_bytes: int, page_bytes: int, page_size: int, max_concurrency: int,
                  device_budget_bytes: int | None, num_pages: int | None, host_budget_bytes: int | None,
                  max_model_len: int | None) -> CapacityPlan:
    """Size the KV pool from the budget (explicit ``num_pages`` wins) and fix max_model_len."""
    limit = min(config.max_position_embeddings, max_model_len or config.max_position_embeddings)
    useful_pages = pages_for(limit, page_size) * max_concurrency  # more pages than this can never be used
    elem = torch.empty((), dtype=compute).element_size()
    workspace = WORKSPACE_TOKENS * elem * (4 * config.hidden_size + 2 * config.intermediate_size
                                           + 2 * config.conv_dim + config.vocab_size // 8)
    headroom = 0
    if num_pages is None:
        if device.is_cuda:
            budget = device_budget_bytes or _env_mib("NINFER_VRAM_BUDGET_MIB")
            torch.cuda.empty_cache()  # loading staged through the caching allocator: return that first
            free, total = torch.cuda.mem_get_info(device.torch)
            budget = min(budget or total, total)
            headroom = HEADROOM
            # Weights are already resident: what is free now is what the stores can still take.
            room = min(budget - weight_bytes, free) - state_bytes - workspace - headroom
        else:
            room = (device_budget_bytes - weight_bytes - state_bytes - workspace) if device_budget_bytes \
                else CPU_KV_BUDGET
        num_pages = min(room // page_bytes, useful_pages) if room > 0 else 0
        if num_pages < 1:
            raise StartupError(
                f"the device budget leaves no room for KV pages: weights {weight_bytes / MIB:.1f} MiB, StateImages "
                f"{state_bytes / MIB:.1f} MiB, workspace {workspace / MIB:.1f} MiB, headroom {headroom / MIB:.0f} MiB; "
                f"one page needs {page_bytes / MIB:.3f} MiB")
    if host_budget_bytes is None:
        env = _env_mib("NINFER_HOST_BUDGET_MIB")
        host_budget_bytes = env if env is not None else (CUDA_HOST_BUDGET if device.is_cuda else CPU_HOST_BUDGET)
    return CapacityPlan(device=str(device), dtype=dtype_name(compute), weight_bytes=weight_bytes,
                        state_bytes=state_bytes, workspace_bytes=workspace, headroom_bytes=headroom,
                        kv_page_bytes=page_bytes, kv_pages=int(num_pages), page_size=page_size,
                        max_model_len=min(limit, int(num_pages) * page_size), host_budget_bytes=host_budget_bytes)
