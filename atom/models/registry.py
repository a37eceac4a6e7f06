"""Model resolution: a preset name (random weights from a seed) or a checkpoint directory.

One table, ``FAMILIES``, maps each ``model_type`` to what the rest of atom needs of a model: its
config class, its presets, its pool geometry, its model and runtime classes and its weight
loader. The engine asks this module for a ``ModelRuntime`` and ``atom.config`` asks it for the
pool geometry; neither names a model class itself.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from atom.models.common.config import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFamily:
    """Where one model's pieces live (``module:attribute``, imported on first use)."""

    model_type: str
    config: str  # config class: from_dict(data, source=...)
    presets: str  # module with PRESETS, PRESET_BLOCK_SIZE and preset_config(name)
    geometry: str  # (config, *, kv_dtype, index_dtype, block_size, speculative_tokens)
    model: str  # model class: (config, *, dtype, kv_dtype, index_dtype, device)
    runtime: str  # runtime class: (model, *, block_size, speculative_tokens)
    loader: str  # load_weights(model, path)
    fp8_linears: str  # (model) -> (module names that run as FP8 GEMMs, FP8 weight block)
    fp4_linears: str  # (model) -> module names kept as FP4 at stored precision (the experts)
    fp8_tables: str = ""  # (model) -> tables kept as FP8 rows at stored precision ("": none)
    # (model, path) -> metadata: make the draft layer a trained draft adapter's ("": the family
    # has none; EngineConfig.draft_adapter)
    draft_adapter: str = ""

    def get(self, what: str) -> Any:
        module, _, attr = getattr(self, what).partition(":")
        mod = importlib.import_module(module)
        return getattr(mod, attr) if attr else mod


