"""Native Qwen4Exp Startup (``ninfer.contract.Startup``): profile -> load -> instance.

Text, and with ``speculative="mtp"`` the MTP drafter (``Qwen4ExpMTPProgram``). The vision encoder is Qwen3.5's
(``Qwen35Vision`` over ``config.base``), bound as Qwen3.5 binds it: ``StartupFeatures.vision`` None binds it when
the artifact has the feature (text only with MTP), True requires it, False leaves it unread; its weights and its
workspace are planned, and the KV pool then pages each token's rotary positions. ``profile`` prepares the very
Parameters execution uses on the meta device (``ninfer.artifact.meta_weights``), as Qwen3.5's does, so its weight
bytes are what a load allocates. Placements, in the planner's order of preference: ``all-device`` (every weight,
the PLE n-gram tables too: a step gathers its rows on the device, so decode can run through CUDA graphs),
``host-tables`` (the n-gram tables in host memory: a forward uploads only the rows it looks up, and decode runs
eagerly) and ``host-experts`` (the tables and the MoE routed expert banks in host memory: Qwen3.5 MoE's host
experts, with a Program-owned device expert cache). A model without PLE has no ``host-tables``. The StateImage slot, the KV page (with the QSA index keys) and the model's
widths complete the profile; ``instance`` builds a ``Qwen4ExpProgram`` of exactly the granted capacity.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ninfer.contract.config import StartupOptions
from ninfer.contract.memory import ModelProfile, ModelShape, ProgramCapacity, WeightPlacement
from ninfer.contract.model import ModelInstance
from ninfer.core.device import Device, dtype_name
from ninfer.core.device_plan import resident_bytes
from ninfer.core.kv_pool import PagedKVPool
from ninfer_qwen4exp.config import Qwen4ExpConfig, parse_config
from ninfer_qwen4exp.source_mapping import NGRAM_TABLE
from ninfer_qwen35.startup import (
    ALL_DEVICE,
    EMBED,
    HOST_EXPERTS,
    StartupError,
    bank_objects,
    bind_vision,
    compute_dtype,
    eager_reason,
    encoder_needs,
    host_experts_runtime,
    qwen_frontend,
    vision_tensors,
    weight_placements,
)

HOST_TABLES = "host-tables"


@attrs.frozen(kw_only=True, eq=False)
class Qwen4ExpLoaded:
    """The read-only Model: config, bound weights, prepared Parameters behind the model calls, the Frontend."""

    config: Qwen4ExpConfig
    weights: Any
    load_report: Any
    executor: Any  # Qwen4ExpModel, the fixed model calls
    frontend: Any
    compute: torch.dtype
    host_experts: bool = False  # the MoE routed expert banks live in host memory (placement "host-experts")
    host_tables: bool = False  # the PLE n-gram tables live in host memory (placements "host-tables", "host-experts")
    vision: Any = None  # Qwen35Vision when the vision feature is bound
    features: tuple[str, ...] = ("text",)
    mtp: Any = None  # Qwen4ExpMTP when speculative="mtp"


class Qwen4ExpStartup:
    """Qwen4Exp's side of startup: what it needs, its weights, and a Program of a granted capacity."""

    def profile(self, artifact: Any, options: StartupOptions) -> ModelProfile:
        config, features = _checked(artifact, options)  # refuses before anything else is read
        from ninfer.artifact import meta_weights

        weights = meta_weights(artifact, features=features)
        return weights_profile(config, weights, options, architecture=artifact.metadata.architecture,
                               tables=[weights.parents[o] for o in ngram_objects(artifact, features)],
                               bank_parents=[weights.parents[o] for o in bank_objects(artifact, features)],
                               vision="vision" in features, media=artifact.frontend.media)

    def load(self, artifact: Any, options: StartupOptions, placement: WeightPlacement) -> Qwen4ExpLoaded:
        from ninfer.artifact import load_weights
        from ninfer_qwen4exp.execution.model import Qwen4ExpModel
        from ninfer_qwen4exp.execution.mtp import Qwen4ExpMTP, Qwen4ExpMTPParams
        from ninfer_qwen4exp.execution.parameters import Qwen4ExpParameters
        from ninfer_qwen35.execution.vision import Qwen35Vision, VisionParams

        config, features = _checked(artifact, options)
        if placement.name not in (ALL_DEVICE, HOST_TABLES, HOST_EXPERTS):
            raise StartupError(f"Qwen4Exp has no weight placement {placement.name!r}")
        host = placement.name == HOST_EXPERTS
        dev = Device.parse(options.device)
        frontend = qwen_frontend(artifact, options, vision="vision" in features)
        # Host tables are gathered on the host, only their looked-up rows uploaded (never pinned: they are large).
        tables = ngram_objects(artifact, features) if placement.name != ALL_DEVICE else frozenset()
        kept = tables | (bank_objects(artifact, features) if host else frozenset())
        weights, report = load_weights(artifact, features=features, device=str(dev), host_objects=kept,
                                       unpinned=tables)
        compute = compute_dtype(options, weights[EMBED].dtype)
        experts = "cpu" if host else None
        executor = Qwen4ExpModel(Qwen4ExpParameters.from_weights(config, weights, compute, dev.torch, experts))
        mtp = vision = None
        if options.features.draft_tokens:
            mtp = Qwen4ExpMTP(Qwen4ExpMTPParams.from_weights(config, weights, compute, dev.torch, experts), executor)
        if "vision" in features:
            vision = Qwen35Vision(VisionParams.from_weights(config.base, weights, compute, dev.torch))
        return Qwen4ExpLoaded(config=config, weights=weights, load_report=report, executor=executor,
                              frontend=frontend, compute=compute, host_experts=host, host_tables=bool(tables),
                              vision=vision,
                              features=features, mtp=mtp)

    def instance(self, loaded: Qwen4ExpLoaded, options: StartupOptions, capacity: ProgramCapacity) -> ModelInstance:
        from ninfer_qwen4exp.program import Qwen4ExpProgram
        from ninfer_qwen4exp.program.mtp_program import Qwen4ExpMTPProgram, verify_steps

        config, dev = loaded.config, Device.parse(options.device)
        layout, pool = _stores(config, options, loaded.compute, media=loaded.vision is not None)
        eager = _eager_reason(loaded)
        experts = None
        if loaded.host_experts:  # a forward runs one stack's layers in order: the main layers, or the MTP's
            stacks = [loaded.executor.params.layers, loaded.mtp.params.layers if loaded.mtp is not None else ()]
            experts = host_experts_runtime(stacks, config.base.moe, dev, capacity.expert_cache_slots)
        common = dict(config=config, state_layout=layout, kv_pool=pool, device=dev,
                      max_concurrency=options.max_concurrency, capacity=capacity, kv_dtype=loaded.compute,
                      vocab_size=config.base.vocab_size, sampling_defaults=loaded.frontend.sampling_defaults(),
                      cuda_graphs=options.cuda_graphs and eager is None, host_experts=experts)
        k = options.features.draft_tokens
        if k:
            steps = verify_steps(config, rows=options.max_concurrency, draft_tokens=k, dtype=loaded.compute,
                                 device=dev.torch)
            program = Qwen4ExpMTPProgram(loaded.executor, mtp=loaded.mtp, steps=steps, draft_tokens=k, **common)
        else:
            program = Qwen4ExpProgram(loaded.executor, vision=loaded.vision, **common)
        if eager is not None and options.cuda_graphs and dev.is_cuda:
            program.graph_error = f"{eager}: decode runs eagerly"
        return ModelInstance(architecture="qwen4exp", config=config, model=loaded,
                             parameters=loaded.executor.params, frontend=loaded.frontend, program=program,
                             features=loaded.features)


