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
from atom.models.deepseek_v41.dspark_config import check_dspark

__all__ = ["ConfigError", "LayerMode", "V41Config"]

V41_MODEL_TYPE = "deepseek_v41"
_PREPUBLISHED_ENGRAM_KEYS = ("engram_max_ngram", "engram_embed_dim", "engram_table_size")


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
    # Engram, with the published keys' meanings (atom.models.deepseek_v41.ngram_hash):
    # engram_vocab_size is where each (n-gram size, head) bucket's prime search starts;
    # engram_num_embeddings the table rows of each engram layer (None: exactly the primes'
    # sum, atom's shorthand for presets); engram_compressed_vocab_size the size of the
    # tokenizer-derived compressed vocabulary (None: the identity map over vocab_size, for
    # presets without a tokenizer); engram_pad_token_id the token hashed where the look-back
    # reaches before the sequence.
    engram_layer_ids: list[int] = []
    engram_num_embeddings: list[int] | None = None
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 64
    engram_n_heads: int = 2
    engram_head_dim: int = 32
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int | None = None
    num_nextn_predict_layers: int = 0
    # The roundings DeepSeek's published inference code applies (atom's keys: a published
    # config has none; they are on for the published model, off in the small presets, where
    # paged and reference forwards are compared at float tolerance). kv_fp8_sim: window KV
    # through E4M3 per 32 over the whole rotated vector; compressed_fp4_sim: compressed rows
    # through FP4 per 16 with E4M3 scales after RoPE; index_fp4_sim: index queries and keys
    # through FP4 per 32 with E8M0 scales; act_fp8_sim: the inputs of the FP8/FP4 linears
    # through E4M3 per 32 (atom.models.common.formats).
    kv_fp8_sim: bool = False
    compressed_fp4_sim: bool = False
    index_fp4_sim: bool = False
    act_fp8_sim: bool = False
    # DSpark's block drafter (``dspark``): stages built when dspark_stages > 0
    dspark_stages: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: list[int] = []
    dspark_markov_rank: int | None = None
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    quantization_config: dict[str, Any] | None = None
    vision_config: dict[str, Any] | None = None
    image_token_id: int | None = None
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

    @model_validator(mode="before")
    @classmethod
    def _published_form(cls, data: Any) -> Any:
        # runs before the others (pydantic runs "before" validators last-defined first)
        from atom.models.deepseek_v41.published_config import flatten, is_published_form

        return flatten(data) if is_published_form(data) else data

    @model_validator(mode="before")
    @classmethod
    def _no_prepublished_engram(cls, data: Any) -> Any:
        old = [k for k in _PREPUBLISHED_ENGRAM_KEYS if isinstance(data, dict) and k in data]
        if old:
            raise ValueError(
                f"{old} are keys of atom's Engram before it followed the published model "
                "(engram_vocab_size now means the prime search start, not a vocabulary "
                "modulus); this config (and its checkpoint) predates that change: retrain or "
                "re-export it with the published keys (engram_max_ngram_size, engram_head_dim, "
                "engram_num_embeddings)"
            )
        return data

    @model_validator(mode="after")
    def _validate(self) -> V41Config:
        _check_config(self)
        return self

    # ---- derived ------------------------------------------------------------------------

    @cached_property
    def engram_spec(self):
        """The Engram's layout keys (``ngram_hash.spec_of``; None without engram layers)."""
        from atom.models.deepseek_v41.ngram_hash import spec_of

        return spec_of(self)

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


def _check_rounding_blocks(c: V41Config) -> None:
    """Each simulated rounding works on whole blocks of the dims it rounds."""
    need = []
    if c.kv_fp8_sim:
        need.append(("kv_fp8_sim", "head_dim", c.head_dim, 32))
    if c.compressed_fp4_sim:
        need.append(("compressed_fp4_sim", "head_dim", c.head_dim, 16))
    if c.index_fp4_sim:
        need.append(("index_fp4_sim", "index_head_dim", c.index_head_dim, 32))
    if c.act_fp8_sim:
        for name in ("hidden_size", "q_lora_rank", "moe_intermediate_size"):
            need.append(("act_fp8_sim", name, getattr(c, name), 32))
        need.append(("act_fp8_sim", "o_groups * o_lora_rank", c.o_groups * c.o_lora_rank, 32))
    for flag, name, value, block in need:
        if value % block:
            fail(name, value, f"must be a multiple of {block} with {flag} on (rounded per {block})")


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
    _check_rounding_blocks(c)
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
        if not 2 <= c.engram_max_ngram_size <= 4:
            fail(
                "engram_max_ngram_size",
                c.engram_max_ngram_size,
                "must be in [2, 4] (the state keeps the last 3 token ids)",
            )
        for name in ("engram_vocab_size", "engram_n_heads", "engram_head_dim"):
            if getattr(c, name) <= 0:
                fail(name, getattr(c, name), "must be a positive integer")
        if c.engram_head_dim % 32:
            fail("engram_head_dim", c.engram_head_dim, "must be a multiple of 32")
        if not 0 <= c.engram_pad_token_id < c.vocab_size:
            fail("engram_pad_token_id", c.engram_pad_token_id, f"must be in [0, {c.vocab_size})")
        try:
            _ = c.engram_spec  # builds the layout: refuses tables too small for it
        except ValueError as e:
            fail("engram_num_embeddings", c.engram_num_embeddings, str(e))
    check_dspark(c)
