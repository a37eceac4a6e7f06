"""Model presets: the published V4.1-Flash config and the small shapes we run.

v41-flash is the published V4.1-Flash config.json (for geometry checks; too large to
instantiate here), with its 3 DSpark stages. v41-tiny runs CPU unit tests in seconds, v41-mini
CPU integration and accuracy jobs, v41-bench keeps the real per-layer dimensions (so bytes per
FLOP stay the real model's) with fewer layers and experts, for GPU benchmarks. v41-tiny-draft
is v41-tiny with 2 MTP-style draft layers, for the draft layers' CPU tests; v41-tiny-dspark is
v41-tiny with two DSpark stages instead, for the DSpark path's; v41-bench-draft is v41-bench
with 1 draft layer, for speculative decoding on the GPU.
"""

from __future__ import annotations

from typing import Any

from atom.models.common.presets import build_preset, yarn
from atom.models.deepseek_v41.config import V41Config

_FLASH: dict[str, Any] = dict(
    vocab_size=129280,
    hidden_size=5120,
    num_hidden_layers=40,
    num_attention_heads=64,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1280,
    o_groups=8,
    o_lora_rank=1024,
    sliding_window=128,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=512,
    rms_norm_eps=1e-20,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_scaling=yarn(16, 65536),
    max_position_embeddings=1048576,
    n_routed_experts=384,
    num_experts_per_tok=6,
    n_shared_experts=1,
    moe_intermediate_size=2304,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    kv_source_layer_ids=[2, 8, 14, 20],
    index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
    candidate_source_layer_id=20,
    candidate_topk_blocks=2048,
    candidate_block_size=8,
    engram_layer_ids=[1, 14],
    engram_num_embeddings=[384006168, 384016682],
    engram_max_ngram_size=4,
    engram_vocab_size=16000000,
    engram_n_heads=8,
    engram_head_dim=256,
    engram_pad_token_id=2,
    engram_compressed_vocab_size=99092,
    num_nextn_predict_layers=3,
)

# v41-flash: the published DeepSeek-V4.1-Flash config.json, exactly (its text model as atom
# reads it; tests/model/test_v41_published_config.py compares the two): three DSpark stages
# drafting blocks of 5 from layers 37-39 (not MTP-style draft layers), the roundings of its FP8
# checkpoint on, and its vision tower's config (the tower itself does not exist yet). The
# smaller presets derive from _FLASH's shapes, without these.
_FLASH_PUBLISHED: dict[str, Any] = dict(
    _FLASH,
    compress_ratios=_FLASH["compress_ratios"][:40],
    num_nextn_predict_layers=0,
    dspark_stages=3,
    dspark_block_size=5,
    dspark_noise_token_id=128799,
    dspark_target_layer_ids=[37, 38, 39],
    dspark_markov_rank=256,
    dspark_n_routed_experts=128,
    dspark_num_experts_per_tok=3,
    kv_fp8_sim=True,
    compressed_fp4_sim=True,
    index_fp4_sim=True,
    act_fp8_sim=True,
    quantization_config=dict(
        quant_method="fp8",
        activation_scheme="dynamic",
        weight_block_size=[32, 32],
        scale_fmt="ue8m0",
        expert_dtype="fp4",
    ),
    image_token_id=129264,
    vision_config={
        "model_type": "deepseek_v41_vision",
        "num_hidden_layers": 32,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "intermediate_size": 2816,
        "patch_size": 14,
        "rope_theta": 10000,
        "downsample_ratio": 3,
        "max_image_tokens": 1024,
        "min_pixels": 295936,
        "max_wh_ratio": None,
    },
)

# The small shapes share one 10-layer pattern that exercises every layer mode:
# WINDOW 0-1, FULL r2 2 and 4, REUSE r2 3 and 5, FULL r1 6 (candidate source), REUSE r1 7,
# REINDEX 8, REUSE 9 (reads 6's rows with 8's selection); Engram on 1 and 4.
_PATTERN: dict[str, Any] = dict(
    num_hidden_layers=10,
    compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1],
    kv_source_layer_ids=[2, 4, 6],
    index_source_layer_ids=[2, 4, 6, 8],
    candidate_source_layer_id=6,
    engram_layer_ids=[1, 4],
)

_TINY: dict[str, Any] = dict(
    _PATTERN,
    vocab_size=320,
    hidden_size=64,
    num_attention_heads=2,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=32,
    sliding_window=8,
    index_n_heads=2,
    index_head_dim=32,
    index_topk=4,
    candidate_topk_blocks=4,
    candidate_block_size=2,
    rms_norm_eps=1e-6,
    rope_scaling=yarn(4, 256),
    max_position_embeddings=65536,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    engram_vocab_size=64,
    engram_n_heads=2,
    engram_head_dim=32,
    initializer_range=0.1,
)

_MINI: dict[str, Any] = dict(
    _PATTERN,
    vocab_size=320,
    hidden_size=512,
    num_attention_heads=8,
    head_dim=128,
    qk_rope_head_dim=32,
    q_lora_rank=256,
    o_groups=2,
    o_lora_rank=256,
    sliding_window=128,
    index_n_heads=4,
    index_head_dim=64,
    index_topk=64,
    candidate_topk_blocks=16,
    candidate_block_size=8,
    rms_norm_eps=1e-6,
    rope_scaling=yarn(4, 4096),
    max_position_embeddings=65536,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    engram_vocab_size=4096,
    engram_n_heads=2,
    engram_head_dim=32,
    initializer_range=0.05,
)

