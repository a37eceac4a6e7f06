"""Load DeepSeek-V4 weights as shipped: DeepSeek's tensor names, FP8 / FP4 with E8M0 scales.

``NAMES`` is the whole mapping from the published names to this model's parameters, as data:
one row per tensor kind, ``{L}`` a layer, ``{M}`` an MTP draft block (``mtp.{M}.*``: a block's
rows plus its own) and ``{E}`` a routed expert, with the format the published checkpoint
stores it in. The loader decides each tensor's decoding from its stored
dtype (so a bf16 re-export loads too), but refuses a format the row does not allow.

Weights are dequantized at load, to the model's dtype (float32 on CPU tests, bf16 on GPU); no
FP8 / FP4 kernel is used yet. The MTP blocks load like the layers (FP8 ``e_proj`` / ``h_proj``
and attention, FP4 experts); the tensors of MTP blocks beyond the config's
``num_nextn_predict_layers`` are left unread.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from atom.models.common.checkpoint import BF16, F32, FP4, FP8, I64, Layout, load_published
from atom.models.common.checkpoint import expected_names as common_expected
from atom.models.common.formats import FP8_TILE
from atom.models.common.fp4_linear import experts_fp4, fp4_module_names
from atom.models.common.fp8_linear import fp8_block, fp8_module_names
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM

# Tensors outside the layers: (published name, parameter name, published format).
_GLOBAL: tuple[tuple[str, str, str], ...] = (
    ("embed.weight", "embed.weight", BF16),
    ("head.weight", "head.weight", BF16),
    ("norm.weight", "norm.weight", BF16),
    ("hc_head_fn", "hc_head.fn", F32),
    ("hc_head_base", "hc_head.base", F32),
    ("hc_head_scale", "hc_head.scale", F32),
)
# One block's tensors, relative to its prefix (``layers.{L}.`` or ``mtp.{M}.``); ``{E}`` is a
# routed expert. A row whose parameter a layer lacks (a window layer's compressor, a hash
# layer's bias) is not expected of that layer.
_BLOCK: tuple[tuple[str, str, str], ...] = (
    ("attn_norm.weight", "attn_norm.weight", BF16),
    ("ffn_norm.weight", "ffn_norm.weight", BF16),
    ("hc_attn_fn", "hc_attn.fn", F32),
    ("hc_attn_base", "hc_attn.base", F32),
    ("hc_attn_scale", "hc_attn.scale", F32),
    ("hc_ffn_fn", "hc_ffn.fn", F32),
    ("hc_ffn_base", "hc_ffn.base", F32),
    ("hc_ffn_scale", "hc_ffn.scale", F32),
    ("attn.attn_sink", "attn.attn_sink", F32),
    ("attn.wq_a.weight", "attn.wq_a.weight", FP8),
    ("attn.q_norm.weight", "attn.q_norm.weight", BF16),
    ("attn.wq_b.weight", "attn.wq_b.weight", FP8),
    ("attn.wkv.weight", "attn.wkv.weight", FP8),
    ("attn.kv_norm.weight", "attn.kv_norm.weight", BF16),
    ("attn.wo_a.weight", "attn.wo_a.weight", FP8),
    ("attn.wo_b.weight", "attn.wo_b.weight", FP8),
    ("attn.compressor.wkv.weight", "attn.compressor.wkv.weight", BF16),
    ("attn.compressor.wgate.weight", "attn.compressor.wgate.weight", BF16),
    ("attn.compressor.ape", "attn.compressor.ape", F32),
    ("attn.compressor.norm.weight", "attn.compressor.norm.weight", BF16),
    ("attn.indexer.wq_b.weight", "attn.indexer.wq_b.weight", FP8),
    ("attn.indexer.weights_proj.weight", "attn.indexer.weights_proj.weight", BF16),
    ("attn.indexer.compressor.wkv.weight", "attn.indexer.compressor.wkv.weight", BF16),
    ("attn.indexer.compressor.wgate.weight", "attn.indexer.compressor.wgate.weight", BF16),
    ("attn.indexer.compressor.ape", "attn.indexer.compressor.ape", F32),
    ("attn.indexer.compressor.norm.weight", "attn.indexer.compressor.norm.weight", BF16),
    ("ffn.gate.weight", "ffn.gate.weight", BF16),
    ("ffn.gate.bias", "ffn.gate.bias", F32),
    ("ffn.gate.tid2eid", "ffn.gate.tid2eid", I64),
    ("ffn.experts.{E}.w1.weight", "ffn.experts.{E}.gate_proj.weight", FP4),
    ("ffn.experts.{E}.w3.weight", "ffn.experts.{E}.up_proj.weight", FP4),
    ("ffn.experts.{E}.w2.weight", "ffn.experts.{E}.down_proj.weight", FP4),
    ("ffn.shared_experts.w1.weight", "ffn.shared_experts.gate_proj.weight", FP8),
    ("ffn.shared_experts.w3.weight", "ffn.shared_experts.up_proj.weight", FP8),
    ("ffn.shared_experts.w2.weight", "ffn.shared_experts.down_proj.weight", FP8),
)
# What an MTP block has besides a block's tensors (no embed or head: it shares the model's).
_MTP_EXTRA: tuple[tuple[str, str, str], ...] = (
    ("e_proj.weight", "e_proj.weight", FP8),
    ("h_proj.weight", "h_proj.weight", FP8),
    ("enorm.weight", "enorm.weight", BF16),
    ("hnorm.weight", "hnorm.weight", BF16),
    ("norm.weight", "norm.weight", BF16),
    ("hc_head_fn", "hc_head.fn", F32),
    ("hc_head_base", "hc_head.base", F32),
    ("hc_head_scale", "hc_head.scale", F32),
)
# (published name, parameter name, published format); {L} a layer, {M} an MTP block.
NAMES: tuple[tuple[str, str, str], ...] = (
    _GLOBAL
    + tuple((f"layers.{{L}}.{a}", f"layers.{{L}}.{b}", fmt) for a, b, fmt in _BLOCK)
    + tuple((f"mtp.{{M}}.{a}", f"mtp.{{M}}.{b}", fmt) for a, b, fmt in _BLOCK + _MTP_EXTRA)
)
LAYOUT = Layout(rows=NAMES, fp8_block=(FP8_TILE, FP8_TILE), unread=lambda name: None)


def expected_names(model: DeepseekV4ForCausalLM) -> dict[str, tuple[str, str]]:
    """published name -> (parameter name, published format), for this model's shape."""
    c = model.config
    counts = {"L": c.num_hidden_layers, "M": len(model.mtp), "E": c.n_routed_experts}
    return common_expected(LAYOUT, model.state_dict(), counts)