def weights_profile(config: Qwen4ExpConfig, weights: Any, options: StartupOptions, *, architecture: str,
                    tables: list[torch.Tensor], bank_parents: list[torch.Tensor], vision: bool = False,
                    media: dict | None = None) -> ModelProfile:
    """The model's profile from its bound ``weights`` (a meta WeightSet: shapes and sharing, no bytes), its
    n-gram ``tables`` and the parents behind the routed expert banks (``bank_parents``) among them; with
    ``speculative="mtp"`` the MTP block's weights and the verify steps (backing bytes) too; with ``vision`` the
    encoder's prepared weights and its workspace for the largest item the artifact's preprocessor config
    (``media``) lets a request carry."""
    from ninfer_qwen4exp.execution.mtp import Qwen4ExpMTPParams
    from ninfer_qwen4exp.execution.parameters import Qwen4ExpParameters
    from ninfer_qwen4exp.program.mtp_program import steps_bytes, verify_steps
    from ninfer_qwen35.execution.vision import VisionParams

    compute, meta = compute_dtype(options, weights[EMBED].dtype), torch.device("meta")
    params = Qwen4ExpParameters.from_weights(config, weights, compute, meta)
    fixed, banks = params.tensors(), params.expert_banks()
    k, backing = options.features.draft_tokens, 0
    if k:
        mtp = Qwen4ExpMTPParams.from_weights(config, weights, compute, meta)
        fixed += mtp.tensors()
        banks += mtp.expert_banks()
        backing = steps_bytes(verify_steps(config, rows=options.max_concurrency, draft_tokens=k, dtype=compute,
                                           device=meta))
    encoder = None
    if vision:  # the encoder's prepared weights (copies where the dtype differs) and its peak
        fixed += vision_tensors(VisionParams.from_weights(config.base, weights, compute, meta))
        context = options.max_model_len or config.base.max_position_embeddings
        encoder = encoder_needs(config.base, media, torch.empty((), dtype=compute).element_size(), context)
    total = resident_bytes([*weights.parents.values(), *fixed])
    placements = weight_placements(total, resident_bytes([*bank_parents, *banks]), banks, config.base.moe.num_experts_per_tok)
    layout, pool = _stores(config, options, compute, media=vision)
    return ModelProfile(
        architecture=architecture, dtype=dtype_name(compute), encoder=encoder,
        features=("text", *(("vision",) if vision else ()), *(("mtp",) if k else ())),
        placements=table_placements(placements, resident_bytes(tables)),
        state_slot_bytes=layout.nbytes_per_slot, kv_page_bytes=PagedKVPool.page_bytes(pool),
        page_size=pool.page_size, backing_bytes=backing, shape=model_shape(config),
        model_limit=config.base.max_position_embeddings, layers=config.base.num_hidden_layers)