_BENCH: dict[str, Any] = dict(
    _FLASH,
    **_PATTERN,
    n_routed_experts=8,
    num_experts_per_tok=2,
    num_nextn_predict_layers=0,
    engram_num_embeddings=None,  # the primes' sums (the published 384M rows would not fit)
    engram_vocab_size=16384,
    engram_n_heads=4,
    engram_head_dim=128,
    engram_compressed_vocab_size=None,  # no tokenizer: the identity map
    max_position_embeddings=1048576,
)

# The shape of the trained recall model (models/v41-recall): small enough to evaluate on CPU in
# CI, with a window (64) much shorter than its contexts, so answers need compressed rows. Its
# own layer pattern (every mode still present): the ratio-1 KV source is layer 0, so the rows
# that later layers look records up in are made from the token embeddings. Measured on CPU
# (single-hop lookup, window 4, 72 tokens): this pattern learns (accuracy 0.26 after 120
# steps), the shared pattern, whose sources are layers 2, 4 and 6, stays at chance for 200.
_RECALL: dict[str, Any] = dict(
    num_hidden_layers=10,
    compress_ratios=[1, 1, 1, 1, 1, 2, 2, 2, 0, 0],
    kv_source_layer_ids=[0, 5],
    index_source_layer_ids=[0, 2, 5],
    candidate_source_layer_id=0,
    engram_layer_ids=[1, 5],
    vocab_size=320,
    hidden_size=256,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=128,
    sliding_window=64,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=64,
    candidate_topk_blocks=16,
    candidate_block_size=8,
    rms_norm_eps=1e-6,
    rope_scaling=yarn(4, 4096),
    max_position_embeddings=65536,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    engram_vocab_size=512,
    engram_n_heads=2,
    engram_head_dim=32,
    initializer_range=0.02,
)

# v41-tiny with two draft layers (v41-tiny itself keeps none: its layout id, and so every stored
# image and namespace derived from it, stays as it was)
_TINY_DRAFT: dict[str, Any] = dict(_TINY, num_nextn_predict_layers=2)

# v41-tiny with two DSpark stages drafting blocks of 3 from three target layers (the DSpark
# path's CPU tests); its target weights are v41-tiny's (the stages draw last)
_TINY_DSPARK: dict[str, Any] = dict(
    _TINY,
    dspark_stages=2,
    dspark_block_size=3,
    dspark_noise_token_id=5,
    dspark_target_layer_ids=[6, 8, 9],
    dspark_markov_rank=16,
    dspark_n_routed_experts=2,
    dspark_num_experts_per_tok=1,
)

# v41-bench with one (random) draft layer. Its target weights are v41-bench's, bit for bit
# (``init_weights`` draws the draft layers last; tests/model/test_bench_draft_preset.py). A
# preset of its own rather than a draft layer in v41-bench: the layout id hashes the config
# (v41-bench's tier namespace would change), and the model builds its draft layers whether or
# not it speculates (every v41-bench run would hold 0.5 B more parameters, which the roofline
# counts as weight bytes)
_BENCH_DRAFT: dict[str, Any] = dict(_BENCH, num_nextn_predict_layers=1)


def _fp8(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` whose checkpoint stores its linears as FP8 in 32 x 32 blocks and its routed
    experts as FP4, as V4.1-Flash ships them: its random weights are ``base``'s rounded through
    FP8 and FP4 (both ``weight_dtype`` settings run that one model; "fp8", the default for it,
    keeps the FP8 and FP4 bytes)."""
    quant = dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[32, 32])
    return dict(base, quantization_config=dict(quant, scale_fmt="ue8m0", expert_dtype="fp4"))


PRESETS: dict[str, dict[str, Any]] = {
    "v41-flash": _FLASH_PUBLISHED,
    "v41-tiny": _TINY,
    "v41-mini": _MINI,
    "v41-bench": _BENCH,
    "v41-recall": _RECALL,
    "v41-tiny-draft": _TINY_DRAFT,
    "v41-tiny-dspark": _TINY_DSPARK,
    "v41-bench-draft": _BENCH_DRAFT,
    "v41-tiny-fp8": _fp8(_TINY),
    "v41-bench-fp8": _fp8(_BENCH),
}

# Block size each preset is meant to run with (the engine's default for it).
PRESET_BLOCK_SIZE: dict[str, int] = {
    "v41-flash": 256,
    "v41-tiny": 16,
    "v41-mini": 256,
    "v41-bench": 256,
    "v41-recall": 256,
    "v41-tiny-draft": 16,
    "v41-tiny-dspark": 16,
    "v41-bench-draft": 256,
    "v41-tiny-fp8": 16,
    "v41-bench-fp8": 256,
}


def preset_config(name: str, **overrides: Any) -> V41Config:
    """The config of a preset, with field overrides (validated like a config.json)."""
    return build_preset(V41Config, PRESETS, name, overrides)
