"""Native Qwen3.5 Startup (``ninfer.contract.Startup``): profile -> load -> instance.

Only the selected features are bound and read (Text; Vision when the artifact has it and ``features.vision`` is
not False; with ``speculative="mtp"`` the MTP head too; the DFlash backends are refused clearly until they exist). ``profile`` prepares the very Parameters execution
uses, on the meta device from the artifact's header (``ninfer.artifact.meta_weights``), so the weight bytes it
reports are what a load allocates (views of the artifact's parents where dtype and layout allow, copies
where not); StateImage slot, KV page, verify records, the model's widths and its encoder's needs complete the
profile (the runtime's planner sizes the workspace and graphs from them).
The runtime plans the budget; ``instance`` builds a Program of exactly the granted capacity.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ninfer.contract.config import StartupOptions
from ninfer.contract.memory import EncoderNeeds, ModelProfile, ModelShape, ProgramCapacity, WeightPlacement
from ninfer.contract.model import ModelInstance
from ninfer.core.device import Device, dtype_name, torch_dtype
from ninfer.core.device_plan import resident_bytes
from ninfer.core.kv_pool import PagedKVPool
from ninfer.models.common.moe.host_experts import expert_bytes, staging_bytes
from ninfer_qwen35.config import Qwen35Config, parse_config

EMBED = "model.embed_tokens.weight"


class StartupError(ValueError):
    """The artifact or the selected features cannot make a working instance."""


@attrs.frozen(kw_only=True, eq=False)
class Qwen35Loaded:
    """The read-only Model: config, bound weights, prepared Parameters (and the MTP drafter), the Frontend."""

    config: Qwen35Config
    weights: Any
    load_report: Any
    executor: Any  # Qwen35Model, the fixed model calls
    mtp: Any  # Qwen35MTP when speculative="mtp"
    frontend: Any
    compute: torch.dtype
    host_experts: bool = False  # the MoE routed expert banks live in host memory (placement "host-experts")
    vision: Any = None  # Qwen35Vision when the vision feature is bound
    features: tuple[str, ...] = ("text",)


class Qwen35Startup:
    """Qwen3.5's side of startup: what it needs, its weights, and a Program of a granted capacity."""

    def profile(self, artifact: Any, options: StartupOptions) -> ModelProfile:
        from ninfer.artifact import meta_weights
        from ninfer_qwen35.execution.parameters import MTPParams, Qwen35Parameters
        from ninfer_qwen35.execution.vision import VisionParams
        from ninfer_qwen35.program.mtp_program import verify_steps

        config, features = _checked(artifact, options)
        weights = meta_weights(artifact, features=features)
        compute = compute_dtype(options, weights[EMBED].dtype)
        meta = torch.device("meta")
        params = Qwen35Parameters.from_weights(config, weights, compute, meta)
        fixed, banks = [*weights.parents.values(), *params.tensors()], params.expert_banks()
        if "vision" in features:  # the encoder's prepared weights (copies where the dtype differs)
            fixed += vision_tensors(VisionParams.from_weights(config, weights, compute, meta))
        k = options.features.draft_tokens
        backing = 0
        if k:
            mtp = MTPParams.from_weights(config, weights, compute, meta)
            fixed += mtp.tensors()
            banks += mtp.expert_banks()
            steps = verify_steps(config, rows=options.max_concurrency, draft_tokens=k, dtype=compute, device=meta)
            backing = resident_bytes([steps.conv, steps.recurrent])
        layout, pool = _stores(config, options, compute)
        encoder = None
        if "vision" in features:  # the encoder runs before its chunk; its output rows stay for the chunk
            context = options.max_model_len or config.max_position_embeddings
            encoder = encoder_needs(config, artifact.frontend.media, torch.empty((), dtype=compute).element_size(),
                                     context)
        return ModelProfile(
            architecture=artifact.metadata.architecture, dtype=dtype_name(compute), features=features,
            placements=weight_placements(resident_bytes(fixed), resident_bytes(
                [*(weights.parents[o] for o in bank_objects(artifact, features)), *banks]), banks,
                config.moe.num_experts_per_tok if config.moe is not None else 0),
            state_slot_bytes=layout.nbytes_per_slot, kv_page_bytes=PagedKVPool.page_bytes(pool),
            page_size=pool.page_size, backing_bytes=backing, shape=model_shape(config), encoder=encoder,
            model_limit=config.max_position_embeddings, layers=config.num_hidden_layers)

    def load(self, artifact: Any, options: StartupOptions, placement: WeightPlacement) -> Qwen35Loaded:
        from ninfer.artifact import load_weights
        from ninfer_qwen35.execution.model import Qwen35Model
        from ninfer_qwen35.execution.mtp import Qwen35MTP
        from ninfer_qwen35.execution.parameters import MTPParams, Qwen35Parameters
        from ninfer_qwen35.execution.vision import Qwen35Vision, VisionParams

        config, features = _checked(artifact, options)
        if placement.name not in (ALL_DEVICE, HOST_EXPERTS) or (placement.name == HOST_EXPERTS and not config.moe):
            raise StartupError(f"Qwen3.5 has no weight placement {placement.name!r} for this model")
        host = placement.name == HOST_EXPERTS
        dev = Device.parse(options.device)
        frontend = qwen_frontend(artifact, options, vision="vision" in features)
        banks = bank_objects(artifact, features) if host else frozenset()
        weights, report = load_weights(artifact, features=features, device=str(dev), host_objects=banks)
        compute = compute_dtype(options, weights[EMBED].dtype)
        experts = "cpu" if host else None
        executor = Qwen35Model(Qwen35Parameters.from_weights(config, weights, compute, dev.torch, experts))
        mtp = vision = None
        if options.features.draft_tokens:
            mtp = Qwen35MTP(MTPParams.from_weights(config, weights, compute, dev.torch, experts), executor)
        if "vision" in features:
            vision = Qwen35Vision(VisionParams.from_weights(config, weights, compute, dev.torch))
        return Qwen35Loaded(config=config, weights=weights, load_report=report, executor=executor, mtp=mtp,
                            frontend=frontend, compute=compute, host_experts=host, vision=vision, features=features)

    def instance(self, loaded: Qwen35Loaded, options: StartupOptions, capacity: ProgramCapacity) -> ModelInstance:
        from ninfer_qwen35.program import Qwen35Program
        from ninfer_qwen35.program.mtp_program import Qwen35MTPProgram, verify_steps

        config, compute, dev = loaded.config, loaded.compute, Device.parse(options.device)
        layout, pool = _stores(config, options, compute)
        eager = _eager_reason(loaded)
        graphs = options.cuda_graphs and eager is None
        common = dict(state_layout=layout, kv_pool=pool, device=dev, max_concurrency=options.max_concurrency,
                      capacity=capacity, kv_dtype=compute, vocab_size=config.vocab_size,
                      sampling_defaults=loaded.frontend.sampling_defaults(), cuda_graphs=graphs,
                      host_experts=_host_experts(loaded, dev, capacity.expert_cache_slots))
        k = options.features.draft_tokens
        if k:
            steps = verify_steps(config, rows=options.max_concurrency, draft_tokens=k, dtype=compute, device=dev.torch)
            program = Qwen35MTPProgram(loaded.executor, mtp=loaded.mtp, steps=steps, draft_tokens=k, **common)
        else:
            program = Qwen35Program(loaded.executor, vision=loaded.vision, **common)
        if eager is not None and options.cuda_graphs and dev.is_cuda:
            program.graph_error = f"{eager}: decode runs eagerly"
        return ModelInstance(architecture="qwen35_moe" if config.moe else "qwen35", config=config, model=loaded,
                             parameters=loaded.executor.params, frontend=loaded.frontend, program=program,
                             features=loaded.features)


