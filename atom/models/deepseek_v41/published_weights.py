"""DeepSeek-V4.1-Flash weights as published: DeepSeek's tensor names, FP8 in 32 x 32 blocks
with E8M0 scales, FP4 routed experts, the Engram table in FP8 with a scale per 32 values of a
row, several shards.

``NAMES`` maps each published tensor to this model's parameter, with the format the published
checkpoint stores it in. What the published code keeps in bf16 (``wo_a``, which DeepSeek's
conversion dequantizes; the compressors; the indexer's ``wk`` and ``weights_proj``; the router;
norms, embedding and head) is bf16 here too; a re-export in bf16 or float32 loads as well.

The DSpark stages (``mtp.{i}.*``) load into ``dspark.{i}`` (``STAGE_NAMES``) when the config
builds them (``dspark_stages``). Left unread, with the reason logged (``UNREAD``): stages past
``dspark_stages``, the vision tower and its image-span tensors (image inputs are
refused until it exists). A config that builds atom's own MTP-style draft layers cannot load a
published checkpoint: the published draft stages are DSpark's, a different network.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

from atom.models.common.checkpoint import (
    BF16,
    F32,
    FP4,
    FP8,
    FP8_ROWS,
    Layout,
    expected_names,
    load_published,
)
from atom.models.common.fp4_linear import experts_fp4, fp4_module_names
from atom.models.common.fp8_linear import fp8_module_names
from atom.models.common.fp8_rows import table_names
from atom.models.common.weights import WeightLoadError
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM

log = logging.getLogger(__name__)

_P = "model.layers.{L}."
# (published name, atom parameter name, published format)
NAMES: tuple[tuple[str, str, str], ...] = (
    ("embed.weight", "model.embed_tokens.weight", BF16),
    ("head.weight", "lm_head.weight", BF16),
    ("norm.weight", "model.norm.weight", BF16),
    ("layers.{L}.attn_norm.weight", _P + "input_layernorm.weight", BF16),
    ("layers.{L}.ffn_norm.weight", _P + "post_attention_layernorm.weight", BF16),
    ("layers.{L}.hc_attn_fn", _P + "attn_hc.fn", F32),
    ("layers.{L}.hc_attn_base", _P + "attn_hc.base", F32),
    ("layers.{L}.hc_attn_scale", _P + "attn_hc.scale", F32),
    ("layers.{L}.hc_ffn_fn", _P + "ffn_hc.fn", F32),
    ("layers.{L}.hc_ffn_base", _P + "ffn_hc.base", F32),
    ("layers.{L}.hc_ffn_scale", _P + "ffn_hc.scale", F32),
    ("layers.{L}.attn.attn_sink", _P + "self_attn.attn_sink", F32),
    ("layers.{L}.attn.wq_a.weight", _P + "self_attn.q_a_proj.weight", FP8),
    ("layers.{L}.attn.q_norm.weight", _P + "self_attn.q_a_layernorm.weight", BF16),
    ("layers.{L}.attn.wq_b.weight", _P + "self_attn.q_b_proj.weight", FP8),
    ("layers.{L}.attn.wkv.weight", _P + "self_attn.kv_proj.weight", FP8),
    ("layers.{L}.attn.kv_norm.weight", _P + "self_attn.kv_norm.weight", BF16),
    ("layers.{L}.attn.wo_a.weight", _P + "self_attn.o_a_proj.weight", BF16),
    ("layers.{L}.attn.wo_b.weight", _P + "self_attn.o_b_proj.weight", FP8),
    ("layers.{L}.attn.compressor.wkv.weight", _P + "self_attn.compressor.wkv.weight", BF16),
    ("layers.{L}.attn.compressor.wgate.weight", _P + "self_attn.compressor.wgate.weight", BF16),
    ("layers.{L}.attn.compressor.norm.weight", _P + "self_attn.compressor.norm.weight", BF16),
    ("layers.{L}.attn.indexer.wq_b.weight", _P + "self_attn.indexer.wq_b.weight", FP8),
    (
        "layers.{L}.attn.indexer.weights_proj.weight",
        _P + "self_attn.indexer.weights_proj.weight",
        BF16,
    ),
    ("layers.{L}.attn.indexer.wk.weight", _P + "self_attn.indexer.wk.weight", BF16),
    ("layers.{L}.attn.indexer.k_norm.weight", _P + "self_attn.indexer.k_norm.weight", BF16),
    ("layers.{L}.ffn.gate.weight", _P + "mlp.gate.weight", BF16),
    ("layers.{L}.ffn.gate.bias", _P + "mlp.gate.e_score_correction_bias", F32),
    ("layers.{L}.ffn.experts.{E}.w1.weight", _P + "mlp.experts.{E}.gate_proj.weight", FP4),
    ("layers.{L}.ffn.experts.{E}.w3.weight", _P + "mlp.experts.{E}.up_proj.weight", FP4),
    ("layers.{L}.ffn.experts.{E}.w2.weight", _P + "mlp.experts.{E}.down_proj.weight", FP4),
    ("layers.{L}.ffn.shared_experts.w1.weight", _P + "mlp.shared_experts.gate_proj.weight", FP8),
    ("layers.{L}.ffn.shared_experts.w3.weight", _P + "mlp.shared_experts.up_proj.weight", FP8),
    ("layers.{L}.ffn.shared_experts.w2.weight", _P + "mlp.shared_experts.down_proj.weight", FP8),
    ("layers.{L}.engram.embed.weight", _P + "engram.embed.weight", FP8_ROWS),
    ("layers.{L}.engram.wkv.weight", _P + "engram.wkv.weight", FP8),
    ("layers.{L}.engram.q_weight", _P + "engram.q_weight", BF16),
    ("layers.{L}.engram.k_weight", _P + "engram.k_weight", BF16),
)

# The DSpark stages (``mtp.{M}.*``): a block's tensors (those a window-only layer has) plus
# stage 0's main projection and the last stage's norm, Markov and confidence heads.
_S = "dspark.{M}."
STAGE_NAMES: tuple[tuple[str, str, str], ...] = tuple(
    (ckpt.replace("layers.{L}.", "mtp.{M}."), param.replace(_P, _S), fmt)
    for ckpt, param, fmt in NAMES
    if ckpt.startswith("layers.{L}.")
) + (
    ("mtp.{M}.main_proj.weight", _S + "main_proj.weight", FP8),
    ("mtp.{M}.main_norm.weight", _S + "main_norm.weight", BF16),
    ("mtp.{M}.norm.weight", _S + "norm.weight", BF16),
    ("mtp.{M}.markov_head.embed.weight", _S + "markov_embed.weight", BF16),
    ("mtp.{M}.markov_head.head.weight", _S + "markov_head.weight", BF16),
    ("mtp.{M}.confidence_head.proj.weight", _S + "confidence.weight", BF16),
)

# Published tensors atom does not read, and why (the first pattern that matches).
UNREAD: tuple[tuple[re.Pattern, str], ...] = (
    (
        re.compile(r"mtp\.\d+\."),
        "a DSpark stage the config does not build (dspark_stages, from num_nextn_predict_layers)",
    ),
    (
        re.compile(r"(vision|aligner)\.|image_(start|end|newline)$"),
        "the vision tower: not built, image inputs are refused",
    ),
    (
        re.compile(r"layers\.\d+\.ffn\.gate\.bias_vl$"),
        "the routing bias of image-span tokens: image inputs are refused",
    ),
)


def _unread(name: str, stages: int = 0) -> str | None:
    m = re.match(r"mtp\.(\d+)\.", name)
    if m and int(m[1]) < stages:
        return None  # a stage the model builds: expected, not left unread
    for pattern, reason in UNREAD:
        if pattern.match(name):
            return reason
    return None


LAYOUT = Layout(rows=NAMES + STAGE_NAMES, fp8_block=(32, 32), unread=_unread)


def layout_of(model: DeepseekV41ForCausalLM) -> Layout:
    """``LAYOUT`` with the FP8 block the config's ``quantization_config.weight_block_size``
    states (the published file says [32, 32]; 32 x 32 when the config says nothing)."""
    quant = model.config.quantization_config or {}
    block = quant.get("weight_block_size") or LAYOUT.fp8_block
    if len(block) != 2 or any(int(b) <= 0 for b in block):
        raise WeightLoadError(
            f"quantization_config.weight_block_size is {block}; expected two positive "
            "integers [rows, columns], as published: [32, 32]"
        )
    stages = model.config.dspark_stages
    return Layout(
        rows=LAYOUT.rows,
        fp8_block=(int(block[0]), int(block[1])),
        unread=lambda name: _unread(name, stages),
    )


def fp8_linears(model: DeepseekV41ForCausalLM) -> tuple[list[str], tuple[int, int]]:
    """(the linears that run as FP8 GEMMs at stored precision, their weight block): every
    published FP8 linear (the Engram tables are ``fp8_tables``); the block from the config,
    else 32 x 32."""
    return fp8_module_names(model, LAYOUT.rows), layout_of(model).fp8_block


def fp8_tables(model: DeepseekV41ForCausalLM) -> list[str]:
    """The tables kept as FP8 rows at stored precision (``Fp8RowTable``): the Engram tables,
    stored so in the published checkpoint (E4M3 rows, one E8M0 scale per 32 values)."""
    return table_names(model, LAYOUT.rows)


def fp4_linears(model: DeepseekV41ForCausalLM) -> list[str]:
    """The linears kept as FP4 at stored precision: the published FP4 rows (the routed
    experts), when the config says the experts are FP4 (``experts_fp4``)."""
    return fp4_module_names(model, LAYOUT.rows) if experts_fp4(model.config) else []


def published_names(model: DeepseekV41ForCausalLM) -> dict[str, tuple[str, str]]:
    """published name -> (parameter name, published format), for this model's shape."""
    if len(model.mtp):
        raise WeightLoadError(
            f"this config builds {len(model.mtp)} MTP-style draft layers "
            f"(num_nextn_predict_layers={len(model.mtp)}); a published V4.1 checkpoint holds "
            "DSpark draft stages instead (mtp.*). Set num_nextn_predict_layers to 0 (the "
            "published config.json does: its stages become dspark_stages)"
        )
    c = model.config
    experts = max(c.n_routed_experts, c.dspark_n_routed_experts or 0)
    counts = {"L": c.num_hidden_layers, "M": c.dspark_stages, "E": experts}
    return expected_names(LAYOUT, model.state_dict(), counts)


def load_published_weights(
    model: DeepseekV41ForCausalLM,
    path: str | Path,
    *,
    shards: Mapping[str, tuple[int, int, int]] | None = None,
) -> None:
    """Load a checkpoint in the published layout (``weights.load_weights`` sends one here).

    Same refusals as ``common.checkpoint.load_published``; the tensors ``UNREAD`` names are
    left unread, counted in one log line per reason.
    """
    layout = layout_of(model)
    unread = load_published(model.state_dict(), path, layout, published_names(model), shards=shards)
    counts: dict[str, int] = {}
    for reason in unread.values():
        counts[reason] = counts.get(reason, 0) + 1
    for reason, n in counts.items():
        log.info("checkpoint %s: %d tensors left unread (%s)", path, n, reason)


def is_published_layout(stored: Mapping[str, str]) -> bool:
    """Whether a checkpoint (tensor name -> safetensors dtype) is in the published layout: it
    holds a quantized tensor, or a tensor only the published layout has."""
    quantized = {"F8_E4M3", "F4", "I8", "U8"}
    return any(dtype in quantized or _unread(name) for name, dtype in stored.items())
