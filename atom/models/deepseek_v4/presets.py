"""DeepSeek-V4 presets: the published Flash config and the small shapes we run.

v4-flash is the published DeepSeek-V4-Flash config.json (geometry checks; far too large to
instantiate here). v4-bench keeps Flash's per-layer dimensions with 10 layers and 8 experts
(bf16 on the H200 benchmarks; v4-bench-fp8 is the same model with its linears stored as FP8 in
128 x 128 blocks, as Flash ships them; v4-tiny-fp8 likewise in 32 x 32 blocks, for CPU tests).
v4-tiny runs CPU unit tests in seconds; v4-mini keeps the real
block (256), window (128) and HCA ratio (128) at small widths, with the FP8/FP4 simulations on,
for CPU integration. Both small shapes have every layer kind: window-only, CSA (ratio 4) and HCA
layers, and hash-routed MoE layers first, as in Flash.
"""

from __future__ import annotations

from typing import Any

from atom.models.common.presets import build_preset, yarn
from atom.models.deepseek_v4.config import V4Config

_FLASH: dict[str, Any] = dict(
    model_type="deepseek_v4",
    vocab_size=129280,
    hidden_size=4096,
    num_hidden_layers=43,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    sliding_window=128,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    rms_norm_eps=1e-6,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rope_theta=10000,
    compress_rope_theta=160000,
    rope_scaling=yarn(16, 65536),
    max_position_embeddings=1048576,
    n_routed_experts=256,
    num_experts_per_tok=6,
    n_shared_experts=1,
    moe_intermediate_size=2048,
    scoring_func="sqrtsoftplus",
    topk_method="noaux_tc",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
    num_hash_layers=3,
    num_nextn_predict_layers=1,
    quantization_config=dict(
        activation_scheme="dynamic",
        fmt="e4m3",
        quant_method="fp8",
        scale_fmt="ue8m0",
        weight_block_size=[128, 128],
    ),
)

_TINY: dict[str, Any] = dict(
    model_type="deepseek_v4",
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=6,
    num_attention_heads=2,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=32,
    sliding_window=8,
    index_n_heads=2,
    index_head_dim=32,
    index_topk=3,
    rope_scaling=yarn(4, 256),
    max_position_embeddings=65536,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    # window, CSA, HCA (ratio 8: 2 rows per 16-token block, as 128 gives 2 per 256), ...
    compress_ratios=[0, 4, 8, 4, 8, 4, 0],
    num_hash_layers=2,
    num_nextn_predict_layers=1,
    initializer_range=0.1,
    kv_fp8_sim=False,
    index_fp4_sim=False,
)

_MINI: dict[str, Any] = dict(
    model_type="deepseek_v4",
    vocab_size=320,
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    head_dim=128,
    qk_rope_head_dim=64,
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=128,
    sliding_window=128,
    index_n_heads=4,
    index_head_dim=128,
    index_topk=32,
    rope_scaling=yarn(4, 4096),
    max_position_embeddings=65536,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    compress_ratios=[0, 0, 4, 128, 4, 128, 4, 4, 0],
    num_hash_layers=3,
    num_nextn_predict_layers=1,
    initializer_range=0.05,
)

# The real per-layer dimensions of Flash (hidden 4096, 64 heads x 512, window 128, indexer
# 64 heads x 128 with top-512, expert width 2048, the full vocabulary and hash layers) with
# fewer layers and experts, for GPU benchmarks (as v41-bench is for V4.1): two window layers,
# then CSA (4) and HCA (128) alternating, as Flash begins, and its MTP block.
_BENCH: dict[str, Any] = dict(
    _FLASH,
    num_hidden_layers=10,
    compress_ratios=[0, 0] + [4, 128] * 4 + [0],
    n_routed_experts=8,
    num_experts_per_tok=2,
    quantization_config=None,  # random bf16 weights; v4-bench-fp8 is the FP8 one
)


def _fp8(base: dict[str, Any], block: list[int]) -> dict[str, Any]:
    """``base`` whose checkpoint stores its linears as FP8 in ``block`` blocks: its random
    weights are ``base``'s rounded through FP8 (both ``weight_dtype`` settings run that one
    model; "fp8", the default for it, keeps the FP8 bytes)."""
    return dict(
        base, quantization_config=dict(_FLASH["quantization_config"], weight_block_size=block)
    )


PRESETS: dict[str, dict[str, Any]] = {
    "v4-flash": _FLASH,
    "v4-tiny": _TINY,
    "v4-mini": _MINI,
    "v4-bench": _BENCH,
    "v4-tiny-fp8": _fp8(_TINY, [32, 32]),
    "v4-bench-fp8": _fp8(_BENCH, [128, 128]),
}

# Block size each preset is meant to run with (the engine's default for it).
PRESET_BLOCK_SIZE: dict[str, int] = {
    "v4-flash": 256,
    "v4-tiny": 16,
    "v4-mini": 256,
    "v4-bench": 256,
    "v4-tiny-fp8": 16,
    "v4-bench-fp8": 256,
}


def preset_config(name: str, **overrides: Any) -> V4Config:
    """The config of a preset, with field overrides (validated like a config.json)."""
    return build_preset(V4Config, PRESETS, name, overrides)
