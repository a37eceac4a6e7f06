"""Weights in safetensors: load (strict, with named errors) and save.

Tensors are named as atom's parameters (HF-transformers style, ``model.layers.N.self_attn.
q_a_proj.weight``), or in DeepSeek's own style (``layers.N.attn.wq_a.weight``), which DeepSeek's
checkpoints use. ``NAMING`` maps one to the other, as data: a row per tensor kind, ``{L}`` a
layer, ``{E}`` a routed expert. A checkpoint may use either style, not
both for one tensor; errors name tensors in the style the checkpoint uses.

Draft layers (``draft``): the model's ``mtp.{i}.*`` are stored as DeepSeek-V3 stores its MTP
layers, as decoder layers past the main ones, ``model.layers.{num_hidden_layers + i}.*``
(DeepSeek style ``layers.{num_hidden_layers + i}.*``), with ``enorm``, ``hnorm``, ``eh_proj``,
``head_hc`` and ``shared_head.norm`` besides the usual layer tensors, and no copy of the shared
embedding or head. A checkpoint's draft layer the model does not build (a layer past
``num_hidden_layers + num_nextn_predict_layers`` that has an ``eh_proj``) is left unread.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from atom.models.common.weights import WeightLoadError
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.published_config import to_published
from atom.models.deepseek_v41.published_weights import (
    is_published_layout,
    load_published_weights,
)
from atom.models.deepseek_v41.token_map import attach_token_map

log = logging.getLogger("atom.weights")

__all__ = ["WeightLoadError", "load_weights", "save_weights", "deepseek_names"]


_P = "model.layers.{L}."
# (atom / HF-style name, DeepSeek-style name)
NAMING: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens.weight", "embed.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.norm.weight", "norm.weight"),
    (_P + "input_layernorm.weight", "layers.{L}.attn_norm.weight"),
    (_P + "post_attention_layernorm.weight", "layers.{L}.ffn_norm.weight"),
    (_P + "attn_hc.fn", "layers.{L}.hc_attn_fn"),
    (_P + "attn_hc.base", "layers.{L}.hc_attn_base"),
    (_P + "attn_hc.scale", "layers.{L}.hc_attn_scale"),
    (_P + "ffn_hc.fn", "layers.{L}.hc_ffn_fn"),
    (_P + "ffn_hc.base", "layers.{L}.hc_ffn_base"),
    (_P + "ffn_hc.scale", "layers.{L}.hc_ffn_scale"),
    (_P + "self_attn.attn_sink", "layers.{L}.attn.attn_sink"),
    (_P + "self_attn.q_a_proj.weight", "layers.{L}.attn.wq_a.weight"),
    (_P + "self_attn.q_a_layernorm.weight", "layers.{L}.attn.q_norm.weight"),
    (_P + "self_attn.q_b_proj.weight", "layers.{L}.attn.wq_b.weight"),
    (_P + "self_attn.kv_proj.weight", "layers.{L}.attn.wkv.weight"),
    (_P + "self_attn.kv_norm.weight", "layers.{L}.attn.kv_norm.weight"),
    (_P + "self_attn.o_a_proj.weight", "layers.{L}.attn.wo_a.weight"),
    (_P + "self_attn.o_b_proj.weight", "layers.{L}.attn.wo_b.weight"),
    (_P + "self_attn.compressor.wkv.weight", "layers.{L}.attn.compressor.wkv.weight"),
    (_P + "self_attn.compressor.wgate.weight", "layers.{L}.attn.compressor.wgate.weight"),
    (_P + "self_attn.compressor.norm.weight", "layers.{L}.attn.compressor.norm.weight"),
    (_P + "self_attn.indexer.wq_b.weight", "layers.{L}.attn.indexer.wq_b.weight"),
    (_P + "self_attn.indexer.wk.weight", "layers.{L}.attn.indexer.wk.weight"),
    (_P + "self_attn.indexer.k_norm.weight", "layers.{L}.attn.indexer.k_norm.weight"),
    (_P + "self_attn.indexer.weights_proj.weight", "layers.{L}.attn.indexer.weights_proj.weight"),
    (_P + "mlp.gate.weight", "layers.{L}.ffn.gate.weight"),
    (_P + "mlp.gate.e_score_correction_bias", "layers.{L}.ffn.gate.bias"),
    (_P + "mlp.experts.{E}.gate_proj.weight", "layers.{L}.ffn.experts.{E}.w1.weight"),
    (_P + "mlp.experts.{E}.up_proj.weight", "layers.{L}.ffn.experts.{E}.w3.weight"),
    (_P + "mlp.experts.{E}.down_proj.weight", "layers.{L}.ffn.experts.{E}.w2.weight"),
    (_P + "mlp.shared_experts.gate_proj.weight", "layers.{L}.ffn.shared_experts.w1.weight"),
    (_P + "mlp.shared_experts.up_proj.weight", "layers.{L}.ffn.shared_experts.w3.weight"),
    (_P + "mlp.shared_experts.down_proj.weight", "layers.{L}.ffn.shared_experts.w2.weight"),
    (_P + "engram.embed.weight", "layers.{L}.engram.embed.weight"),
    (_P + "engram.wkv.weight", "layers.{L}.engram.wkv.weight"),
    (_P + "engram.q_weight", "layers.{L}.engram.q_weight"),
    (_P + "engram.k_weight", "layers.{L}.engram.k_weight"),
    (_P + "enorm.weight", "layers.{L}.enorm.weight"),
    (_P + "hnorm.weight", "layers.{L}.hnorm.weight"),
    (_P + "eh_proj.weight", "layers.{L}.eh_proj.weight"),
    (_P + "head_hc.fn", "layers.{L}.hc_head_fn"),
    (_P + "head_hc.base", "layers.{L}.hc_head_base"),
    (_P + "head_hc.scale", "layers.{L}.hc_head_scale"),
    (_P + "shared_head.norm.weight", "layers.{L}.shared_head.norm.weight"),
)


def _pattern(name: str) -> re.Pattern:
    return re.compile(re.sub(r"\\\{([LET])\\\}", r"(?P<\1>\\d+)", re.escape(name)) + "$")


_NAMING_RE = tuple((_pattern(hf), ds) for hf, ds in NAMING)


def deepseek_names(params) -> dict[str, str]:
    """atom parameter name -> its DeepSeek-style name, for every parameter ``NAMING`` covers."""
    out = {}
    for name in params:
        for pat, ds in _NAMING_RE:
            m = pat.match(name)
            if m:
                out[name] = ds.format(**m.groupdict())
                break
    return out


def checkpoint_tensors(model: DeepseekV41ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's state under its checkpoint (HF-style) names: draft layer i's ``mtp.{i}.*``
    as ``model.layers.{num_hidden_layers + i}.*``, every other tensor under its own name."""
    first = model.config.num_hidden_layers
    out = {}
    for name, t in model.state_dict().items():
        m = re.match(r"mtp\.(\d+)\.(.*)$", name)
        out[f"model.layers.{first + int(m[1])}.{m[2]}" if m else name] = t
    return out


