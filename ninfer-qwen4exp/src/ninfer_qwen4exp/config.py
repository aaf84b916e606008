"""Qwen4Exp config: parsed from a Hugging Face config.json (``Qwen4ExpForCausalLM`` flat, or the VL layout with
``text_config``), names following transformers' ``Qwen4ExpTextConfig``.

Qwen4Exp is Qwen3.5 MoE's geometry (Gated DeltaNet, gated attention, sparse MoE with a shared expert) plus the
hyper-connections (``hc_count`` residual streams), QSA on the attention layers, PLE on some GDN layers and a
choice of GDN output gate. ``base`` holds the shared geometry in Qwen3.5's terms (an ``indexed_attention`` layer
is Qwen3.5's ``full_attention`` there), so the parts both models share read one config.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import attrs
from attrs import validators as v

from ninfer_qwen35.config import ConfigError, Qwen35Config
from ninfer_qwen35.config import parse_config as parse_qwen35_config

__all__ = ["ConfigError", "PLEConfig", "QSAConfig", "Qwen4ExpConfig", "parse_config"]

# full_attention: the published config's name; qwen_sparse_attention: what older transformers (5.17) saves
_LAYER_TYPES = ("linear_attention", "indexed_attention", "full_attention", "qwen_sparse_attention")
_QSA = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


@attrs.frozen(kw_only=True)
class QSAConfig:
    """QSA on every attention layer: an indexer of ``n_heads`` query heads and one key head of ``head_dim``
    scores blocks of ``compress_ratio`` consecutive tokens; a query attends the tokens of its ``budget //
    compress_ratio`` best complete blocks plus the open tail (every visible token while few blocks are complete)."""

    n_heads: int = attrs.field(validator=v.gt(0))
    head_dim: int = attrs.field(validator=v.gt(0))
    budget: int = attrs.field(validator=v.gt(0))
    compress_ratio: int = attrs.field(validator=v.gt(0))

    def __attrs_post_init__(self) -> None:
        if self.budget % self.compress_ratio:
            raise ConfigError(f"indexer_budget {self.budget} is not a multiple of indexer_compress_ratio "
                              f"{self.compress_ratio}")

    @property
    def block_topk(self) -> int:
        return self.budget // self.compress_ratio


@attrs.frozen(kw_only=True)
class PLEConfig:
    """Per-Layer Embedding on the GDN layers ``layers`` (0-indexed; the checkpoint's ``ple_layer_ids`` are
    1-indexed): hashed 2..``ngram_size``-gram ids, ``heads_per_ngram`` heads per order, each a prime-sized slice of
    one table of ``embed_dim // ngram_heads`` columns, then a dilated depthwise conv over the streams."""

    layers: tuple[int, ...] = attrs.field(converter=tuple)
    embed_dim: int = attrs.field(validator=v.gt(0))
    conv_kernel_size: int = attrs.field(validator=v.gt(0))
    ngram_size: int = attrs.field(validator=v.ge(2))
    heads_per_ngram: int = attrs.field(validator=v.gt(0))
    vocab_size_base: int = attrs.field(validator=v.gt(1))
    vocab_divisor: int = attrs.field(validator=v.gt(0))
    seed: int
    split_parts: int = attrs.field(validator=v.gt(0))

    def __attrs_post_init__(self) -> None:
        if self.embed_dim % self.ngram_heads:
            raise ConfigError(f"ple_embed_dim {self.embed_dim} is not a multiple of the {self.ngram_heads} n-gram "
                              "heads ((ngram_size - 1) * heads_per_ngram)")

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_dim(self) -> int:
        """Columns of the n-gram table (one head's slice of the concatenated embedding)."""
        return self.embed_dim // self.ngram_heads

    @property
    def context_len(self) -> int:
        """Earlier token ids the n-gram ids of a new token read (its per-sequence history)."""
        return self.ngram_size - 1

    @property
    def conv_state_len(self) -> int:
        """Earlier positions the dilated conv reads: (kernel - 1) * dilation, the dilation being ``ngram_size``."""
        return (self.conv_kernel_size - 1) * self.ngram_size

    def head_vocab_sizes(self, ple_index: int) -> tuple[int, ...]:
        """The primes by which the ``ple_index``-th PLE layer (its rank among ``layers``) reduces each head's hash:
        the model's heads, counted across PLE layers, take the consecutive primes >= ``vocab_size_base``."""
        first = ple_index * self.ngram_heads
        return tuple(_primes_from(self.vocab_size_base, first + self.ngram_heads)[first:])

    def head_offsets(self, ple_index: int) -> tuple[int, ...]:
        """Each head's first row in that layer's n-gram table (its slices are back to back)."""
        sizes = self.head_vocab_sizes(ple_index)
        return tuple(sum(sizes[:h]) for h in range(len(sizes)))

    def table_rows(self, ple_index: int) -> int:
        """Rows of that layer's n-gram table: the heads' primes summed, padded to a multiple of ``vocab_divisor``."""
        return -(-sum(self.head_vocab_sizes(ple_index)) // self.vocab_divisor) * self.vocab_divisor

    def shard_rows(self, ple_index: int) -> tuple[int, ...]:
        """Rows of each checkpoint shard of that table (``...ngram_embedding.shard_{k}.weight``): transformers
        saves it as ``torch.chunk(table, split_parts)``, equal chunks of ceil(rows / parts) rows, the last one
        shorter, and fewer than ``split_parts`` of them when the rows run out first."""
        rows = self.table_rows(ple_index)
        step = -(-rows // self.split_parts)
        return tuple(min(step, rows - start) for start in range(0, rows, step))


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@functools.cache
def _primes_from(base: int, count: int) -> tuple[int, ...]:
    """The first ``count`` primes >= ``base``."""
    out: list[int] = []
    n = base
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 1
    return tuple(out)


@attrs.frozen(kw_only=True)
class Qwen4ExpConfig:
    """Instance parameters of a Qwen4Exp text model."""

    base: Qwen35Config
    layer_types: tuple[Literal["linear_attention", "indexed_attention"], ...] = attrs.field(converter=tuple)
    hc_count: int = attrs.field(validator=v.gt(1))
    hc_lowrank: int = attrs.field(validator=v.gt(0))
    output_gate: Literal["sigmoid", "silu"] = attrs.field(validator=v.in_(("sigmoid", "silu")))
    qsa: QSAConfig | None = None
    ple: PLEConfig | None = None

    def __attrs_post_init__(self) -> None:
        b = self.base
        if b.moe is None:
            raise ConfigError("a Qwen4Exp config needs the MoE fields (num_experts, num_experts_per_tok, "
                              "moe_intermediate_size, shared_expert_intermediate_size)")
        if self.qsa is not None and b.rotary_dim > self.qsa.head_dim:
            raise ConfigError(f"the attention's rotary dim {b.rotary_dim} does not fit the QSA index head "
                              f"{self.qsa.head_dim}")
        if self.ple is not None:
            bad = [i + 1 for i in self.ple.layers if not 0 <= i < b.num_hidden_layers
                   or self.layer_types[i] != "linear_attention"]
            if bad:
                raise ConfigError(f"ple_layer_ids {bad} are not linear_attention layers of this model")
            if not b.eos_token_id:
                raise ConfigError("a Qwen4Exp config with PLE layers needs eos_token_id (n-grams reset there)")

    @property
    def hidden_size(self) -> int:
        return self.base.hidden_size

    @property
    def hc_hidden_size(self) -> int:
        """Width of the residual: ``hc_count`` streams of ``hidden_size``."""
        return self.hc_count * self.base.hidden_size

    @property
    def eos_token_id(self) -> int | None:
        """The token at which n-gram histories reset (the first of the config's EOS ids)."""
        return self.base.eos_token_id[0] if self.base.eos_token_id else None

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return self.base.gdn_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return self.base.attention_layers

    @property
    def ple_layers(self) -> tuple[int, ...]:
        return self.ple.layers if self.ple is not None else ()


def parse_config(raw: dict[str, Any]) -> Qwen4ExpConfig:
    """Parse config.json: the flat text layout or the VL layout (``text_config`` + top-level vision ids)."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must be a JSON object")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    n = text.get("num_hidden_layers")
    layer_types = text.get("layer_types")
    if layer_types is None and isinstance(n, int):
        interval = text.get("full_attention_interval", 4)
        layer_types = ["indexed_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if not isinstance(layer_types, list | tuple):
        raise ConfigError("config.json needs layer_types or num_hidden_layers")
    bad = sorted({str(t) for t in layer_types} - set(_LAYER_TYPES))
    if bad:
        raise ConfigError(f"unknown Qwen4Exp layer_types {bad} (known: linear_attention, indexed_attention)")
    types = tuple("linear_attention" if t == "linear_attention" else "indexed_attention" for t in layer_types)
    rope = text.get("rope_parameters") or {}
    # transformers' Qwen4Exp rotates the whole head unless rope_parameters says otherwise (Qwen3.5 defaults to 0.25)
    shared = {**text, "layer_types": ["linear_attention" if t == "linear_attention" else "full_attention"
                                      for t in types],
              "partial_rotary_factor": rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)),
              "mtp_num_hidden_layers": _mtp_layers(raw, text)}
    base = parse_qwen35_config({**raw, "text_config": shared} if text is not raw else shared)
    gate = text.get("output_gate_type") or text.get("hidden_act", "silu")
    try:
        return Qwen4ExpConfig(base=base, layer_types=types, hc_count=text.get("hc_count", 4),
                              hc_lowrank=text.get("hc_lowrank", 320), output_gate=gate, qsa=_qsa(text),
                              ple=_ple(text))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"invalid Qwen4Exp config: {exc}") from exc


def _mtp_layers(raw: dict[str, Any], text: dict[str, Any]) -> int:
    """MTP depth: Qwen3.5's ``mtp_num_hidden_layers``, or the ``mtp: {num_hidden_layers: N, ...}`` block the
    published Qwen4Exp config carries instead."""
    flat = text.get("mtp_num_hidden_layers", raw.get("mtp_num_hidden_layers"))
    if flat is not None:
        return flat
    block = text.get("mtp", raw.get("mtp"))
    if block is None:
        return 0
    if not isinstance(block, dict):
        raise ConfigError(f"mtp must be an object with num_hidden_layers, got {block!r}")
    return block.get("num_hidden_layers", 0)


def _qsa(text: dict[str, Any]) -> QSAConfig | None:
    given = {k: text.get(k) for k in _QSA}
    if all(x is None for x in given.values()):
        return None
    missing = [k for k, x in given.items() if x is None]
    if missing:
        raise ConfigError(f"the QSA config is missing {', '.join(missing)}")
    if given["indexer_kv_heads"] != 1:
        raise ConfigError(f"Qwen4Exp QSA has one indexer key head, not indexer_kv_heads={given['indexer_kv_heads']}")
    return QSAConfig(n_heads=given["indexer_n_heads"], head_dim=given["indexer_head_dim"],
                     budget=given["indexer_budget"], compress_ratio=given["indexer_compress_ratio"])


def _ple(text: dict[str, Any]) -> PLEConfig | None:
    ids = text.get("ple_layer_ids") or []
    if not ids:
        return None
    if not all(isinstance(i, int) for i in ids):
        raise ConfigError(f"ple_layer_ids must be integers, got {ids}")
    return PLEConfig(layers=sorted({i - 1 for i in ids}),
                     embed_dim=text.get("ple_embed_dim") or text["hidden_size"],
                     conv_kernel_size=text.get("ple_conv_kernel_size", 4), ngram_size=text.get("ngram_size", 3),
                     heads_per_ngram=text.get("heads_per_ngram", 8),
                     vocab_size_base=text.get("ngram_vocab_size_base", 20_000_000),
                     vocab_divisor=text.get("make_ngram_vocab_size_divisible_by", 128),
                     seed=text.get("seed", 1234), split_parts=text.get("split_ngram_parts", 512))