def build(artifact: Any, options: StartupOptions) -> ModelInstance:
    """The whole start of an opened artifact as the engine runs it (plan, load, formal Program): for direct
    Program users and tests. ``instance.memory`` is its MemorySummary."""
    from ninfer.engine.startup import start

    return start(Qwen4ExpStartup(), artifact, options)


def ngram_objects(artifact: Any, features: tuple[str, ...]) -> frozenset[str]:
    """The artifact objects behind the selected features' PLE n-gram tables (from the header's bindings)."""
    return frozenset(b.object for b in artifact.bindings.values()
                     if b.feature in features and b.name.endswith(NGRAM_TABLE))


def table_placements(placements: tuple[WeightPlacement, ...], tables: int) -> tuple[WeightPlacement, ...]:
    """Qwen3.5's ``placements`` (all-device first) with the PLE n-gram tables' ``tables`` bytes: on the device in
    ``all-device``, then ``host-tables`` (all-device with the tables in host memory), then each other placement
    with the tables in host memory. A decode step reads only the rows it looks up, so the tables leave
    ``step_bytes`` wherever they are."""
    if not tables:
        return placements
    first, rest = placements[0], placements[1:]
    everything = attrs.evolve(first, step_bytes=first.step_read_bytes - tables)
    return (everything, attrs.evolve(host_tables(first, tables), name=HOST_TABLES),
            *(host_tables(p, tables) for p in rest))