def build(artifact: Any, options: StartupOptions) -> ModelInstance:
    """The whole start of an opened artifact as the engine runs it (plan, load, calibration on CUDA, formal
    Program): for direct Program users and tests. ``instance.memory`` is its MemorySummary."""
    from ninfer.engine.startup import start

    return start(Qwen35Startup(), artifact, options)


ALL_DEVICE, HOST_EXPERTS = "all-device", "host-experts"
BANKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def weight_placements(total: int, host: int, banks: list[torch.Tensor], top_k: int) -> tuple[WeightPlacement, ...]:
    """Every weight on the device; for a MoE model, then the routed expert banks in host memory (the shared
    expert, router and every dense weight stay on the device), with two layers' staging buffers and experts
    to cache (``banks``: the prepared gate_up / down bank of every MoE layer, in pairs). A one-row decode step
    reads the dense weights and ``top_k`` experts of each MoE layer (``step_bytes``) in either placement."""
    if not banks:
        return (WeightPlacement(name=ALL_DEVICE, device_bytes=total),)
    gate_up, down = banks[0], banks[1]
    one = expert_bytes(gate_up, down)
    step = total - host + len(banks) // 2 * top_k * one
    if not isinstance(gate_up, torch.Tensor):  # HostExperts serves dense banks only: quantized ones stay on the device
        return (WeightPlacement(name=ALL_DEVICE, device_bytes=total, step_bytes=step),)
    return (WeightPlacement(name=ALL_DEVICE, device_bytes=total, step_bytes=step),
            WeightPlacement(name=HOST_EXPERTS, device_bytes=total - host, host_bytes=host,
                            staging_bytes=staging_bytes(gate_up, down), expert_bytes=one,
                            experts=len(banks) // 2 * gate_up.shape[0], step_bytes=step))


def _eager_reason(loaded: Qwen35Loaded) -> str | None:
    return eager_reason(host_experts=loaded.host_experts, moe=loaded.config.moe is not None)


def eager_reason(*, host_experts: bool, moe: bool) -> str | None:
    """Why decode cannot run through CUDA graphs (None: it can). Host experts read each MoE layer's routing on the
    host; the routed experts' torch reference reads which experts were hit (their Triton kernels do not)."""
    from ninfer.ops.dispatch import triton_selected

    if host_experts:
        return "the MoE routed experts live in host memory (placement host-experts)"
    if moe and not triton_selected("moe", "moe_experts"):
        return "the MoE routed experts run the torch reference, which reads the hit experts on the host"
    return None


def _host_experts(loaded: Qwen35Loaded, dev: Device, cache_slots: int):
    """The Program's runtime of the host-resident routed experts (None when the banks are on the device)."""
    if not loaded.host_experts:
        return None
    stacks = [loaded.executor.params.layers, loaded.mtp.params.layers if loaded.mtp is not None else ()]
    return host_experts_runtime(stacks, loaded.config.moe, dev, cache_slots)


def host_experts_runtime(stacks: list, moe: Any, dev: Device, cache_slots: int):
    """``HostExperts`` over the MoE blocks (``MoEParams``) of each stack of layer parameters (each layer's ``mlp``;
    a forward runs one stack's layers in order: the main layers, then an MTP block's)."""
    from ninfer.models.common.moe.host_experts import HostExperts, default_team
    from ninfer_qwen35.execution.parameters import MoEParams

    blocks = [[layer.mlp for layer in stack if isinstance(layer.mlp, MoEParams)] for stack in stacks]
    banks = [(b.gate_up, b.down) for stack in blocks for b in stack]
    # Each layer's successor in the same forward (main layers, then the MTP layers' own chain) predicts ahead.
    routers = [stack[i + 1].router_shared_gate.weight[:moe.num_experts] if i + 1 < len(stack) else None
               for stack in blocks for i in range(len(stack))]
    return HostExperts(banks, device=dev.torch, cache_slots=cache_slots, team=default_team(),
                       top_k=moe.num_experts_per_tok, next_routers=routers)


def qwen_frontend(artifact: Any, options: StartupOptions, *, vision: bool) -> Any:
    """The Qwen Frontend of an artifact under the start's options (template override, special tokens in content,
    constraint limits, media limits when the vision feature is bound)."""
    from ninfer.models.common.qwen import QwenFrontend
    from ninfer.models.common.qwen.media_preparation import MediaLimits

    return QwenFrontend.from_resources(artifact.frontend, chat_template_override=options.chat_template,
                                       special_tokens_in_content=options.special_tokens_in_content,
                                       constraint_limits=options.constraint_limits, vision=vision,
                                       media_limits=MediaLimits(max_decoded_pixels=options.media_max_pixels,
                                                                max_request_tokens=options.media_max_tokens))


def bank_objects(artifact: Any, features: tuple[str, ...]) -> frozenset[str]:
    """The artifact objects behind the selected features' routed expert banks (from the header's bindings)."""
    return frozenset(b.object for b in artifact.bindings.values() if b.feature in features and b.name.endswith(BANKS))


def encoder_needs(config: Qwen35Config, media: dict | None, element_size: int, context: int) -> EncoderNeeds:
    """The encoder's bytes for the largest item a request can carry: an image at ``max_pixels``, or a video at
    its pixel bound over all frames, each patch row covering the temporal patch; and never more placeholder
    tokens than the context holds. On CUDA it keeps its per-frame-size table cache (at most
    ``TABLE_CACHE_BYTES``)."""
    from ninfer.models.common.qwen.vision_preprocess import PreprocessConfig
    from ninfer_qwen35.execution.vision import TABLE_CACHE_BYTES, VisionConfig

    vc = VisionConfig.from_config(config)
    pre = PreprocessConfig.from_preprocessor_config(media) if media else PreprocessConfig()
    area = vc.patch_size ** 2
    patches = min(max(pre.max_pixels // area, pre.video_max_pixels // (area * vc.temporal_patch_size)),
                  context * vc.spatial_merge_size ** 2)
    return EncoderNeeds(workspace_bytes=vc.workspace_bytes(patches, element_size),
                        output_bytes=vc.output_bytes(patches, element_size), cuda_cache_bytes=TABLE_CACHE_BYTES)


def model_shape(config: Qwen35Config) -> ModelShape:
    """The widths the planner sizes transients from: the MLP (or MoE block) and the GDN mixer's convolution
    input and output, its widest."""
    return ModelShape(hidden_size=config.hidden_size, vocab_size=config.vocab_size, mlp_width=config.ffn_width,
                      mixer_width=2 * config.conv_dim)


def _checked(artifact: Any, options: StartupOptions) -> tuple[Qwen35Config, tuple[str, ...]]:
    """The config and the features to bind; refuses what this Startup cannot run."""
    features = options.features
    if features.speculative not in (None, "mtp"):
        raise StartupError(f"speculative backend {features.speculative!r} is not implemented yet for Qwen3.5")
    config = parse_config(artifact.config)
    if features.draft_tokens and not config.mtp_num_hidden_layers:
        raise StartupError("speculative='mtp' needs an MTP head, and this model's config has "
                           "mtp_num_hidden_layers = 0")
    vision = bind_vision(artifact, config, features)
    return config, ("text", *(("vision",) if vision else ()), *(("mtp",) if features.draft_tokens else ()))


def bind_vision(artifact: Any, config: Qwen35Config, features: Any) -> bool:
    """Whether to bind the encoder (``features``: ``StartupFeatures``): ``vision`` None binds it when the artifact
    has it and the config names the placeholder ids (text only with MTP, whose units place tokens at plain
    positions), True requires it, False never. Refuses what cannot be bound."""
    present = "vision" in artifact.features and bool(config.vision)
    if features.vision and not present:
        raise StartupError("vision=True, but this artifact has no vision feature (a text-only conversion)")
    if features.vision and features.draft_tokens:
        raise StartupError("vision with speculative='mtp' is not supported yet: the MTP units do not place tokens "
                           "at MRoPE positions; start with vision=False or without speculative decoding")
    pads = config.image_token_id is not None or config.video_token_id is not None
    if features.vision and not pads:
        raise StartupError("vision=True, but the config names no image_token_id / video_token_id")
    return present and pads and features.vision is not False and not features.draft_tokens


def vision_tensors(params: Any) -> list[torch.Tensor]:
    """Every tensor of the encoder's prepared weights (``VisionParams``: nested attrs records and tuples)."""
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, tuple):
        return [t for item in params for t in vision_tensors(item)]
    if attrs.has(type(params)):
        return [t for f in attrs.fields(type(params)) for t in vision_tensors(getattr(params, f.name))]
    return []


def compute_dtype(options: StartupOptions, stored: torch.dtype) -> torch.dtype:
    compute = torch_dtype(options.dtype) if options.dtype is not None else stored
    if compute not in (torch.float32, torch.bfloat16, torch.float16):
        raise StartupError(f"compute dtype must be float32, bfloat16 or float16, got {compute}")
    return compute


def _stores(config: Qwen35Config, options: StartupOptions, compute: torch.dtype):
    """The StateImage layout and the one KV pool (target attention layers, then the MTP's when selected)."""
    from ninfer_qwen35.state import kv_pools, state_layout

    mtp_layers = config.mtp_num_hidden_layers if options.features.draft_tokens else 0
    pools = kv_pools(config, page_size=options.page_size, dtype=dtype_name(compute), mtp_layers=mtp_layers)
    if len(pools) != 1:
        raise StartupError(f"this Program runs exactly one KV pool (the attention layers); the config gives "
                           f"{len(pools)}")
    return state_layout(config, dtype_name(compute)), pools[0]