_V41 = "atom.models.deepseek_v41"
_V4 = "atom.models.deepseek_v4"
FAMILIES: dict[str, ModelFamily] = {
    "deepseek_v41": ModelFamily(
        model_type="deepseek_v41",
        config=f"{_V41}.config:V41Config",
        presets=f"{_V41}.presets",
        geometry=f"{_V41}.pool_geometry:build_v41_pool_geometry",
        model=f"{_V41}.model:DeepseekV41ForCausalLM",
        runtime=f"{_V41}.runtime:V41Runtime",
        loader=f"{_V41}.weights:load_weights",
        fp8_linears=f"{_V41}.published_weights:fp8_linears",
        fp4_linears=f"{_V41}.published_weights:fp4_linears",
        fp8_tables=f"{_V41}.published_weights:fp8_tables",
        draft_adapter=f"{_V41}.draft_adapter:apply_adapter",
    ),
    "deepseek_v4": ModelFamily(
        model_type="deepseek_v4",
        config=f"{_V4}.config:V4Config",
        presets=f"{_V4}.presets",
        geometry=f"{_V4}.geometry:build_v4_pool_geometry",
        model=f"{_V4}.model:DeepseekV4ForCausalLM",
        runtime=f"{_V4}.runtime:V4Runtime",
        loader=f"{_V4}.checkpoint:load_checkpoint",
        fp8_linears=f"{_V4}.checkpoint:fp8_linears",
        fp4_linears=f"{_V4}.checkpoint:fp4_linears",
    ),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def _preset_family(model: str) -> ModelFamily | None:
    for fam in FAMILIES.values():
        if model in fam.get("presets").PRESETS:
            return fam
    return None


def all_presets() -> list[str]:
    return sorted(name for fam in FAMILIES.values() for name in fam.get("presets").PRESETS)


def family(config: Any) -> ModelFamily:
    """The family a config object belongs to (by its ``model_type``)."""
    return FAMILIES[config.model_type]


def config_from_dict(data: dict, source: str = "config"):
    """Parse a config.json's content with the config class its ``model_type`` names."""
    kind = data.get("model_type", "deepseek_v41")  # older atom checkpoints omit it
    if kind not in FAMILIES:
        raise ConfigError(
            f"{source} has model_type={kind!r}; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    return FAMILIES[kind].get("config").from_dict(data, source=source)


def resolve_config(model: str, overrides: dict | None = None) -> tuple[Any, Path | None]:
    """(config, checkpoint directory or None for a preset); ``overrides`` (the engine's
    ``model_overrides``) replace fields of the preset or config.json before it is validated,
    so a bad name or value is refused as a config.json's would be."""
    overrides = dict(overrides or {})
    fam = _preset_family(model)
    if fam is not None:
        config = fam.get("presets").preset_config(model, **overrides)
        _known_fields(config, overrides)
        return config, None
    path = Path(model)
    if path.is_dir() and (path / "config.json").exists():
        source = str(path / "config.json")
        try:
            data = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source} is not valid JSON: {exc}") from None
        config = config_from_dict(data, source=source)
        if overrides:  # on the config as atom reads it (a published file's names translated)
            _known_fields(config, overrides)
            source = f"{source} with model_overrides {sorted(overrides)}"
            config = type(config).from_dict({**config.to_dict(), **overrides}, source=source)
        return config, path
    raise ConfigError(
        f"model={model!r} is neither a preset ({', '.join(all_presets())}) nor a directory "
        "holding config.json and *.safetensors"
    )


def _known_fields(config: Any, overrides: dict) -> None:
    """Refuse overrides that name no field of the config (a config.json's extra keys are
    ignored; an override's would silently change nothing)."""
    unknown = sorted(set(overrides) - set(type(config).model_fields))
    if unknown:
        raise ConfigError(
            f"{unknown} name no field of {type(config).__name__} (fields are "
            "the model's config.json names, e.g. num_hidden_layers, num_attention_heads)"
        )


def default_block_size(model: str) -> int:
    fam = _preset_family(model)
    return fam.get("presets").PRESET_BLOCK_SIZE.get(model, 256) if fam else 256


def pool_geometry(
    config: Any,
    *,
    kv_dtype: str,
    index_dtype: str,
    block_size: int,
    speculative_tokens: int,
):
    """The model's PAGE and state geometry (``block_bytes``, ``units_per_image``,
    ``state_spec()``); raises ``GeometryError`` for arguments the model cannot lay out."""
    return family(config).get("geometry")(
        config,
        kv_dtype=kv_dtype,
        index_dtype=index_dtype,
        block_size=block_size,
        speculative_tokens=speculative_tokens,
    )


def load_runtime(
    model: str,
    *,
    dtype: torch.dtype,
    kv_dtype: str,
    index_dtype: str,
    block_size: int,
    device: str | torch.device,
    seed: int,
    speculative_tokens: int = 0,
    weight_dtype: str = "bf16",
    model_overrides: dict | None = None,
    draft_adapter: str | None = None,
):
    """The model's runtime: weights from the preset's seed or the checkpoint, the linears its
    checkpoint stores as FP8 kept so when ``weight_dtype`` is "fp8", dequantized when "bf16"
    ("auto": as the config says they are stored on CUDA, dequantized on CPU, as
    ``EngineConfig.resolved`` decides it); the draft layer a draft adapter's where
    ``draft_adapter`` names one (``apply_draft_adapter``)."""
    from atom.models.common.fp8_linear import stored_fp8

    config, path = resolve_config(model, model_overrides)
    if weight_dtype == "auto":
        on_gpu = str(device).startswith("cuda")
        weight_dtype = "fp8" if stored_fp8(config) and on_gpu else "bf16"
    net = build_model(
        config, path, dtype=dtype, kv_dtype=kv_dtype, index_dtype=index_dtype, device=device,
        seed=seed, weight_dtype=weight_dtype, draft_adapter=draft_adapter,
    )  # fmt: skip
    runtime = family(config).get("runtime")
    return runtime(net, block_size=block_size, speculative_tokens=speculative_tokens)


def build_model(
    config: Any,
    path: Path | None,
    *,
    dtype: torch.dtype,
    kv_dtype: str,
    index_dtype: str,
    device: str | torch.device,
    seed: int | None,
    weight_dtype: str,
    split: Callable[[Any], dict] | None = None,
    draft_adapter: str | None = None,
):
    """The model of ``config`` in eval mode at ``weight_dtype`` ("bf16" or "fp8", resolved):
    from ``seed`` (``path`` None) or the checkpoint at ``path``.

    ``split`` (tensor parallelism: ``atom.distributed.split_models``) narrows the model to one
    rank's slices, allocates it on ``device`` if it is on ``meta``, and returns the loader's
    ``shards``. From a seed the whole model is built, initialized and put at its precision as
    at one rank, then split. From a checkpoint the model is built on ``meta``, its stored
    precision kept (``Fp8Linear`` / ``Fp4Linear`` where the checkpoint stores them, empty),
    split, and only the rank's slices, scales included, are read into it.

    ``draft_adapter`` (one rank only): the draft layer made the adapter file's once the weights
    are set, before they are put at their precision (``apply_draft_adapter``)."""
    from atom.models.common.fp8_linear import stored_fp8

    fam = family(config)
    kw = dict(dtype=dtype, kv_dtype=kv_dtype, index_dtype=index_dtype)
    if draft_adapter and split is not None:
        raise ValueError("draft_adapter with tensor parallelism: adapt a one-rank model")
    if path is None:
        net = fam.get("model")(config, device=device, **kw).init_weights(seed)
        if draft_adapter:
            apply_draft_adapter(net, fam, draft_adapter)
        set_weight_precision(net, fam, weight_dtype, random=True)
        if split is not None:
            split(net)
        return net.eval()
    net = fam.get("model")(config, device="meta" if split is not None else device, **kw)
    # a checkpoint stored in bf16 (or float32), asked for FP8: quantized once loaded, as the
    # presets are (online quantization; the checkpoint's values are rounded)
    online = weight_dtype == "fp8" and not stored_fp8(config)
    if weight_dtype == "fp8" and not online:  # the loader fills them with the stored bytes
        keep_stored_precision(net, fam)
    if split is None:
        fam.get("loader")(net, path)
    else:
        fam.get("loader")(net, path, shards=split(net))
    if draft_adapter:
        apply_draft_adapter(net, fam, draft_adapter)
    if online:
        count = set_weight_precision(net, fam, "fp8", random=False)
        log.info(
            "%s stores its weights unquantized: %d linears quantized to FP8 at load "
            "(weight_dtype fp8; bf16 or auto keeps the stored values)",
            path,
            count,
        )
    return net.eval()


def apply_draft_adapter(net, fam: ModelFamily, path: str) -> dict:
    """Make the model's draft layer the adapter file's (its family's ``draft_adapter``); logs
    what it applied. Raises ``ValueError`` (``AdapterError``) for a family without adapters or
    a file that does not fit."""
    if not fam.draft_adapter:
        raise ValueError(
            f"draft_adapter={path!r}: model family {fam.model_type} has no draft adapters "
            "(deepseek_v41 has)"
        )
    meta = fam.get("draft_adapter")(net, path)
    log.info(
        "draft layer %s from adapter %s (rank %s, recipe %s)",
        meta.get("layer"),
        path,
        meta.get("rank"),
        meta.get("recipe"),
    )
    return meta


def keep_stored_precision(net, fam: ModelFamily) -> tuple[int, int]:
    """Make the linears a checkpoint stores as FP8 ``Fp8Linear`` and the routed experts it
    stores as FP4 ``Fp4Linear``, empty, for the family's loader to fill with the stored bytes
    (on any device, ``meta`` too); returns the FP8 weight block. The experts round their inputs
    per the FP8 linears' K block, as DeepSeek's kernels do."""
    from atom.models.common.fp4_linear import quantize_fp4_linears
    from atom.models.common.fp8_linear import quantize_linears
    from atom.models.common.fp8_rows import quantize_tables

    names, block = fam.get("fp8_linears")(net)
    quantize_linears(net, names, block, empty=True)
    quantize_fp4_linears(net, fam.get("fp4_linears")(net), act_block=block[1], empty=True)
    quantize_tables(net, _tables(net, fam), empty=True)
    return block


def _tables(net, fam: ModelFamily) -> list[str]:
    """The family's tables kept as FP8 rows at stored precision (``fp8_tables``)."""
    return fam.get("fp8_tables")(net) if fam.fp8_tables else []


def set_weight_precision(net, fam: ModelFamily, weight_dtype: str, *, random: bool) -> int:
    """Put the model's FP8-stored linears at the precision asked, after its weights are set;
    returns how many are FP8.

    ``weight_dtype`` "fp8": each becomes an ``Fp8Linear`` holding its weight quantized, the
    routed experts a config says are FP4 (``fp4_linears``) become ``Fp4Linear``, and the
    tables the family stores as FP8 rows (``fp8_tables``: V4.1's Engram) ``Fp8RowTable``.
    "bf16": a preset whose config says FP8 (random weights, ``random``) has them rounded
    through FP8 (its experts through FP4, its tables through FP8 rows) and back, so both
    precisions run the same model; other
    weights are left as they are. (A checkpoint loads its FP8 and FP4 tensors' bytes directly:
    ``keep_stored_precision``.)
    """
    from atom.models.common.fp4_linear import dequantize_fp4_linears, quantize_fp4_linears
    from atom.models.common.fp8_linear import dequantize_linears, quantize_linears, stored_fp8
    from atom.models.common.fp8_rows import dequantize_tables, quantize_tables

    if weight_dtype not in ("bf16", "fp8"):
        raise ValueError(
            f"weight_dtype must be 'bf16' or 'fp8' once resolved, got {weight_dtype!r}"
        )
    if weight_dtype == "bf16" and not (random and stored_fp8(net.config)):
        return 0
    names, block = fam.get("fp8_linears")(net)
    count = quantize_linears(net, names, block)
    # the experts' inputs are rounded per the FP8 linears' K block, as DeepSeek's kernels do
    quantize_fp4_linears(net, fam.get("fp4_linears")(net), act_block=block[1])
    quantize_tables(net, _tables(net, fam))
    if weight_dtype == "bf16":
        dequantize_linears(net)
        dequantize_fp4_linears(net)
        dequantize_tables(net)
        return 0
    return count
