"""DeepSeek-V4 model config, read from the published config.json (DeepSeek-V4-Flash's fields).

Layer kinds come from ``compress_ratios``: 0 is WINDOW (sliding window only), 4 is CSA
(overlapping compressor + indexer top-k over the compressed rows), any other ratio is HCA (a
non-overlapping compressor, every visible compressed row attended). The entries past
``num_hidden_layers`` belong to the MTP draft layers (window-only).

Two fields are atom's own and absent from DeepSeek's file: ``kv_fp8_sim`` (round the NoPE dims
of window KV and compressed rows through FP8 E4M3 in blocks of 64, as the published model was
trained) and ``index_fp4_sim`` (Hadamard-rotate the indexer's queries and keys and round them
through FP4 E2M1 in blocks of 32). Both default to on, as published; the tiny presets turn them
off so the paged forward can be compared with the oracle to 1e-4 (a rounding step can turn a
1e-7 reduction-order difference into one quantization step).
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

V4_MODEL_TYPE = "deepseek_v4"
CSA_RATIO = 4  # the one ratio with an overlapping compressor and an indexer
FP8_SIM_BLOCK = 64
FP4_SIM_BLOCK = 32

__all__ = ["ConfigError", "V4Config", "V4LayerKind", "CSA_RATIO"]


class V4LayerKind(str, enum.Enum):
    WINDOW = "window"  # ratio 0: sliding window only
    CSA = "csa"  # ratio 4: overlapping compressor, indexer top-k
    HCA = "hca"  # other ratios: compressor without overlap, every visible row


class V4Config(ModelConfig):
    """The fields of a DeepSeek-V4 config.json that this implementation reads.

    Unknown fields are ignored (HF configs carry many); every field below is validated, and
    cross-field constraints are checked on construction, naming the field and the fix.
    """

    model_type: str = V4_MODEL_TYPE
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float = 1e-6
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
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    compress_ratios: list[int]
    num_hash_layers: int = 0
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    expert_dtype: str | None = "fp4"
    quantization_config: dict[str, Any] | None = None
    initializer_range: float = 0.02
    kv_fp8_sim: bool = True
    index_fp4_sim: bool = True

    @model_validator(mode="after")
    def _validate(self) -> V4Config:
        _check_config(self)
        return self

    # ---- derived ------------------------------------------------------------------------

    @cached_property
    def layer_kinds(self) -> tuple[V4LayerKind, ...]:
        return tuple(_kind(self.compress_ratios[i]) for i in range(self.num_hidden_layers))

    def layers_of(self, kind: V4LayerKind) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is kind)

    @property
    def compressed_layers(self) -> tuple[int, ...]:
        """Layers with a compressor (CSA and HCA), in layer order."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is not V4LayerKind.WINDOW)

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    def layer_ratio(self, layer: int) -> int:
        """Compress ratio of a layer; the MTP draft layers (``num_hidden_layers + i``) are
        window-only (0) whether or not ``compress_ratios`` lists them."""
        return self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(theta, yarn scaling or None): compressed layers use the long RoPE with YaRN,
        window-only layers (the MTP layers among them) the base theta without it."""
        if self.layer_ratio(layer) > 0:
            return self.compress_rope_theta, self.rope_scaling
        return self.rope_theta, None


def _kind(ratio: int) -> V4LayerKind:
    if ratio == 0:
        return V4LayerKind.WINDOW
    return V4LayerKind.CSA if ratio == CSA_RATIO else V4LayerKind.HCA


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
    "max_position_embeddings",
)


def _check_config(c: V4Config) -> None:
    if c.model_type != V4_MODEL_TYPE:
        fail("model_type", c.model_type, f"a V4 config has model_type {V4_MODEL_TYPE!r}")
    check_positive(c, _POSITIVE)
    if c.num_key_value_heads != 1:
        fail("num_key_value_heads", c.num_key_value_heads, "V4 attention is MQA: must be 1")
    check_attention_dims(c)
    if c.num_experts_per_tok > c.n_routed_experts:
        fail("num_experts_per_tok", c.num_experts_per_tok, f"must be <= {c.n_routed_experts}")
    if c.n_shared_experts != 1:
        fail("n_shared_experts", c.n_shared_experts, "V4 has exactly one shared expert")
    if c.scoring_func != "sqrt_softplus":
        fail("scoring_func", c.scoring_func, "only 'sqrtsoftplus' (alias 'sqrt_softplus')")
    if c.topk_method != "noaux_tc":
        fail("topk_method", c.topk_method, "only 'noaux_tc' (top-k of score + bias)")
    if not c.norm_topk_prob:
        fail("norm_topk_prob", c.norm_topk_prob, "V4 normalizes the chosen scores: must be true")
    if c.hidden_act != "silu":
        fail("hidden_act", c.hidden_act, "only 'silu' (clamped SwiGLU)")
    if c.tie_word_embeddings:
        fail("tie_word_embeddings", True, "V4 has a separate head: must be false")
    if c.expert_dtype not in (None, "fp4", "bf16", "fp8"):
        fail("expert_dtype", c.expert_dtype, "one of 'fp4', 'fp8', 'bf16' (or absent: fp4)")
    if not c.rms_norm_eps >= 0:
        fail("rms_norm_eps", c.rms_norm_eps, "must be a non-negative number")
    if c.hc_sinkhorn_iters < 1:
        fail("hc_sinkhorn_iters", c.hc_sinkhorn_iters, "must be >= 1")
    check_rope_scaling(c.rope_scaling)
    n_all = c.num_hidden_layers + c.num_nextn_predict_layers
    if len(c.compress_ratios) not in (c.num_hidden_layers, n_all):
        fail(
            "compress_ratios",
            f"<{len(c.compress_ratios)} entries>",
            f"needs {c.num_hidden_layers} entries (or {n_all} with the MTP layers)",
        )
    for i, r in enumerate(c.compress_ratios):
        if r < 0 or r == 1:
            fail(f"compress_ratios[{i}]", r, "0 (window), 4 (CSA) or another ratio >= 2 (HCA)")
    for i in range(c.num_hidden_layers, len(c.compress_ratios)):
        if c.compress_ratios[i] != 0:
            fail(f"compress_ratios[{i}]", c.compress_ratios[i], "MTP layers are window-only (0)")
    if not 0 <= c.num_hash_layers <= c.num_hidden_layers:
        fail("num_hash_layers", c.num_hash_layers, f"must be in [0, {c.num_hidden_layers}]")
    if c.kv_fp8_sim and c.nope_head_dim % FP8_SIM_BLOCK:
        fail(
            "head_dim",
            c.head_dim,
            f"with kv_fp8_sim the NoPE dims ({c.nope_head_dim}) must be a multiple of "
            f"{FP8_SIM_BLOCK}; set kv_fp8_sim=false for other shapes",
        )
    if c.index_fp4_sim:
        d = c.index_head_dim
        if d % FP4_SIM_BLOCK or d & (d - 1):
            fail(
                "index_head_dim",
                d,
                f"with index_fp4_sim it must be a power of two and a multiple of "
                f"{FP4_SIM_BLOCK} (Hadamard + FP4 blocks); set index_fp4_sim=false otherwise",
            )