def _unbuilt_draft_layers(stored, first_unbuilt: int) -> set[int]:
    """Layers >= ``first_unbuilt`` the checkpoint holds as draft layers (with an eh_proj)."""
    out = set()
    for name in stored:
        m = re.match(r"(?:model\.)?layers\.(\d+)\.eh_proj\.weight$", name)
        if m and int(m[1]) >= first_unbuilt:
            out.add(int(m[1]))
    return out


def _layer_of(name: str) -> int | None:
    m = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
    return int(m[1]) if m else None


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path}")
    return files


@torch.no_grad()
def load_weights(
    model: DeepseekV41ForCausalLM,
    path: str | Path,
    *,
    shards: Mapping[str, tuple[int, int, int]] | None = None,
) -> None:
    """Load every parameter and buffer from safetensors at ``path`` (a file or a directory),
    named as ``checkpoint_tensors`` names them (or in DeepSeek's style).

    A checkpoint in DeepSeek's published layout (FP8 / FP4 tensors with scales, DSpark stages,
    a vision tower) goes to ``published_weights.load_published_weights``.

    Refuses (before copying anything) a missing tensor, an unexpected tensor, or a tensor whose
    shape differs, naming the tensor and both shapes. A model whose Engram hashes over a
    compressed vocabulary gets its map from the ``tokenizer.json`` beside the weights
    (``token_map.attach_token_map``), refused first when that file is missing or foreign.
    Values are cast to the model's dtypes.

    ``shards`` (tensor parallelism, ``atom.distributed``): checkpoint name -> (dim, index,
    parts) for tensors of which the model holds only part ``index`` of ``parts`` equal slices
    along ``dim``; the stored tensor must have the whole shape (the model's, ``dim`` times
    ``parts``) and only that slice is read.
    """
    path = Path(path)
    # a compressed Engram vocabulary (the published models): its map from the tokenizer
    # beside the weights, refused before any tensor is copied when it is missing or foreign
    attach_token_map(model, path)
    expected = checkpoint_tensors(model)
    shards = shards or {}

    def whole(name: str) -> tuple[int, ...]:
        shape = list(expected[name].shape)
        if name in shards:
            dim, _, parts = shards[name]
            shape[dim] *= parts
        return tuple(shape)

    stored: dict[str, tuple[Path, tuple[int, ...]]] = {}
    dtypes: dict[str, str] = {}
    for f in _files(path):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                stored[name] = (f, tuple(sl.get_shape()))
                dtypes[name] = sl.get_dtype()
    if is_published_layout(dtypes):
        load_published_weights(model, path, shards=shards)
        return
    unbuilt = _unbuilt_draft_layers(stored, model.config.num_hidden_layers + len(model.mtp))
    stored = {k: v for k, v in stored.items() if _layer_of(k) not in unbuilt}
    # DSpark stages the config does not build (a checkpoint may hold both drafters; its config
    # builds one): left unread, as unbuilt draft layers are
    stages = {int(m[1]) for k in stored if (m := re.match(r"dspark\.(\d+)\.", k))}
    skipped = sorted(i for i in stages if i >= len(model.dspark))
    if skipped:
        log.info("left unread: DSpark stages %s (the config builds %d)", skipped, len(model.dspark))
        stored = {
            k: v
            for k, v in stored.items()
            if not ((m := re.match(r"dspark\.(\d+)\.", k)) and int(m[1]) >= len(model.dspark))
        }
    to_ds = deepseek_names(expected)
    from_ds = {ds: name for name, ds in to_ds.items()}
    problems = []
    # found: parameter name -> (file, shape, the name it is stored under)
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for name, (f, shape) in stored.items():
        param = name if name in expected else from_ds.get(name, name)
        if param in found:
            problems.append(f"tensor {param} is stored twice, as {found[param][2]} and {name}")
        found[param] = (f, shape, name)
    deepseek = any(name not in expected and name in from_ds for name in stored)
    for name in sorted(set(expected) - set(found)):
        shown = to_ds.get(name, name) if deepseek else name
        problems.append(f"missing tensor {shown} (model expects shape {list(whole(name))})")
    for name in sorted(set(found) - set(expected)):
        f, shape, as_stored = found[name]
        problems.append(f"unexpected tensor {as_stored} with shape {list(shape)} in {f.name}")
    for name in sorted(set(found) & set(expected)):
        if found[name][1] != whole(name):
            problems.append(
                f"tensor {found[name][2]} has shape {list(found[name][1])} in the checkpoint, "
                f"the model expects {list(whole(name))}"
            )
    if problems:
        shown = "; ".join(problems[:20])
        more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        raise WeightLoadError(f"checkpoint {path} does not fit the model: {shown}{more}")
    by_file: dict[Path, list[str]] = {}
    for name, (f, _, _) in found.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as sf:
            for name in names:
                target = expected[name]
                if name in shards:  # read only this rank's slice
                    dim, index, _ = shards[name]
                    n = target.shape[dim]
                    cut = (slice(None),) * dim + (slice(index * n, (index + 1) * n),)
                    raw = sf.get_slice(found[name][2])[cut]
                else:
                    raw = sf.get_tensor(found[name][2])
                target.copy_(raw.to(device=target.device, dtype=target.dtype))


def save_weights(model: DeepseekV41ForCausalLM, directory: str | Path) -> Path:
    """Write config.json (in the published nested form) and model.safetensors into
    ``directory``; returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # clone: expert weights may be views of one stacked tensor (safetensors refuses shared storage)
    tensors = {k: v.detach().cpu().clone() for k, v in checkpoint_tensors(model).items()}
    save_file(tensors, str(directory / "model.safetensors"))
    config = to_published(model.config.to_dict())
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
