"""The shared parts of a dense, text-only architecture: its Program over one paged KV pool (``DenseProgram``),
its three-step Startup with every weight on the device (``DenseStartup``) and the source mapping of a checkpoint
whose tensor names are the logical names (``DenseSourceMapping``). A plugin subclasses the two classes and
fills the hooks that are its model's (config, Parameters, model calls, KV pool, state layout, widths, Frontend,
parameter shapes, fused groups); the memory plan, the Program and the ModelInstance are built here the same way
for every such model (docs/program.md, "Building a Program from the shared parts").
"""

from __future__ import annotations

import abc
from collections.abc import Collection
from typing import Any

import attrs
import torch

from ninfer.contract.config import StartupOptions
from ninfer.contract.memory import ModelProfile, ModelShape, ProgramCapacity, WeightPlacement
from ninfer.contract.model import Frontend, ModelInstance
from ninfer.contract.request import SamplingParams
from ninfer.contract.state import KVPoolSpec, StateImageLayout
from ninfer.core.device import Device, dtype_name, torch_dtype
from ninfer.core.device_plan import resident_bytes
from ninfer.core.forward_batch import ForwardBatch, PagedKVViews
from ninfer.core.kv_pool import PagedKVPool
from ninfer.models.common.paged_program import PagedProgram
from ninfer.models.common.weights import FusedParent

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALL_DEVICE = "all-device"
FEATURES = ("text",)


class DenseProgram(PagedProgram):
    """A Program for a model whose every layer reads the one paged KV pool: ``model.forward(batch, views)``
    (``views``: ``PagedKVViews`` over the pool, layer i at ``views.kv[i]``) and ``model.logits(hidden)``."""

    def __init__(self, model: Any, *, state_layout: StateImageLayout, kv_pool: KVPoolSpec, device: Device | str,
                 max_concurrency: int, capacity: ProgramCapacity, vocab_size: int,
                 kv_dtype: torch.dtype | str | None = None, sampling_defaults: SamplingParams | None = None,
                 cuda_graphs: bool = True, static_decode: bool = False) -> None:
        """``static_decode``: without graphs, still decode through the graphs' static input buffers (the
        CUDA-graph input path, checked on the CPU). The rest is ``PagedProgram``'s."""
        super().__init__(state_layout=state_layout, kv_pool=kv_pool, device=device, max_concurrency=max_concurrency,
                         capacity=capacity, kv_dtype=kv_dtype, vocab_size=vocab_size,
                         sampling_defaults=sampling_defaults)
        self.model = model
        self.views = PagedKVViews(kv=self.pool.caches(), page_size=self.page_size)
        self.start_graphs(cuda_graphs=cuda_graphs, static_decode=static_decode)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch, self.views)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)


@attrs.frozen(kw_only=True, eq=False)
class DenseLoaded:
    """What ``DenseStartup.load`` made: the config, the bound weights and their load report, the model over its
    prepared Parameters, the Frontend and the compute dtype."""

    config: Any
    weights: Any
    load_report: Any
    model: Any
    frontend: Frontend
    compute: torch.dtype