def host_tables(placement: WeightPlacement, tables: int) -> WeightPlacement:
    """``placement`` with the n-gram tables' ``tables`` bytes in host memory, out of ``step_bytes`` too."""
    if not tables:
        return placement
    return attrs.evolve(placement, device_bytes=placement.device_bytes - tables,
                        host_bytes=placement.host_bytes + tables, step_bytes=placement.step_read_bytes - tables)


def model_shape(config: Qwen4ExpConfig) -> ModelShape:
    """The widths the planner sizes transients from: the residual is ``hc_count`` streams wide; the widest mixer
    is the GDN convolution's input and output, the gated attention's projections with the QSA indexer's, or a
    PLE layer's looked-up rows, key, value, gated value and conv output."""
    b = config.base
    attention = (2 * b.num_attention_heads + 2 * b.num_key_value_heads) * b.head_dim
    if config.qsa is not None:
        attention += (config.qsa.n_heads + 1) * config.qsa.head_dim
    ple = config.ple.embed_dim + 3 * config.hc_hidden_size + b.hidden_size if config.ple is not None else 0
    return ModelShape(hidden_size=config.hc_hidden_size, vocab_size=b.vocab_size, mlp_width=b.ffn_width,
                      mixer_width=max(2 * b.conv_dim, attention, ple))


def _eager_reason(loaded: Qwen4ExpLoaded) -> str | None:
    """Why decode cannot run through CUDA graphs (None: it can): PLE n-gram tables in host memory, whose rows a
    step looks up on the host, and Qwen3.5 MoE's reasons. (QSA decodes through its static selection and
    attention there, ``ninfer.ops.qsa``.)"""
    if loaded.host_tables:
        return "the PLE n-gram tables live in host memory (placement host-tables or host-experts)"
    return eager_reason(host_experts=loaded.host_experts, moe=True)


def _checked(artifact: Any, options: StartupOptions) -> tuple[Qwen4ExpConfig, tuple[str, ...]]:
    """The config and the features to bind (text, vision as Qwen3.5 binds it, and mtp with speculative="mtp");
    refuses what this Startup cannot run yet."""
    features = options.features
    if features.speculative not in (None, "mtp"):
        raise StartupError(f"speculative={features.speculative!r} is not built yet for Qwen4Exp (only 'mtp' is)")
    config = parse_config(artifact.config)
    if features.draft_tokens and not config.base.mtp_num_hidden_layers:
        raise StartupError("speculative='mtp' needs an MTP head, and this model's config has "
                           "mtp_num_hidden_layers = 0")
    if features.draft_tokens and "mtp" not in artifact.features:
        raise StartupError("speculative='mtp', but this artifact has no mtp feature (converted without it)")
    vision = bind_vision(artifact, config.base, features)
    return config, ("text", *(("vision",) if vision else ()), *(("mtp",) if features.draft_tokens else ()))


def _stores(config: Qwen4ExpConfig, options: StartupOptions, compute: torch.dtype, *, media: bool = False):
    """The StateImage layout and the one KV pool (the attention layers, then the MTP's when selected, with the QSA
    index keys, and with ``media`` each token's rotary positions)."""
    from ninfer_qwen4exp.state import kv_pools, state_layout

    mtp_layers = config.base.mtp_num_hidden_layers if options.features.draft_tokens else 0
    pools = kv_pools(config, page_size=options.page_size, dtype=dtype_name(compute), mtp_layers=mtp_layers,
                     media=media)
    if len(pools) != 1:
        raise StartupError(f"this Program runs exactly one KV pool (the attention layers); the config gives "
                           f"{len(pools)}")
    return state_layout(config, dtype_name(compute)), pools[0]
