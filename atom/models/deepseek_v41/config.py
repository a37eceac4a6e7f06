"""DeepSeek-V4.1 model config, read from an HF-style config.json with V4.1-Flash's field names.

Validation names the field, the bad value and what is allowed. Derived facts (layer modes, the
owner a REUSE layer reads, the compressor owners) are computed here once, so the model, the
geometry and the reference forward agree by construction.
"""

from __future__ import annotations

import enum
from functools import cached_property
from typing import Any

from pydantic import model_validator

from atom.models.common.config import (
    ConfigError,
    ModelConfig,
    check_attention_dims,
    check_positive,
    check_rope_scaling,
    fail,
)

__all__ = ["ConfigError", "LayerMode", "V41Config"]

V41_MODEL_TYPE = "deepseek_v41"


class LayerMode(str, enum.Enum):
    WINDOW = "window"  # sliding window only
    FULL = "full"  # own compressor and own indexer
    REINDEX = "reindex"  # own index query over the candidate source's keys, in its blocks
    REUSE = "reuse"  # the latest owner's compressed rows and the latest selection


class V41Config(ModelConfig):
    """The fields of a DeepSeek-V4.1 config.json that this implementation reads.

    Unknown fields in a real config.json are ignored (HF configs carry many), but every field
    below is validated, and cross-field constraints are checked on construction.
    """

    model_type: str = "deepseek_v41"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float = 1e-20
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 65536
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    moe_intermediate_size: int
    scoring_func: str = "sqrt_softplus"
    routed_scaling_factor: float = 1.5
    gate_temp: float = 1.0  # the router divides its logits by it (published ModelArgs.gate_temp)
    swiglu_limit: float = 10.0
    compress_ratios: list[int]
    kv_source_layer_ids: list[int]
    index_source_layer_ids: list[int]
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    engram_layer_ids: list[int] = []
    engram_vocab_size: int = 32768
    engram_max_ngram: int = 4
    engram_n_heads: int = 2
    engram_embed_dim: int = 64
    engram_table_size: int = 65521
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    @model_validator(mode="before")
    @classmethod
    def _model_type(cls, data: Any) -> Any:
        # checked before the fields, so a V4 file is named as such, not as a missing V4.1 field
        kind = data.get("model_type", V41_MODEL_TYPE) if isinstance(data, dict) else None
        if kind not in (None, V41_MODEL_TYPE):
            raise ValueError(
                f"model_type={kind!r} is invalid: a V4.1 config has model_type "
                f"{V41_MODEL_TYPE!r} (atom.models.registry picks the model from model_type)"
            )
        return data

    @model_validator(mode="after")
    def _validate(self) -> V41Config:
        _check_config(self)
        return self

    # ---- derived ------------------------------------------------------------------------

    @cached_property
    def layer_modes(self) -> tuple[LayerMode, ...]:
        modes = []
        for layer in range(self.num_hidden_layers):
            ratio = self.compress_ratios[layer]
            if ratio == 0:
                modes.append(LayerMode.WINDOW)
            elif layer in self.kv_source_layer_ids:
                modes.append(LayerMode.FULL)
            elif layer in self.index_source_layer_ids:
                modes.append(LayerMode.REINDEX)
            else:
                modes.append(LayerMode.REUSE)
        return tuple(modes)

    @cached_property
    def kv_owner(self) -> tuple[int | None, ...]:
        """For each layer, the kv-source layer whose compressed rows it attends (None: window)."""
        owners: list[int | None] = []
        latest: int | None = None
        for layer in range(self.num_hidden_layers):
            if layer in self.kv_source_layer_ids:
                latest = layer
            owners.append(latest if self.compress_ratios[layer] > 0 else None)
        return tuple(owners)

    @cached_property
    def selection_owner(self) -> tuple[int | None, ...]:
        """For each layer, the index-source layer whose top-k selection it uses."""
        owners: list[int | None] = []
        latest: int | None = None
        for layer in range(self.num_hidden_layers):
            if layer in self.index_source_layer_ids:
                latest = layer
            owners.append(latest if self.compress_ratios[layer] > 0 else None)
        return tuple(owners)

    @property
    def compressor_owners(self) -> tuple[int, ...]:
        """Layers that own a compressor (and an index-key plane), in layer order."""
        return tuple(sorted(self.kv_source_layer_ids))

    @property
    def max_ratio(self) -> int:
        return max([self.compress_ratios[i] for i in self.compressor_owners] or [1])

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(theta, yarn scaling or None) for a layer: compressed layers use the long RoPE."""
        if self.compress_ratios[layer] > 0:
            return self.compress_rope_theta, self.rope_scaling
        return self.rope_theta, None


_POSITIVE = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "hc_mult",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "candidate_topk_blocks",
    "candidate_block_size",
)


def _check_config(c: V41Config) -> None:
    check_positive(c, _POSITIVE)
    check_attention_dims(c)
    if c.num_experts_per_tok > c.n_routed_experts:
        fail("num_experts_per_tok", c.num_experts_per_tok, f"<= {c.n_routed_experts}")
    if c.scoring_func != "sqrt_softplus":
        fail(
            "scoring_func",
            c.scoring_func,
            "only 'sqrtsoftplus' (alias 'sqrt_softplus') is implemented",
        )
    if c.rms_norm_eps < 0 or c.rms_norm_eps != c.rms_norm_eps:
        fail("rms_norm_eps", c.rms_norm_eps, "must be a non-negative number")
    if c.hc_sinkhorn_iters < 0:
        fail("hc_sinkhorn_iters", c.hc_sinkhorn_iters, "must be >= 0")
    check_rope_scaling(c.rope_scaling)
    n_all = c.num_hidden_layers + c.num_nextn_predict_layers
    if len(c.compress_ratios) not in (c.num_hidden_layers, n_all):
        fail(
            "compress_ratios",
            c.compress_ratios,
            f"needs {c.num_hidden_layers} entries (or {n_all} with the draft layers)",
        )
    for i, r in enumerate(c.compress_ratios):
        if r not in (0, 1, 2):
            fail(f"compress_ratios[{i}]", r, "each ratio must be 0, 1 or 2")
    for i in range(c.num_hidden_layers, len(c.compress_ratios)):
        if c.compress_ratios[i] != 0:
            fail(f"compress_ratios[{i}]", c.compress_ratios[i], "draft layers are window-only (0)")
    layers = range(c.num_hidden_layers)
    for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        ids = getattr(c, name)
        if sorted(set(ids)) != list(ids):
            fail(name, ids, "must be strictly increasing layer ids")
        bad = [i for i in ids if i not in layers]
        if bad:
            fail(name, ids, f"layer ids must be in [0, {c.num_hidden_layers})")
    for i in c.kv_source_layer_ids:
        if c.compress_ratios[i] == 0:
            fail("kv_source_layer_ids", c.kv_source_layer_ids, f"layer {i} has ratio 0")
        if i not in c.index_source_layer_ids:
            fail(
                "index_source_layer_ids",
                c.index_source_layer_ids,
                f"must include every kv source (missing {i}: its index keys fill a PAGE plane)",
            )
    for i in c.index_source_layer_ids:
        if c.compress_ratios[i] == 0:
            fail("index_source_layer_ids", c.index_source_layer_ids, f"layer {i} has ratio 0")
    latest_kv: int | None = None
    latest_sel: int | None = None
    for layer in layers:
        ratio = c.compress_ratios[layer]
        if layer in c.kv_source_layer_ids:
            latest_kv = layer
        if layer in c.index_source_layer_ids:
            latest_sel = layer
        if ratio == 0:
            continue
        if latest_kv is None:
            fail(
                "kv_source_layer_ids",
                c.kv_source_layer_ids,
                f"compressed layer {layer} has no kv source at or before it",
            )
        if c.compress_ratios[latest_kv] != ratio:
            fail(
                f"compress_ratios[{layer}]",
                ratio,
                f"layer {layer} reads kv source {latest_kv} (ratio {c.compress_ratios[latest_kv]})"
                "; a reader's ratio must equal its source's",
            )
        if latest_sel is None or latest_sel < latest_kv:
            fail(
                "index_source_layer_ids",
                c.index_source_layer_ids,
                f"layer {layer} has no selection over kv source {latest_kv}'s rows",
            )
        reindex = layer in c.index_source_layer_ids and layer not in c.kv_source_layer_ids
        if reindex and c.candidate_source_layer_id != latest_kv:
            fail(
                "candidate_source_layer_id",
                c.candidate_source_layer_id,
                f"REINDEX layer {layer} re-scores kv source {latest_kv}, which must be the "
                "candidate source",
            )
    if c.candidate_source_layer_id is not None:
        if c.candidate_source_layer_id not in c.kv_source_layer_ids:
            fail(
                "candidate_source_layer_id",
                c.candidate_source_layer_id,
                f"must be one of kv_source_layer_ids={c.kv_source_layer_ids}",
            )
        if c.candidate_topk_blocks * c.candidate_block_size < c.index_topk:
            fail(
                "candidate_topk_blocks",
                c.candidate_topk_blocks,
                f"candidate_topk_blocks * candidate_block_size ({c.candidate_block_size}) must "
                f"be >= index_topk ({c.index_topk})",
            )
    if c.engram_layer_ids:
        if not 2 <= c.engram_max_ngram <= 4:
            fail("engram_max_ngram", c.engram_max_ngram, "must be in [2, 4] (history holds 3)")
        for name in ("engram_vocab_size", "engram_n_heads", "engram_embed_dim"):
            if getattr(c, name) <= 0:
                fail(name, getattr(c, name), "must be a positive integer")
        if c.engram_table_size < 2:
            fail("engram_table_size", c.engram_table_size, "must be >= 2")