class DenseStartup(abc.ABC):
    """``ninfer.contract.Startup`` for a dense text model with every weight on the device.

    ``profile`` prepares the very Parameters a load makes, on the meta device from the artifact's header, so the
    weight bytes it reports are what a load allocates (views of the artifact's parents where dtype and layout
    allow, copies where not). The config must name ``vocab_size``, ``num_hidden_layers`` and
    ``max_position_embeddings`` (config.json's names); ``embed`` is the logical name of the token embedding,
    whose stored dtype is the compute dtype unless ``options.dtype`` says otherwise."""

    architecture: str
    embed: str

    # -- the model's hooks ----------------------------------------------------------------------------
    @abc.abstractmethod
    def parse_config(self, raw: dict) -> Any:
        """The typed config of config.json; refuses what the model code does not run."""

    @abc.abstractmethod
    def parameters(self, config: Any, weights: Any, dtype: torch.dtype, device: torch.device) -> Any:
        """The prepared Parameters of bound ``weights`` (``tensors()`` yields every tensor they hold)."""

    @abc.abstractmethod
    def model(self, params: Any) -> Any:
        """The fixed model calls over prepared Parameters (``forward(batch, views)``, ``logits(hidden)``)."""

    @abc.abstractmethod
    def kv_pool(self, config: Any, *, page_size: int, dtype: str) -> KVPoolSpec:
        """The one paged KV pool every layer reads."""

    def state_layout(self, config: Any) -> StateImageLayout:
        """A sequence's StateImage: none for an attention-only model (a slot is only a sequence's identity)."""
        return StateImageLayout(fields=())

    @abc.abstractmethod
    def shape(self, config: Any) -> ModelShape:
        """The widths the planner sizes the workspace and graph estimate from."""

    @abc.abstractmethod
    def frontend(self, artifact: Any, options: StartupOptions) -> Frontend:
        """The Frontend over the artifact's tokenizer and template resources."""

    # -- the three steps ------------------------------------------------------------------------------
    def profile(self, artifact: Any, options: StartupOptions) -> ModelProfile:
        from ninfer.artifact import meta_weights

        config = self._checked(artifact, options)
        weights = meta_weights(artifact, features=FEATURES)
        compute = _compute_dtype(options, weights[self.embed].dtype)
        params = self.parameters(config, weights, compute, torch.device("meta"))
        pool = self.kv_pool(config, page_size=options.page_size, dtype=dtype_name(compute))
        fixed = resident_bytes([*weights.parents.values(), *params.tensors()])
        return ModelProfile(
            architecture=artifact.metadata.architecture, dtype=dtype_name(compute), features=FEATURES,
            placements=(WeightPlacement(name=ALL_DEVICE, device_bytes=fixed),),
            state_slot_bytes=self.state_layout(config).nbytes_per_slot, kv_page_bytes=PagedKVPool.page_bytes(pool),
            page_size=pool.page_size, shape=self.shape(config), model_limit=config.max_position_embeddings,
            layers=config.num_hidden_layers)

    def load(self, artifact: Any, options: StartupOptions, placement: WeightPlacement) -> DenseLoaded:
        from ninfer.artifact import load_weights

        if placement.host_bytes:
            raise ValueError(f"{self.architecture} places every weight on the device; placement {placement.name!r} "
                             f"asks for {placement.host_bytes} host bytes")
        config = self._checked(artifact, options)
        device = Device.parse(options.device)
        frontend = self.frontend(artifact, options)
        weights, report = load_weights(artifact, features=FEATURES, device=str(device))
        compute = _compute_dtype(options, weights[self.embed].dtype)
        model = self.model(self.parameters(config, weights, compute, device.torch))
        return DenseLoaded(config=config, weights=weights, load_report=report, model=model, frontend=frontend,
                           compute=compute)

    def instance(self, loaded: DenseLoaded, options: StartupOptions, capacity: ProgramCapacity) -> ModelInstance:
        config = loaded.config
        program = DenseProgram(
            loaded.model, state_layout=self.state_layout(config), device=options.device,
            kv_pool=self.kv_pool(config, page_size=options.page_size, dtype=dtype_name(loaded.compute)),
            max_concurrency=options.max_concurrency, capacity=capacity, vocab_size=config.vocab_size,
            kv_dtype=loaded.compute, sampling_defaults=loaded.frontend.sampling_defaults(),
            cuda_graphs=options.cuda_graphs)
        return ModelInstance(architecture=self.architecture, config=config, model=loaded.model,
                             parameters=loaded.model.params, frontend=loaded.frontend, program=program)

    def _checked(self, artifact: Any, options: StartupOptions) -> Any:
        if options.features.vision or options.features.speculative is not None:
            raise ValueError(f"the {self.architecture} plugin runs text only; start without vision or a "
                             f"speculative backend")
        return self.parse_config(artifact.config)


class DenseSourceMapping(abc.ABC):
    """``ninfer.artifact.mapping.SourceMapping`` for a text checkpoint whose Hugging Face names are the logical
    names (``model.*``, ``lm_head.weight``), each stored whole; a tied checkpoint's head reads the embedding
    (``embed``). The config names ``vocab_size`` and ``tie_word_embeddings``."""

    validated_features = FEATURES
    embed: str

    def __init__(self, config: Any) -> None:
        self.config = config

    @abc.abstractmethod
    def parameters(self) -> dict[str, tuple[int, ...]]:
        """Logical name -> shape of every parameter the config implies."""

    @abc.abstractmethod
    def fused_parents(self) -> list[FusedParent]:
        """Groups stored back to back as one physical parent (one matmul serves them)."""

    def canonical_name(self, source_name: str) -> tuple[str, str] | None:
        if source_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # a tied checkpoint may still ship a copy; the head reads the embedding instead
        if source_name.startswith("model.") or source_name == "lm_head.weight":
            return "text", source_name
        return None

    def stacked_sources(self, source_names: Collection[str]) -> tuple:
        return ()

    def configured_features(self) -> tuple[str, ...]:
        return FEATURES

    def expected_parameters(self, features: tuple[str, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {name: ("text", shape) for name, shape in self.parameters().items()} if "text" in features else {}

    def shared_uses(self, bound: set[str], features: tuple[str, ...]) -> list:
        from ninfer.artifact import Use

        tied = self.config.tie_word_embeddings and self.embed in bound
        return [Use(site="lm_head", feature="text", binding=self.embed)] if tied else []

    def embedding_vocab(self) -> int:
        return self.config.vocab_size


def _compute_dtype(options: StartupOptions, stored: torch.dtype) -> torch.dtype:
    compute = torch_dtype(options.dtype) if options.dtype is not None else stored
    if compute not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be float32, bfloat16 or float16, got {compute}")
    return compute