def _layout(model: DeepseekV4ForCausalLM) -> Layout:
    """The layout with the MTP blocks this model does not build left unread."""
    num_mtp = len(model.mtp)

    def unread(name: str) -> str | None:
        m = re.match(r"mtp\.(\d+)\.", name)
        if m is not None and int(m.group(1)) >= num_mtp:
            return f"MTP block {m.group(1)}: the config builds {num_mtp}"
        return None

    block = fp8_block(model.config, LAYOUT.fp8_block)
    return Layout(rows=NAMES, fp8_block=block, unread=unread)


# FP8 in the checkpoint but read directly by the forward (a grouped projection: the weight is
# viewed per group), so kept dense; DeepSeek's own converter dequantizes it too
FP8_READ_DENSE = ("attn.wo_a",)


def fp8_linears(model: DeepseekV4ForCausalLM) -> tuple[list[str], tuple[int, int]]:
    """(the linears that run as FP8 GEMMs at stored precision, their weight block): the
    published FP8 rows less ``FP8_READ_DENSE``; the block from the config, else 128 x 128."""
    names = fp8_module_names(model, NAMES, exclude=FP8_READ_DENSE)
    return names, fp8_block(model.config, LAYOUT.fp8_block)


def fp4_linears(model: DeepseekV4ForCausalLM) -> list[str]:
    """The linears kept as FP4 at stored precision: the published FP4 rows (the routed
    experts), when the config says the experts are FP4 (``experts_fp4``)."""
    return fp4_module_names(model, NAMES) if experts_fp4(model.config) else []


@torch.no_grad()
def load_checkpoint(
    model: DeepseekV4ForCausalLM,
    path: str | Path,
    shards: dict[str, tuple[int, int, int]] | None = None,
) -> None:
    """Load every parameter from the safetensors at ``path`` (a file or a directory);
    ``shards`` (tensor parallelism): parameter name -> (dim, index, parts) for a parameter that
    holds only slice ``index`` of ``parts`` of the stored tensor (only that slice is read).

    Refuses, before copying anything, a missing tensor, an unexpected tensor (the tensors of
    an MTP block beyond the model's ``num_nextn_predict_layers`` aside),
    a quantized tensor without its scale, and a tensor (or scale) of the wrong shape, naming
    each. Values are dequantized and cast to the model's dtypes.
    """
    load_published(model.state_dict(), path, _layout(model), expected_names(model), shards=shards)
