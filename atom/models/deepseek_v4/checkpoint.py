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
from safetensors import safe_open

from atom.models.common.weights import WeightLoadError
from atom.models.deepseek_v4.checkpoint_formats import (
    dequant_fp4,
    dequant_fp8,
    fp4_shapes,
    fp8_scale_shape,
)
from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM

BF16, F32, FP8, FP4, I64 = "bf16", "f32", "fp8", "fp4", "i64"

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
_ALLOWED = {  # stored formats each published format may arrive in (re-exports dequantize)
    BF16: {BF16, F32},
    F32: {F32, BF16},
    FP8: {FP8, BF16, F32},
    FP4: {FP4, FP8, BF16, F32},
    I64: {I64},
}


def expected_names(model: DeepseekV4ForCausalLM) -> dict[str, tuple[str, str]]:
    """published name -> (parameter name, published format), for this model's shape."""
    c = model.config
    params = model.state_dict()
    out: dict[str, tuple[str, str]] = {}
    for ckpt, param, fmt in NAMES:
        if "{L}" in ckpt:
            key, blocks = "{L}", range(c.num_hidden_layers)
        else:
            key, blocks = "{M}", range(len(model.mtp)) if "{M}" in ckpt else [None]
        experts = range(c.n_routed_experts) if "{E}" in ckpt else [None]
        for i in blocks:
            for e in experts:
                name = param.replace(key, str(i)).replace("{E}", str(e))
                if name in params:
                    out[ckpt.replace(key, str(i)).replace("{E}", str(e))] = (name, fmt)
    unmapped = set(params) - {p for p, _ in out.values()}
    if unmapped:  # a parameter with no row: the table is out of date with the model
        raise WeightLoadError(f"no published name for parameters {sorted(unmapped)[:5]}")
    return out


def _skipped(name: str, num_mtp: int) -> bool:
    """An MTP block the model does not build (``num_nextn_predict_layers`` below the
    checkpoint's), with its scales: left unread."""
    m = re.match(r"mtp\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= num_mtp


def _stored_format(dtype: str) -> str:
    return {"F8_E4M3": FP8, "I8": FP4, "U8": FP4, "I64": I64, "I32": I64, "F32": F32}.get(
        dtype, BF16
    )


def _check(name, fmt, stored, shape, want, scale) -> str | None:
    """A problem with one tensor (None when it fits)."""
    if stored not in _ALLOWED[fmt]:
        return f"tensor {name} is stored as {stored}; the published format is {fmt}"
    if stored in (FP8, FP4) and scale is None:
        return f"tensor {name} is {stored} but {name.removesuffix('.weight')}.scale is missing"
    if stored == FP8:
        want_scale = fp8_scale_shape(want)
        if shape != want or scale != want_scale:
            return (
                f"tensor {name} has shape {list(shape)} (scale {list(scale)}), the model "
                f"expects {list(want)} (scale {list(want_scale)})"
            )
    elif stored == FP4:
        packed, want_scale = fp4_shapes(want)
        if shape != packed or scale != want_scale:
            return (
                f"tensor {name} has packed shape {list(shape)} (scale {list(scale)}), the "
                f"model expects {list(packed)} (scale {list(want_scale)}) for {list(want)}"
            )
    elif shape != want:
        return f"tensor {name} has shape {list(shape)}, the model expects {list(want)}"
    return None


@torch.no_grad()
def load_checkpoint(model: DeepseekV4ForCausalLM, path: str | Path) -> None:
    """Load every parameter from the safetensors at ``path`` (a file or a directory).

    Refuses, before copying anything, a missing tensor, an unexpected tensor (the tensors of
    an MTP block beyond the model's ``num_nextn_predict_layers`` aside),
    a quantized tensor without its scale, and a tensor (or scale) of the wrong shape, naming
    each. Values are dequantized and cast to the model's dtypes.
    """
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path}")
    found: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                found[name] = (f, sl.get_dtype(), tuple(sl.get_shape()))
    expected = expected_names(model)
    params = model.state_dict()
    problems, scales = [], set()
    for name, (param, fmt) in sorted(expected.items()):
        if name not in found:
            problems.append(f"missing tensor {name} ({fmt}, {list(params[param].shape)})")
            continue
        stored = _stored_format(found[name][1])
        sname = re.sub(r"\.weight$", ".scale", name)
        scale = found[sname][2] if sname in found and sname != name else None
        if stored in (FP8, FP4) and scale is not None:
            scales.add(sname)
        shape = tuple(params[param].shape)
        problem = _check(name, fmt, stored, found[name][2], shape, scale)
        if problem:
            problems.append(problem)
    for name in sorted(set(found) - set(expected) - scales):
        if not _skipped(name, len(model.mtp)):
            f, dtype, shape = found[name]
            problems.append(f"unexpected tensor {name} ({dtype} {list(shape)}) in {f.name}")
    if problems:
        shown = "; ".join(problems[:20])
        more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        raise WeightLoadError(f"checkpoint {path} does not fit the model: {shown}{more}")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(found[name][0], []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as sf:
            for name in names:
                target = params[expected[name][0]]
                target.copy_(
                    _decode(sf, f, name, found).to(device=target.device, dtype=target.dtype)
                )


def _decode(sf, file: Path, name: str, found: dict) -> torch.Tensor:
    """One published tensor as float (or int64), its scale read from whichever shard holds it."""
    raw = sf.get_tensor(name)
    stored = _stored_format(found[name][1])
    if stored not in (FP8, FP4):
        return raw
    sname = re.sub(r"\.weight$", ".scale", name)
    if found[sname][0] == file:
        scale = sf.get_tensor(sname)
    else:
        with safe_open(str(found[sname][0]), framework="pt") as other:
            scale = other.get_tensor(sname)
    return dequant_fp8(raw, scale) if stored == FP8 else dequant_fp4(raw, scale)
